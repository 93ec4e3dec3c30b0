"""agent/core/exchange.py, the exchange state machine of every link, and what the MQTT binding
decides beside it (agent/core/binding.py: what an answer proves, refusals before parsing, the order
of intake, when acknowledgements are signed), driven without a broker, a store or a clock: the
window in flight, answers and what they prove, giving up on a silent peer, the body limits and
presence. (The same code runs behind agent/runner.py in tests/mqtt against a
real mosquitto; here every decision is pinned with time passed in.)"""
from __future__ import annotations

from collections import Counter

from nacl.signing import SigningKey

from agent.core.cose import assemble
from agent.core.delivery import answer_moves
from agent.core.binding import (MAX_ACKS_LOOKED_AT, Intake, ack_due, ack_wait, answer_proof, request_refusal,
                                signed_ack_owed)
from agent.core.exchange import (GIVE_UP_DOUBLINGS, KIND_BATCH, KIND_REALTIME, BodyLimits, Exchange, ExchangeConfig,
                                 InFlight, Presence, Schedule, SurfaceBudget, answered_progress)
from agent.core.messages import Handshake, SyncBody, emit_body
from agent.core.records import MAX_ACK_ANSWERS, AckAnswer, ack_to_be_signed, record_hash
from agent.core.sending import MIN_BODY_LIMIT, first_body

MESH = bytes(range(16))
ME, PEER, OTHER = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
FLOOR, LINK = 16 * 1024, 256 * 1024


def ex(window: int = 2, secure: bool = True, timeout: float = 10.0) -> Exchange:
    stats: Counter = Counter()
    cfg = ExchangeConfig(window=window, answer_timeout_s=timeout, secure=secure)
    return Exchange(cfg, BodyLimits(FLOOR, cfg, stats), Presence(8, stats), stats)


def body(peer: bytes = PEER, start: int = 0, end: int = 3, seqs=(1, 2, 3), size: int = 100, **kw) -> InFlight:
    return InFlight(peer, "batch", start, end, list(seqs), 0.0, size=size, **kw)


def present(x: Exchange, site: bytes = PEER, realtime: bool = False) -> None:
    x.presence.arrived(site, Handshake(site, (0, 0), realtime, None, None), lambda s: s in (PEER, OTHER))


def answer(x: Exchange, corr: bytes, sender: bytes = PEER, status: str = "ok", processed: str | None = "3",
           rejected=None, proof=lambda b: None, reason=None, recalled=None, now: float = 0.0):
    p, earlier = x.lookup(corr, recalled)
    return x.answer(corr, sender, p, earlier, status=status, reason=reason, processed_text=processed,
                    rejected=rejected, proof=proof, now=now, link_max=LINK)


# ------------------------------------------------------------------ the window
def test_the_window_bounds_bodies_in_flight_and_the_next_body_starts_after_them():
    x = ex(window=2)
    assert x.batch_room(PEER) == 2 and x.start_at(PEER, cursor=5) == 5
    x.sent(b"c1", body(start=5, end=8, seqs=(6, 7, 8)))
    assert x.in_flight(PEER) == 1 and x.room(PEER) == 1 and x.start_at(PEER, cursor=5) == 8
    x.sent(b"c2", body(start=8, end=9, seqs=(9,)))
    assert x.batch_room(PEER) == 0, "a full window waits, however many cycles pass (quiet links)"
    assert x.in_flight(OTHER) == 0 and x.batch_room(OTHER) == 2


def test_one_backfill_body_in_flight_per_peer():
    x = ex()
    x.sent(b"c1", body())
    assert not x.backfill_in_flight(PEER)
    x.sent(b"c2", body(start=3, end=3, seqs=(), n_backfill=2, backfill=True))
    assert x.backfill_in_flight(PEER) and not x.backfill_in_flight(OTHER)


def test_an_ok_answer_settles_its_body_and_keeps_the_window_full():
    x = ex()
    x.sent(b"c1", body())
    d = answer(x, b"c1", processed="3")
    assert d.advances and (d.processed, d.rejected, d.then) == (3, None, "offer")
    assert x.in_flight(PEER) == 0 and x.stats["answers"] == 1 and x.stats["events_acknowledged"] == 3


def test_a_prefix_answer_re_offers_from_the_cursor():
    x = ex()
    x.sent(b"c1", body(start=0, end=3))
    x.sent(b"c2", body(start=3, end=6, seqs=(4, 5, 6)))
    assert x.start_at(PEER, 0) == 6
    d = answer(x, b"c1", processed="1")
    assert (d.processed, d.then) == (1, "reset")
    assert x.start_at(PEER, cursor=1) == 1, "the next body starts at the durable cursor again"
    assert x.in_flight(PEER) == 1, "the other body keeps its slot until answered or given up"


def test_rejected_indices_count_everything_else_as_processed():
    assert answered_progress(5, None, "1", [1, 3]) == (5, [1, 3])
    assert answered_progress(5, None, "9", None) == (5, None)
    assert answered_progress(5, None, "x", None) == (0, None)
    signed = AckAnswer(b"h" * 32, 2, 5, (4,))
    assert answered_progress(5, signed, "5", None) == (5, [4]), "the signed answer wins over the properties"


def test_unknown_and_misdirected_answers_move_nothing():
    x = ex()
    x.sent(b"c1", body())
    assert answer(x, b"nope").ignored == "unknown_answers"
    assert answer(x, b"c1", sender=OTHER).ignored == "answers_from_wrong_sender"
    assert x.in_flight(PEER) == 1 and x.stats["answers"] == 0


def test_without_the_acls_only_a_proven_answer_settles_a_body():
    x = ex(secure=False)
    x.sent(b"c1", body())
    d = answer(x, b"c1", proof=lambda b: None)
    assert d.ignored == "answers_unproven" and x.in_flight(PEER) == 1, "the peer's own answer may still come"
    d = answer(x, b"c1", processed="0", proof=lambda b: AckAnswer(b"h" * 32, 3, 3, ()))
    assert d.advances and d.processed == 3, "what the peer signed, not the properties"


def test_a_refusal_settles_the_body_and_only_the_secure_binding_forgets_it():
    for secure in (True, False):
        x = ex(secure=secure)
        x.sent(b"c1", body())
        d = answer(x, b"c1", status="rejected", reason="bad_frame_meta", processed="0")
        assert d.refused == "bad_frame_meta" and d.forget is secure and not d.advances
        assert x.in_flight(PEER) == 0 and x.stats["push_rejected:bad_frame_meta"] == 1


def test_a_too_large_refusal_halves_the_limit_unless_it_states_the_limit():
    x = ex()
    x.sent(b"c1", body(size=200_000))
    answer(x, b"c1", status="rejected", reason="too_large", now=0.0)
    assert x.limits.limit(PEER, 0.0, LINK) == LINK // 2
    x.sent(b"c2", body(size=100_000))
    x.note_message("ans", PEER, 1.0, member=True, advertised=64 * 1024, told_too_large=True)
    answer(x, b"c2", status="rejected", reason="too_large", now=1.0)
    assert x.stats["body_limit_told"] == 1
    assert x.limits.limit(PEER, 1.0, LINK) == 64 * 1024, "the advertised limit, not a second halving"


def test_an_earlier_process_body_is_restored_answered_and_not_offered_after():
    x = ex()
    x.restore(7, b"e1", PEER, end=10, cursor=4, backfill=False)
    x.restore(8, b"e2", PEER, end=3, cursor=4, backfill=False)  # the cursor covers it: not in flight
    assert x.in_flight(PEER) == 1 and x.start_at(PEER, 4) == 10
    rec = {"peer": PEER, "kind": "batch", "start": 4, "end": 10, "seqs": [5, 10], "n_backfill": 0,
           "backfill": False, "token": None}
    d = answer(x, b"e1", processed="2", recalled=rec)
    assert d.earlier and d.advances and d.then is None, "the next batch cycle sends the window after it"
    assert x.answered(PEER, b"e1", still_recorded=False, refused=False) is None
    assert x.in_flight(PEER) == 0


def test_an_answer_to_a_newer_body_gives_up_the_earlier_ones_it_overtook():
    x = ex()
    x.restore(7, b"e1", PEER, end=10, cursor=0, backfill=False)
    x.restore(9, b"e2", PEER, end=12, cursor=0, backfill=False)
    x.sent(b"c1", body(start=12, end=13, seqs=(13,)))
    answer(x, b"c1", processed="1")
    assert x.answered(PEER, b"c1", still_recorded=False, refused=False) == 9
    assert x.in_flight(PEER) == 0 and x.start_at(PEER, 0) == 0 and x.stats["unanswered"] == 1


def test_an_ignored_answer_to_an_earlier_body_keeps_it_in_flight():
    x = ex()
    x.restore(7, b"e1", PEER, end=10, cursor=0, backfill=False)
    assert x.answered(PEER, b"e1", still_recorded=True, refused=False) is None
    assert x.in_flight(PEER) == 1


# ------------------------------------------------------------------ giving up (quiet links)
def test_an_absent_peer_is_never_given_up_on():
    x = ex()
    x.sent(b"c1", body())
    assert x.expire(10**9, LINK) == [] and x.in_flight(PEER) == 1


def test_a_present_silent_peer_is_given_up_on_after_a_doubling_wait():
    x = ex(timeout=10.0)
    present(x)
    x.sent(b"c1", body())
    assert x.expire(100.0, LINK) == []            # the silence starts now
    assert x.expire(109.0, LINK) == []
    assert x.expire(110.0, LINK) == [PEER] and x.in_flight(PEER) == 0
    x.sent(b"c2", body())
    assert x.expire(200.0, LINK) == [] and x.expire(219.0, LINK) == [] and x.expire(220.0, LINK) == [PEER]
    assert x.wait_s(PEER) == 40.0
    x.give_ups[PEER] = 100
    assert x.wait_s(PEER) == 10.0 * 2 ** GIVE_UP_DOUBLINGS


def test_silence_with_large_bodies_halves_the_limit_provisionally():
    x = ex(timeout=1.0)
    present(x)
    x.sent(b"c1", body(size=FLOOR + 1))
    x.expire(0.0, LINK)
    x.expire(1.0, LINK)
    assert x.stats["body_limit_reduced_by_silence"] == 1 and x.limits.limit(PEER, 1.0, LINK) == LINK // 2
    assert x.limits.limit(PEER, 10**6, LINK) == LINK, "probed back up to the link's maximum"


def test_a_request_starts_the_wait_and_leaving_ends_it():
    x = ex(timeout=5.0)
    x.sent(b"c1", body())
    x.note_message("req", PEER, 50.0, member=True)
    assert x.silent_since[PEER] == 50.0 and PEER in x.heard
    x.note_message("presence", PEER, 52.0, member=True, empty=True)
    assert x.expire(60.0, LINK) == [], "it left: what it did not answer waits in its session"
    x.note_message("req", PEER, 61.0, member=True, dup=True)
    assert PEER not in x.silent_since, "a redelivered request is no evidence of the peer now"


def test_a_wake_gives_up_on_earlier_bodies_of_a_peer_it_heard_from():
    x = ex()
    x.restore(1, b"e1", PEER, end=5, cursor=0, backfill=False)
    x.restore(2, b"e2", OTHER, end=5, cursor=0, backfill=False)
    x.note_message("req", PEER, 0.0, member=True)
    assert x.lost_while_away() == [PEER]
    assert x.in_flight(PEER) == 0 and x.in_flight(OTHER) == 1


# ------------------------------------------------------------------ limits and presence
def test_an_advertised_limit_is_never_taken_below_the_floor_nor_above_the_link():
    lim = BodyLimits(FLOOR)
    lim.learn(PEER, 1000)
    assert lim.top(PEER, LINK) == FLOOR and lim.dirty == {PEER}
    lim.learn(PEER, 10**9)
    assert lim.top(PEER, LINK) == LINK
    rows = lim.take_dirty(0.0, 0)
    assert rows == [(PEER, 10**9, None)] and not lim.dirty


def test_body_limits_survive_the_store_round_trip():
    lim = BodyLimits(FLOOR)
    lim.too_large(PEER, 100.0, LINK)
    (_, adv, state), = lim.take_dirty(100.0, 1_000_000)
    back = BodyLimits(FLOOR)
    back.restore(PEER, adv, state, 5.0, 1_000_000)  # another process: another monotonic clock
    assert back.limit(PEER, 5.0, LINK) == LINK // 2
    back.restore(OTHER, None, {"limit": "junk"}, 5.0, 0)
    assert OTHER not in back.peer_limit and back.limit(OTHER, 5.0, LINK) == LINK
    assert MIN_BODY_LIMIT <= back.peer_limit[PEER].limit


def test_presence_is_bounded_and_keeps_keyring_sites():
    p = Presence(limit=3)
    member = {PEER}.__contains__
    p.arrived(PEER, Handshake(PEER, (0, 0), True, None, None), member)
    for i in range(10):
        s = bytes([0x80 + i]) * 16
        p.arrived(s, Handshake(s, (0, 0), False, None, None), member)
    assert len(p.caps) == 3 and PEER in p and p.realtime(PEER) and p.stats["presence_evicted"] == 8
    p.left(PEER)
    assert PEER not in p and not p.realtime(PEER)


def test_a_handshake_not_understood_is_no_realtime_partner():
    p = Presence()
    p.arrived(PEER, Handshake(PEER, (0, 0), True, None, None, False), lambda s: True)
    assert PEER in p and not p.realtime(PEER)


# ------------------------------------------------------------------ answer proof (docs/protocol.md §5)
def _signed_ack(key: SigningKey, issuer: bytes, subject: bytes, answers) -> bytes:
    protected, payload, tbs = ack_to_be_signed(issuer, MESH, subject, list(answers))
    return assemble(protected, payload, key.sign(tbs).signature)


def test_answer_proof_takes_only_the_peers_signature_over_this_exact_body():
    kp, ko = SigningKey.generate(), SigningKey.generate()
    keyring = {PEER: (bytes(kp.verify_key), None), OTHER: (bytes(ko.verify_key), None)}
    sent = b"the exact body sent"
    p = body(seqs=(1, 2), end=2, body_hash=record_hash(sent))

    def answer_with(*records) -> bytes:
        return emit_body(SyncBody(PEER, (0, 0), (), tuple(records), ()))

    good = _signed_ack(kp, PEER, ME, [AckAnswer(record_hash(sent), 2, 2, ())])
    stats: Counter = Counter()
    assert answer_proof(p, answer_with(good), MESH, ME, keyring.get, stats) == AckAnswer(record_hash(sent), 2, 2, ())
    other_body = _signed_ack(kp, PEER, ME, [AckAnswer(record_hash(b"another body"), 2, 2, ())])
    by_other = _signed_ack(ko, OTHER, ME, [AckAnswer(record_hash(sent), 2, 2, ())])
    to_other = _signed_ack(kp, PEER, OTHER, [AckAnswer(record_hash(sent), 2, 2, ())])
    wrong_count = _signed_ack(kp, PEER, ME, [AckAnswer(record_hash(sent), 1, 1, ())])
    for rec in (other_body, by_other, to_other, wrong_count):
        assert answer_proof(p, answer_with(rec), MESH, ME, keyring.get, stats) is None
    assert stats["ack_misaddressed"] == 2
    forged = _signed_ack(ko, PEER, ME, [AckAnswer(record_hash(sent), 2, 2, ())])  # another key under PEER's name
    assert answer_proof(p, answer_with(*[forged] * 50), MESH, ME, keyring.get, stats) is None
    assert stats["ack_refused:bad_signature"] == MAX_ACKS_LOOKED_AT, "a stuffed answer costs a few checks"
    assert answer_proof(p, b"not a body", MESH, ME, keyring.get, stats) is None
    unhashed = body(seqs=(1, 2), end=2)
    assert answer_proof(unhashed, answer_with(good), MESH, ME, keyring.get, stats) is None
    assert stats["answers_unprovable"] == 1


# ------------------------------------------------------------------ what to send, and when
def test_an_offer_starts_after_the_window_and_forces_a_body_for_records_only_when_idle():
    x = ex(window=3)
    asked = []

    def pending() -> bool:
        asked.append(1)
        return True
    plan = x.plan_offer(PEER, KIND_BATCH, cursor=4, limit=64 * 1024, records_pending=pending)
    assert (plan.start, plan.bodies, plan.record_budget, plan.force) == (4, 3, 16 * 1024, True)
    assert plan.worth_sending(end=4, backfill=False), "records the peer lacks: one body even with no events"
    assert not plan.worth_sending(end=4, backfill=False), "forcing sends one body"
    assert plan.worth_sending(end=4, backfill=True), "the backfill walk's end still goes"
    x.sent(b"c1", body(start=4, end=9, seqs=(9,)))
    asked.clear()
    plan = x.plan_offer(PEER, KIND_BATCH, cursor=4, limit=1000, records_pending=pending)
    assert (plan.start, plan.bodies, plan.record_budget, plan.force) == (9, 2, 256, False) and not asked
    plan.sent(12)
    assert plan.start == 12


def test_backfill_rides_batch_bodies_only_one_in_flight():
    x = ex()
    assert x.may_carry_backfill(PEER, KIND_BATCH) and not x.may_carry_backfill(PEER, KIND_REALTIME)
    x.sent(b"c1", body(backfill=True))
    assert not x.may_carry_backfill(PEER, KIND_BATCH)


def test_first_body_cuts_a_selection_that_does_not_fit():
    assert first_body([100] * 10, 50, 10**6, 100) is None
    n = first_body([300] * 40, 200, 4096, 1000)
    assert n is not None and 200 + 8 + n * 303 <= 4096 < 200 + 8 + (n + 1) * 303
    assert first_body([10] * 10, 0, 10**6, 4) == 4


def test_requests_are_refused_with_the_one_list_of_reason_codes():
    from agent.core.reasons import ALL as REASONS
    assert request_refusal(10, 100, KIND_BATCH, PEER, False) is None
    assert request_refusal(10, 100, KIND_REALTIME, PEER, True) is None
    cases = [(101, KIND_BATCH, PEER, True, "too_large"), (10, "push", PEER, True, "unknown_kind"),
             (10, KIND_BATCH, None, True, "bad_topic"), (10, KIND_REALTIME, PEER, False, "realtime_not_established")]
    for size, kind, sender, rt, reason in cases:
        got = request_refusal(size, 100, kind, sender, rt)
        assert got is not None and got[0] == reason and reason in REASONS


def test_signed_acknowledgements_are_grouped_until_full_or_the_interval():
    assert ack_due(1, last_signed=0.0, now=5.0, interval_s=0.0)
    assert not ack_due(3, last_signed=4.9, now=5.0, interval_s=1.0)
    assert ack_due(MAX_ACK_ANSWERS, last_signed=4.9, now=5.0, interval_s=1.0)
    assert ack_due(1, last_signed=4.9, now=5.0, interval_s=1.0, force=True)
    assert ack_wait([4.5, 4.9], now=5.0, interval_s=1.0) == 0.5
    assert ack_wait([1.0], now=5.0, interval_s=1.0) == 0.0


def test_the_batch_cycle_runs_every_cadence_while_connected():
    s = Schedule(ExchangeConfig(cadence_s=30.0))
    assert not s.batch_due(0.0, connected=False)
    assert s.batch_due(0.0, connected=True) and not s.batch_due(29.9, True) and s.batch_due(30.0, True)


def test_realtime_pushes_are_coalesced_after_production():
    s = Schedule(ExchangeConfig(coalesce_s=0.05), local_top=10)
    assert s.realtime_due(1.0, local_top=10) is None, "writes before the start are the batch cycle's"
    assert s.realtime_due(1.0, local_top=11) is None          # produced: the push waits coalesce_s
    assert s.realtime_due(1.04, local_top=12) is None
    assert s.realtime_due(1.05, local_top=12) == "push"
    assert s.realtime_due(2.0, local_top=12) is None, "nothing new"
    s.produced(3.0)                                           # an in-process writer says so
    assert s.realtime_due(3.1, local_top=12) == "push"
    assert Schedule(ExchangeConfig(realtime=False)).realtime_due(1.0, 99) is None


def test_a_fixed_cadence_flush_goes_whatever_was_produced():
    s = Schedule(ExchangeConfig(flush_cadence_s=2.0))
    assert s.realtime_due(0.0, 0) == "flush" and s.realtime_due(1.9, 50) is None and s.realtime_due(2.0, 0) == "flush"


# ------------------------------------------------------------------ the cursor movement an answer proves (every link)
def test_a_prefix_answer_moves_the_live_cursor_to_before_the_first_unprocessed_event():
    mv = answer_moves(10, (12, 15, 20), 25, (), [], processed=2, rejected=None)
    assert mv.live == 19 and mv.new_reoffers == () and mv.backfill == ()
    assert answer_moves(10, (12, 15, 20), 25, (), [], 3, None).live == 25, "all processed: the range's end"
    assert answer_moves(10, (12, 15, 20), 25, (), [], 0, None).live == 11


def test_rejected_events_are_passed_and_re_offered_not_pinning_the_stream():
    mv = answer_moves(10, (12, 15, 20), 25, (), [], processed=3, rejected=[1])
    assert mv.live == 25 and mv.new_reoffers == (15,)


def test_re_offers_and_backfill_rows_commit_only_what_reached_a_final_state():
    # 2 live, 2 re-offered, then a backfill part of rows with 2, 1 and 3 events (walk at the end)
    body = dict(start=0, seqs=(1, 2), end=2, reoffer_seqs=(7, 8), bf_counts=[((2, 1, 3), True)])
    mv = answer_moves(**body, processed=7, rejected=None)  # the prefix ends inside the third row
    assert mv.reoffers_done == (7, 8) and mv.rescans_done and mv.backfill == ((2, 3, 1, False),)
    mv = answer_moves(**body, processed=10, rejected=[])
    assert mv.backfill == ((3, 6, 2, True),), "every row whole: the job is done"
    mv = answer_moves(**body, processed=10, rejected=[3, 5])  # a re-offer and the first backfill row's 2nd event
    assert mv.reoffers_done == (7,) and mv.reoffers_again == (8,) and mv.rescans_done
    assert mv.backfill == ((0, 0, -1, False),), "the row holding a rejected event does not commit"
    mv = answer_moves(**body, processed=3, rejected=None)  # stopped in the re-offers
    assert mv.reoffers_done == (7,) and mv.reoffers_again == () and not mv.rescans_done and mv.backfill == ()


# ------------------------------------------------------------------ the order what arrived is handled in
class _M:
    def __init__(self, kind: str, who: bytes | None, i: int = 0) -> None:
        self.kind, self.who, self.i = kind, who, i


def test_members_requests_are_taken_one_per_sender_in_turn():
    it = Intake()
    for i in range(5):
        assert not it.take(_M("req", PEER, i), "req", PEER, from_member=True)
    assert not it.take(_M("req", OTHER, 9), "req", OTHER, from_member=True)
    first = it.turn()
    assert [(m.who, m.i) for m in first] == [(PEER, 0), (OTHER, 9)], "a flooding member holds no one back"
    assert [m.i for m in it.turn()] == [1] and it.waiting()


def test_answers_and_members_presence_are_handled_at_once_strangers_wait_bounded():
    it = Intake(presence_limit=3)
    assert it.take(_M("ans", None), "ans", None, from_member=False)
    assert it.take(_M("presence", PEER), "presence", PEER, from_member=True)
    stranger = bytes([0x90]) * 16
    assert not it.take(_M("req", stranger), "req", stranger, from_member=False)
    for i in range(10):
        it.take(_M("presence", stranger, i), "presence", stranger, from_member=False)
    assert it.others_presence == 3 and it.stats["others_presence_dropped"] == 7
    assert [m.kind for m in it.others] == ["req", "presence", "presence", "presence"]
    assert [m.i for m in it.others if m.kind == "presence"] == [7, 8, 9], "the oldest waiting presence goes"
    due = it.others_due(2)
    assert len(due) == 2 and it.others_presence == 2 and len(it.others) == 2


def test_surfaced_rows_are_bounded_per_reason_and_window_and_the_rest_told_once():
    b = SurfaceBudget(per_window=2, window=60.0)
    assert [b.admit(("mqtt_request", "too_large"), t) for t in (0.0, 1.0, 2.0, 3.0)] == \
        [(True, 0), (True, 0), (False, 0), (False, 0)]
    assert b.admit(("mqtt_request", "bad_topic"), 4.0) == (True, 0), "each reason has its own budget"
    assert b.admit(("mqtt_request", "too_large"), 60.0) == (True, 2), "the next window tells the 2 held back"
    b.admit(("mqtt_request", "too_large"), 61.0)
    b.admit(("mqtt_request", "too_large"), 62.0)
    assert b.drain() == [(("mqtt_request", "too_large"), 1)] and b.drain() == []


def test_realtime_bodies_go_to_present_realtime_members_with_room():
    x = ex(window=1)
    member = {PEER, OTHER}.__contains__
    present(x, PEER, realtime=True)
    present(x, OTHER, realtime=False)
    stranger = bytes([0x91]) * 16
    x.presence.arrived(stranger, Handshake(stranger, (0, 0), True, None, None), member)
    assert x.realtime_peers(member) == [PEER] and x.push_targets(member) == [PEER]
    x.sent(b"c1", body())
    assert x.push_targets(member) == [], "its window is out: the answers decide"
    x.cfg.realtime = False
    assert x.realtime_peers(member) == []


def test_a_signed_acknowledgement_is_owed_only_to_a_trusted_sender_that_asked():
    assert signed_ack_owed(True, PEER, True, ME)
    assert not signed_ack_owed(False, PEER, True, ME)
    assert not signed_ack_owed(True, PEER, False, ME), "a body under an unknown name signs nothing"
    assert not signed_ack_owed(True, ME, True, ME) and not signed_ack_owed(True, None, True, ME)


def test_a_refused_presence_makes_the_site_absent_and_is_surfaced_once_per_payload():
    from agent.core.messages import emit_handshake
    p = Presence()
    member = {PEER}.__contains__
    assert p.received(PEER, emit_handshake(Handshake(PEER, (0, 0), True, None, None)), member) is None
    assert p.realtime(PEER)
    e = p.received(PEER, b"\xa1junk", member)
    assert e is not None and PEER not in p, "refused: absent"
    assert p.received(PEER, b"\xa1junk", member) is None, "the same retained payload again: surfaced once"
    assert p.received(PEER, b"\xa1more junk", member) is not None and p.stats["refused_presence"] == 3
    other = emit_handshake(Handshake(OTHER, (0, 0), False, None, None))
    assert p.received(PEER, other, member).reason == "handshake_site_mismatch", "one site cannot speak for another"
    p.received(PEER, emit_handshake(Handshake(PEER, (0, 0), False, None, None)), member)
    assert PEER in p
    assert p.received(PEER, b"", member) is None and PEER not in p, "an empty presence: it left"


def test_refusals_of_a_window_sent_before_the_reduction_halve_the_limit_once():
    # A window of bodies in flight refused as too large (on any link) is one piece of evidence:
    # the bodies sent at the old size do not halve the limit again and again.
    x = ex()
    present(x)
    for c in (b"c1", b"c2", b"c3"):
        x.sent(c, body(size=LINK))
    for c in (b"c1", b"c2", b"c3"):
        p, earlier = x.lookup(c)
        x.answer(c, PEER, p, earlier, status="rejected", reason="too_large", processed_text="0", rejected=None,
                 proof=lambda _b: None, now=1.0, link_max=LINK)
    assert x.limits.limit(PEER, 1.0, LINK) == LINK // 2
    x.sent(b"c4", body(size=LINK // 2))  # sent at the reduced size and refused again: halved again
    p, earlier = x.lookup(b"c4")
    x.answer(b"c4", PEER, p, earlier, status="rejected", reason="too_large", processed_text="0", rejected=None,
             proof=lambda _b: None, now=2.0, link_max=LINK)
    assert x.limits.limit(PEER, 2.0, LINK) == LINK // 4


def test_with_nothing_in_flight_the_next_body_starts_at_the_durable_cursor():
    # The cursor can move back under the window (a rehydration request resets it to genesis):
    # once nothing is in flight, where the last body ended says nothing any more.
    x = ex()
    x.sent(b"c1", body(start=0, end=9, seqs=(7, 8, 9)))
    assert x.start_at(PEER, 0) == 9
    answer(x, b"c1")
    assert x.in_flight(PEER) == 0 and x.start_at(PEER, 0) == 0
