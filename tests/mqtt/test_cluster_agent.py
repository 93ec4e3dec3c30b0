"""The agent on a clustered broker (docs/scale.md): a two-node ejabberd cluster, where a retained
message written through one node never reaches a later subscriber on the other
(tests/mqtt/test_cluster_broker.py). A gateway under `run` is connected to node 1; devices to node 2.

- batch: a device that wakes with `sync --once` converges with the gateway within a bounded number
  of wakes;
- realtime: a device under `run` that came up after the gateway receives the gateway's writes as
  realtime pushes (the gateway's batch cadence is an hour, so only a push can carry them);
- a device's persistent session resumes on the other node: what the gateway sent while it slept,
  queued on node 2, is taken in when it wakes through node 1.

Nothing here waits on a retained presence crossing nodes: presence is learned from traffic."""
from __future__ import annotations

import json
import secrets
import sqlite3
import subprocess
import time

import pytest

from agent.node import Node

from .ejabberd_cluster import EjabberdCluster
from .helpers import MANIFEST, T, start_run, stop_run, wait_serving
from tests.cli_cmd import agent_cmd, agent_env, run_cli

CEILING = 300        # only catches a hang
MAX_WAKES = 8


@pytest.fixture
def fleet(tmp_path):
    nodes = {name: Node.init(tmp_path / name, MANIFEST)[0] for name in ("gateway", "sleeper", "live")}
    for a in nodes.values():
        for b in nodes.values():
            if a is not b:
                a.add_peer(b.site_id, b.keyring[b.site_id][0], None)
    users = {n.site_id.hex(): secrets.token_hex(8) for n in nodes.values()}
    homes = {name: n.home for name, n in nodes.items()}
    for name, n in nodes.items():
        (n.home.parent / f"{name}.site").write_text(n.site_id.hex())
        (n.home.parent / f"{name}.pw").write_text(users[n.site_id.hex()])
    for n in nodes.values():
        n.close()
    cluster = EjabberdCluster(tmp_path / "ejabberd", users).start()
    yield cluster, homes
    cluster.close()


def _site(home) -> str:
    return (home.parent / f"{home.name}.site").read_text()


def _broker_args(cluster, node: int, home) -> list[str]:
    return ["--broker", cluster.url(node), "--username", _site(home), "--password-file",
            str(home.parent / f"{home.name}.pw")]


def _rows(home) -> set:
    with sqlite3.connect(f"file:{home}/store.sqlite?mode=ro", uri=True, timeout=30) as c:
        return {r for r in c.execute('SELECT device, seq, note FROM "app.readings"')}


def _write(home, i: int, device: str = "gw") -> None:
    p = run_cli("--home", home, "write", T, "--key", json.dumps({"device": device, "seq": i}),
                "--set", json.dumps({"temp": float(i), "note": f"{device}{i}"}))
    assert p.returncode == 0, p.stderr








def _run(cluster, node: int, home, *extra) -> subprocess.Popen:
    proc = start_run(home, None, *_broker_args(cluster, node, home), *extra)
    wait_serving(home, proc)
    return proc


def _wake(cluster, node: int, home) -> dict:
    p = subprocess.run([*agent_cmd(), "--home", str(home), "sync", "--once", *_broker_args(cluster, node, home)],
                       capture_output=True, text=True, env=agent_env(), timeout=CEILING)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


def _until(cond, what: str) -> None:
    deadline = time.monotonic() + CEILING
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.2)


def test_gateway_and_devices_on_different_cluster_nodes(fleet):
    cluster, homes = fleet
    for i in range(5):
        _write(homes["gateway"], i)
    for i in range(3):
        _write(homes["sleeper"], i, "sl")
    gateway = _run(cluster, 0, homes["gateway"], "--cadence", "3600")
    try:
        # batch: the sleeper wakes on node 2 until it and the gateway hold the same rows
        for wake in range(1, MAX_WAKES + 1):
            _wake(cluster, 1, homes["sleeper"])
            if _rows(homes["sleeper"]) == _rows(homes["gateway"]) and len(_rows(homes["gateway"])) == 8:
                break
        assert _rows(homes["sleeper"]) == _rows(homes["gateway"]), f"not converged after {wake} wakes"

        # realtime: a device that came up after the gateway, on the other node
        live = _run(cluster, 1, homes["live"], "--cadence", "3600")
        try:
            _until(lambda: len(_rows(homes["live"])) == 8, "the live device never got the gateway's rows")
            _write(homes["gateway"], 100)
            _until(lambda: ("gw", 100, "gw100") in _rows(homes["live"]),
                   "no realtime push reached the device on the other cluster node")
        finally:
            stop_run(live)

        # a persistent session resumed on the other node: written while the sleeper is away
        for i in range(200, 204):
            _write(homes["gateway"], i)
        for wake in range(1, MAX_WAKES + 1):
            _wake(cluster, 0, homes["sleeper"])
            if {("gw", i, f"gw{i}") for i in range(200, 204)} <= _rows(homes["sleeper"]):
                break
        assert {("gw", i, f"gw{i}") for i in range(200, 204)} <= _rows(homes["sleeper"])
    finally:
        stop_run(gateway)
