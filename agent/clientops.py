"""What the control socket's sessions serve (docs/client.md "Protocol"): the versioned handshake,
then requests one JSON line each, answered in order: `write` / `write_many` run on the loop thread
through `Node.write_many` (the one local write path: the bridge, persist before release, the one
apply path); `read` and `watch` read the store on the connection's own thread through a read-only
connection, so a reader or a slow watcher never holds up the loop. A watch turns the connection
into a subscription stream of feed records (agent/feed.py) until the client closes it, sent no
further than a window beyond the client's acknowledgements; a watcher that leaves its window full
for STALL_S is told it fell behind and disconnected; it resumes from its cursor.
Anything malformed is answered with an error and ends the connection, never the agent."""
from __future__ import annotations

import collections
import contextlib
import json
import os
import select
import socket
import time
from typing import Any

VERSIONS = (1,)   # the session protocol versions this agent speaks
BATCH = 256   # feed records read per query: bounds a watcher's memory whatever its lag
CACHE = 4096   # resolved record lines the server keeps for all its watchers
STALL_ENV = "SSP_AGENT_WATCH_STALL_S"
WINDOW = 256   # feed records a watch sends beyond the client's last acknowledgement
WINDOW_BYTES = 1 << 20   # and their lines' bytes (a single record may exceed it alone)
STALL_S = 30.0   # a watcher whose window stays full this long is disconnected (told "behind")
IDLE_S = 600.0   # a session with no request for this long is closed (the client reconnects)


class Malformed(ValueError):
    """A request this protocol cannot read: answered, then the connection ends."""


def _value(v: Any) -> Any:
    if isinstance(v, dict):
        if set(v) == {"$bytes"} and isinstance(v["$bytes"], str):
            try:
                return bytes.fromhex(v["$bytes"])
            except ValueError:
                raise Malformed('{"$bytes": ...} must hold hex') from None
        raise Malformed('nested objects are not column values (use {"$bytes": "hex"} for bytes)')
    if isinstance(v, list):
        raise Malformed("arrays are not column values")
    return v   # a bool is refused by the node's own check (SSP/1 has no bool type)


def _columns(d: Any, what: str) -> dict:
    if not isinstance(d, dict):
        raise Malformed(f"{what} must be a JSON object")
    return {str(k): _value(v) for k, v in d.items()}


def writes_of(op: dict) -> list[tuple[str, dict, dict | None, bool]]:
    """The (table, key, values, delete) list of a write or write_many request."""
    items = op.get("writes") if op.get("op") == "write_many" else [op]
    if not isinstance(items, list) or not items:
        raise Malformed("writes must be a non-empty list")
    out = []
    for w in items:
        if not isinstance(w, dict) or not isinstance(w.get("table"), str):
            raise Malformed("each write needs a table")
        delete = w.get("delete") is True
        if delete == ("set" in w):
            raise Malformed("each write has either set or delete: true")
        out.append((w["table"], _columns(w.get("key"), "key"), None if delete else _columns(w["set"], "set"), delete))
    return out


def request_id_of(req: dict) -> str | None:
    """A write's request id: the same on each retry of one write (docs/client.md "Protocol")."""
    rid = req.get("request_id")
    if rid is not None and (not isinstance(rid, str) or not 0 < len(rid) <= 64):
        raise Malformed("request_id must be a string of 1 to 64 characters")
    return rid


def write_once(node, writes: list, request_id: str | None) -> list[bytes]:
    """`Node.write_many`, exactly once per request id: a request already answered gets the event
    ids it signed then. The id is stored in the transaction after the write's, before the answer
    leaves (`requests.note`): only an agent killed between the two commits, or a power cut before
    the next commit syncs the id, makes a retry of that write a second event."""
    if request_id is None:
        return node.write_many(writes)
    import hashlib
    from .errors import NodeError
    from .store import requests
    # the rows and columns written, not their values: no file of the home keeps a fingerprint of a
    # value a later write replaces (docs/reliability.md "Superseded values")
    digest = hashlib.sha256(json.dumps([[t, k, None if d else sorted(v or ()), d] for t, k, v, d in writes],
                                       sort_keys=True, default=lambda v: {"$bytes": bytes(v).hex()}).encode()).digest()
    done = requests.answered(node.conn, request_id)
    if done is not None:
        if done[0] != digest:
            raise NodeError(f"request id {request_id!r} was used for other writes")
        return [bytes.fromhex(i) for i in done[1]]
    ids = node.write_many(writes)
    requests.note(node.conn, request_id, digest, [i.hex() for i in ids])
    return ids


def execute(node, op: dict) -> dict:
    """On the loop thread: one write request on the running agent's node."""
    from .errors import NodeError
    from .store.db import StoreError
    try:
        ids = write_once(node, op["writes"], op.get("request_id"))
    except NodeError as e:
        return {"error": "refused", "message": str(e)}
    except StoreError as e:
        return {"error": "fault", "message": str(e)}
    return {"ok": True, "event_ids": [i.hex() for i in ids]}


def read_row(conn, table: str, key: dict) -> dict:
    """{"ok", "row"} or an error, from a read connection."""
    from .feed import value_json
    from .store import feed
    try:
        row = feed.read_row(conn, table, key)
    except KeyError as e:
        return {"error": "refused", "message": str(e.args[0])}
    if row is None:
        return {"error": "refused", "message": f"no table {table!r} on this node"}
    row["values"] = {c: value_json(v) for c, v in row["values"].items()}
    return {"ok": True, "row": row}


def stall_s() -> float:
    try:
        return float(os.environ.get(STALL_ENV, "") or STALL_S)
    except ValueError:
        return STALL_S


class Session:
    """One connection after its hello: requests in order until it ends."""

    def __init__(self, server, conn: socket.socket, reader) -> None:
        self.server, self.conn, self.reader = server, conn, reader
        self._rconn = None

    def send(self, obj: dict) -> None:
        self.conn.sendall(json.dumps(obj, separators=(",", ":")).encode() + b"\n")

    def fail(self, error: str, message: str, rid: Any = None, **more) -> None:
        with contextlib.suppress(OSError):
            self.send({**({"id": rid} if rid is not None else {}), "error": error, "message": message, **more})

    def reads(self):
        if self._rconn is None:
            from .store import feed
            node = self.server.node
            self._rconn = feed.reader(node.home / node.STORE_FILE)
        return self._rconn

    def run(self, hello: dict) -> None:
        from .controlframe import MAX_REQUEST, TooLarge, drain
        try:
            if hello.get("hello") != "ssp-agent" or hello.get("version") not in VERSIONS:
                self.fail("version", f"this agent speaks session protocol versions {list(VERSIONS)}",
                          versions=list(VERSIONS))
                return
            self.send({"ok": True, "hello": "ssp-agent", "version": 1, "max_request": MAX_REQUEST,
                       "window": {"records": WINDOW, "bytes": WINDOW_BYTES, "stall_s": stall_s()}})
            self.conn.settimeout(IDLE_S)
            while not self.server.closed():
                try:
                    line = self.reader.line()
                except TooLarge:
                    self.fail("too_large", f"a request is at most {MAX_REQUEST} bytes")
                    drain(self.conn)
                    return
                if line is None:
                    return
                req = None
                try:
                    req = json.loads(line)
                    if not isinstance(req, dict) or not isinstance(req.get("op"), str):
                        raise Malformed("a request is a JSON object with an op")
                    if not self.request(req):
                        return
                except (ValueError, UnicodeDecodeError) as e:   # Malformed is a ValueError
                    self.fail("malformed", str(e) if isinstance(e, Malformed) else "not a JSON line",
                              req.get("id") if isinstance(req, dict) else None)
                    return
        except OSError:
            return   # the client went away (or its idle time ran out)
        finally:
            if self._rconn is not None:
                self._rconn.close()

    def request(self, req: dict) -> bool:
        """Serve one request; False when the connection ends after it."""
        op, rid = req["op"], req.get("id")
        tag = {"id": rid} if rid is not None else {}
        if op in ("write", "write_many"):
            r = self.server.submit_op({"op": op, "writes": writes_of(req), "request_id": request_id_of(req)})
            self.send({**tag, **(r.result if not r.not_run else
                                 {"error": "not_run", "message": "the agent stopped before it ran this"})})
            return not r.not_run
        if op == "read":
            if not isinstance(req.get("table"), str):
                raise Malformed("read needs a table")
            self.send({**tag, **read_row(self.reads(), req["table"], _columns(req.get("key"), "key"))})
            return True
        if op == "head":
            from .store import feed
            pruned, head = feed.bounds(self.reads())
            self.send({**tag, "ok": True, "cursor": head, "oldest": pruned})
            return True
        if op == "ping":
            self.send({**tag, "ok": True})
            return True
        if op == "watch":
            self.watch(req, tag)
            return False
        raise Malformed(f"unknown op {op!r}")

    # ---------------------------------------------------------------- the subscription stream
    def watch(self, req: dict, tag: dict) -> None:
        from .store import feed
        tables, since = req.get("tables"), req.get("since")
        if tables is not None and (not isinstance(tables, list) or not all(isinstance(t, str) for t in tables)):
            raise Malformed("tables must be a list of SCHEMA.TABLE names")
        if since is not None and (type(since) is not int or since < 0):
            raise Malformed("since must be a cursor (an integer >= 0)")
        rc = self.reads()
        pruned, head = feed.bounds(rc)
        cursor = head if since is None else since
        if cursor < pruned:
            # the records after this cursor are gone: the application must re-read its tables
            self.fail("cursor_expired", f"records after cursor {cursor} are no longer retained (oldest kept "
                                        f"follows {pruned}): re-read the tables, then watch from {head}",
                      req.get("id"), cursor=cursor, oldest=pruned, head=head)
            return
        self.send({**tag, "ok": True, "cursor": cursor})
        srv = self.server
        with srv.watchers_lock:
            srv.watchers += 1
        try:
            self.stream(rc, cursor, tables)
        finally:
            with srv.watchers_lock:
                srv.watchers -= 1

    def stream(self, rc, cursor: int, tables: list | None) -> None:
        """Records after `cursor`, never more than the window beyond what the client acknowledged
        (docs/client.md "Protocol"): what a watcher costs is bounded whatever the kernel buffers.
        The socket is written without blocking, so acknowledgements are read while the client is
        slow to take what was sent; no acknowledgement for stall_s while blocked ends the watch."""
        from .store import feed
        srv, sent, pending, stuck = self.server, Unacked(cursor), b"", None
        seen, at_head = -1, False
        self.conn.setblocking(False)
        while not srv.closed():
            acked = sent.acked
            if not self.inbound(sent):
                return
            full = len(sent.cursors) >= WINDOW or sent.size >= WINDOW_BYTES
            if not pending and not full:
                seen = srv.version   # before the read: a commit after it is not slept through
                want = min(BATCH, WINDOW - len(sent.cursors))
                recs = feed.seqs_after(rc, cursor, tables, want)
                if feed.pruned_through(rc) > cursor:   # pruned past what was sent: that read may skip some
                    self._behind(cursor)
                    return
                out = []
                for seq, line in zip(recs, self.lines(rc, recs)):
                    if line is None:   # pruned since it was listed: found below on the next read
                        break
                    if out and sent.size + len(line) > WINDOW_BYTES:
                        break
                    out.append(line)
                    sent.add(seq, len(line))
                pending, cursor = b"".join(out), sent.last
                at_head = len(recs) < want and len(out) == len(recs)
            if pending:
                try:
                    pending = pending[self.conn.send(pending):]
                except BlockingIOError:
                    pass
                if not pending:
                    stuck = None
                    if not at_head:
                        continue
            if not pending and not full:
                # at the head as of `seen`: sleep until the loop tells of a later commit
                stuck = None
                with srv.changed:
                    if srv.version == seen:
                        srv.changed.wait(1.0)
                continue
            # waiting for the client to take what was sent, or to acknowledge it
            now = time.monotonic()
            if stuck is None or sent.acked != acked:
                stuck = now
            if now - stuck >= stall_s():
                if not pending:   # a notice only between whole lines
                    self._behind(cursor)
                return
            select.select([self.conn], [self.conn] if pending else [], [], min(stall_s() - (now - stuck), 1.0))

    def inbound(self, sent: "Unacked") -> bool:
        """Read the acknowledgements the client sent, without waiting; False when it closed its
        stream or sent anything else (a watch owns its connection: that is answered, then it ends)."""
        from .controlframe import TooLarge
        try:
            lines, ended = self.reader.ready()
        except TooLarge:
            self.fail("too_large", "an acknowledgement is one short JSON line")
            return False
        for line in lines:
            try:
                ack = json.loads(line)
            except (ValueError, UnicodeDecodeError):
                ack = None
            c = ack.get("ack") if isinstance(ack, dict) and len(ack) == 1 else None
            if type(c) is not int or c > sent.last:
                self.fail("malformed", "a subscription stream takes only {\"ack\": CURSOR} of a record sent: "
                                       "a watch owns its connection")
                return False
            sent.ack(c)
        return not ended

    def lines(self, rc, seqs: list[int]) -> list[bytes]:
        """The stream's lines for these cursors, each resolved once for every watcher (a value read
        from its row): the server keeps the newest CACHE, and one watcher at a time resolves what
        is missing while the others wait for it, so ten watchers cost the agent about what one does."""
        from .store import feed
        srv = self.server
        with srv.watchers_lock:
            cache = srv.resolved_lines
            have = {s: cache.get(s) for s in seqs}
        if None in have.values():
            with srv.resolving:
                with srv.watchers_lock:
                    have.update({s: cache.get(s) for s, line in have.items() if line is None})
                todo = [s for s, line in have.items() if line is None]
                if todo:
                    made = {r["cursor"]: json.dumps(r, separators=(",", ":")).encode() + b"\n"
                            for r in feed.resolved(rc, feed.rows_at(rc, todo))}
                    have.update(made)
                    with srv.watchers_lock:
                        cache.update(made)
                        while len(cache) > CACHE:
                            del cache[next(iter(cache))]
        return [have[s] for s in seqs]   # None: pruned since it was listed

    def _behind(self, cursor: int) -> None:
        # best effort: a client that stopped reading may never see it; its library treats a cut
        # stream the same way (docs/client.md "The change feed")
        with contextlib.suppress(OSError):
            self.conn.setblocking(False)
            self.conn.send(json.dumps({"error": "behind", "cursor": cursor,
                                       "message": "fell behind the feed: resume from this cursor"}).encode() + b"\n")
        with contextlib.suppress(OSError):
            for _ in range(64):   # acknowledgements left unread would reset the stream (bounded)
                if not self.conn.recv(65536):
                    break


class Unacked:
    """The records sent in a watch and not yet acknowledged: their cursors and line sizes, in order."""

    def __init__(self, cursor: int) -> None:
        self.acked = self.last = cursor
        self.cursors: collections.deque[tuple[int, int]] = collections.deque()
        self.size = 0

    def add(self, cursor: int, size: int) -> None:
        self.cursors.append((cursor, size))
        self.last, self.size = cursor, self.size + size

    def ack(self, cursor: int) -> None:
        while self.cursors and self.cursors[0][0] <= cursor:
            self.size -= self.cursors.popleft()[1]
        self.acked = max(self.acked, cursor)
