"""A fault inside the batched resume after a rollback (§22.6 step 1, step 4; docs/sequencer.md
"Resume"): an exception raised after some of the settle transactions, inside a batch of
statements (its intents durable, no output) or after a batch was stored leaves a state the next
resume completes: the epoch never ahead of a durable receipt or stated gap, no receipt signed
again, one statement released per gap (the attempts of a batch cut between intent and output are
never signed again). In process, with the fault hook raising; the SIGKILL version is
test_sequencer_crash.py::test_rollback_resume_named_crash_points.

The rollback is the one of test_rollback_cost.py: the journal is never compacted, every receipt
released after the copy is adopted, and the gaps are unknown outcomes (an INTENT without output)
— each group's epoch LAST + 1 and epoch 0 of the gap groups — the §22.6 "epoch advanced, receipt
absent" path. (A state restored past a compaction floor takes another path: docs/sequencer.md
"Resume".)"""
from __future__ import annotations

import sqlite3

import pytest

from agent.sequencer import receipts, resume as seq_resume, service
from agent.sequencer.store import Store
from bridge_helpers import parse_journal
from firmware_bridge import DiscontinuityIdentity, ReceiptIdentity
from firmware_bridge.identity import decode_identity
from test_rollback_cost import BACKUP_AT, GROUPS, msg, rolled_back_home

LAST = 204                    # 200 receipts a group adopted, 800 in all
GAP_GROUPS = 496              # + 4 gaps at LAST + 1: 500 gaps
CHUNK = 100                   # epochs a settle transaction (13), statements a bridge call (5)
SETTLED = len(GROUPS) * (LAST + 2 - BACKUP_AT) + GAP_GROUPS   # epochs settled: 1 300


class Boom(Exception):
    pass


def raising_at(point: str, hit: int):
    seen = {"n": 0}

    def hook(reached: str) -> None:
        if reached == point:
            seen["n"] += 1
            if seen["n"] == hit:
                raise Boom(f"{point}:{hit}")
    return hook


def check_state(home) -> dict:
    """The durable state, read with sqlite3: every epoch below a group's current_epoch has its
    receipt or a stated gap (never both), no receipt at or above it, a statement only for a gap.
    Returns {group: current_epoch}."""
    conn = sqlite3.connect(str(home / service.DB_NAME))
    try:
        groups = {bytes(g): e for g, e in conn.execute("SELECT group_id, current_epoch FROM groups")}
        held = {(bytes(g), e) for g, e in conn.execute("SELECT group_id, epoch FROM receipts")}
        gaps = {(bytes(g), e) for g, e in conn.execute("SELECT group_id, epoch FROM discontinuities")}
        stated = {(bytes(g), e) for g, e in conn.execute("SELECT group_id, epoch FROM statements")}
    finally:
        conn.close()
    assert not held & gaps, "an epoch with a receipt and a gap"
    assert stated <= gaps, "a statement for no gap"
    for g, current in groups.items():
        for e in range(0, current):
            assert (g, e) in held or (g, e) in gaps, f"epoch {current} of {g.hex()} ahead of {e}'s receipt or gap"
        assert not any(h == g and e >= current for h, e in held), "a receipt at or above current_epoch"
    return groups


def once_each(home, before: list, signed: tuple = ()) -> None:
    """Nothing signed twice: the journal only appended to since the restore (``before``, its
    records then), no receipt intended or signed since except ``signed``, at most one statement
    released per gap, and every stored statement the journal's bytes."""
    records = parse_journal(str(home / service.JOURNAL_NAME))
    assert records[:len(before)] == before, "the journal changed below its tail"
    new = [(t, decode_identity(i), data) for t, i, data in records[len(before):]]
    assert [i for _t, i, _d in new if isinstance(i, ReceiptIdentity) and i not in signed] == [], "a receipt signed again"
    stated = {}
    for t, i, data in new:
        if t == 2 and isinstance(i, DiscontinuityIdentity):
            assert (i.group_id, i.epoch) not in stated, "two statements released for one gap"
            stated[(i.group_id, i.epoch)] = data
    conn = sqlite3.connect(str(home / service.DB_NAME))
    try:
        for g, e, raw in conn.execute("SELECT group_id, epoch, statement FROM statements"):
            assert stated.get((bytes(g), e)) == bytes(raw), "a stored statement the journal did not release"
    finally:
        conn.close()


def settled_epochs(epochs: dict) -> int:
    """Epochs the resumes settled so far, all groups together (from BACKUP_AT, gap groups from 0)."""
    return sum(e - (BACKUP_AT if g in GROUPS else 0) for g, e in epochs.items())


def test_faults_inside_the_batched_resume_leave_a_state_the_next_resume_completes(tmp_path, monkeypatch):
    home, got, gap_groups, before = rolled_back_home(tmp_path, monkeypatch, LAST, GAP_GROUPS)
    monkeypatch.setattr(seq_resume, "SETTLE_CHUNK", CHUNK)
    monkeypatch.setattr(seq_resume, "STATEMENT_BATCH", CHUNK)
    progress = []
    # after the 3rd settle transaction; after the 2nd (of the next resume); in the 2nd statement
    # batch between its intents and outputs (its 100 attempts spent); between a batch's
    # signatures (29 persisted, 71 attempts spent); after the 3rd batch stored (of 4 left)
    for point, hit in (("settled", 3), ("settled", 2), ("after_intent", 2), ("after_sign", 30), ("stated", 3)):
        with pytest.raises(Boom):
            service.Sequencer(home, fault_hook=raising_at(point, hit))
        epochs = check_state(home)
        once_each(home, before)
        progress.append(settled_epochs(epochs))
    # stopped inside the settlement, whole settle transactions each time, then in the statements
    assert progress == [3 * CHUNK, 5 * CHUNK, SETTLED, SETTLED, SETTLED], progress
    with service.Sequencer(home) as s:
        for g in GROUPS:
            st = s.store.group(g)
            assert st.current_epoch == LAST + 2 and st.discontinuities == (LAST + 1,)
            for e in range(BACKUP_AT, LAST + 1):
                assert s.receipt(g, e) == got[(g, e)]                 # adopted byte for byte
            stmt = receipts.verify_statement(s.receipt(g, LAST + 1).statement, s.public_key)
            assert (stmt.group_id, stmt.epoch) == (g, LAST + 1)
            assert stmt.previous_receipt_hash == receipts.receipt_hash(got[(g, LAST)])
        for g in gap_groups:
            st = s.store.group(g)
            assert st.current_epoch == 1 and st.discontinuities == (0,)
            stmt = receipts.verify_statement(s.receipt(g, 0).statement, s.public_key)
            assert (stmt.group_id, stmt.epoch) == (g, 0)
        nxt = s.submit(msg(GROUPS[0], LAST + 2))
        assert receipts.parse_receipt(nxt.receipt).previous_receipt_hash == receipts.receipt_hash(got[(GROUPS[0], LAST)])
    check_state(home)
    once_each(home, before, signed=(ReceiptIdentity(GROUPS[0], LAST + 2),))
    outs = [decode_identity(r[1]) for r in parse_journal(str(home / service.JOURNAL_NAME)) if r[0] == 2]
    attempts = [i.attempt for i in outs if isinstance(i, DiscontinuityIdentity)]
    assert len(attempts) == len(GROUPS) + GAP_GROUPS and max(attempts) == 2    # the 2nd batch cut twice


def test_negative_control_an_epoch_advanced_before_its_gaps_fails_the_check(tmp_path, monkeypatch):
    """A settlement that commits the epoch advance (with the adopted receipts) in one transaction
    and the gaps in a second (§22.5 cl. 3 violated) fails check_state after a fault between the
    two, at a gap's epoch."""
    home, _got, _gaps, _before = rolled_back_home(tmp_path, monkeypatch, 30, 8)
    real = Store.commit_settled

    def split(self, states, receipts_, gaps, events, pending_done, all_pending=False):
        real(self, states, receipts_, [], events, pending_done, all_pending)
        raise Boom("between the epoch advance and its gaps")
    monkeypatch.setattr(Store, "commit_settled", split)
    with pytest.raises(Boom):
        service.Sequencer(home)
    with pytest.raises(AssertionError, match=r"ahead of (0|31)'s receipt or gap"):
        check_state(home)
