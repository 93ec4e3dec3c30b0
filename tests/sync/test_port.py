"""PortAdapter: the sync layer behind the MQTT runner's SyncPort interface (no broker needed)."""
from __future__ import annotations

from agent.core.messages import SyncBody, emit_body
from agent.store import sync_state as st
from agent.sync import PortAdapter

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
