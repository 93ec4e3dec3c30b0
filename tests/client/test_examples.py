"""The examples run as an application would: examples/sensor.py writes readings through a running
agent; examples/follow_setpoint.py follows a table a gateway writes, says when a row was
resurrected or partially rebuilt, and resumes from its cursor file after a restart."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from agent.client import Client
from tests.cli_cmd import agent_env, installed_python
from tests.core.helpers import NOW, make_node, peers
from tests.waiting import HANG_S

from .helpers import T, before_the_feed, running

ROOT = Path(__file__).resolve().parents[2]
SETPOINTS = """
[[tables]]
schema = "app"
name = "setpoints"
category = "syncable"
retention = "telemetry"
key = ["zone"]
columns = { zone = "text", target = "real" }
"""
S = "app.setpoints"


def example(name: str, *args) -> list[str]:
    p = subprocess.run([installed_python() or sys.executable, str(ROOT / "examples" / name), *map(str, args)],
                       capture_output=True, text=True, env=agent_env(), timeout=HANG_S)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.splitlines()


def test_sensor_writes_readings_through_the_running_agent(broker, tmp_path):
    with running(tmp_path, broker) as home:
        ids = example("sensor.py", home, "--count", 3, "--interval", 0)
        assert len(set(ids)) == 3
        recs = list(Client(home).watch([T], since=0, idle_s=0.5))
        assert [r["event_id"] for r in recs] == ids
        assert all(r["key"]["device"] == "sensor-1" and isinstance(r["columns"]["temp"]["value"], float) for r in recs)


def test_follow_setpoint_acts_on_each_change_and_resumes_from_its_cursor(tmp_path):
    (gw,) = peers(1)
    node = make_node(tmp_path / "n", [gw], tables=SETPOINTS)
    cursor = tmp_path / "cursor"
    try:
        node.apply_batch([gw.event(S, {"zone": "a"}, {"target": 21.0}, (NOW, 1)),
                          gw.event(S, {"zone": "b"}, {"target": 19.0}, (NOW, 2)),
                          gw.event(S, {"zone": "b"}, None, (NOW, 3), delete=True),
                          gw.event(S, {"zone": "b"}, {"target": 18.5}, (NOW, 4)),      # resurrected
                          gw.event(S, {"zone": "a"}, None, (NOW, 5), delete=True)], NOW)
        node.raise_horizon(S, (NOW + 100, 0))   # zone a's tombstone and history now below the horizon
        first = [json.loads(x) for x in example("follow_setpoint.py", node.home, "--cursor-file", cursor,
                                                "--idle", 0)]
        # catching up: the setpoints replaced since (21.0, 19.0) are skipped, what replaced them acted on
        assert [x["action"] for x in first] == ["zone b: setpoint removed, back to the default",
                                                "zone b: setpoint 18.5 (resurrected)",
                                                "zone a: setpoint removed, back to the default"]
        node.apply_batch([gw.event(S, {"zone": "a"}, {"target": 22.0}, (NOW + 200, 0))], NOW + 300)
        # restarted: only what came since its cursor
        again = [json.loads(x)["action"] for x in example("follow_setpoint.py", node.home, "--cursor-file", cursor,
                                                          "--idle", 0)]
        assert again == [f"zone a: setpoint 22.0 (resurrected; history below horizon {NOW + 100}.0 is evicted: "
                         "partial)"]
        assert cursor.read_text() == "6"
    finally:
        node.close()


def test_follow_setpoint_on_a_home_older_than_the_feed_re_reads_the_setpoints(tmp_path):
    from agent.node import Node
    (gw,) = peers(1)
    node = make_node(tmp_path / "n", [gw], tables=SETPOINTS)
    node.apply_batch([gw.event(S, {"zone": "a"}, {"target": 21.0}, (NOW, 1))], NOW)
    node.close()
    before_the_feed(tmp_path / "n")
    node = Node.open(tmp_path / "n")   # migrated: the feed starts with a record saying so
    try:
        node.apply_batch([gw.event(S, {"zone": "b"}, {"target": 19.0}, (NOW, 2))], NOW)
        got = [json.loads(x)["action"] for x in example("follow_setpoint.py", node.home, "--cursor-file",
                                                        tmp_path / "cursor", "--idle", 0)]
        assert got == ["the feed starts here: re-read every setpoint", "zone b: setpoint 19.0"]
    finally:
        node.close()
