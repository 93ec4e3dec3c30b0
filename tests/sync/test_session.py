"""The session (agent/core/session.py): strict parsing (every malformed body rejected with a
stated reason, nothing changed), version fail-closed, realtime rules, coalescing, cadence."""
from __future__ import annotations

import cbor2
import pytest

from agent.core.messages import Handshake, emit_handshake
from agent.core.session import encode_frame
from agent.sync import SyncDriver

from .helpers import NOW, T, Signer, log_set, mesh, pair


@pytest.fixture
def two(tmp_path):
    a, b = mesh(tmp_path, 2)
    return a, b, SyncDriver(a), SyncDriver(b)


def ready_pair(da, db_, **kw):
    p = pair(da, db_, **kw)
    p.start(NOW)
    p.run(NOW, NOW + 10_000)
    assert p.sessions[0].state == p.sessions[1].state == "ready"
    return p


def snapshot(node):
    c = node.conn
    return [c.execute(f"SELECT * FROM {t} ORDER BY 1").fetchall() for t in
            ("events", "watermarks", "peer_watermarks", "control_records", "sync_streams", "sync_cursors", "held")]


def good_body(sender: bytes, **over):
    ev = Signer().event(T, {"device": "x", "seq": 1}, {"temp": 1.0}, (NOW, 0))
    b = {"ssp_version": 1, "from_site_id": sender.hex(), "have_max_hlc": {"physical_ms": 0, "logical": 0},
         "events": [ev], "records": [], "applied_watermarks": []}
    b.update(over)
    for k in [k for k, v in over.items() if v is DEL]:
        del b[k]
    return cbor2.dumps(b)


DEL = object()
META = {"s": 0, "e": 1, "d": [1], "g": [], "x": 0}
WM_OK = {"site_id": "ab" * 16, "table_schema": "app", "table_name": "readings", "hlc_physical_ms": 1, "hlc_logical": 0}


def malformed(sender):
    ok = cbor2.loads(good_body(sender))
    return [
        (b"\xff\x00", "malformed_cbor"),
        (good_body(sender) + b"\x00", "malformed_cbor"),  # trailing bytes
        (cbor2.dumps([1, 2]), "not_a_map"),
        (cbor2.dumps({k: v for k, v in ok.items() if k != "ssp_version"}), "missing_ssp_version"),
        (good_body(sender, ssp_version=2), "unknown_ssp_version"),
        (good_body(sender, ssp_version="1"), "bad_ssp_version"),
        (good_body(sender, records=DEL), "bad_members"),
        (good_body(sender, extra=1), "bad_members"),
        (good_body(sender, events=DEL, records=DEL, applied_watermarks=DEL, from_site_id=DEL), "bad_members"),
        (good_body(sender, events=ok["events"][0]), "bad_events"),
        (good_body(sender, events=ok["events"] + ["text"]), "bad_events"),
        (good_body(sender, records={}), "bad_records"),
        (good_body(sender, applied_watermarks={}), "bad_watermarks"),
        (good_body(sender, applied_watermarks=[dict(WM_OK, extra=1)]), "bad_watermark"),
        (good_body(sender, applied_watermarks=[dict(WM_OK, hlc_logical=-1)]), "bad_watermark"),
        (good_body(sender, from_site_id="AB" * 16), "bad_site_id"),
        (good_body(sender, from_site_id="cd" * 16), "sender_mismatch"),
        (good_body(sender, have_max_hlc=[0, 0]), "bad_have_max_hlc"),
        (good_body(sender, have_max_hlc={"physical_ms": True, "logical": 0}), "bad_have_max_hlc"),
        (emit_handshake(Handshake(sender, (0, 0), False, False, None)), "not_a_body"),
        (b"\xa1\x61a\x01\x61a\x02", "malformed_cbor"),  # duplicate keys
    ]


def test_every_malformed_body_is_rejected_with_a_reason_and_changes_nothing(two):
    a, b, da, db_ = two
    p = ready_pair(da, db_)
    sb = p.sessions[1]
    cases = malformed(a.site_id)
    for data, reason in cases:
        before = snapshot(b)
        sb.events.clear()
        sb.receive(encode_frame("body", c=7, b=data, m=META), NOW)
        errs = [e.detail for e in sb.events if e.kind == "protocol_error"]
        assert errs == [reason], (reason, errs)
        assert snapshot(b) == before
        out = sb.data_to_send()
        assert len(out) == 1 and cbor2.loads(out[0])["t"] == "error"  # surfaced to the peer, no answer
    assert sum(1 for s in b.surfaced() if s["kind"] == "refused") == len(cases)


def test_bad_frames_and_meta(two):
    a, b, da, db_ = two
    p = ready_pair(da, db_)
    sb = p.sessions[1]
    for frame, reason in [
        (b"\x00", "bad_frame"),
        (cbor2.dumps({"t": "body", "c": 1, "b": good_body(a.site_id)}), "bad_frame"),
        (cbor2.dumps({"t": "nope"}), "bad_frame"),
        (encode_frame("body", c=1, b=good_body(a.site_id), m={"s": 0, "e": 0, "d": [1], "g": [], "x": 0}), "bad_frame_meta"),
        (encode_frame("body", c=1, b=good_body(a.site_id), m={"s": 0, "e": 5, "d": [], "g": [], "x": 0}), "bad_frame_meta"),
        # the frames of the one session's window (push_ack, refused, the hello's body limit)
        (cbor2.dumps({"t": "push_ack", "c": 1}), "bad_frame"),                    # no k
        (encode_frame("push_ack", c=1, k=-1), "bad_frame"),
        (encode_frame("push_ack", c=1, k=0, j=["x"]), "bad_frame"),
        (encode_frame("push_ack", c=1, k=0, r="extra"), "bad_frame"),            # a member it does not have
        (encode_frame("refused", c=1, f="ack", r="too_large"), "bad_frame"),    # an ack carries no body
        (encode_frame("refused", c=1, f="body", r=5), "bad_frame"),
        (cbor2.dumps({"t": "refused", "c": 1, "r": "too_large"}), "bad_frame"),  # no f
        (encode_frame("hello", b=emit_handshake(Handshake(a.site_id, (0, 0), False, False, None)), r=False, l=-1),
         "bad_frame"),
    ]:
        before = snapshot(b)
        sb.events.clear()
        sb.receive(frame, NOW)
        assert [e.detail for e in sb.events if e.kind == "protocol_error"] == [reason]
        assert snapshot(b) == before


def test_outcomes_for_bodies_never_sent_change_nothing(two):
    """A hostile peer's well-formed push_ack, ack and refused frames naming correlation ids this
    end never used: no cursor, watermark or stored row moves, and the body limit stays."""
    a, b, da, db_ = two
    p = ready_pair(da, db_)
    sa = p.sessions[0]
    limit = sa.ex.limits.limit(b.site_id, NOW / 1000, 1 << 30)
    before = snapshot(a)
    for frame in (encode_frame("push_ack", c=999_999, k=10**6), encode_frame("ack", c=999_998, k=10**6),
                  encode_frame("push_ack", c=999_997, k=0, j=[0, 1, 2]),
                  encode_frame("refused", c=999_996, f="body", r="too_large"),
                  encode_frame("refused", c=999_995, f="answer", r="too_large")):
        sa.receive(frame, NOW + 10_001)
    assert snapshot(a) == before
    assert sa.ex.limits.limit(b.site_id, NOW / 1000, 1 << 30) == limit


def test_unknown_version_in_handshake_fails_closed(two):
    a, b, da, db_ = two
    s = db_.session("memory", a.site_id, secure=True)
    s.start(NOW)
    hs = cbor2.loads(emit_handshake(Handshake(a.site_id, (0, 0), False, True, None)))
    hs["ssp_version"] = 2
    s.receive(encode_frame("hello", b=cbor2.dumps(hs), r=True), NOW)
    assert s.state == "hello" and [e.detail for e in s.events if e.kind == "protocol_error"] == ["unknown_ssp_version"]
    # and a body on that session is refused: no handshake
    s.receive(encode_frame("body", c=1, b=good_body(a.site_id), m=META), NOW)
    assert s.events[-1].detail == "no_handshake"


def test_handshake_value_not_understood_falls_back_to_batch(two):
    a, b, da, db_ = two
    s = db_.session("memory", a.site_id, secure=True, realtime_capable=True, binding_unsolicited=True)
    s.start(NOW)
    hs = cbor2.loads(emit_handshake(Handshake(a.site_id, (0, 0), True, True, None)))
    hs["rtt_ms"] = "fast"
    s.receive(encode_frame("hello", b=cbor2.dumps(hs), r=False), NOW)
    assert s.state == "ready" and not s.realtime


@pytest.mark.parametrize("member, value", [
    ("have_max_hlc", {"physical_ms": 1, "logical": 0, "epoch": 7}),   # a member this version does not know
    ("have_max_hlc", {"physical_ms": -1, "logical": 0}),
    ("have_max_hlc", "soon"),
    ("supports_realtime", 2),
    ("secure_channel", "maybe"),
    ("rtt_ms", -5),
])
def test_any_unknown_handshake_value_falls_back_to_batch_not_rejection(two, member, value):
    # §31: "A receiver MUST fail closed to batch mode on any unknown member value".
    a, b, da, db_ = two
    s = db_.session("memory", a.site_id, secure=True, realtime_capable=True, binding_unsolicited=True)
    s.start(NOW)
    hs = cbor2.loads(emit_handshake(Handshake(a.site_id, (5, 0), True, True, None)))
    hs[member] = value
    s.receive(encode_frame("hello", b=cbor2.dumps(hs), r=False), NOW)
    assert [e for e in s.events if e.kind == "protocol_error"] == []
    assert s.state == "ready" and not s.realtime
    # and the session works in batch mode
    s.receive(encode_frame("body", c=1, b=good_body(a.site_id), m=META), NOW)
    assert [e for e in s.events if e.kind == "protocol_error"] == []


def test_secure_channel_disagreement_warns(two):
    a, b, da, db_ = two
    s = db_.session("memory", a.site_id, secure=False)
    s.start(NOW)
    s.receive(encode_frame("hello", b=emit_handshake(Handshake(a.site_id, (0, 0), False, True, None)), r=False), NOW)
    assert any(e.kind == "warning" and "secure_channel" in e.detail for e in s.events)
    assert s.state == "ready"  # a warning, never a security input


def test_unsolicited_body_without_mutual_realtime_is_rejected(two):
    a, b, da, db_ = two
    p = ready_pair(da, db_)  # neither side advertised realtime
    sb = p.sessions[1]
    before = snapshot(b)
    sb.receive(encode_frame("push", c=1, b=good_body(a.site_id), m=META), NOW)
    assert [e.detail for e in sb.events if e.kind == "protocol_error"] == ["realtime_not_established"]
    assert snapshot(b) == before
    assert any(s["reason"] == "realtime_not_established" for s in b.surfaced())
    # one side capable is not enough
    p2 = pair(da, db_, realtime_capable=True, binding_unsolicited=False)
    assert not p2.sessions[0].advertises_realtime


def test_realtime_push_coalesced_and_batch_keeps_running(two):
    a, b, da, db_ = two
    p = ready_pair(da, db_, realtime_capable=True, binding_unsolicited=True, cycle_ms=1_000, coalesce_ms=20)
    sa, sb = p.sessions
    assert sa.realtime and sb.realtime
    t = p.run(NOW, NOW + 5_000)  # let the first batch cycles finish
    for i in range(5):
        a.write(T, {"device": "rt", "seq": i}, {"temp": 1.0}, now=NOW)
        sa.local_events(t + i)
    p.flush(t)
    t2 = t + 30
    for x in range(t, t2):
        p.step(x)
    pushes = [e for e in sa.events if e.kind == "pushed"]
    assert len(pushes) == 1 and pushes[0].detail == "5"  # five productions, one body
    assert any(e.kind == "received_push" for e in sb.events)
    assert log_set(a) == log_set(b)
    # the push is answered (push_ack): the cursor moved on its observed outcome (§33), and b
    # followed a's stream through it (a push is a window body sent early, positions and all)
    from agent.store import sync_state as st
    top = a.conn.execute("SELECT max(seq) FROM events").fetchone()[0]
    assert st.cursor(a.conn, b.site_id, "memory")[0] == top
    assert st.own_watermarks(b.conn).get((a.site_id, T)) is not None
    # the batch cycle keeps running underneath (§33.1)
    bodies = da.stats["bodies_out"]
    for x in range(t2, t2 + 3_000, 5):
        p.step(x)
    assert da.stats["bodies_out"] > bodies


def test_fixed_cadence_flush_sends_constant_pushes(two):
    a, b, da, db_ = two
    p = ready_pair(da, db_, realtime_capable=True, binding_unsolicited=True, flush_ms=100, cycle_ms=60_000)
    sa = p.sessions[0]
    for x in range(NOW, NOW + 1_000, 10):
        p.step(x)
    n_empty = len([e for e in sa.events if e.kind == "pushed"])
    assert 8 <= n_empty <= 11  # one per cadence tick, whether or not there is anything to send
    a.write(T, {"device": "rt", "seq": 1}, {"temp": 1.0}, now=NOW)
    sa.local_events(NOW + 1_000)  # production does not trigger a push: only the cadence does
    for x in range(NOW + 1_000, NOW + 1_200, 10):
        p.step(x)
    assert log_set(a) == log_set(b)


def test_session_state_survives_lost_hello(two):
    a, b, da, db_ = two
    from agent.transport.memory import Faults
    p = pair(da, db_, Faults(drop=0.5), seed=3)
    p.start(NOW)
    p.run(NOW, NOW + 60_000)
    assert p.sessions[0].state == p.sessions[1].state == "ready"
