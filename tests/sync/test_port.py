"""PortAdapter: the sync layer behind the MQTT runner's SyncPort interface (no broker needed)."""
from __future__ import annotations

from agent.core.messages import SyncBody, emit_body
from agent.store import sync_state as st
from agent.sync_port import PortAdapter

from .helpers import NOW, T, log_set, mesh


def test_port_adapter_select_receive_advance(tmp_path):
    a, b = mesh(tmp_path, 2)
    pa, pb = PortAdapter(a), PortAdapter(b)
    for i in range(5):
        a.write(T, {"device": "a", "seq": i}, {"temp": 1.0}, now=NOW)
    assert pa.peers() == [b.site_id] and pa.cursor(b.site_id) == 0 and pa.backlog(b.site_id) == 5
    off = pa.select(b.site_id, 0, 3)
    assert len(off.events) == 3 and off.seqs == [1, 2, 3]
    body, outs, k = pb.receive(emit_body(SyncBody(a.site_id, pa.have_max(), tuple(off.events), (), ())))
    assert k == 3 and len(log_set(b)) == 3
    assert pa.advance(b.site_id, off.start, off.seqs, off.end, k) and pa.cursor(b.site_id) == 3
    assert not pa.advance(b.site_id, 4, [5], 5, 1)  # a gap: an earlier body is unanswered
    pa.note_answer(b.site_id, pb.answer_body())
    # plain MQTT is not authenticated: no watermark inference, no reports stored
    assert st.own_watermarks(b.conn) == {} and st.peer_watermarks(a.conn, b.site_id) == {}
    # b never offers a's own events back
    assert pb.select(a.site_id, 0, 10).events == []


def test_answer_selected_before_a_rehydrate_reset_never_moves_the_cursor(tmp_path):
    """A live-only body selected before the peer asked for its history again, answered after the
    reset: its token carries the old rehydration generation, so the cursor stays at genesis and
    the whole log is re-offered (docs/protocol.md §8). The MQTT runner confirms every answer
    through the body's token."""
    from agent import rehydrate
    a, b = mesh(tmp_path, 2)
    pa, pb = PortAdapter(a), PortAdapter(b)
    for i in range(5):
        a.write(T, {"device": "a", "seq": i}, {"temp": 1.0}, now=NOW)
    stale = pa.select(b.site_id, 0, 10)
    assert stale.seqs == [1, 2, 3, 4, 5]
    rehydrate.start(b, a.site_id)
    pa.receive(pb.body((), a.site_id))     # b's rehydrate request reaches a: a resets b's cursor
    assert st.rehydrate_generation(a.conn, b.site_id) == 0 and pa.cursor(b.site_id) == 0
    assert not pa.advance(b.site_id, stale.start, stale.seqs, stale.end, 5, token=stale.token)
    assert pa.cursor(b.site_id) == 0
    fresh = pa.select(b.site_id, 0, 10)
    assert fresh.seqs == stale.seqs
    assert pa.advance(b.site_id, fresh.start, fresh.seqs, fresh.end, 5, token=fresh.token)
    assert pa.cursor(b.site_id) == fresh.end
