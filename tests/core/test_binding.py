"""agent/core/binding.py: what the MQTT binding's loop decides beside the exchange, pure. Here:
`next_due`, the deadline the runtime loop sleeps until (agent/runtime.py). Each deadline is checked
against the decision it stands for: just before it the exchange has nothing to do, at it it does."""
from __future__ import annotations

from agent.core.binding import NEVER, expiry_due, next_due
from agent.core.exchange import ExchangeConfig, Schedule

from .test_exchange import PEER, LINK, body, ex, present


def test_an_idle_exchange_is_due_at_its_next_batch_cycle_and_not_before():
    x = ex()
    s = Schedule(x.cfg)
    assert next_due(x, s, 0.0, connected=True) == 0.0   # the first cycle at once
    assert s.batch_due(0.0, True)
    due = next_due(x, s, 0.0, connected=True)
    assert due == x.cfg.cadence_s
    assert not s.batch_due(due - 1e-6, True) and s.batch_due(due, True)


def test_without_a_connection_only_what_arrives_wakes_the_loop():
    x = ex()
    s = Schedule(x.cfg)
    assert next_due(x, s, 5.0, connected=False) == NEVER
    assert next_due(x, s, 5.0, connected=False, others=[None, 70.0, 65.0]) == 65.0


def test_a_coalesced_push_is_due_coalesce_s_after_the_node_produced():
    x = ex()
    s = Schedule(x.cfg)
    s.batch_due(0.0, True)
    s.produced(1.0)
    due = next_due(x, s, 1.0, connected=True)
    assert due == 1.0 + x.cfg.coalesce_s
    assert s.realtime_due(due - 1e-6, 0) is None and s.realtime_due(due, 0) == "push"
    assert next_due(x, s, due, connected=True) == x.cfg.cadence_s   # pushed: back to the cycle


def test_a_fixed_cadence_flush_is_due_at_its_cadence():
    cfg = ExchangeConfig(flush_cadence_s=2.0)
    x = ex()
    x.cfg = cfg
    s = Schedule(cfg)
    s.batch_due(0.0, True)
    assert s.realtime_due(0.0, 0) == "flush"
    assert next_due(x, s, 0.5, connected=True) == 2.0
    cfg.realtime = False
    assert next_due(x, s, 0.5, connected=True) == cfg.cadence_s   # no realtime: no flush deadline


def test_a_reachable_silent_peer_is_given_up_on_exactly_at_its_deadline():
    x = ex(timeout=10.0)
    x.sent(b"c1", body())
    assert expiry_due(x, 0.0) == NEVER, "an absent peer's bodies wait for it in its broker session"
    present(x)
    assert expiry_due(x, 3.0) == 3.0   # its wait starts at the next expire
    assert x.expire(3.0, LINK) == []
    due = expiry_due(x, 3.0)
    assert due == 13.0
    assert x.expire(due - 1e-6, LINK) == [] and x.expire(due, LINK) == [PEER]
    assert expiry_due(x, due) == NEVER   # given up: nothing in flight


def test_the_wait_doubles_with_each_give_up_and_the_deadline_follows():
    x = ex(timeout=10.0)
    present(x)
    x.sent(b"c1", body())
    x.expire(0.0, LINK)
    assert x.expire(10.0, LINK) == [PEER]
    x.sent(b"c2", body())
    x.expire(10.0, LINK)
    assert expiry_due(x, 10.0) == 30.0 and x.expire(29.9, LINK) == [] and x.expire(30.0, LINK) == [PEER]


def test_bodies_an_earlier_process_sent_have_a_deadline_too():
    x = ex(timeout=10.0)
    x.restore(1, b"c0", PEER, 3, 0, False)
    present(x)
    x.expire(1.0, LINK)
    assert expiry_due(x, 1.0) == 11.0


# ------------------------------------------------------------------ the wire of a request and its answer
from collections import Counter  # noqa: E402

from agent.core.binding import (P_ACK, P_META, P_REJECTED_AT, P_START, P_STATUS, OnceWake,  # noqa: E402
                                answer_properties, asks_signed_ack, body_fit, decode_indices, refusal_properties,
                                request_properties)
from agent.core.session import parse_meta_text  # noqa: E402


def test_a_request_asks_for_a_signed_acknowledgement_unless_the_binding_is_secure():
    plain = request_properties("batch", 4, 9, [5, 7, 9], ["app.b", "app.a"], 2, 5, secure=False)
    assert plain[P_ACK] == "1" and asks_signed_ack(plain)
    secure = request_properties("batch", 4, 9, [5, 7, 9], [], 0, 3, secure=True)
    assert P_ACK not in secure and not asks_signed_ack(secure)
    assert plain["ssp-count"] == "5" and plain[P_START] == "4" and plain["ssp-end"] == "9"
    meta = parse_meta_text(plain[P_META])   # what the receiver's boundary parser reads back
    assert meta == {"s": 4, "e": 9, "d": [1, 2, 2], "g": ["app.a", "app.b"], "x": 2}


def test_an_answer_states_the_outcomes_and_the_rejected_indices_and_echoes_the_range():
    req = {P_START: "4", "ssp-end": "9"}
    ok = answer_properties(req, Counter(applied=2, rejected=1), 3, 3, [1])
    assert ok[P_STATUS] == "ok" and ok["ssp-processed"] == "3" and ok["ssp-applied"] == "2"
    assert ok["ssp-duplicate"] == "0" and ok["ssp-rejected"] == "1" and ok[P_START] == "4"
    assert decode_indices(ok[P_REJECTED_AT], 3) == [1]
    assert P_REJECTED_AT not in answer_properties(req, Counter(applied=3), 3, 3, [])
    no = refusal_properties({}, "too_large")
    assert no == {P_STATUS: "rejected", "ssp-reason": "too_large", "ssp-processed": "0", P_START: "", "ssp-end": ""}


def test_body_fit_counts_the_empty_body_the_meta_and_the_gaps():
    events = [b"x" * 100] * 10
    seqs = list(range(1, 11))   # deltas of 1: two bytes of meta each
    assert body_fit(events, 0, seqs, 0, [], 50, 10_000, 1000) is None   # all fit
    base = 50 + 96
    # exactly room for 4 events of 102 bytes after the base (first_body's own framing aside)
    n = body_fit(events, 0, seqs, 0, [], 50, base + 4 * 102 + 40, 1000)
    assert n is not None and 1 <= n <= 4
    with_gap = body_fit(events, 0, seqs, 0, ["app." + "t" * 200], 50, base + 4 * 102 + 40, 1000)
    assert with_gap is not None and with_gap < n   # a gap's name takes room in the meta
    assert body_fit(events, 0, seqs, 0, [], 50, 10_000, 3) == 3   # events per body bound


# ------------------------------------------------------------------ a sync --once wake
def _drive(w: OnceWake, script):
    """`script`: (now, echoed, took, waiting) per call; returns the steps."""
    return [w.next(now, echoed=e, took=t, waiting=q) for now, e, t, q in script]


def test_a_wake_takes_in_until_its_presence_echo_then_offers_then_waits_for_answers():
    w = OnceWake(0.0, settle_s=0.5, timeout_s=20.0)
    steps = _drive(w, [(0.0, False, 0, False),   # nothing yet: take
                       (0.01, True, 2, False),   # the echo: what waited is queued, drain it
                       (0.02, True, 5, False),   # still taking
                       (0.03, True, 0, False),   # drained: offer
                       (0.04, True, 0, True),    # offered: wait for answers
                       (0.1, True, 1, True),     # still in flight to a present peer
                       (0.2, True, 1, False),    # answered: a last look
                       (0.21, True, 0, False)])
    assert steps == ["take", "drain", "drain", "offer", "await", "await", "last_look", "done"]
    assert w.next(0.3, echoed=True) == "done"


def test_without_an_echo_a_quiet_settle_ends_the_intake():
    w = OnceWake(0.0, settle_s=0.5, timeout_s=20.0)
    steps = _drive(w, [(0.0, False, 0, False), (0.2, False, 1, False),   # a message: the settle restarts
                       (0.6, False, 0, False),                           # 0.4 s quiet: not yet
                       (0.71, False, 0, False)])                         # 0.51 s quiet: offer
    assert steps == ["take", "take", "take", "offer"]
    assert w.wait == 0.0


def test_the_timeout_ends_the_intake_and_the_wait_but_the_offer_and_the_last_look_always_run():
    w = OnceWake(0.0, settle_s=0.5, timeout_s=1.0)
    steps = _drive(w, [(0.0, False, 0, False), (0.3, False, 1, False), (0.6, False, 1, False),
                       (1.0, False, 1, False),   # past the deadline while messages keep coming
                       (1.1, False, 0, True),    # offered; the deadline has passed: no waiting
                       (1.2, False, 0, True)])
    assert steps == ["take", "take", "take", "offer", "last_look", "done"]


def test_with_nothing_in_flight_to_a_present_peer_a_wake_looks_once_then_ends():
    w = OnceWake(0.0)
    steps = _drive(w, [(0.0, True, 0, False), (0.0, True, 0, False), (0.0, True, 0, False),
                       (0.1, True, 0, False), (0.2, True, 0, False)])
    assert steps == ["drain", "offer", "await", "last_look", "done"]
