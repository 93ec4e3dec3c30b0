"""Builders for the MQTT tests: real nodes that trust each other, runners on a real broker."""
from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

from agent.node import Node
from agent.simpeer import NOTES_TABLE, manifest_text, readings_table
from agent.runner import RunConfig, Runner
from agent.transport.mqtt import MqttSettings
from tests.cli_cmd import agent_cmd, agent_env, run_cli
from tests.waiting import HANG_S

MESH = bytes.fromhex("5e5e0000000000000000000000000042")
T = "app.readings"
MANIFEST = manifest_text(MESH, readings_table() + NOTES_TABLE)
N = "app.notes"


def make_nodes(tmp: Path, n: int, manifest: str = MANIFEST) -> list[Node]:
    nodes = [Node.init(tmp / f"n{i}", manifest)[0] for i in range(n)]
    for a in nodes:
        for b in nodes:
            if a is not b:
                a.add_peer(b.site_id, b.keyring[b.site_id][0], None)
    return nodes


def make_authority(nodes: list[Node], k: int = 0) -> None:
    """Node k becomes the mesh authority on every node (as a manifest `authorities` entry would)."""
    auth = nodes[k].site_id
    for n in nodes:
        n.conn.execute("INSERT OR REPLACE INTO meta VALUES ('authorities', ?)", (json.dumps([auth.hex()]),))
        n.authorities = {auth}


def settings(broker, url: str | None = None, **kw) -> MqttSettings:
    return MqttSettings.from_url(url or broker.url, backoff_min_s=0.05, backoff_max_s=0.5, **kw)


def runner(node: Node, broker, url: str | None = None, link: dict | None = None, **cfg) -> Runner:
    base = dict(cadence_s=0.5, answer_timeout_s=3.0)
    base.update(cfg)
    r = Runner(node, settings(broker, url, **(link or {})), RunConfig(**base))
    assert r.start(60), r.link.last_error
    return r


def step_until(runners, cond, timeout: float = HANG_S) -> bool:
    """Step the runners until ``cond()``: a wait for an event, so its ceiling only catches a hang
    (at least tests/waiting.HANG_S whatever ``timeout`` says: a small machine is slow, not hung)."""
    deadline = time.monotonic() + max(timeout, HANG_S)
    while time.monotonic() < deadline:
        for r in runners:
            r.step(0.01)
        if cond():
            return True
    return False


def pulls_answered(runners) -> bool:
    """Every runner pulled its peers on connecting and each of the others answered (docs/mqtt.md
    "A waking device"): what that exchange sends is over, so timing-sensitive steps start after it."""
    sites = {r.node.site_id for r in runners}
    return all(r.stats["pulls_sent"] >= 1 and not (set(r.ex.pulls.values()) & sites) for r in runners)


def pump_for(runners, seconds: float) -> None:
    """Step the runners for ``seconds`` (work that must not happen has had its chance)."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for r in runners:
            r.step(0.01)


def write(node: Node, i: int, device: str = "d") -> bytes:
    return node.write(T, {"device": device, "seq": i}, {"temp": float(i), "note": f"{device}{i}"})


def event_ids(node: Node) -> set[bytes]:
    return {bytes(r[0]) for r in node.conn.execute("SELECT event_id FROM events")}


def start_run(home, broker, *extra: str) -> subprocess.Popen:
    """`ssp-agent run` as a real process on `broker` (a cadence of 0.3 s unless `extra` says)."""
    args = ["--broker", broker.url, "--cadence", "0.3"] if broker is not None else []
    return subprocess.Popen([*agent_cmd(), "--home", str(home), "run", *args, *extra],
                            env=agent_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_serving(home, proc, deadline_s: float = HANG_S) -> None:
    """Until the running agent answers `status` through its socket (a ceiling that only catches a hang)."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        if (home / "control.sock").exists():
            p = run_cli("--home", home, "status")
            # answered by the agent itself ("run"), not by a read-only open past a stale socket
            if p.returncode == 0 and "run" in json.loads(p.stdout):
                return
        time.sleep(0.1)
    raise AssertionError("the running agent never answered on its control socket")


def stop_run(proc) -> dict:
    """SIGTERM, then its exit status 0 and its summary."""
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=HANG_S)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out)
