"""`ssp-agent rehydrate` SIGKILLed after its request is signed and persisted (it will be served:
the journal's recovery stores it on the next open) and before the horizons are reset: the next
open finishes the start, so the history the peers re-send is restored, without running
`rehydrate` again (docs/operations.md "4. Rehydrate the new device from the gateway")."""
from __future__ import annotations

import subprocess

from agent import rehydrate
from agent.node import Node
from agent.sync import SyncDriver
from tests.cli_cmd import agent_env, patched_cmd
from tests.lifecycle.test_eviction import DAY, R, T0, TABLES
from tests.sync.helpers import mesh, sync

# Killed right after the request is released (signed, persisted in the signing journal).
KILLED_AFTER_RELEASE = patched_cmd("""
import os, signal
from agent import rehydrate
def _kill(point):
    if point == "released":
        os.kill(os.getpid(), signal.SIGKILL)
rehydrate._CRASH_HOOK = _kill
""")


def _events(node):
    return node.conn.execute("SELECT count(*) FROM events").fetchone()[0]


def test_a_killed_rehydrate_is_finished_by_the_next_open(tmp_path):
    gw, pi = mesh(tmp_path, 2, TABLES)
    for s in range(20):
        gw.write(R, {"device": "g", "seq": s}, {"temp": float(s)}, now=T0 + s)
    dg, dp = SyncDriver(gw), SyncDriver(pi)
    t = sync(dg, dp, T0 + 100)
    pi.evict_table(R, (T0 + DAY, 0), now=T0 + DAY + 1)
    t = sync(dg, dp, t + 1)
    assert _events(pi) == 0 and pi.tables[R].horizon is not None
    home = pi.home
    pi.close()
    p = subprocess.run([*KILLED_AFTER_RELEASE, "--home", str(home), "rehydrate", "--from", gw.site_id.hex()],
                       capture_output=True, text=True, env=agent_env(), timeout=300)
    assert p.returncode == -9, (p.returncode, p.stderr)
    pi = Node.open(home)
    assert rehydrate.record_raws(pi.conn), "the released request is recovered and served"
    dp = SyncDriver(pi)
    sync(dp, dg, t + 1, cycles=3)   # the gateway serves the history again
    assert rehydrate.status(gw)["serving"][0]["subject"] == pi.site_id.hex()
    assert _events(pi) == 20
    assert pi.dump() == gw.dump()
    assert rehydrate.status(pi)["rehydrating"]["generation"] == 0
    pi.close()
    gw.close()
