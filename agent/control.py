"""The running agent's control socket: while `ssp-agent run` holds a home, the verbs in `FORWARDED`
and the applications' requests (agent/client.py) are served by it; whatever touches the node runs on
the loop thread that owns its SQLite connection and signing bridge (one writer, docs/operations.md).

- **Where**: `HOME/control.sock`, 0600 in the 0700 home; file permissions are the only access rule.
  `SSP_AGENT_CONTROL_SOCKET` adds a second socket (0660, group `SSP_AGENT_CONTROL_GROUP`) for
  applications running as another user (docs/client.md "Access").
- **Protocol**: a first line `{"argv": [...]}` is the CLI's one verb (one `{"exit", "stdout", "stderr"}`
  line back; `"not_run": true`: the agent stopped before running it); a first line `{"hello":
  "ssp-agent", "version": 1}` opens a session of many requests (agent/clientops.py, docs/client.md).
  Every line is bounded (MAX_REQUEST); anything malformed is answered with an error and ends that
  connection, never the agent.
- **Staleness**: a socket nobody listens on is ignored by the client and replaced by the next
  `run`, which holds the home's journal lock before it binds."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import socket
import threading
import time
from pathlib import Path
from typing import Callable

from .controlframe import MAX_REQUEST, LineReader, TooLarge, drain

SOCKET_NAME = "control.sock"
# the verbs a running agent serves (a verb, or "verb action" for one action of it): every verb the
# runbooks use on a live gateway or device (docs/operations.md); `sequencing` so a member's
# `commits run` can hand the receipts it gets to the node's gossip (docs/sequencer.md).
# `record list`, `rehydrate --status` and `keystore show` are served too rather than read from a
# read-only open: the first two may create their tables on an older home (a write), and `keystore
# show` needs the keystore itself, which a serial device lends to one process, and the live
# journal's figures. Verbs left out rebuild what the running loop holds (tables, policy, the
# keystore) or move files: they need the home to themselves.
FORWARDED = ("status", "dump", "events", "log", "write", "sequencing", "peer", "record", "rehydrate", "evict",
             "keystore show", "authority add")
CLIENT_TIMEOUT_S = 120.0  # a forwarded verb waits at most this long for the loop to run it
MAX_CLIENTS = 256  # connections served at once; more wait in the listen backlog
# sessions held open at once (a watcher or an application's persistent session holds one); past it
# a hello is answered "busy": held sessions never use up the connections the CLI's verbs need
MAX_SESSIONS = 64
SOCKET_ENV, GROUP_ENV = "SSP_AGENT_CONTROL_SOCKET", "SSP_AGENT_CONTROL_GROUP"

log = logging.getLogger("ssp_agent.control")


def socket_path(home: Path) -> Path:
    return Path(home) / SOCKET_NAME


@contextlib.contextmanager
def _addr(path: Path):
    """An address for `path` that fits sun_path (108 bytes): long paths go through the directory's
    /proc/self/fd entry (Linux), so a home may live at any depth."""
    p = str(path)
    if len(os.fsencode(p)) < 100:
        yield p
        return
    fd = os.open(str(path.parent), os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


def served(path: str) -> bool:
    """Whether a running agent serves this verb ("verb" or "verb action")."""
    return path in FORWARDED or path.split(" ", 1)[0] in FORWARDED


# ---------------------------------------------------------------- client
def listening(home: Path) -> bool:
    """Whether an agent serves `home`'s control socket now (a connection is accepted)."""
    path = socket_path(home)
    if not path.exists():
        return False
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(10.0)
        with _addr(path) as addr:
            s.connect(addr)
        return True
    except OSError:
        return False   # stale (its agent is gone), or being replaced
    finally:
        s.close()


def forward(home: Path, argv: list[str], timeout: float = CLIENT_TIMEOUT_S) -> tuple[int, str, str] | None:
    """Run `argv` in the agent running on `home`. None when no agent listens there (no socket, or a
    stale one): the caller then opens the home itself."""
    path = socket_path(home)
    if not path.exists():
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(10.0)
        try:
            with _addr(path) as addr:
                s.connect(addr)
        except (ConnectionRefusedError, FileNotFoundError):
            return None  # stale: the agent that made it is gone
        s.settimeout(timeout)
        s.sendall(json.dumps({"argv": list(argv)}).encode() + b"\n")
        s.shutdown(socket.SHUT_WR)
        data = _read_all(s)
    except socket.timeout:
        return 1, "", f"ssp-agent: the agent running on {home} did not answer within {timeout:.0f}s\n"
    except OSError as e:
        return 1, "", f"ssp-agent: cannot talk to the agent running on {home} ({SOCKET_NAME}): {e.strerror or e}\n"
    finally:
        s.close()
    try:
        r = json.loads(data)
        if r.get("not_run") is True:
            return None   # it stopped before running this (never started): the caller takes its turn
        return int(r["exit"]), str(r.get("stdout", "")), str(r.get("stderr", ""))
    except (ValueError, KeyError, TypeError):
        return 1, "", f"ssp-agent: the agent running on {home} closed its control socket without an answer " \
                      "(it is stopping?); try again\n"


def _read_all(s: socket.socket, limit: int | None = None) -> bytes:
    chunks, n = [], 0
    while True:
        b = s.recv(65536)
        if not b:
            return b"".join(chunks)
        chunks.append(b)
        n += len(b)
        if limit is not None and n > limit:
            raise ValueError("request too large")


# ---------------------------------------------------------------- server
class Request:
    def __init__(self, argv: list[str], op: dict | None = None) -> None:
        self.argv = argv
        self.op = op   # an application's request (agent/clientops.py), else a CLI command line
        self.done = threading.Event()
        self.result: tuple[int, str, str] | dict = (1, "", "ssp-agent: the running agent stopped before it ran "
                                                          "this; try again\n")
        # set when the agent stops with this request never taken by its loop: the client is told
        # so, and waits for the home instead of failing (a service restarting around a write)
        self.not_run = False


MALFORMED = (2, "", "ssp-agent: malformed control request\n")


class ControlServer:
    """Accepts connections on a thread; requests wait in a queue until the loop thread, which owns
    the node, calls `serve()` (between its steps) and runs them with `execute` (a CLI command
    line) or agent/clientops.py (an application's write, with `node`)."""

    def __init__(self, home: Path, execute: Callable[[list[str]], tuple[int, str, str]],
                 wake: Callable[[], None] | None = None, node=None) -> None:
        self.home = Path(home)
        self.path = socket_path(home)
        self.execute = execute
        self.node = node
        self.wake = wake or (lambda: None)
        self.requests: queue.Queue[Request] = queue.Queue()
        self._slots = threading.BoundedSemaphore(MAX_CLIENTS)
        self.sessions = threading.BoundedSemaphore(MAX_SESSIONS)
        self._closed = threading.Event()
        # watchers wait on this; `serve()` (every loop turn, after the turn applied) notifies
        self.changed = threading.Condition()
        self.version = 0   # counts those notices: a watcher sleeps only while it has seen the last
        self.watchers = 0
        self.watchers_lock = threading.Lock()
        self.resolved_lines: dict[int, bytes] = {}   # feed records as streamed, shared by the watchers
        self.resolving = threading.Lock()   # one watcher resolves the records missing there at a time
        self.paths = [self.path]
        self.socks = [self._bind(self.path, 0o600, None)]
        extra = os.environ.get(SOCKET_ENV, "").strip()
        if extra:
            self.paths.append(Path(extra))
            self.socks.append(self._bind(Path(extra), 0o660, os.environ.get(GROUP_ENV, "").strip() or None))
        self._thread = threading.Thread(target=self._accept_loop, name="ssp-control", daemon=True)
        self._thread.start()

    @staticmethod
    def _bind(path: Path, mode: int, group: str | None) -> socket.socket:
        # Only an agent that holds the home (its journal lock) gets here, so a socket file already
        # there was left by one that died: replace it.
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # created 0600: file permissions are the only access rule
        try:
            with _addr(path) as addr:
                sock.bind(addr)
        finally:
            os.umask(old)
        if group is not None:
            import grp
            os.chown(path, -1, grp.getgrnam(group).gr_gid)   # KeyError: no such group, `run` refuses
        os.chmod(path, mode)
        sock.listen(64)
        sock.setblocking(False)
        return sock

    # accept thread and its per-connection threads: never touch the node
    def _accept_loop(self) -> None:
        import select
        while not self._closed.is_set():
            try:
                ready, _, _ = select.select(self.socks, [], [], 0.5)   # so close() stops it promptly
            except (OSError, ValueError):
                return  # closed
            for sock in ready:
                try:
                    conn, _ = sock.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    return
                conn.setblocking(True)
                self._slots.acquire()
                # the extra socket serves applications only: the CLI's verbs (peer, authority,
                # keystore...) stay with whoever may open the home's own socket
                threading.Thread(target=self._handle, args=(conn, sock is self.socks[0]), name="ssp-control-conn",
                                 daemon=True).start()

    def _handle(self, conn: socket.socket, verbs: bool = True) -> None:
        try:
            conn.settimeout(10.0)
            reader = LineReader(conn, MAX_REQUEST)
            try:
                first = reader.line()
                req = json.loads(first) if first is not None else None
                if not isinstance(req, dict):
                    raise ValueError
            except TooLarge:
                self._reply(conn, MALFORMED, error="too_large")
                drain(conn)
                return
            except (ValueError, OSError, UnicodeDecodeError):
                self._reply(conn, MALFORMED, error="malformed")
                return
            if "hello" in req:
                from .clientops import Session
                if not self.sessions.acquire(blocking=False):
                    with contextlib.suppress(OSError):
                        conn.sendall(json.dumps({"error": "busy", "message": f"{MAX_SESSIONS} sessions are open "
                                                 "already; try again later"}).encode() + b"\n")
                    return
                try:
                    Session(self, conn, reader).run(req)
                finally:
                    self.sessions.release()
                return
            argv = req.get("argv")
            if not verbs:
                self._reply(conn, (2, "", "ssp-agent: this socket serves applications (agent.client), not "
                                          "the CLI's verbs\n"), error="refused")
                return
            if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
                self._reply(conn, MALFORMED, error="malformed")
                return
            r = self.submit(Request(argv))
            self._reply(conn, r.result, r.not_run)
        finally:
            conn.close()
            self._slots.release()

    def submit(self, r: Request) -> Request:
        """Queue `r` for the loop thread and wait until it ran (or the agent stopped without it)."""
        if self._closed.is_set():
            r.not_run = True
            return r
        self.requests.put(r)
        self.wake()
        deadline = time.monotonic() + CLIENT_TIMEOUT_S
        while not r.done.wait(0.5) and time.monotonic() < deadline:
            if self._closed.is_set():
                # closed by the loop thread once its loop ended: a request queued after close()
                # took the waiting ones is never taken either
                r.not_run = True
                break
        return r

    def submit_op(self, op: dict) -> Request:
        """An application's write request (agent/clientops.py), run on the loop thread."""
        return self.submit(Request([], op))

    def closed(self) -> bool:
        return self._closed.is_set()

    def _not_run(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError):
            conn.settimeout(2.0)
            _read_all(conn, MAX_REQUEST)   # read first: unread data would reset the reply
            self._reply(conn, Request([]).result, True)
        conn.close()

    @staticmethod
    def _reply(conn: socket.socket, result: tuple[int, str, str], not_run: bool = False,
               error: str | None = None) -> None:
        """A CLI answer; `error`: the first line was malformed, said so to either kind of client."""
        rc, out, err = result
        with contextlib.suppress(OSError):
            conn.settimeout(CLIENT_TIMEOUT_S)
            conn.sendall(json.dumps({"exit": rc, "stdout": out, "stderr": err,
                                     **({"not_run": True} if not_run else {}),
                                     **({"error": error, "message": err.strip()} if error else {})}).encode() + b"\n")

    # the loop thread
    def serve(self, max_items: int = 64) -> int:
        """Run waiting requests on the calling (loop) thread. Returns how many ran."""
        n = 0
        while n < max_items:
            try:
                r = self.requests.get_nowait()
            except queue.Empty:
                break
            try:
                if r.op is not None:
                    from .clientops import execute
                    r.result = execute(self.node, r.op)
                else:
                    r.result = self.execute(r.argv)
            except Exception as e:  # noqa: BLE001 - a request must never stop the service
                log.exception("control request %s failed", r.argv[:1] or r.op.get("op"))
                r.result = {"error": "internal", "message": str(e)} if r.op is not None else \
                    (1, "", f"ssp-agent: internal error in the running agent: {e}\n")
            r.done.set()
            n += 1
        if self.watchers and self.node is not None:
            from .store import feed
            head = feed.bounds(self.node.conn)[1]
            if head != self._head:   # after the turn's apply and these writes: watchers read the feed
                self._head = head
                with self.changed:
                    self.version += 1
                    self.changed.notify_all()
        return n

    _head = -1

    def close(self) -> None:
        self._closed.set()
        # No new client finds the socket once its name is gone; those already in the listen
        # backlog are answered "not run" (closing the socket would reset them, and their verb
        # would fail where it can simply take its turn after this agent)
        for path in self.paths:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        for sock in self.socks:
            with contextlib.suppress(OSError):
                while True:
                    conn, _ = sock.accept()
                    conn.setblocking(True)
                    self._not_run(conn)
            with contextlib.suppress(OSError):
                sock.close()
        with self.changed:
            self.changed.notify_all()
        while True:  # whoever still waits is told the agent stopped without running theirs
            try:
                r = self.requests.get_nowait()
            except queue.Empty:
                break
            r.not_run = True
            r.done.set()
        self._thread.join(timeout=2)
