"""A sequencer whose state (`sequencer.db`) was restored from a copy far behind its signing journal
resumes (§22.6 step 1) with work in proportion to what it does, not one transaction, one fsync and
one scan of `pending` per lost epoch (docs/sequencer.md "Resume: before anything is served").

Before: `_resume` settled the lost epochs one by one — each `_settle` read the whole `pending`
table and wrote its own SQLite transaction — and `_sign_statements` signed each statement of
absence through its own bridge call (durable intent, sign, durable output) and stored it in its own
transaction: a rollback past a compaction over N epochs cost ~2N SQLite commits, 2N journal fsyncs
and N scans of `pending` before anything was served. Counted here (SQLite COMMITs through the
trace callback, the journal's fsync counter, reads of `pending`), not timed.
"""
from __future__ import annotations

import shutil
from collections import Counter

from agent.sequencer import layout, receipts, service
from agent.sequencer.framing import encode_private_message
from bridge_helpers import parse_journal
from firmware_bridge import DiscontinuityIdentity, ReceiptIdentity, Status
from firmware_bridge.identity import decode_identity

GROUPS = [bytes([0xC0 + i]) * 16 for i in range(4)]
BACKUP_AT = 5          # the copy: every group at epoch 5
LAST = 604             # then every group through epoch 604: 599 epochs a group lost, 2 396 in all


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


def rolled_back_home(tmp_path, monkeypatch, last: int = LAST):
    """A home whose state is restored from a copy taken at epoch BACKUP_AT, while its journal,
    compacted since, holds each group's receipt of epoch ``last`` and a floor below it; returns
    the home and the receipts released after the copy."""
    monkeypatch.setattr(service, "JOURNAL_COMPACT_BYTES", 64 * 1024)
    home = tmp_path / "s"
    service.init(home)
    with service.Sequencer(home) as s:
        for g in GROUPS:
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
        s.compact_journal()
    for suffix in ("-wal", "-shm"):
        (home / (service.DB_NAME + suffix)).unlink(missing_ok=True)
    shutil.copy(tmp_path / "backup.db", home / service.DB_NAME)
    return home, got


def journal_outputs(home) -> list:
    return [(decode_identity(rec[1]), rec[2]) for rec in parse_journal(str(home / service.JOURNAL_NAME)) if rec[0] == 2]


def test_resume_after_a_deep_rollback_costs_a_bounded_number_of_commits(tmp_path, monkeypatch):
    home, got = rolled_back_home(tmp_path, monkeypatch)
    lost = len(GROUPS) * (LAST - BACKUP_AT)            # epochs stated absent: 2 396
    counts = count_state_work(monkeypatch)
    with service.Sequencer(home) as s:
        fsyncs = s.bridge.journal_stats()["fsyncs"]     # journal commits since it was opened
        work = dict(counts, journal_fsyncs=fsyncs)
        # the outcome is §22.6's, as before: the head adopted byte for byte, every older lost epoch
        # a stated gap with one signed statement, nothing signed a second time
        for g in GROUPS:
            st = s.store.group(g)
            assert st.current_epoch == LAST + 1
            assert st.discontinuities == tuple(range(BACKUP_AT, LAST))
            assert s.receipt(g, LAST) == got[(g, LAST)]
            for e in (BACKUP_AT, LAST // 2, LAST - 1):
                ans = s.receipt(g, e)
                assert ans.discontinuity
                stmt = receipts.verify_statement(ans.statement, s.public_key)
                assert (stmt.group_id, stmt.epoch, stmt.commit_hash) == (g, e, None)
                assert stmt.previous_receipt_hash == receipts.receipt_hash(s.receipt(g, BACKUP_AT - 1))
            assert s.bridge.status(ReceiptIdentity(g, LAST // 2)) is Status.OUTCOME_UNKNOWN
        assert len(s.store.statements()) == lost
        nxt = s.submit(msg(GROUPS[2], LAST + 1))
        assert receipts.parse_receipt(nxt.receipt).previous_receipt_hash == receipts.receipt_hash(got[(GROUPS[2], LAST)])
    outs = journal_outputs(home)
    stated = [i for i, _ in outs if isinstance(i, DiscontinuityIdentity)]
    assert len(stated) == len({(i.group_id, i.epoch) for i in stated}) == lost      # one statement a gap
    resigned = [i for i, _ in outs if isinstance(i, ReceiptIdentity) and i.epoch < LAST]
    assert resigned == []
    # The work: bounded whatever the depth of the rollback (2 396 epochs here). Before: one
    # transaction per lost epoch and one per statement (~4 800 commits), two journal fsyncs per
    # statement (~4 800), one read of `pending` per lost epoch (~2 400).
    print("resume work after a rollback over", lost, "epochs:", work)
    assert work["commits"] <= 12, work
    assert work["journal_fsyncs"] <= 2 * -(-lost // service.STATEMENT_BATCH) + 2, work
    assert work["journal_fsyncs"] <= 12, work
    assert work.get("pending_reads", 0) <= 1, work
