"""No single event pins a stream. A rejected event (a relayed event stamped 20
minutes ahead, or one over the held limit) no longer stops the sender's cursor: everything
behind it keeps flowing, the event is re-offered later and applies once it can, held storage
is bounded per signer, and no watermark is inferred across a rejected event."""
from __future__ import annotations

import pytest

from agent import apply as node_mod
from agent.simpeer import NOTES_TABLE, readings_table
from agent.store import sync_progress, sync_state as st
from agent.sync import SyncDriver

from ..sync.helpers import NOW, T, Signer, mesh, sync
from .test_watermark_floors import _catalogue, assert_no_overclaim

TABLES = readings_table() + NOTES_TABLE
MIN = 60_000


def _count(node, site):
    return sum(1 for e in node.log_entries() if e["site_id"] == site.hex())


def test_a_skewed_relayed_event_does_not_stall_the_stream_behind_it(tmp_path):
    s, r = mesh(tmp_path, 2, TABLES)
    x, y = Signer(), Signer()  # x's clock ran 20 minutes fast once; y is an honest third site
    for n in (s, r):
        n.add_peer(x.site_id, x.public_key, None)
        n.add_peer(y.site_id, y.public_key, None)
    fast = x.event(T, {"device": "x", "seq": 0}, {"temp": 9.0}, (NOW + 20 * MIN, 0))
    assert s.apply_batch([fast], NOW + 20 * MIN)[0].status == "applied"  # S took it when its clock agreed
    s.apply_batch([y.event(T, {"device": "y", "seq": i}, {"temp": 1.0}, (NOW + i, 0)) for i in range(2000)], NOW + 20 * MIN)
    ds, dr = SyncDriver(s, batch_limit=100), SyncDriver(r, batch_limit=100)
    # R's clock is at NOW + 2 s: the relayed event is beyond its skew bound, y's are not.
    sync(ds, dr, NOW + 2000, cycles=30)
    assert _count(r, y.site_id) == 2000, "the stream behind the rejected event stalled"
    assert _count(r, x.site_id) == 0
    assert st.reoffer_count(s.conn, r.site_id, "memory") == 1
    # Later R's clock has caught up: the re-offer brings the event, and the set empties.
    sync(ds, dr, NOW + 20 * MIN, cycles=2)
    assert _count(r, x.site_id) == 1
    assert st.reoffer_count(s.conn, r.site_id, "memory") == 0
    s.close()
    r.close()


def test_held_storage_is_bounded_per_signer_and_overflow_is_reoffered(tmp_path, monkeypatch):
    monkeypatch.setattr(node_mod, "HELD_LIMIT_PER_SIGNER", 50)
    s, r = mesh(tmp_path, 2, TABLES)
    h = Signer()  # a trusted signer that floods fictional tables
    for n in (s, r):
        n.add_peer(h.site_id, h.public_key, None)
    for name in ["extra"] + [f"fiction{i}" for i in range(5)]:  # S has them all; R lacks them
        s.create_table({"schema": "app", "name": name, "category": "syncable", "key": ["id"],
                        "columns": {"id": "integer", "v": "text"}})
    flood = [h.event(f"app.fiction{i % 5}", {"id": i}, {"v": "x"}, (NOW + i, 0)) for i in range(300)]
    assert {o.status for o in s.apply_batch(flood, NOW + 400)} == {"applied"}
    s.write_many([("app.extra", {"id": i}, {"v": "new"}, False) for i in range(80)], now=NOW + 1000)
    s.write_many([(T, {"device": "s", "seq": i}, {"temp": 1.0}, False) for i in range(40)], now=NOW + 2000)
    ds, dr = SyncDriver(s, batch_limit=100), SyncDriver(r, batch_limit=100)
    sync(ds, dr, NOW + 3000, cycles=12)
    held = dict(((bytes(k), n) for k, n in r.conn.execute("SELECT site_id, count(*) FROM held GROUP BY site_id")))
    assert held[h.site_id] == 50 and held[s.site_id] == 50  # each signer within its own bound
    assert sum(1 for e in r.log_entries() if e["table"] == T) == 40  # other groups kept flowing
    everything = _catalogue([s])
    assert_no_overclaim([r], everything)
    # The rolling upgrade reaches R: the held events apply, and the 30 that did not fit come back.
    r.create_table({"schema": "app", "name": "extra", "category": "syncable", "key": ["id"],
                    "columns": {"id": "integer", "v": "text"}})
    t = NOW + 3000
    for _ in range(8):
        t = sync(ds, dr, t + 120_000, cycles=2)
    assert len(r.dump()["app.extra"]) == 80
    assert_no_overclaim([r], _catalogue([s]))
    s.close()
    r.close()


def test_rejections_of_the_senders_own_events_pin_its_watermark(tmp_path, monkeypatch):
    """Over the held limit, the sender's own events for a missing table are rejected; later
    events of the same group must not let R infer a watermark across the rejected ones."""
    monkeypatch.setattr(node_mod, "HELD_LIMIT_PER_SIGNER", 5)
    s, r = mesh(tmp_path, 2, TABLES)
    spec = {"schema": "app", "name": "extra", "category": "syncable", "key": ["id"], "columns": {"id": "integer"}}
    s.create_table(spec)
    s.write_many([("app.extra", {"id": i}, {}, False) for i in range(10)], now=NOW)
    ds, dr = SyncDriver(s, batch_limit=100), SyncDriver(r, batch_limit=100)
    sync(ds, dr, NOW + 10, cycles=2)
    r.create_table(spec)   # 5 held apply; 5 were rejected and are pinned until re-offered
    s.write_many([("app.extra", {"id": i}, {}, False) for i in range(10, 12)], now=NOW + 20)
    sync(ds, dr, NOW + 30, cycles=1)
    assert_no_overclaim([r], _catalogue([s]))
    t = NOW + 30
    for _ in range(6):
        t = sync(ds, dr, t + 120_000, cycles=2)
    assert len(r.dump()["app.extra"]) == 12
    assert_no_overclaim([r], _catalogue([s]))
    # Once the re-offers applied, the next live event of the group carries the watermark past them.
    s.write_many([("app.extra", {"id": 12}, {}, False)], now=t)
    sync(ds, dr, t + 1, cycles=1)
    wm = r.conn.execute("SELECT hlc_p, hlc_l FROM watermarks WHERE site_id=? AND qualified='app.extra'",
                        (s.site_id,)).fetchone()
    assert wm is not None and tuple(wm) == max(h for _e, (si, q, h) in _catalogue([s]).items()
                                               if si == s.site_id and q == "app.extra")
    s.close()
    r.close()


def test_a_flood_past_the_reoffer_bound_is_rescanned_not_lost(tmp_path, monkeypatch):
    """A trusted signer's flood of events the peer cannot take yet: past REOFFER_PER_SIGNER the
    sender keeps one rescan marker for that signer; honest events flow meanwhile, and once the
    peer can take them every flood event arrives (overflow re-offered later, not lost)."""
    monkeypatch.setattr(node_mod, "HELD_LIMIT_PER_SIGNER", 10)
    monkeypatch.setattr(sync_progress, "REOFFER_PER_SIGNER", 20)
    s, r = mesh(tmp_path, 2, TABLES)
    h, y = Signer(), Signer()
    for n in (s, r):
        n.add_peer(h.site_id, h.public_key, None)
        n.add_peer(y.site_id, y.public_key, None)
    spec = {"schema": "app", "name": "fiction", "category": "syncable", "key": ["id"], "columns": {"id": "integer"}}
    s.create_table(spec)
    s.apply_batch([h.event("app.fiction", {"id": i}, {}, (NOW + i, 0)) for i in range(100)], NOW + 200)
    s.apply_batch([y.event(T, {"device": "y", "seq": i}, {"temp": 1.0}, (NOW + i, 0)) for i in range(100)], NOW + 200)
    ds, dr = SyncDriver(s, batch_limit=40), SyncDriver(r, batch_limit=40)
    sync(ds, dr, NOW + 300, cycles=10)
    assert _count(r, y.site_id) == 100
    stored = s.conn.execute("SELECT count(*) FROM reoffer").fetchone()[0]
    markers = s.conn.execute("SELECT count(*) FROM reoffer_rescan").fetchone()[0]
    assert stored <= 20 and markers == 1
    r.create_table(spec)
    t = NOW + 300
    for _ in range(12):
        t = sync(ds, dr, t + 700_000, cycles=3)
    assert len(r.dump()["app.fiction"]) == 100
    assert s.conn.execute("SELECT count(*) FROM reoffer").fetchone()[0] == 0
    assert_no_overclaim([r], _catalogue([s]))
    s.close()
    r.close()
