"""A fault inside the batched resume after a rollback (§22.6 step 1, step 4; docs/sequencer.md
"Resume"): an exception raised after some of the settle transactions, inside a batch of
statements (its intents durable, no output) or after a batch was stored leaves a state the next
resume completes: the epoch never ahead of a durable receipt or stated gap, no receipt signed
again, one statement released per gap (the attempts of a batch cut between intent and output are
never signed again). In process, with the fault hook raising; the SIGKILL version is
test_sequencer_crash.py::test_rollback_resume_named_crash_points."""
from __future__ import annotations

import sqlite3

import pytest

from agent.sequencer import receipts, service
from agent.sequencer.store import Store
from firmware_bridge import DiscontinuityIdentity, ReceiptIdentity
from test_rollback_cost import BACKUP_AT, GROUPS, journal_outputs, msg, rolled_back_home

LAST = 204                    # 199 epochs a group lost, 796 in all
CHUNK = 100                   # epochs a settle transaction, statements a bridge call: 8 of each


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


def once_each(home) -> None:
    """Nothing signed twice: no receipt below each group's journal head signed since the copy,
    at most one statement released per gap."""
    outs = journal_outputs(home)
    assert [i for i, _ in outs if isinstance(i, ReceiptIdentity) and BACKUP_AT <= i.epoch < LAST] == []
    stated = [(i.group_id, i.epoch) for i, _ in outs if isinstance(i, DiscontinuityIdentity)]
    assert len(stated) == len(set(stated)), "two statements released for one gap"


def test_faults_inside_the_batched_resume_leave_a_state_the_next_resume_completes(tmp_path, monkeypatch):
    home, got = rolled_back_home(tmp_path, monkeypatch, LAST)
    monkeypatch.setattr(service, "SETTLE_CHUNK", CHUNK)
    monkeypatch.setattr(service, "STATEMENT_BATCH", CHUNK)
    progress = []
    # after the 3rd settle transaction; in the 2nd statement batch between its intents and
    # outputs (its 100 attempts spent); between a batch's signatures; after the 3rd batch stored
    for point, hit in (("settled", 3), ("settled", 2), ("after_intent", 2), ("after_sign", 30), ("stated", 3)):
        with pytest.raises(Boom):
            service.Sequencer(home, fault_hook=raising_at(point, hit))
        epochs = check_state(home)
        once_each(home)
        progress.append(sorted(epochs.values()))
    assert progress[0] != progress[1] and min(progress[0]) < LAST + 1     # stopped inside the settlement
    with service.Sequencer(home) as s:
        for g in GROUPS:
            st = s.store.group(g)
            assert st.current_epoch == LAST + 1 and st.discontinuities == tuple(range(BACKUP_AT, LAST))
            assert s.receipt(g, LAST) == got[(g, LAST)]
            for e in range(BACKUP_AT, LAST):
                stmt = receipts.verify_statement(s.receipt(g, e).statement, s.public_key)
                assert (stmt.group_id, stmt.epoch) == (g, e)
        nxt = s.submit(msg(GROUPS[0], LAST + 1))
        assert receipts.parse_receipt(nxt.receipt).previous_receipt_hash == receipts.receipt_hash(got[(GROUPS[0], LAST)])
    check_state(home)
    once_each(home)
    attempts = [i.attempt for i, _ in journal_outputs(home) if isinstance(i, DiscontinuityIdentity)]
    assert len(attempts) == len(GROUPS) * (LAST - BACKUP_AT) and max(attempts) >= 1


def test_negative_control_an_epoch_advanced_before_its_gaps_fails_the_check(tmp_path, monkeypatch):
    """A settlement that commits the epoch advance in one transaction and the gaps in a second
    (§22.5 cl. 3 violated) fails check_state after a fault between the two."""
    home, _got = rolled_back_home(tmp_path, monkeypatch, 30)
    real = Store.commit_settled

    def split(self, states, receipts_, gaps, events, pending_done, all_pending=False):
        real(self, states, [], [], [], [])
        raise Boom("between the epoch advance and its gaps")
    monkeypatch.setattr(Store, "commit_settled", split)
    with pytest.raises(Boom):
        service.Sequencer(home)
    with pytest.raises(AssertionError, match="ahead of"):
        check_state(home)
