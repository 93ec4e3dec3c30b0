"""A running agent for the client tests (tests/mqtt/helpers.py's `run`), and raw connections to
its control socket for the hostile ones."""
from __future__ import annotations

import contextlib
import json
import socket
from pathlib import Path

from agent.simpeer import manifest_text
from tests.core.helpers import READINGS
from tests.mqtt.helpers import MESH, N, T, make_nodes, start_run, stop_run, wait_serving  # noqa: F401 - shared
from tests.waiting import HANG_S


BLOBS = manifest_text(MESH, READINGS)   # app.readings with a blob column, raw


@contextlib.contextmanager
def running(tmp: Path, broker, env: dict | None = None, manifest: str | None = None):
    """One node's home served by `ssp-agent run` on `broker`; yields the home."""
    import os
    node, = make_nodes(tmp, 1, *([manifest] if manifest else []))
    home = node.home
    node.close()
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        proc = start_run(home, broker)
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        wait_serving(home, proc)
        yield home
        stop_run(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def before_the_feed(home: Path) -> None:
    """Take a closed home back to the store version before the feed (7): no feed table, as a home
    an older agent made; the next writing open migrates it."""
    import sqlite3
    conn = sqlite3.connect(home / "store.sqlite", isolation_level=None)
    conn.execute("BEGIN")
    conn.execute("DROP TABLE feed")
    conn.execute("DROP TABLE IF EXISTS client_requests")
    conn.execute("DELETE FROM sqlite_sequence WHERE name = 'feed'")
    conn.execute("UPDATE meta SET value = 7 WHERE key = 'schema_version'")
    conn.execute("COMMIT")
    conn.execute("PRAGMA user_version = 7")
    conn.close()


class Raw:
    """One raw connection to a running agent's control socket."""

    def __init__(self, home: Path) -> None:
        self.s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.s.settimeout(HANG_S)
        self.s.connect(str(home / "control.sock"))
        self.f = self.s.makefile("rb")

    def send(self, obj) -> None:
        self.s.sendall((obj if isinstance(obj, bytes) else json.dumps(obj).encode() + b"\n"))

    def line(self) -> dict:
        return json.loads(self.f.readline())

    def rest(self) -> list[dict]:
        """Every line the agent sends until it closes the connection."""
        return [json.loads(x) for x in self.f.read().splitlines() if x.strip()]

    def hello(self, version: int = 1) -> dict:
        self.send({"hello": "ssp-agent", "version": version})
        return self.line()

    def close(self) -> None:
        self.f.close()
        self.s.close()


class SwallowingProxy:
    """A socket in front of a running agent's control socket that passes sessions through, except
    that on its first connection it swallows the answer to the first write (the agent applied it)
    and cuts the connection: a client then sees a lost connection and retries. Each later
    connection waits for `gate` before it reaches the agent (the test may restart `run` first)."""

    def __init__(self, path: Path, upstream: Path) -> None:
        import threading
        self.path, self.upstream = path, upstream
        self.gate = threading.Event()
        self.gate.set()
        self.swallowed = threading.Event()
        self.connections = 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(str(path))
        self.sock.listen(8)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import threading
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            first = self.connections == 0
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn, first), daemon=True).start()

    def _serve(self, conn: socket.socket, first: bool) -> None:
        import threading
        if not first:
            self.gate.wait(HANG_S)
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        up.connect(str(self.upstream))

        def pump_in() -> None:
            with contextlib.suppress(OSError):
                while (b := conn.recv(65536)):
                    up.sendall(b)
        threading.Thread(target=pump_in, daemon=True).start()
        with contextlib.suppress(OSError):
            for line in up.makefile("rb"):
                if first and b'"event_ids"' in line:
                    self.swallowed.set()   # applied by the agent; its answer never reaches the client
                    break
                conn.sendall(line)
        for s in (conn, up):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()

    def close(self) -> None:
        self.sock.close()
