"""Per-peer record delivery: a body carries only the control records the peer does not hold yet
(not answered for on that path, not received from it), within a byte budget, so a fleet's
records never make a body too large for a small device; a rehydrate request sends them again."""
from __future__ import annotations

import dataclasses
import json
import os

from agent import rehydrate
from agent.core import records as rec
from agent.core.messages import parse_body
from agent.store import sync_state as st
from agent.sync import MAILBOX_PATH, MAX_RECORDS_PER_BODY, SyncDriver, _txn, delivery_hash
from agent.sync_port import PortAdapter

from .helpers import MESH, NOW, T, Signer, mesh, sync

AUTH = Signer()
PI_ZERO_LIMIT = 64 * 1024


def _authority_mesh(tmp_path, n=2):
    """n nodes that list the standalone authority AUTH (its key in every keyring)."""
    nodes = mesh(tmp_path, n)
    for nd in nodes:
        nd.conn.execute("INSERT OR REPLACE INTO meta VALUES ('authorities', ?)", (json.dumps([AUTH.site_id.hex()]),))
        nd.authorities = {AUTH.site_id}
        nd.add_peer(AUTH.site_id, AUTH.public_key, None)
    return nodes


def _hold_records(node, n: int) -> list[bytes]:
    """n vouch records (≈200 bytes each) stored on `node` directly (fast: no issuing path)."""
    raws = []
    for _ in range(n):
        subj = Signer()
        raws.append(rec.build_record("vouch", AUTH.site_id, MESH, subj.site_id, subj.public_key, 0, None, AUTH.sign))
    st.ensure_schema(node.conn)
    with _txn(node.conn):
        for raw in raws:
            r = rec.verify_record(raw, MESH, {AUTH.site_id}, {AUTH.site_id: AUTH.public_key}.get)
            st.put_record(node.conn, r)
    return raws


def _recs(body: bytes) -> list[bytes]:
    return list(parse_body(body).records)


def test_records_go_until_answered_then_no_more_and_a_lost_answer_resends(tmp_path):
    a, b = _authority_mesh(tmp_path)
    held = _hold_records(a, 3)
    pa, pb = PortAdapter(a), PortAdapter(b)
    assert pa.records_pending(b.site_id)
    off = pa.select(b.site_id, 0, 10)
    body = pa.body(off.events, b.site_id, off.token)
    assert set(_recs(body)) == set(held)
    # the answer is lost: nothing is marked, the next body carries them again
    off2 = pa.select(b.site_id, 0, 10)
    assert set(_recs(pa.body(off2.events, b.site_id, off2.token))) == set(held)
    assert st.delivered_records(a.conn, b.site_id, "mqtt") == set()
    # b takes the (second) body and answers it; b's answer does not echo a's records back
    pb.receive(pa.body(off2.events, b.site_id, off2.token))
    assert set(held) <= set(st.record_raws(b.conn))
    ans = pb.answer_body(a.site_id)
    assert _recs(ans) == []
    pa.note_answer(b.site_id, ans, off2.token)
    assert st.delivered_records(a.conn, b.site_id, "mqtt") == {delivery_hash(r) for r in held}
    assert not pa.records_pending(b.site_id)
    off3 = pa.select(b.site_id, 0, 10)
    assert _recs(pa.body(off3.events, b.site_id, off3.token)) == []
    # delivery is per path: another path still carries them
    assert set(_recs(PortAdapter(a, path="other").answer_body(b.site_id))) == set(held)
    # a record issued later goes (alone) in the next body
    new = _hold_records(a, 1)
    off4 = pa.select(b.site_id, 0, 10)
    assert _recs(pa.body(off4.events, b.site_id, off4.token)) == new


def test_session_confirm_marks_and_a_lost_exchange_resends(tmp_path):
    a, b = _authority_mesh(tmp_path)
    held = _hold_records(a, 2)
    da, dbb = SyncDriver(a), SyncDriver(b)
    o = da.build(b.site_id, "lossy", "batch")
    assert set(_recs(o.body)) == set(held)
    o2 = da.build(b.site_id, "lossy", "batch")  # unconfirmed (lost): offered again
    assert set(_recs(o2.body)) == set(held)
    da.confirm(b.site_id, o2.token, o2.n_events)
    assert _recs(da.build(b.site_id, "lossy", "batch").body) == []
    # over real sessions: b gets them, and a's next bodies to b no longer carry them
    sync(da, dbb, NOW, cycles=2)
    assert set(held) <= set(st.record_raws(b.conn))
    assert {delivery_hash(r) for r in held} <= st.delivered_records(a.conn, b.site_id, "memory")
    assert _recs(da.build(b.site_id, "memory", "batch").body) == []
    # b received them from a: it never sends them back to a
    assert _recs(dbb.build(a.site_id, "memory", "batch").body) == []


def test_500_records_flow_in_bounded_bodies_over_several_exchanges(tmp_path):
    a, b = _authority_mesh(tmp_path)
    for nd in (a, b):
        nd.profile = dataclasses.replace(nd.profile, body_limit_bytes=PI_ZERO_LIMIT)
    held = _hold_records(a, 500)
    total = sum(len(r) for r in held)
    assert total > PI_ZERO_LIMIT  # all of them in one body would be too large for the peer
    for i in range(20):
        a.write(T, {"device": "a", "seq": i}, {"temp": 1.0}, now=NOW + i)
    pa, pb = PortAdapter(a), PortAdapter(b)
    budget = PI_ZERO_LIMIT // 4
    exchanges = 0
    while pa.records_pending(b.site_id):
        exchanges += 1
        assert exchanges < 50
        off = pa.select(b.site_id, pa.cursor(b.site_id), 10, record_budget=budget)
        body = pa.body(off.events, b.site_id, off.token)
        recs = _recs(body)
        assert 0 < len(recs) <= MAX_RECORDS_PER_BODY
        assert sum(len(r) for r in recs) <= budget and len(body) <= PI_ZERO_LIMIT
        _, outs, k = pb.receive(body)
        pa.advance(b.site_id, off.start, off.seqs, off.end, k)
        pa.note_answer(b.site_id, pb.answer_body(a.site_id), off.token)
    assert exchanges >= 4
    assert set(held) <= set(st.record_raws(b.conn))
    assert len(list(b.log_entries())) == 20
    # the default budget (a quarter of the profile's body limit) bounds answers and sessions too
    c_body = PortAdapter(a, path="other").answer_body(b.site_id)
    assert sum(len(r) for r in _recs(c_body)) <= SyncDriver(a).record_budget() == budget
    assert len(SyncDriver(a).build(b.site_id, "memory", "batch").body) <= PI_ZERO_LIMIT


def test_mailbox_records_are_delivered_on_the_answer(tmp_path):
    """Like the cursor (§14.1): a file's records count as delivered when the peer's answer to that
    file comes back in its next file, not when the file is written (it may be lost)."""
    from agent.mailbox import is_ack
    a, b = _authority_mesh(tmp_path)
    held = _hold_records(a, 4)
    da, dbb = SyncDriver(a), SyncDriver(b)
    f1, f2 = tmp_path / "m1.ssp", tmp_path / "m2.ssp"
    da.export_mailbox(b.site_id, f1)
    assert set(_recs(f1.read_bytes())) == set(held)
    assert st.delivered_records(a.conn, b.site_id, MAILBOX_PATH) == set()
    da.export_mailbox(b.site_id, f2)
    assert set(_recs(f2.read_bytes())) == set(held)  # f1 may be lost: offered again
    dbb.import_mailbox(f1.read_bytes(), NOW)
    assert set(held) <= set(st.record_raws(b.conn))
    # b holds them from a's file: its mailbox export to a does not send them back, only its answer
    f3 = tmp_path / "m3.ssp"
    dbb.export_mailbox(a.site_id, f3)
    assert [r for r in _recs(f3.read_bytes()) if not is_ack(r)] == []
    da.import_mailbox(f3.read_bytes(), NOW)
    assert st.delivered_records(a.conn, b.site_id, MAILBOX_PATH) == {delivery_hash(r) for r in held}
    f4 = tmp_path / "m4.ssp"
    da.export_mailbox(b.site_id, f4)
    assert [r for r in _recs(f4.read_bytes()) if not is_ack(r)] == []


def test_a_rehydrate_request_makes_records_flow_again(tmp_path):
    a, b = _authority_mesh(tmp_path)
    held = _hold_records(a, 3)
    pa, pb = PortAdapter(a), PortAdapter(b)
    off = pa.select(b.site_id, 0, 10)
    pb.receive(pa.body(off.events, b.site_id, off.token))
    pa.note_answer(b.site_id, pb.answer_body(a.site_id), off.token)
    assert not pa.records_pending(b.site_id)
    later = _hold_records(a, 1)
    stale = pa.select(b.site_id, 0, 10)  # selected before b's request arrives, answered after it
    assert _recs(pa.body(stale.events, b.site_id, stale.token)) == later
    # b rehydrates (it may have lost everything): its request travels in its bodies
    rehydrate.start(b, a.site_id, now=NOW)
    off_b = pb.select(a.site_id, 0, 10)
    req = pb.body(off_b.events, a.site_id, off_b.token)
    assert any(rehydrate.is_rehydrate_record(r) for r in _recs(req))
    pa.receive(req, sender=b.site_id)
    assert st.rehydrate_generation(a.conn, b.site_id) == 0
    assert st.delivered_records(a.conn, b.site_id, "mqtt") == {delivery_hash(r) for r in _recs(req)}
    pa.note_answer(b.site_id, b"", stale.token)  # selected before the reset: not counted
    assert pa.records_pending(b.site_id)
    off2 = pa.select(b.site_id, 0, 10)
    sent = _recs(pa.body(off2.events, b.site_id, off2.token))
    assert set(held + later) <= set(sent)
    assert not any(rehydrate.is_rehydrate_record(r) for r in sent)  # b's own request: b holds it
    pb.receive(pa.body(off2.events, b.site_id, off2.token))
    pa.note_answer(b.site_id, pb.answer_body(a.site_id), off2.token)
    assert not pa.records_pending(b.site_id)
    # a repeat of the same generation clears nothing
    pa.receive(req, sender=b.site_id)
    assert not pa.records_pending(b.site_id)


def test_older_home_gains_the_table(tmp_path):
    (a,) = mesh(tmp_path, 1)
    st.ensure_schema(a.conn)
    a.conn.execute("DROP TABLE records_delivered")
    SyncDriver(a)  # ensure_schema again
    assert a.conn.execute("SELECT 1 FROM sqlite_master WHERE name='records_delivered'").fetchone()
    assert os.path.exists(a.home)


class _FakeLink:
    """Just enough of MqttLink for the runner: bodies and answers go straight to the other side's
    inbound queue (no broker). `drop_answers`: answers that are lost on the way."""

    def __init__(self, site: bytes, limit: int) -> None:
        import collections
        import queue
        import threading
        self.site, self.limit = site, limit
        self.inbound: "queue.Queue" = queue.Queue()
        self.connected = threading.Event()
        self.connected.set()
        self.other: "_FakeLink | None" = None
        self.drop_answers = 0
        self._n = 0
        self.received = 0   # MqttLink's count of messages received (a body sent records it)
        self.losses: "collections.deque" = collections.deque()   # MqttLink's noted connection losses: none here

    def max_payload(self) -> int:
        return self.limit

    def _inbound(self, kind, site, payload, props, corr):
        from agent.transport.mqtt import Inbound
        return Inbound(kind, site, payload, dict(props), corr, None, 0, 1, False, False, 0, sender=self.site)

    def push(self, peer, body, user, correlation=None):
        self._n += 1
        corr = correlation or self._n.to_bytes(8, "big")
        if peer == self.other.site:  # anyone else (AUTH is in the keyring) is never present
            self.other.inbound.put(self._inbound("req", peer, body, user, corr))
        return corr

    def answer(self, m, payload, user):
        if self.drop_answers:
            self.drop_answers -= 1
            return True
        self.other.inbound.put(self._inbound("ans", m.sender, payload, user, m.correlation))
        return True

    def ack(self, m):
        pass

    def close(self):
        pass


def _runners(a, b, limit_a: int, limit_b: int):
    from agent.runner import RunConfig, Runner
    from agent.transport.mqtt import MqttSettings
    rs = []
    for nd, lim in ((a, limit_a), (b, limit_b)):
        r = Runner(nd, MqttSettings(host="127.0.0.1", port=1, body_limit_bytes=lim), RunConfig(realtime=False))
        r.link = _FakeLink(nd.site_id, lim)
        rs.append(r)
    rs[0].link.other, rs[1].link.other = rs[1].link, rs[0].link
    return rs


def _pump(rs, rounds=200):
    for _ in range(rounds):
        if not sum(r.pump(0) for r in rs):
            return


def test_runner_delivers_500_records_to_a_small_peer_instead_of_stalling(tmp_path):
    a, b = _authority_mesh(tmp_path)
    held = _hold_records(a, 500)
    assert sum(len(r) for r in held) > PI_ZERO_LIMIT
    ra, rb = _runners(a, b, 256 * 1024, PI_ZERO_LIMIT)
    try:
        for _ in range(20):
            ra.batch_cycle()
            _pump([ra, rb])
            if set(held) <= set(st.record_raws(b.conn)):
                break
        assert set(held) <= set(st.record_raws(b.conn))
        assert not ra.sync.records_pending(b.site_id)
        assert ra.stats["push_rejected:too_large"] <= 2  # the runner learns the peer's limit, then fits
        n = ra.stats["bodies_pushed"]
        ra.batch_cycle()
        _pump([ra, rb])
        assert ra.stats["bodies_pushed"] == n  # nothing new: no body at all
    finally:
        ra.close(), rb.close()


def test_runner_resends_records_whose_answer_was_lost(tmp_path):
    a, b = _authority_mesh(tmp_path)
    held = _hold_records(a, 3)
    ra, rb = _runners(a, b, 256 * 1024, 256 * 1024)
    try:
        rb.link.drop_answers = 1
        ra.batch_cycle()
        _pump([ra, rb])
        assert set(held) <= set(st.record_raws(b.conn))  # b has them, but a never heard back
        assert ra.sync.records_pending(b.site_id) and ra.in_flight(b.site_id)
        # The answer timeout gives up only on a peer that is reachable and silent (an absent peer's bodies
        # wait in its broker session): b's presence is there.
        from agent.core.messages import Handshake
        ra.caps[b.site_id] = Handshake(b.site_id, (0, 0), False, False, None)
        ra._expire(0.0)
        ra._expire(float(10**9))  # the answer timeout: given up on
        ra.batch_cycle()
        _pump([ra, rb])
        assert not ra.sync.records_pending(b.site_id) and not ra.in_flight(b.site_id)
    finally:
        ra.close(), rb.close()


def test_a_dropped_request_goes_again_once_a_new_record_can_admit_it(tmp_path):
    """A peer that dropped a record (here: a rehydrate request from a device it does not trust yet)
    gets it again when the sender stores a record it did not hold (the vouch for that device), and
    the vouch travelling in the same body admits the request (docs/protocol.md §5)."""
    from agent.node import Node
    from agent.store import db
    from .helpers import TABLES, manifest
    srv, dev = (Node.init(tmp_path / name, manifest(TABLES))[0] for name in ("srv", "dev"))
    for nd in (srv, dev):
        nd.conn.execute("INSERT OR REPLACE INTO meta VALUES ('authorities', ?)", (json.dumps([AUTH.site_id.hex()]),))
        nd.authorities = {AUTH.site_id}
        nd.add_peer(AUTH.site_id, AUTH.public_key, None)
    dev.add_peer(srv.site_id, bytes(db.get_meta(srv.conn, "public_key")), None)   # srv does not know dev
    ps, pd = PortAdapter(srv), PortAdapter(dev)
    rehydrate.start(dev, srv.site_id, now=NOW)
    off = pd.select(srv.site_id, 0, 10)
    body = pd.body(off.events, srv.site_id, off.token)
    ps.receive(body, sender=dev.site_id)
    assert st.rehydrate_generation(srv.conn, dev.site_id) is None   # dropped: dev is not trusted there
    pd.note_answer(srv.site_id, ps.answer_body(dev.site_id), off.token)
    assert not pd.records_pending(srv.site_id)                        # ...and counted as delivered
    dev_pub = bytes(db.get_meta(dev.conn, "public_key"))
    vouch = rec.build_record("vouch", AUTH.site_id, MESH, dev.site_id, dev_pub, 0, None, AUTH.sign)
    assert pd.driver.apply_records([vouch], NOW)["stored"] == 1        # dev learns its vouch (from anyone)
    assert pd.records_pending(srv.site_id)
    off2 = pd.select(srv.site_id, 0, 10)
    body2 = pd.body(off2.events, srv.site_id, off2.token)
    assert {vouch} | {r for r in _recs(body) if rehydrate.is_rehydrate_record(r)} <= set(_recs(body2))
    ps.receive(body2, sender=dev.site_id)
    assert st.rehydrate_generation(srv.conn, dev.site_id) == 0        # the vouch admitted the request
    pd.note_answer(srv.site_id, ps.answer_body(dev.site_id), off2.token)
    assert not pd.records_pending(srv.site_id)
