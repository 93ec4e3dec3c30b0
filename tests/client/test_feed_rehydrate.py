"""The change feed of a home being rehydrated (`rehydrate --from`, then the source's bodies): a
watcher following it sees the rows arrive, each as a change record, and ends with the tables."""
from __future__ import annotations

from agent import rehydrate
from agent.client import Client
from agent.sync import SyncDriver
from tests.lifecycle.test_eviction import DAY, R, T0, TABLES
from tests.sync.helpers import mesh, sync

from .test_feed import replay


def test_a_watcher_following_a_rehydrating_home_sees_the_rows_arrive(tmp_path):
    gw, pi, other = mesh(tmp_path, 3, TABLES)
    for s in range(40):
        other.write(R, {"device": "o", "seq": s}, {"temp": float(s)}, now=T0 + s)
    dg, dp, do = SyncDriver(gw), SyncDriver(pi), SyncDriver(other)
    t = sync(do, dg, T0 + 100)
    t = sync(dg, dp, t + 1)
    pi.evict_table(R, (T0 + DAY, 0))
    t = sync(dg, dp, t + 1)
    head = Client(pi.home).head()
    evicted = pi.dump().get(R, [])
    rehydrate.start(pi, gw.site_id, now=T0 + 2 * DAY)
    sync(dp, dg, t + 1, cycles=3)   # the request reaches the gateway; it re-offers from genesis
    assert pi.dump() == gw.dump() and len(pi.dump()[R]) == 40
    recs = list(Client(pi.home).watch([R], since=head, idle_s=0))
    changed = {r["key"]["seq"] for r in recs if r["kind"] == "change" and r["exists"]}
    assert changed >= {s for s in range(40)} - {r["key"]["seq"] for r in evicted}, recs[:3]
    # the whole feed from 0 describes the tables the rehydrated home holds
    rows = sorted(pi.dump()[R], key=lambda r: repr(tuple(sorted(r["key"].items()))))
    assert replay(list(Client(pi.home).watch(None, since=0, idle_s=0))).get(R, []) == rows
    for n in (gw, pi, other):
        n.close()
