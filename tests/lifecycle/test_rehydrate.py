"""Rehydration over an in-memory session link: a node that evicted takes its history back from a
peer that still holds it; the peer re-offers what its cursor had passed, once per generation."""
from __future__ import annotations

from agent import rehydrate
from agent.store import sync_state as st
from agent.sync import SyncDriver
from tests.lifecycle.test_eviction import DAY, R, T0, TABLES
from tests.sync.helpers import mesh, sync


def test_an_evicted_node_rehydrates_from_a_gateway_over_a_session(tmp_path):
    gw, pi, other = mesh(tmp_path, 3, TABLES)
    for s in range(40):
        other.write(R, {"device": "o", "seq": s}, {"temp": float(s)}, now=T0 + s)
    dg, dp, do = SyncDriver(gw), SyncDriver(pi), SyncDriver(other)
    t = sync(do, dg, T0 + 100)
    t = sync(dg, dp, t + 1)
    assert pi.dump() == gw.dump()
    # the pi evicts, then is told to rebuild (e.g. moved to a bigger card): its log is gone below H
    pi.evict_table(R, (T0 + DAY, 0))
    assert pi.conn.execute("SELECT count(*) FROM events").fetchone()[0] == 0
    t = sync(dg, dp, t + 1)
    assert pi.conn.execute("SELECT count(*) FROM events").fetchone()[0] == 0  # cursors passed it: nothing comes
    s = rehydrate.start(pi, gw.site_id, now=T0 + 2 * DAY)
    assert s["generation"] == 0 and pi.tables[R].horizon is None
    t = sync(dp, dg, t + 1, cycles=3)  # the record reaches the gateway; it re-offers from genesis
    assert pi.conn.execute("SELECT count(*) FROM events").fetchone()[0] == 40
    assert pi.dump() == gw.dump()
    st_pi = rehydrate.status(pi)["rehydrating"]
    assert st_pi["events_applied"] == 40
    served = rehydrate.status(gw)["serving"]
    assert served[0]["subject"] == pi.site_id.hex() and served[0]["remaining_events"] == 0
    # once per generation: the same record again changes nothing on the gateway
    before = gw.conn.execute("SELECT * FROM sync_cursors WHERE peer=?", (pi.site_id,)).fetchall()
    dg.apply_records(rehydrate.record_raws(pi.conn), T0 + 3 * DAY)
    assert gw.conn.execute("SELECT * FROM sync_cursors WHERE peer=?", (pi.site_id,)).fetchall() == before
    # the record travels on through relays: the third node learns it from the gateway
    sync(dg, do, t + 1)
    assert st.rehydrate_generation(other.conn, pi.site_id) == 0


def test_a_forged_or_foreign_rehydrate_record_is_dropped(tmp_path):
    a, b = mesh(tmp_path, 2, TABLES)
    from agent.core.cose import assemble
    from tests.sync.helpers import Signer
    stranger = Signer()
    prot, payload, tbs = rehydrate.to_be_signed(stranger.site_id, a.mesh_id, 0, None, T0)
    raw = assemble(prot, payload, stranger.sign(tbs))
    out = SyncDriver(a).apply_records([raw], T0)
    assert out["rehydrate"]["dropped"] == 1 and out["rehydrate"]["reset"] == 0
    # claiming another site's subject under one's own kid is refused too
    b_key = Signer()
    prot, payload, tbs = rehydrate.to_be_signed(b.site_id, a.mesh_id, 0, None, T0)
    raw = assemble(prot, payload, b_key.sign(tbs))
    assert SyncDriver(a).apply_records([raw], T0)["rehydrate"]["dropped"] == 1


def test_a_window_in_flight_when_the_request_lands_is_not_sent_twice(tmp_path):
    """The gateway's window was selected before the fresh node's rehydrate record reached it:
    answers to it cannot move the reset cursor, so the next bodies start again from that cursor,
    and the history goes once (plus what was in flight then, a window or two), not twice."""
    from tests.sync.helpers import pair
    gw, pi, other = mesh(tmp_path, 3, TABLES)
    n, batch = 200, 5
    for s in range(n):
        other.write(R, {"device": "o", "seq": s}, {"temp": float(s)}, now=T0 + s)
    dg, dp = SyncDriver(gw, batch_limit=batch), SyncDriver(pi, batch_limit=batch)
    t = sync(SyncDriver(other), dg, T0 + 1000)
    rehydrate.start(pi, gw.site_id, now=T0 + 2000)
    p = pair(dg, dp)
    p.start(t + 1)
    t = p.run(t + 1, t + 60_000)
    for _ in range(100):
        if pi.conn.execute("SELECT count(*) FROM events").fetchone()[0] == n:
            break
        t = p.exchange(t + 1, t + 60_000)
    assert pi.dump() == gw.dump()
    assert dg.stats["pushed_events"] <= n + 10 * batch  # the window (4 bodies) in flight, resent
