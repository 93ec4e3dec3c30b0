"""A sequencer whose state (`sequencer.db`) was restored from a copy far behind its signing journal
resumes (§22.6 step 1) with work in proportion to what it does, not one transaction, one fsync and
one scan of `pending` per lost epoch (docs/sequencer.md "Resume: before anything is served").

Before: `_resume` settled the lost epochs one by one — each `_settle` read the whole `pending`
table and wrote its own SQLite transaction — and `_sign_statements` signed each statement of
absence through its own bridge call (durable intent, sign, durable output) and stored it in its own
transaction: a rollback over N epochs with G gaps cost ~N + G SQLite commits, 2G journal fsyncs
and N scans of `pending` before anything was served. Counted here (SQLite COMMITs through the
trace callback, the journal's fsync counter, reads of `pending`), not timed.

The scenario: the journal is never compacted (no FLOOR record), so every lost epoch the journal
released is adopted byte for byte, and the gaps are real unknown outcomes — INTENT records without
output, appended to the journal while no sequencer holds the home (a crash between a signing
intent and its persisted bytes: §22.6 "epoch advanced, receipt absent"). Each such gap gets exactly
one signed statement of absence. A state restored past a compaction floor takes another path (its
compacted epochs had receipts released to members: they are not stated absent; docs/sequencer.md
"Resume"), which these tests must not depend on.
"""
from __future__ import annotations

import shutil
from collections import Counter

from agent.sequencer import home as seq_home, layout, receipts, resume as seq_resume, service
from agent.sequencer.framing import encode_private_message
from bridge_helpers import parse_journal
from firmware_bridge import DiscontinuityIdentity, ReceiptIdentity, Status
from firmware_bridge.identity import decode_identity
from firmware_bridge.journal import INTENT, Journal

GROUPS = [bytes([0xC0 + i]) * 16 for i in range(4)]
BACKUP_AT = 5          # the copy: every group at epoch 5
LAST = 804             # then every group through epoch 804: 800 receipts a group lost, 3 200 in all
GAP_GROUPS = 1024      # groups in the copy at epoch 0 whose epoch-0 signing intent has no output
NEVER = 2**40          # a journal compaction threshold never reached: the journal stays whole


def gap_group(i: int) -> bytes:
    return b"\xd0" + i.to_bytes(2, "big") + b"\x00" * 13       # sorted after GROUPS


def msg(g: bytes, epoch: int, tag: bytes = b"") -> bytes:
    return encode_private_message(g, epoch, 3, ciphertext=b"c" * 32 + tag)


def count_state_work(monkeypatch) -> Counter:
    """Count, on every `sequencer.db` connection opened from now on, the SQLite transactions
    committed (each one durable: WAL, synchronous=FULL) and the reads of `pending`."""
    counts: Counter = Counter()
    real = layout.open_file

    def open_file(path, lay, **kw):
        conn = real(path, lay, **kw)
        if str(path).endswith(service.DB_NAME):
            def trace(sql: str) -> None:
                words = sql.split()
                if words and words[0].upper() == "COMMIT":
                    counts["commits"] += 1
                elif words and words[0].upper() == "SELECT" and " pending" in sql:
                    counts["pending_reads"] += 1
            conn.set_trace_callback(trace)
        return conn
    monkeypatch.setattr(layout, "open_file", open_file)
    return counts


def add_unknown_outcomes(home, pairs) -> None:
    """Append a signing INTENT without output for each (group, epoch): a crash after the intent
    was durable and before the receipt was (§22.5 cl. 2: counts as signed, never signed again).
    Only while no sequencer holds the home (the journal's own lock refuses otherwise)."""
    j = Journal(str(home / service.JOURNAL_NAME))
    try:
        j.commit([(INTENT, ReceiptIdentity(g, e).encode(), service.RECEIPT_KEY) for g, e in pairs])
    finally:
        j.close()


def rolled_back_home(tmp_path, monkeypatch, last: int = LAST, gap_groups: int = GAP_GROUPS):
    """A home whose state is restored from a copy taken at epoch BACKUP_AT, while its journal, never
    compacted, holds every receipt released since (adopted on resume) and, as unknown outcomes
    (intent, no output): each group's epoch ``last`` + 1 and epoch 0 of ``gap_groups`` groups
    registered in the copy. Returns the home, the receipts released after the copy, the gap
    groups and the journal's records at the restore."""
    monkeypatch.setattr(seq_home, "JOURNAL_COMPACT_BYTES", NEVER)
    monkeypatch.setattr(seq_home, "JOURNAL_OPEN_COMPACT_BYTES", NEVER)
    home = tmp_path / "s"
    service.init(home)
    gaps = [gap_group(i) for i in range(gap_groups)]
    with service.Sequencer(home) as s:
        for g in GROUPS + gaps:
            s.register(g, 0)
        for e in range(BACKUP_AT):
            s.submit_many([msg(g, e) for g in GROUPS])
    shutil.copy(home / service.DB_NAME, tmp_path / "backup.db")
    got = {}
    with service.Sequencer(home) as s:
        for e in range(BACKUP_AT, last + 1):
            for g, ans in zip(GROUPS, s.submit_many([msg(g, e) for g in GROUPS])):
                assert isinstance(ans, service.Accepted), ans
                got[(g, e)] = ans.receipt
        assert s.bridge.journal_stats()["compactions"] == 0
    add_unknown_outcomes(home, [(g, last + 1) for g in GROUPS] + [(g, 0) for g in gaps])
    for suffix in ("-wal", "-shm"):
        (home / (service.DB_NAME + suffix)).unlink(missing_ok=True)
    shutil.copy(tmp_path / "backup.db", home / service.DB_NAME)
    records = parse_journal(str(home / service.JOURNAL_NAME))
    assert not [r for r in records if r[0] == 3], "a FLOOR record: the journal was compacted"
    return home, got, gaps, records


def test_resume_after_a_deep_rollback_costs_a_bounded_number_of_commits(tmp_path, monkeypatch):
    home, got, gap_groups, before = rolled_back_home(tmp_path, monkeypatch)
    adopted = len(GROUPS) * (LAST + 1 - BACKUP_AT)     # receipts adopted from the journal: 3 200
    expected_gaps = {(g, LAST + 1) for g in GROUPS} | {(g, 0) for g in gap_groups}
    gaps = len(expected_gaps)                          # unknown outcomes stated absent: 1 028
    settled = adopted + gaps                           # epochs settled against the journal: 4 228
    counts = count_state_work(monkeypatch)
    with service.Sequencer(home) as s:
        stats = s.bridge.journal_stats()
        work = dict(counts, journal_fsyncs=stats["fsyncs"])   # journal commits since it was opened
        assert stats["compactions"] == 0
        # the outcome is §22.6's: every released receipt adopted byte for byte, every unknown
        # outcome a stated gap with one signed statement, nothing signed a second time
        for g in GROUPS:
            st = s.store.group(g)
            assert st.current_epoch == LAST + 2
            assert st.discontinuities == (LAST + 1,)
            for e in range(BACKUP_AT, LAST + 1):
                assert s.receipt(g, e) == got[(g, e)]
            ans = s.receipt(g, LAST + 1)
            assert ans.discontinuity
            stmt = receipts.verify_statement(ans.statement, s.public_key)
            assert (stmt.group_id, stmt.epoch, stmt.commit_hash) == (g, LAST + 1, None)
            assert stmt.previous_receipt_hash == receipts.receipt_hash(got[(g, LAST)])
            assert s.bridge.status(ReceiptIdentity(g, LAST + 1)) is Status.OUTCOME_UNKNOWN
            assert s.bridge.status(ReceiptIdentity(g, LAST // 2)) is Status.RELEASED
        for g in gap_groups:
            st = s.store.group(g)
            assert (st.current_epoch, st.discontinuities) == (1, (0,))
        for g in (gap_groups[0], gap_groups[-1]):
            stmt = receipts.verify_statement(s.receipt(g, 0).statement, s.public_key)
            assert (stmt.group_id, stmt.epoch, stmt.previous_receipt_hash) == (g, 0, None)
        assert set(s.store.statements()) == expected_gaps
        nxt = s.submit(msg(GROUPS[2], LAST + 2))
        assert receipts.parse_receipt(nxt.receipt).previous_receipt_hash == receipts.receipt_hash(got[(GROUPS[2], LAST)])
    records = parse_journal(str(home / service.JOURNAL_NAME))
    assert records[:len(before)] == before and not [r for r in records if r[0] == 3]   # appended to, never compacted
    new = [(r[0], decode_identity(r[1])) for r in records[len(before):]]
    stated = [(i.group_id, i.epoch) for t, i in new if t == 2 and isinstance(i, DiscontinuityIdentity)]
    assert len(stated) == len(set(stated)) and set(stated) == expected_gaps      # one statement a gap
    signed = [i for t, i in new if isinstance(i, ReceiptIdentity)]
    assert signed == [ReceiptIdentity(GROUPS[2], LAST + 2)] * 2      # only the new Commit: its intent, its output
    # The work: one SQLite transaction per SETTLE_CHUNK epochs settled and one per batch of
    # STATEMENT_BATCH statements, two journal fsyncs per batch (its intents, its outputs), one read
    # of `pending`, whatever the depth of the rollback (4 228 epochs settled, 1 028 of them gaps).
    # Before: one transaction per settled epoch and one per statement (~5 300 commits), two
    # journal fsyncs per statement (~2 000), one read of `pending` per settled epoch (~4 200).
    settle_tx = -(-settled // seq_resume.SETTLE_CHUNK)           # 2
    batches = -(-gaps // seq_resume.STATEMENT_BATCH)             # 2
    print("resume work after a rollback over", settled, "epochs,", gaps, "gaps:", work)
    assert settle_tx == 2 and batches == 2, "the settlement and the statements must each take more than one batch"
    assert work["commits"] <= settle_tx + batches, work
    assert work["journal_fsyncs"] <= 2 * batches, work
    assert work.get("pending_reads", 0) <= 1, work
