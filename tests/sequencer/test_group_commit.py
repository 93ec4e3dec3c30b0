"""The pipelined group commit (agent/sequencer/service.py GroupCommit, docs/sequencer.md
"Pipelined group commit"): batches overlap, first-Commit-wins stays the arrival order, a stream
chains, a keystore failure in flight is settled and never re-signed."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from firmware_bridge import KeystoreError, ReceiptIdentity, Status
from agent.sequencer import home as seq_home, receipts, service
from agent.sequencer.framing import encode_private_message


def gid(n: int) -> bytes:
    return b"gc-group-%04d..." % n


def msg(g: bytes, epoch: int, who: bytes = b"alice") -> bytes:
    return encode_private_message(g, epoch, ciphertext=who + b"-" + g)


def open_seq(tmp_path, hook=None, *, groups: int = 0, start: int = 0,
             chunk: int | None = None) -> tuple[service.Sequencer, list[bytes]]:
    """A sequencer home with ``groups`` groups registered at ``start``, and their ids."""
    home = tmp_path / "seq"
    if not home.exists():
        service.init(home)
    seq = service.Sequencer(home, fault_hook=hook)
    gs = [gid(i) for i in range(groups)]
    for g in gs:
        seq.register(g, start)
    if chunk is not None:
        seq.chunk = chunk
    return seq, gs


def test_the_next_batches_are_signing_before_the_first_is_committed(tmp_path):
    points = []
    seq, gs = open_seq(tmp_path, points.append, groups=4, chunk=1)  # every group its own batch
    try:
        answers = seq.submit_many([msg(g, 0) for g in gs])
        assert all(isinstance(a, service.Accepted) for a in answers)
        first_commit = points.index("committed")
        # batches 2 and 3 had durable intents (and were at the keystore) before batch 1 committed
        assert points[:first_commit].count("after_intent") >= 3
        # and one journal commit held batch 1's output and a later batch's intent
        k = points.index("after_persist")
        assert points[k + 1] == "after_intent"
    finally:
        seq.close()


def test_each_fsync_is_shared_by_two_batches(tmp_path):
    seq, gs = open_seq(tmp_path, groups=64, chunk=8)  # 8 batches
    try:
        f0 = seq.bridge.journal_stats()["fsyncs"]
        assert all(isinstance(a, service.Accepted) for a in seq.submit_many([msg(g, 0) for g in gs]))
        # unpipelined: two per batch (intents, outputs) = 16; pipelined: one per step, each holding
        # one batch's outputs and a later one's intents, but for the DEPTH steps that fill the
        # keystore's queue and the DEPTH that empty it: 8 + DEPTH
        assert seq.bridge.journal_stats()["fsyncs"] - f0 == 8 + service.GroupCommit.DEPTH
    finally:
        seq.close()


def test_first_commit_wins_in_arrival_order_across_overlapping_batches(tmp_path):
    seq, gs = open_seq(tmp_path, groups=3, start=5, chunk=1)
    try:
        order = [(gs[0], 5, b"a"), (gs[1], 5, b"a"), (gs[0], 5, b"b"), (gs[2], 5, b"a"), (gs[1], 5, b"b"),
                 (gs[0], 5, b"c"), (gs[2], 5, b"b")]
        answers = seq.submit_many([msg(g, e, w) for g, e, w in order])
        won = {}
        for (g, e, w), a in zip(order, answers):
            if isinstance(a, service.Accepted):
                assert g not in won, "two Commits accepted for one epoch"
                won[g] = (w, a.receipt)
        assert {g: w for g, (w, _r) in won.items()} == {g: b"a" for g in gs}   # the first to arrive
        for (g, e, w), a in zip(order, answers):
            if w != b"a":
                assert isinstance(a, service.Rejected) and a.reason == "stale_epoch"
                assert a.current_epoch == 6 and a.head == won[g][1]         # the canonical head
    finally:
        seq.close()


def in_flight_of(gc) -> tuple[set, int]:
    """The groups and disk need of the batches in flight, gathered from them (what
    GroupCommit.in_flight and in_flight_need keep as batches come and go)."""
    batches = [batch for batch, _tk, _r in gc.signing] + [gc.prepared]
    return ({d.group_id for batch in batches for _t, _m, _ch, _s, d in batch},
            sum(seq_home.disk_need(m) for batch in batches for _t, m, _ch, _s, _d in batch))


def test_a_stream_chains_each_groups_receipts(tmp_path):
    """Commits put while earlier ones are in flight: each group's next Commit, put as its answer
    is released, is accepted and names the receipt before it."""
    seq, gs = open_seq(tmp_path, groups=40)
    try:
        gc = seq.group_commit(chunk=8)
        for g in gs:
            gc.put(g, msg(g, 0))
        last: dict = {}
        n = 0
        while n < 400:
            assert (gc.in_flight, gc.in_flight_need) == in_flight_of(gc)
            for g, a in gc.step():
                assert isinstance(a, service.Accepted), a
                r = receipts.parse_receipt(a.receipt)
                assert r.previous_receipt_hash == (receipts.receipt_hash(last[g]) if g in last else None)
                last[g] = a.receipt
                n += 1
                gc.put(g, msg(g, a.epoch + 1))
        gc.drain()
        assert (gc.in_flight, gc.in_flight_need) == in_flight_of(gc) == (set(), 0)
        for g in gs:
            assert seq.store.group(g).current_epoch >= 10
            st = seq.store.group(g)
            assert seq.store.receipt(g, st.current_epoch - 1) is not None
        assert seq.store.pending() == []
    finally:
        seq.close()


def test_a_keystore_failure_in_flight_settles_every_pair_and_never_resigns(tmp_path):
    seq, gs = open_seq(tmp_path, groups=12)
    try:
        ks = seq.bridge.keystore
        orig = ks._sign_start
        calls = []

        def failing(requests):
            calls.append(len(requests))
            if len(calls) == 2:                     # the second batch: the token fails mid-way
                sigs, _ = ks._sign_many(requests[:1])
                return lambda: (sigs, KeystoreError("token removed"))
            return orig(requests)
        ks._sign_start = failing
        seq.chunk = 4
        with pytest.raises(KeystoreError):
            seq.submit_many([msg(g, 0) for g in gs])
        ks._sign_start = orig
        assert seq.store.pending() == []            # every pair in flight was settled
        released = gaps = 0
        for g in gs:
            st = seq.store.group(g)
            status = seq.bridge.status(ReceiptIdentity(g, 0))
            if status is Status.RELEASED:           # adopted: exactly the journal's bytes
                assert st.current_epoch == 1 and seq.store.receipt(g, 0) == seq.bridge.released(ReceiptIdentity(g, 0))
                released += 1
            elif status is Status.OUTCOME_UNKNOWN:  # counted as signed: a stated gap, never re-signed
                assert st.current_epoch == 1 and seq.store.is_discontinuity(g, 0)
                gaps += 1
            else:                                   # never intended: nothing happened
                assert st.current_epoch == 0
        assert released >= 5 and gaps >= 1
        # and the sequencer goes on: every group's next Commit is accepted
        again = seq.submit_many([msg(g, seq.store.group(g).current_epoch, b"bob") for g in gs])
        assert all(isinstance(a, service.Accepted) for a in again)
    finally:
        seq.close()


def test_a_local_fault_mid_pipeline_leaves_no_claim_behind(tmp_path):
    """A SQLite fault (a full disk, an I/O error) in a step with batches at the keystore: the
    fault is raised, and the same process goes on — the members' retried Commits are answered
    (the pairs in flight are settled against the journal as a state behind its journal), not
    left waiting for ever on claims nobody will drop."""
    import sqlite3
    import threading
    seq, gs = open_seq(tmp_path, groups=24, chunk=4)
    try:
        orig = seq.store.commit_step
        calls = []

        def faulty(*a, **kw):
            calls.append(1)
            if len(calls) == 4:
                raise sqlite3.OperationalError("disk I/O error")
            return orig(*a, **kw)
        seq.store.commit_step = faulty
        with pytest.raises(sqlite3.OperationalError):
            seq.submit_many([msg(g, 0) for g in gs])
        seq.store.commit_step = orig
        got = []
        th = threading.Thread(target=lambda: got.append(seq.submit_many([msg(g, 0) for g in gs])), daemon=True)
        th.start()
        th.join(60)
        assert not th.is_alive(), "a retried Commit waits for ever on a claim of the failed step"
        for g, a in zip(gs, got[0]):
            st = seq.store.group(g)
            assert st.current_epoch == 1
            if isinstance(a, service.Accepted):      # exactly the bytes the journal holds, if it held any
                assert seq.store.receipt(g, 0) == a.receipt
                if seq.bridge.status(ReceiptIdentity(g, 0)) is Status.RELEASED:
                    assert seq.bridge.released(ReceiptIdentity(g, 0)) == a.receipt
            else:                                    # an intent without output: a stated gap
                assert seq.store.is_discontinuity(g, 0)
    finally:
        seq.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_batching_gives_the_answers_of_one_commit_at_a_time(tmp_path_factory, data):
    """Whatever the batch size and however a group's Commits interleave with other groups' —
    competing Commits for one epoch, Commits for the next epoch queued behind the current one,
    stale and future epochs, unknown groups bootstrapped by their first Commit — the pipelined
    group commit answers exactly as a sequencer taking one Commit at a time in arrival order would
    (§22.5 first-Commit-wins), and every accepted receipt chains to the group's one before."""
    n_groups = data.draw(st.integers(1, 5), label="groups")
    registered = {i: data.draw(st.integers(0, 3), label=f"start{i}") for i in range(n_groups)
                  if data.draw(st.booleans(), label=f"registered{i}")}
    msgs = data.draw(st.lists(st.tuples(st.integers(0, n_groups - 1), st.integers(0, 6), st.sampled_from([b"a", b"b", b"c"])),
                              min_size=1, max_size=40), label="messages")
    chunk = data.draw(st.sampled_from([1, 2, 3, 7, 256]), label="chunk")
    home = tmp_path_factory.mktemp("prop") / "seq"
    service.init(home)
    seq = service.Sequencer(home)
    try:
        for i, start in registered.items():
            seq.register(gid(i), start)
        seq.chunk = chunk
        answers = seq.submit_many([msg(gid(i), e, w) for i, e, w in msgs])
        current = dict(registered)
        for (i, e, w), a in zip(msgs, answers):
            cur = current.get(i)
            if cur is None or e == cur:          # the first Commit of an unknown group bootstraps it
                assert isinstance(a, service.Accepted) and a.epoch == e, (i, e, w, a)
                current[i] = e + 1
            else:
                assert isinstance(a, service.Rejected), (i, e, w, a)
                assert a.reason == ("stale_epoch" if e < cur else "future_epoch") and a.current_epoch == cur
        for i, cur in current.items():
            st_ = seq.store.group(gid(i))
            assert st_.current_epoch == cur
            prev = None
            start = registered[i] if i in registered else next(e for j, e, _w in msgs if j == i)
            for e in range(start, cur):
                r = receipts.parse_receipt(seq.store.receipt(gid(i), e))
                assert r.previous_receipt_hash == prev
                prev = receipts.receipt_hash(seq.store.receipt(gid(i), e))
        assert seq.store.pending() == []
    finally:
        seq.close()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hostile_messages_in_overlapping_batches_are_refused_and_change_nothing(tmp_path_factory, data):
    """Garbage, truncated and trailing-byte frames, proposals, future and out-of-range epochs,
    mixed into overlapping batches with valid Commits: each hostile one gets its refusal reason,
    no state, receipt, pending row or journal entry comes from it, and the valid ones are answered
    exactly as without them."""
    from agent.sequencer.framing import CT_PROPOSAL
    valid = [msg(gid(i), 0) for i in range(4)]
    hostile = {
        "unparseable": [data.draw(st.binary(max_size=64), label="garbage"), valid[0][:-1], valid[1] + b"\x00",
                        b"\x00\x01\x00\x02\x80"],
        "not_commit": [encode_private_message(gid(0), 0, CT_PROPOSAL)],
        "future_epoch": [msg(gid(1), 5, b"x")],
        "epoch_out_of_range": [msg(gid(7), 2**63)],
    }
    bad = [(reason, m) for reason, ms in hostile.items() for m in ms]
    order = data.draw(st.permutations([("ok", m) for m in valid] + bad), label="order")
    home = tmp_path_factory.mktemp("hostile") / "seq"
    service.init(home)
    seq = service.Sequencer(home)
    try:
        for i in range(4):
            seq.register(gid(i), 0)
        seq.chunk = data.draw(st.sampled_from([1, 2, 256]), label="chunk")
        answers = seq.submit_many([m for _r, m in order])
        for (reason, m), a in zip(order, answers):
            if reason == "ok":
                assert isinstance(a, service.Accepted) and a.epoch == 0
            else:
                assert isinstance(a, service.Rejected) and a.reason == reason, (reason, m, a)
        assert sorted(seq.store.group_ids()) == sorted(gid(i) for i in range(4))    # gid(7) never made
        assert all(seq.store.group(gid(i)).current_epoch == 1 for i in range(4))
        assert seq.store.pending() == [] and seq.bridge.journal_stats()["entries"] == 4
    finally:
        seq.close()
