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
