"""`sync_state.peer_lag` (what `check` and the runner report as a peer's backlog) counts the events above
the peer's reported watermarks; with the per-group counts shared across peers (`check` made one pass over the
log per peer) it must give what counting every event by hand gives."""
from __future__ import annotations

from agent.store.sync_state import group_counts, peer_lag
from agent.store import sync_state as st

from tests.core.helpers import NOW, T, make_node, peers


def _by_hand(node, peer: bytes) -> int:
    wms = st.peer_watermarks(node.conn, peer)
    n = 0
    for site, q, p, l in node.conn.execute("SELECT site_id, qualified, hlc_p, hlc_l FROM events"):
        site = bytes(site)
        if site == peer:
            continue
        wm = wms.get((site, q))
        if wm is None or (p, l) > wm:
            n += 1
    return n


def test_peer_lag_counts_the_events_above_each_reported_watermark(tmp_path):
    a, b, c = peers(3)
    node = make_node(tmp_path / "n", [a, b, c])
    raws = [s.event(T, {"device": "d", "seq": i}, {"temp": float(i)}, (NOW + i // 3, i % 3))
            for i in range(90) for s in (a, b, c)]
    node.apply_batch(raws, NOW + 100)
    st.ensure_schema(node.conn)
    with node.conn:
        # b reports a's events up to the middle (an HLC with events on both sides of it, same
        # physical time) and c's up to the end; c reports nothing
        st.set_peer_watermarks(node.conn, b.site_id, [(a.site_id, T, (NOW + 15, 1)), (c.site_id, T, (NOW + 99, 0))])
    counts = group_counts(node.conn)
    for p in (a, b, c):
        assert peer_lag(node.conn, p.site_id) == peer_lag(node.conn, p.site_id, counts) == _by_hand(node, p.site_id)
    assert 0 < peer_lag(node.conn, b.site_id) < peer_lag(node.conn, c.site_id)
    node.close()


def test_the_log_watch_says_when_the_log_grew_and_only_then(tmp_path):
    """`eventlog.LogWatch`, the "log grew" signal the runtime loop wakes its links with: an append
    (a local write, events applied from a peer) is seen once; reads, and writes that add no event,
    are not growth."""
    from agent.store import eventlog
    a, = peers(1)
    node = make_node(tmp_path / "n", [a])
    w = eventlog.LogWatch(node.conn)
    assert not w.grew()
    node.write(T, {"device": "d", "seq": 1}, {"temp": 1.0})
    assert w.grew() and w.top == eventlog.top(node.conn) and not w.grew()
    assert eventlog.newest_local(node.conn, 0) == w.top
    node.apply_batch([a.event(T, {"device": "e", "seq": 1}, {"temp": 2.0}, (NOW, 0))], NOW + 1)
    assert w.grew() and not w.grew()
    assert eventlog.newest_local(node.conn, w.top - 1) is None   # the newest is a's, not ours
    node.conn.execute("SELECT count(*) FROM events").fetchone()
    with node.conn:
        node.conn.execute("INSERT OR REPLACE INTO meta VALUES ('x', 'y')")
    assert not w.grew()   # something changed, but not the log
    node.close()


def test_a_copy_of_a_live_home_is_refused_and_a_moved_home_is_followed(tmp_path):
    """identity.claim_home reads the other home's store (store/reports.py `site_of_store`): a
    `cp -a` copy of a home whose original is still there must not sign as it (§13.5)."""
    import shutil

    import pytest

    from agent.node import Node, NodeError
    a, = peers(1)
    node = make_node(tmp_path / "n", [a])
    node.close()
    shutil.copytree(tmp_path / "n", tmp_path / "copy")
    with pytest.raises(NodeError, match="is a copy of"):
        Node.open(tmp_path / "copy")
    shutil.rmtree(tmp_path / "n")   # the original is gone: the copy is the home now (it moved)
    Node.open(tmp_path / "copy").close()
