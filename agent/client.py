"""What applications on the device import to write, read and follow their tables (docs/client.md).
Standard library only at import: the agent's modules are loaded only when no agent runs and the
client opens the home itself. While `ssp-agent run` holds the home, requests go over one
persistent session on its control socket (agent/clientops.py); otherwise a write opens the home in
its turn (one writer, agent/hometurn.py), writes through `Node.write_many` and closes it, and reads
and watches use a read-only connection. Either way a write takes the one local write path."""
from __future__ import annotations

import collections
import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterable, Iterator, NamedTuple

PROTOCOL = 1
SOCKET_NAME = "control.sock"
STORE_FILE = "store.sqlite"
POLL_S = 0.1   # how often a watch without a running agent looks for new records


class ClientError(Exception):
    """A request that could not be done; the message says why."""


class RequestRefused(ClientError):
    """The node refused the request (no such table, a value that does not fit, ...)."""


class CursorExpired(ClientError):
    """The records after this cursor are no longer retained: re-read the tables, then watch from `head`."""

    def __init__(self, message: str, cursor: int, oldest: int, head: int) -> None:
        super().__init__(message)
        self.cursor, self.oldest, self.head = cursor, oldest, head


class FellBehind(ClientError):
    """The watcher did not keep up and was disconnected; watch again from `cursor`."""

    def __init__(self, message: str, cursor: int) -> None:
        super().__init__(message)
        self.cursor = cursor


class Value(NamedTuple):
    value: Any
    state: str   # "materialized", "deleted" (cleared by a delete) or "unmaterialized" (never set here)


class Row(NamedTuple):
    exists: bool
    state: str   # "materialized", "deleted" or "absent" (never materialized here)
    values: dict
    states: dict

    def value(self, column: str) -> Value:
        return Value(self.values[column], self.states[column])


def _to_wire(v: Any) -> Any:
    if isinstance(v, (bytes, bytearray)):
        return {"$bytes": bytes(v).hex()}
    return v


def _from_wire(v: Any) -> Any:
    if isinstance(v, dict) and set(v) == {"$bytes"}:
        return bytes.fromhex(v["$bytes"])
    return v


def _decoded(rec: dict) -> dict:
    """A feed record with its key and column values as Python values (bytes for blobs), and each
    written column's clock (site, hlc) given in full (the stored record names only those that are
    not the event's own)."""
    if "key" in rec:
        rec["key"] = {k: _from_wire(v) for k, v in rec["key"].items()}
    for c in rec.get("columns", {}).values():
        if "value" in c:
            c["value"] = _from_wire(c["value"])
        if "state" not in c and "site" not in c:
            c["site"], c["hlc"] = rec["site"], rec["hlc"]
    return rec


def _connect(sock: socket.socket, path: Path) -> None:
    """Connect to `path` even past sun_path's 108 bytes, through the directory's /proc entry."""
    if len(os.fsencode(str(path))) < 100:
        sock.connect(str(path))
        return
    fd = os.open(str(path.parent), os.O_PATH | os.O_DIRECTORY)
    try:
        sock.connect(f"/proc/self/fd/{fd}/{path.name}")
    finally:
        os.close(fd)


def _norm(w) -> dict:
    if isinstance(w, dict):
        return w
    table, key, values = w
    return {"table": table, "key": key, "delete": True} if values is None else \
        {"table": table, "key": key, "set": values}


def _write_request(ws: list[dict], rid: str) -> dict:
    return {"op": "write_many", "request_id": rid, "writes": [
        {"table": w["table"], "key": {k: _to_wire(v) for k, v in w["key"].items()},
         **({"delete": True} if w.get("delete") else {"set": {k: _to_wire(v) for k, v in w["set"].items()}})}
        for w in ws]}


class _Stream:
    """A watch's lines off its socket, and its acknowledgements (docs/client.md "Protocol"): the
    agent sends at most a window beyond the last one, so the application acknowledges what it
    consumed: every half window, at least every quarter of the agent's stall time while it
    consumes, and whenever it waits for more; one that stops consuming is cut off."""

    def __init__(self, sock: socket.socket, window: dict) -> None:
        self.sock, self.lines, self.tail = sock, collections.deque(), b""
        self.every = max(1, int(window.get("records", 256)) // 2)
        self.bytes = max(1, int(window.get("bytes", 1 << 20)) // 2)
        self.every_s = float(window.get("stall_s", 30.0)) / 4
        self.done = self.done_bytes = self.count = 0
        self.acked_at, self.cursor = time.monotonic(), None

    def line(self) -> bytes:
        """The next line with its newline; at the stream's end what is left (b"" or a cut line)."""
        while not self.lines:
            self.ack()   # before waiting: the agent may be waiting for it
            b = self.sock.recv(65536)
            if not b:
                tail, self.tail = self.tail, b""
                return tail
            *whole, self.tail = (self.tail + b).split(b"\n")
            self.lines.extend(x + b"\n" for x in whole)
        line = self.lines.popleft()
        self.done_bytes += len(line)
        return line

    def consumed(self, cursor: int) -> None:
        self.cursor, self.count = cursor, self.count + 1
        if self.count >= self.every or self.done_bytes >= self.bytes or \
                time.monotonic() - self.acked_at >= self.every_s:
            self.ack()

    def ack(self) -> None:
        if not self.count:
            return
        self.count = self.done_bytes = 0
        self.acked_at = time.monotonic()
        try:
            self.sock.sendall(b'{"ack":%d}\n' % self.cursor)
        except OSError:
            pass   # cut off already: what was sent before is still read, then the stream's end


class Client:
    """`Client(home)`: the node at `home`; `socket_path`: a running agent's extra socket (an
    application running as another user, docs/client.md "Access")."""

    def __init__(self, home: str | os.PathLike | None = None, *, socket_path: str | os.PathLike | None = None,
                 timeout: float = 120.0) -> None:
        if home is None and socket_path is None:
            home = os.environ.get("SSP_AGENT_HOME")
            if not home:
                raise ClientError("give the node's home (or set SSP_AGENT_HOME), or a socket_path")
        self.home = Path(home) if home is not None else None
        self.socket_path = Path(socket_path) if socket_path is not None else self.home / SOCKET_NAME
        self.only_socket = socket_path is not None
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._rfile = None
        self._id = 0

    # ------------------------------------------------------------------ writes
    def write(self, table: str, key: dict, set: dict | None = None, delete: bool = False) -> str:   # noqa: A002
        """One signed local event; returns its event_id (hex)."""
        if (set is None) == (not delete):
            raise ClientError("give set={...} or delete=True")
        return self.write_many([{"table": table, "key": key, "delete": True} if delete else
                                {"table": table, "key": key, "set": set}])[0]

    def write_many(self, writes: Iterable) -> list[str]:
        """Many events in one round trip and one signed group commit. Each write is a dict
        {"table", "key", "set"} or {"table", "key", "delete": True}, or a tuple (table, key, set),
        set None for a delete."""
        ws = [_norm(w) for w in writes]
        if not ws:
            return []
        # one id for every attempt of this write: a retry after a lost answer is answered with the
        # events the first attempt signed, never signs them again (docs/client.md "Protocol")
        rid = os.urandom(16).hex()
        r = self._call(_write_request(ws, rid))
        if r is not None:
            return r["event_ids"]
        return self._write_here(ws, rid)

    def _write_here(self, ws: list[dict], rid: str) -> list[str]:
        from agent import hometurn
        from agent.clientops import write_once
        from agent.errors import NodeError
        from agent.node import Node
        home = self.home
        try:
            node = hometurn.open_in_turn(home, lambda: Node.open(home), wait_s=hometurn.budget())
        except hometurn.HeldByService:
            r = self._call(_write_request(ws, rid))
            if r is None:
                raise ClientError(f"{home} is held by a running agent that does not answer") from None
            return r["event_ids"]
        except (hometurn.StillHeld, ValueError) as e:
            raise ClientError(str(e)) from None
        try:
            ids = write_once(node, [(w["table"], w["key"], None if w.get("delete") else w["set"], bool(w.get("delete")))
                                    for w in ws], rid)
        except NodeError as e:
            raise RequestRefused(str(e)) from None
        finally:
            node.close()
        return [i.hex() for i in ids]

    # ------------------------------------------------------------------ reads
    def read(self, table: str, key: dict) -> Row:
        """One row with each value's state."""
        r = self._call({"op": "read", "table": table, "key": {k: _to_wire(v) for k, v in key.items()}})
        if r is not None:
            row = r["row"]
            return Row(row["exists"], row["state"], {c: _from_wire(v) for c, v in row["values"].items()},
                       row["states"])
        from agent.store import feed
        conn = self._reader()
        try:
            try:
                row = feed.read_row(conn, table, key)
            except KeyError as e:
                raise RequestRefused(str(e.args[0])) from None
        finally:
            conn.close()
        if row is None:
            raise RequestRefused(f"no table {table!r} on this node")
        return Row(row["exists"], row["state"], row["values"], row["states"])

    def value(self, table: str, key: dict, column: str) -> Value:
        row = self.read(table, key)
        if column not in row.values:
            raise RequestRefused(f"{table} has no value column {column!r}")
        return row.value(column)

    def head(self) -> int:
        """The feed's newest cursor now: watch from it to see only what comes next."""
        r = self._call({"op": "head"})
        if r is not None:
            return r["cursor"]
        from agent.store import feed
        conn = self._reader()
        try:
            return feed.bounds(conn)[1]
        finally:
            conn.close()

    def _reader(self):
        from agent.store import db
        path = self.home / STORE_FILE
        if not path.exists():
            raise ClientError(f"no node at {self.home} (no {STORE_FILE})")
        return db.connect_readonly(path)

    # ------------------------------------------------------------------ the change feed
    def watch(self, tables: Iterable[str] | None = None, since: int | None = None, *,
              idle_s: float | None = None, raw: bool = False) -> Iterator[dict]:
        """Feed records after cursor `since` (None: from now) in apply order, for `tables` (None:
        all). Ends after `idle_s` seconds without a record (None: never). CursorExpired when
        `since` is older than what the node retains; FellBehind when this watcher was cut off
        (it stopped consuming for the agent's stall time): watch again from its cursor. `raw`:
        values in their JSON form ({"$bytes": hex})."""
        tables = list(tables) if tables is not None else None
        s = self._open_session()
        if s is not None:
            yield from self._watch_socket(s, tables, since, idle_s, raw)
            return
        yield from self._watch_here(tables, since, idle_s, raw)

    def _watch_socket(self, s, tables, since, idle_s, raw) -> Iterator[dict]:
        sock, rfile, hello = s
        rfile.close()   # the agent sends nothing unasked after its hello: the stream is read below
        stream = _Stream(sock, hello.get("window") or {})
        cursor = since or 0
        try:
            sock.sendall(json.dumps({"op": "watch", "tables": tables, "since": since}).encode() + b"\n")
            head = json.loads(stream.line() or b"{}")
            self._raise_error(head)
            cursor = head.get("cursor", since or 0)
            # a zero idle time still lets records already on their way arrive
            sock.settimeout(max(idle_s, 0.1) if idle_s is not None else None)
            while True:
                try:
                    line = stream.line()
                except (socket.timeout, TimeoutError):
                    return   # idle
                if not line.endswith(b"\n"):
                    raise FellBehind(f"the watch ended at cursor {cursor} (the agent stopped or cut this "
                                     "watcher off): watch again from it", cursor)
                rec = json.loads(line)
                if "error" in rec:
                    self._raise_error(rec)
                cursor = rec["cursor"]
                yield rec if raw else _decoded(rec)
                stream.consumed(cursor)   # the application asked for the next: it has this one
        except (ConnectionError, OSError) as e:
            if isinstance(e, (socket.timeout, TimeoutError)):
                return
            raise FellBehind(f"the watch ended at cursor {cursor}: {e}", cursor) from None
        finally:
            sock.close()

    def _watch_here(self, tables, since, idle_s, raw) -> Iterator[dict]:
        from agent.store import feed
        conn = self._reader()
        try:
            if not feed.exists(conn):
                # no records is not an empty history here: the rows were written before any feed
                raise ClientError(f"{self.home} has no change feed yet (made by an older agent): the next "
                                  "writing open (`ssp-agent run`, `write`) adds it")
            pruned, head = feed.bounds(conn)
            cursor = head if since is None else since
            if cursor < pruned:
                raise CursorExpired(f"records after cursor {cursor} are no longer retained: re-read the tables, "
                                    f"then watch from {head}", cursor, pruned, head)
            last = time.monotonic()
            while True:
                recs = feed.after(conn, cursor, tables, 256)
                if recs and feed.bounds(conn)[0] > recs[0][0] - 1:
                    raise FellBehind(f"records after cursor {cursor} were pruned while this watcher read", cursor)
                for r in feed.resolved(conn, recs):
                    cursor = r["cursor"]
                    yield r if raw else _decoded(r)
                if recs:
                    last = time.monotonic()
                    continue
                if idle_s is not None and time.monotonic() - last >= idle_s:
                    return
                time.sleep(POLL_S)
        finally:
            conn.close()

    # ------------------------------------------------------------------ the session
    def _open_session(self):
        """A new connection past its handshake, or None when no agent listens."""
        path = self.socket_path
        if not path.exists():
            if self.only_socket:
                raise ClientError(f"no agent listens on {path}")
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            _connect(sock, path)
        except (ConnectionRefusedError, FileNotFoundError):
            sock.close()
            if self.only_socket:
                raise ClientError(f"no agent listens on {path}") from None
            return None   # stale: the agent that made it is gone
        except OSError:
            sock.close()
            raise
        rfile = sock.makefile("rb")
        sock.sendall(json.dumps({"hello": "ssp-agent", "version": PROTOCOL}).encode() + b"\n")
        r = json.loads(rfile.readline() or b"{}")
        if not r.get("ok"):
            rfile.close()
            sock.close()
            if not r or r.get("not_run"):
                return None   # it stopped as we connected
            raise ClientError(f"the agent refused the session: {r.get('message', r)}")
        return sock, rfile, r

    def _call(self, req: dict) -> dict | None:
        """One request over the persistent session; None when no agent runs (do it here)."""
        for attempt in (0, 1):
            fresh = self._sock is None
            if fresh:
                s = self._open_session()
                if s is None:
                    return None
                self._sock, self._rfile, _ = s
            self._id += 1
            try:
                self._sock.sendall(json.dumps({**req, "id": self._id}).encode() + b"\n")
                line = self._rfile.readline()
            except OSError:
                line = b""
            if not line:
                # the agent closed an idle session, or stopped: a fresh one (or the home) takes it
                self.close()
                if fresh and attempt:
                    return None
                continue
            r = json.loads(line)
            if r.get("error") == "not_run":
                self.close()
                continue
            self._raise_error(r)
            return r
        return None

    @staticmethod
    def _raise_error(r: dict) -> None:
        err = r.get("error")
        if err is None:
            return
        msg = r.get("message", err)
        if err == "cursor_expired":
            raise CursorExpired(msg, r["cursor"], r["oldest"], r["head"])
        if err == "behind":
            raise FellBehind(msg, r["cursor"])
        if err == "refused":
            raise RequestRefused(msg)
        raise ClientError(f"{err}: {msg}")

    def close(self) -> None:
        if self._rfile is not None:
            self._rfile.close()
        if self._sock is not None:
            self._sock.close()
        self._sock = self._rfile = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
