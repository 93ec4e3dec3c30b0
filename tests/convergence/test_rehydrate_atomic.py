"""The rehydration start is one commitment. A process SIGKILLed at every named
point leaves either the old horizons with the old watermarks, or zero horizons with none: never
zero horizons with stale watermarks (serving peers would skip exactly the requested history)."""
from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from agent.node import Node

from ..core.helpers import NOW, T, make_node, peers

PRODUCER = Path(__file__).with_name("rehydrate_producer.py")


@pytest.mark.parametrize("point", ["noted", "released", "horizons_reset", None])
def test_crash_at_every_point_of_the_rehydration_start(tmp_path, point):
    (b,) = peers(1)
    home = tmp_path / "n"
    node = make_node(home, [b])
    node.apply_batch([b.event(T, {"device": "d", "seq": i}, {"temp": 1.0}, (NOW + i, 0)) for i in range(3)], NOW + 10)
    node.evict_table(T, (NOW + 2, 0), now=NOW + 10)
    node.close()
    con = sqlite3.connect(home / "store.sqlite")
    con.execute("INSERT INTO watermarks VALUES (?, ?, ?, ?)", (b.site_id, T, NOW + 2, 0))
    con.commit()
    con.close()
    env = dict(os.environ, SSP_CRASH=f"{point}:1" if point else "")
    p = subprocess.run([sys.executable, str(PRODUCER), str(home)], env=env, capture_output=True, text=True, timeout=60)
    assert (p.returncode == -9) == (point is not None), p.stderr
    node = Node.open(home)
    horizon = node.tables[T].horizon
    wms = node.conn.execute("SELECT count(*) FROM watermarks").fetchone()[0]
    node.close()
    if horizon is None:
        assert wms == 0, "horizons reset but the watermarks that described them survived"
    else:
        assert wms == 1 and point is not None
    # a request released before the kill is finished by that open (zero horizons); one never
    # released leaves nothing behind
    assert (horizon is None) == (point != "noted")


def test_a_rehydrate_killed_after_its_request_was_released_is_finished_on_the_next_open(tmp_path):
    """`ssp-agent rehydrate` SIGKILLed after its request record was signed and persisted (it may
    have left the node) and before the horizons were reset: the next open stores the request (it
    is out) and finishes the start in one commitment, horizons to zero and the watermarks gone;
    never the request served while the horizon that drops the re-sent history stands."""
    from tests.cli_cmd import agent_env, patched_cmd
    (b,) = peers(1)
    home = tmp_path / "n"
    node = make_node(home, [b])
    node.apply_batch([b.event(T, {"device": "d", "seq": i}, {"temp": 1.0}, (NOW + i, 0)) for i in range(3)], NOW + 10)
    node.evict_table(T, (NOW + 2, 0), now=NOW + 10)
    node.close()
    pre = ("from agent import rehydrate\nfrom tests.crashpoint import hook_from_env\n"
           "rehydrate._CRASH_HOOK = hook_from_env('SSP_CRASH')\n")
    root = str(Path(__file__).resolve().parents[2])
    env = agent_env({"SSP_CRASH": "released:1", "PYTHONPATH": root})
    p = subprocess.run([*patched_cmd(pre), "--home", str(home), "rehydrate", "--from", b.site_id.hex()], env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == -9, (p.stdout, p.stderr)
    node = Node.open(home)
    try:
        from agent.store import rehydration
        held = rehydration.last_request(node.conn, node.site_id)
        assert held is not None and held[0] == 0          # the request is out: stored from the journal
        assert node.tables[T].horizon is None, "the request is served while the horizon stands"
        assert node.conn.execute("SELECT count(*) FROM watermarks").fetchone()[0] == 0
        from agent import rehydrate
        st = rehydrate.state(node.conn)
        assert st is not None and st["generation"] == 0 and st["record_hash"] == held[1].hex()
    finally:
        node.close()
