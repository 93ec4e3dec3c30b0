"""One session, every link: the in-memory session runs the same exchange rules
as MQTT (agent/core/exchange.py): answered pushes move the cursor (§33 "a sender advances its
durable cursor only on a successful push"), a window of bodies in flight, the too-large back-off.
Each test here failed on the session that kept its own rules (one body in flight, one-way pushes,
no body limit)."""
from __future__ import annotations

import dataclasses

import cbor2

from agent.store import sync_state as st
from agent.sync import SyncDriver
from agent.transport.memory import frames

from .helpers import NOW, T, log_set, mesh, pair


def write_n(node, n, dev="w", note=""):
    for i in range(n):
        node.write(T, {"device": dev, "seq": i}, {"temp": float(i), "note": note}, now=NOW + i)


def ready(da, db_, **kw):
    p = pair(da, db_, **kw)
    p.start(NOW)
    t = p.run(NOW, NOW + 10_000)
    assert p.sessions[0].state == p.sessions[1].state == "ready"
    return p, t


def max_seq(node) -> int:
    return node.conn.execute("SELECT max(seq) FROM events").fetchone()[0]


def test_a_realtime_push_is_answered_and_the_next_batch_cycle_does_not_send_it_again(tmp_path):
    a, b = mesh(tmp_path, 2)
    da, db_ = SyncDriver(a), SyncDriver(b)
    p, t = ready(da, db_, realtime_capable=True, binding_unsolicited=True, cycle_ms=600_000, coalesce_ms=20)
    sa, sb = p.sessions
    assert sa.realtime and sb.realtime
    write_n(a, 5, "rt")
    sa.local_events(t)
    t = p.run(t, t + 2_000, idle_stop=False)
    assert any(e.kind == "pushed" for e in sa.events) and log_set(a) == log_set(b)
    # the push's answer is its observed outcome: the cursor moved past the pushed events (§33)
    assert st.cursor(a.conn, b.site_id, "memory")[0] >= max_seq(a)
    received = db_.stats["received_events"]
    sa.cycle(t + 1)
    p.flush(t + 1)
    p.run(t + 1, t + 10_000)
    assert db_.stats["received_events"] == received  # nothing pushed is sent again by the batch path


def test_a_backlog_goes_as_a_window_of_bodies_in_flight(tmp_path):
    a, b = mesh(tmp_path, 2)
    da, db_ = SyncDriver(a, 100), SyncDriver(b, 100)
    p, t = ready(da, db_, cycle_ms=600_000)
    write_n(a, 1000)
    sent = da.stats["pushed_events"]
    sa = p.sessions[0]
    sa.cycle(t + 1)
    p.flush(t + 1)
    bodies = [f for f in map(cbor2.loads, frames(p.link)) if f["t"] == "body"]
    assert len(bodies) == 4  # the exchange's window (ExchangeConfig.window), not one body at a time
    for _ in range(20):
        t = p.run(t + 1, t + 60_000)
        if log_set(a) == log_set(b):
            break
        sa.cycle(t + 1)
        p.flush(t + 1)
    assert log_set(a) == log_set(b)
    assert da.stats["pushed_events"] - sent == 1000  # the bodies in flight never overlap


def test_a_body_the_peer_refuses_as_too_large_is_offered_again_smaller(tmp_path):
    a, b = mesh(tmp_path, 2)
    b.profile = dataclasses.replace(b.profile, body_limit_bytes=8_000)
    da, db_ = SyncDriver(a), SyncDriver(b)
    p, t = ready(da, db_, cycle_ms=600_000)
    write_n(a, 200, note="x" * 200)
    sa = p.sessions[0]
    sizes = []  # every body a sends b, in order
    send = p.link.send

    def tap(frm, data, now):
        f = cbor2.loads(data)
        if frm == 0 and f["t"] == "body":
            sizes.append(len(f["b"]))
        send(frm, data, now)
    p.link.send = tap
    for _ in range(40):
        sa.cycle(t + 1)
        p.flush(t + 1)
        t = p.run(t + 1, t + 60_000)
        if log_set(a) == log_set(b):
            break
    refusals = [e for e in p.sessions[1].events if e.kind == "protocol_error" and e.detail == "too_large"]
    assert refusals, "b takes no body above its limit"
    assert log_set(a) == log_set(b)
    # once refused, a's bodies to b shrink below b's limit (BodyLimits: the back-off MQTT uses)
    assert max(sizes) > 8_000 and sizes[-1] <= 8_000
    assert len(refusals) <= 4 + 2  # the window sent before the first refusal, then a probe or two


def test_one_backfill_body_in_flight_so_no_row_goes_twice(tmp_path):
    from agent.core.scope import PolicyRow
    from agent.sync import _txn

    def R(peer, table, layer, effect):
        return PolicyRow(peer, "app", table, layer, effect, "")
    a, b = mesh(tmp_path, 2)
    a.profile = dataclasses.replace(a.profile, backfill_rows_per_cycle=5)
    da, db_ = SyncDriver(a), SyncDriver(b)
    with _txn(a.conn):
        st.put_policy_row(a.conn, R(b.site_id.hex(), "notes", "user", "deny"))
    for i in range(40):
        a.write("app.notes", {"id": f"n{i}"}, {"body": "x"}, now=NOW + i)
    p, t = ready(da, db_, cycle_ms=600_000)
    with _txn(a.conn):  # widening: the withheld rows go as backfill (scope §2)
        st.delete_policy_row(a.conn, R(b.site_id.hex(), "notes", "user", "deny"))
        assert st.schedule_backfill(a.conn, "*") >= 1
    backfill = []  # backfill events in each body or answer a sends
    send = p.link.send

    def tap(frm, data, now):
        f = cbor2.loads(data)
        if frm == 0 and "m" in f:
            backfill.append(f["m"]["x"])
        send(frm, data, now)
    p.link.send = tap
    for _ in range(30):
        for s in p.sessions:  # both ends start an exchange at once: a's answer must not repeat a's body
            s.cycle(t + 1)
        p.flush(t + 1)
        t = p.run(t + 1, t + 60_000)
        if log_set(a) == log_set(b):
            break
    assert log_set(a) == log_set(b)
    assert sum(backfill) == 40, backfill


def test_a_silent_peer_is_given_up_on_after_the_doubling_wait_mqtt_uses(tmp_path):
    a, b = mesh(tmp_path, 2)
    da, db_ = SyncDriver(a), SyncDriver(b)
    p, t = ready(da, db_, cycle_ms=600_000, answer_timeout_ms=1_000)
    sa = p.sessions[0]
    send = p.link.send
    p.link.send = lambda frm, data, now: send(frm, data, now) if frm == 0 else None  # b falls silent
    write_n(a, 3)
    sa.cycle(t + 1)
    assert sa.timer() <= t + 1 + 1_001
    sa.handle_timer(t + 1 + 1_001)
    assert [e.kind for e in sa.events].count("timeout") == 1
    t2 = t + 5_000
    sa.cycle(t2)
    # the second give-up in a row waits twice as long (Exchange.wait_s), as on MQTT
    assert sa.timer() >= t2 + 2_000
    sa.handle_timer(t2 + 1_500)
    assert [e.kind for e in sa.events].count("timeout") == 1
    sa.handle_timer(t2 + 2_001)
    assert [e.kind for e in sa.events].count("timeout") == 2
