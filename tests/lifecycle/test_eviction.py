"""Eviction (scope §3, §13.4-§13.5): a node that evicts below a horizon against one that evicts
nothing, fed the same events. Rows whose history lies above the horizon are identical; the only
differences are the two §13.5 names (below-horizon events count applied and write nothing; partial
rebuilds), and both are surfaced. Horizons only move up, except by rehydration; eviction emits
nothing; the store shrinks."""
from __future__ import annotations

import json

import pytest

from agent.node import Node, NodeError
from agent.simpeer import readings_table
from agent.sync import SyncDriver
from tests.sync.helpers import Signer, manifest, sync

DAY = 86_400_000
T0 = 1_790_000_000_000
R = "app.readings"
TABLES = readings_table("telemetry")


def node(tmp_path, name, signers):
    n, _ = Node.init(tmp_path / name, manifest(TABLES), profile="pi-zero-2w")
    for s in signers:
        n.add_peer(s.site_id, s.public_key, None)
    return n


def feed(nodes, raws, now):
    return [n.apply_batch(raws, now) for n in nodes]


def rows(n):
    return {json.dumps(r["key"], sort_keys=True): r["values"] for r in n.dump()[R]}


def key(d, s):
    return json.dumps({"device": d, "seq": s}, sort_keys=True)


def test_evicting_and_keeping_nodes_differ_exactly_as_13_5_says(tmp_path):
    a, b = Signer(), Signer()
    ev_node, keep = node(tmp_path, "evicts", [a, b]), node(tmp_path, "keeps", [a, b])
    H = (T0 + 2 * DAY, 0)
    early = []
    for s in range(50):  # old history, entirely below the horizon
        early.append(a.event(R, {"device": "old", "seq": s}, {"temp": float(s)}, (T0 + s, 0)))
    # row X: a value, then a delete, both old
    early.append(a.event(R, {"device": "x", "seq": 0}, {"temp": 1.0}, (T0 + 100, 0)))
    early.append(a.event(R, {"device": "x", "seq": 0}, None, (T0 + 200, 0), delete=True))
    feed([ev_node, keep], early, T0 + DAY)
    # the evicting node moves its horizon: the old events go from its log
    n_deleted = ev_node.evict_table(R, H)
    assert n_deleted == len(early)
    late = [
        b.event(R, {"device": "x", "seq": 0}, {"temp": 5.0}, (T0 + DAY, 0)),  # below H, relayed late
        a.event(R, {"device": "x", "seq": 0}, {"note": "back"}, (T0 + 3 * DAY, 0)),  # resurrects X
    ]
    for s in range(20):  # new history, entirely above the horizon
        late.append(b.event(R, {"device": "new", "seq": s}, {"temp": 100.0 + s}, (T0 + 3 * DAY + s, 1)))
    late.append(b.event(R, {"device": "new", "seq": 3}, None, (T0 + 3 * DAY + 50, 0), delete=True))
    late.append(a.event(R, {"device": "new", "seq": 3}, {"note": "again"}, (T0 + 3 * DAY + 60, 0)))
    out_ev, out_keep = feed([ev_node, keep], late, T0 + 3 * DAY + 100)
    # difference 1: below the horizon, counted applied, written nowhere
    assert (out_ev[0].status, out_ev[0].reason) == ("applied", "below_horizon")
    assert (out_keep[0].status, out_keep[0].reason) == ("applied", "applied")
    # difference 2: the resurrection of X is partial on the evicting node, and surfaced as such
    partial = [e for e in ev_node.surfaced() if e["kind"] == "partial_rebuild"]
    assert [p["detail"]["row_key"] for p in partial] == [{"device": "x", "seq": 0}]
    assert partial[0]["detail"]["horizon"] == f"{H[0]}.{H[1]}"
    assert not [e for e in keep.surfaced() if e["kind"] == "partial_rebuild"]
    re, rk = rows(ev_node), rows(keep)
    assert re.keys() == rk.keys()
    assert {k for k in re if re[k] != rk[k]} == {key("x", 0)}  # confined to the row below the horizon
    assert rk[key("x", 0)] == {"temp": 5.0, "note": "back"} and re[key("x", 0)] == {"temp": None, "note": "back"}
    # rows whose history lies above the horizon (including a resurrection above it) are identical
    for s in range(20):
        assert re[key("new", s)] == rk[key("new", s)]
    # the old rows stay materialized (eviction is not deletion)
    assert all(re[key("old", s)] == rk[key("old", s)] for s in range(50))


def test_horizons_never_move_back_except_by_rehydration(tmp_path):
    n = node(tmp_path, "n", [])
    n.raise_horizon(R, (T0, 5))
    with pytest.raises(NodeError, match="never move back"):
        n.raise_horizon(R, (T0, 4))
    n.profile = n.profile.__class__.from_dict({**n.profile.as_dict(), "horizons_ms": {"telemetry": 10 * DAY}})
    n.run_eviction(now=T0 + DAY)  # the profile target (now - 10 days) is below: unchanged
    assert n.tables[R].horizon == (T0, 5)
    home = n.home
    n.close()
    n = Node.open(home)
    assert n.tables[R].horizon == (T0, 5)  # durable
    assert n.reset_horizons() == {R: f"{T0}.5"}
    assert n.tables[R].horizon is None
    assert [e for e in n.surfaced() if e["kind"] == "horizons_reset"]


def test_eviction_emits_nothing_and_the_store_shrinks(tmp_path):
    a = Signer()
    n = node(tmp_path, "n", [a])
    peer = node(tmp_path, "peer", [a])
    n.add_peer(peer.site_id, bytes.fromhex(json.loads((peer.home / "identity.json").read_text())["public_key"]), None)
    peer.add_peer(n.site_id, bytes.fromhex(json.loads((n.home / "identity.json").read_text())["public_key"]), None)
    big = "x" * 400
    for lo in range(0, 3000, 500):
        n.apply_batch([a.event(R, {"device": "d", "seq": s}, {"temp": float(s), "note": big}, (T0 + s, 0))
                       for s in range(lo, lo + 500)], T0 + DAY)
    n.write(R, {"device": "own", "seq": 1}, {"temp": 1.0}, now=T0 + 2 * DAY)
    sync(SyncDriver(n), SyncDriver(peer), T0 + 2 * DAY)
    cursors = n.conn.execute("SELECT * FROM sync_cursors ORDER BY 1, 2").fetchall()
    log_before = {e["event_id"]: e for e in n.log_entries()}
    max_seq = n.conn.execute("SELECT max(seq) FROM events").fetchone()[0]
    clock = n.clock.current()
    dump = n.dump()
    n.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()   # measure the pages, not the WAL
    size_before = n.store_bytes()
    n.profile = n.profile.__class__.from_dict({**n.profile.as_dict(), "horizons_ms": {"telemetry": DAY}})
    report = n.run_eviction(now=T0 + 2 * DAY + 10)
    assert report["tables"][R]["events_deleted"] == 3000
    log_after = {e["event_id"]: e for e in n.log_entries()}
    assert set(log_after) < set(log_before) and all(log_after[k] == log_before[k] for k in log_after)
    assert n.conn.execute("SELECT max(seq) FROM events").fetchone()[0] == max_seq  # nothing appended
    assert n.conn.execute("SELECT * FROM sync_cursors ORDER BY 1, 2").fetchall() == cursors
    assert n.clock.current() == clock and n.dump() == dump
    # whatever is still offered to the peer is original, pre-eviction log content (no new event)
    from agent.core.events import event_id
    sel, bf, *_ = SyncDriver(n).select_for(peer.site_id, "memory")
    assert bf is None and {event_id(r).hex() for r in sel.events} <= set(log_after)
    assert report["bytes_after"] < size_before * 0.7, (size_before, report["bytes_after"])
    assert n.store_bytes() == report["bytes_after"]
    assert n.conn.execute("PRAGMA freelist_count").fetchone()[0] == 0   # every freed page went back


def test_a_new_store_returns_freed_pages_to_the_filesystem(tmp_path):
    """auto_vacuum=INCREMENTAL only takes when it is chosen before the file's header is written;
    switching to WAL writes it, so a store opened WAL-first never shrank (freed pages stayed)."""
    n = node(tmp_path, "n", [])
    assert n.conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2   # incremental


def _old_store_without_auto_vacuum(tmp_path):
    """A home made before the fix: the same store, rewritten with auto_vacuum off."""
    a = Signer()
    n = node(tmp_path, "old", [a])
    n.conn.execute("PRAGMA auto_vacuum=NONE")
    n.conn.execute("VACUUM")
    assert n.conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 0
    home = n.home
    n.close()
    n = Node.open(home)
    big = "x" * 400
    n.apply_batch([a.event(R, {"device": "d", "seq": s}, {"temp": float(s), "note": big}, (T0 + s, 0))
                   for s in range(2000)], T0 + DAY)
    return n, a


def test_eviction_converts_an_older_store_and_then_shrinks_it(tmp_path):
    n, a = _old_store_without_auto_vacuum(tmp_path)
    n.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    before = n.store_bytes()
    n.profile = n.profile.__class__.from_dict({**n.profile.as_dict(), "horizons_ms": {"telemetry": DAY}})
    # the signer's clock now: the evidence of time a horizon needs (docs/apply.md "Eviction")
    n.apply_batch([a.event(R, {"device": "d", "seq": 5000}, {"temp": 0.5}, (T0 + 2 * DAY, 0))], T0 + 2 * DAY)
    report = n.run_eviction(now=T0 + 2 * DAY + 10)
    assert report["tables"][R]["events_deleted"] == 2000
    assert n.conn.execute("PRAGMA auto_vacuum").fetchone()[0] == 2
    assert n.conn.execute("PRAGMA freelist_count").fetchone()[0] == 0
    assert report["bytes_after"] < before * 0.8, (before, report["bytes_after"])
