"""The sequencer's signing journal stays bounded by its groups, not by every receipt it ever signed
(docs/sequencer.md "Journal compaction"). Before, the journal kept every receipt in full and its
in-memory index one entry per receipt: ~350 bytes of disk and of memory per Commit, for ever
(200 000 Commits: 70 MB of journal, +69 MB resident, 0.7 s to open), so a long-lived sequencer on
a 512 MB device ran out of memory. Compaction keeps each group's last receipt in full and one
floor per group; the receipts table (SQLite) re-serves every older receipt byte for byte, and no
pair the journal forgot is ever signed again (§22.5 cl. 1-2)."""
from __future__ import annotations

import shutil

import pytest

from agent.sequencer import home as seq_home, receipts, service
from agent.sequencer.framing import encode_private_message
from bridge_helpers import parse_journal
from firmware_bridge import ReceiptIdentity, Status

GROUPS = [bytes([0xA0 + i]) * 16 for i in range(4)]


def msg(g: bytes, epoch: int, tag: bytes = b"") -> bytes:
    return encode_private_message(g, epoch, 3, ciphertext=b"c" * 32 + tag)


def run_epochs(s: service.Sequencer, first: int, last: int) -> dict:
    """Every group through epochs first..last, one submit_many per epoch; {(g, e): receipt}."""
    out = {}
    for e in range(first, last + 1):
        for g, ans in zip(GROUPS, s.submit_many([msg(g, e) for g in GROUPS])):
            assert isinstance(ans, service.Accepted), ans
            out[(g, e)] = ans.receipt
    return out


def outputs(home) -> list:
    return [rec for rec in parse_journal(str(home / "sign-journal")) if rec[0] == 2 and rec[1][:1] == b"R"]


def test_journal_holds_a_bounded_number_of_entries_and_every_receipt_is_reserved(tmp_path, monkeypatch):
    monkeypatch.setattr(seq_home, "JOURNAL_COMPACT_BYTES", 8 * 1024)
    home = tmp_path / "s"
    service.init(home)
    with service.Sequencer(home) as s:
        for g in GROUPS:
            s.register(g, 0)
        got = run_epochs(s, 0, 119)
        stats = s.bridge.journal_stats()
        assert stats["compactions"] >= 3
        # each group's last receipt in full, nothing older (the bound does not grow with epochs)
        assert stats["entries"] <= 2 * len(GROUPS), stats
        assert stats["bytes"] < 8 * 1024 + 4 * 1024, stats
        for (g, e), raw in got.items():
            assert s.receipt(g, e) == raw                         # byte for byte, from SQLite
            assert s.bridge.status(ReceiptIdentity(g, e)) is not Status.ABSENT   # never signable again
    with service.Sequencer(home) as s:                            # reopen: nothing to settle
        assert "rollback" not in [e["kind"] for e in s.store.events()]
        for g in GROUPS:
            assert s.store.group(g).current_epoch == 120 and not s.store.group(g).discontinuities
            stale = s.submit(msg(g, 119, b"late"))
            assert isinstance(stale, service.Rejected) and stale.head == got[(g, 119)]
        nxt = s.submit(msg(GROUPS[0], 120))
        assert receipts.parse_receipt(nxt.receipt).previous_receipt_hash == receipts.receipt_hash(got[(GROUPS[0], 119)])


def test_state_rolled_back_past_a_compaction_is_never_resigned(tmp_path, monkeypatch):
    """§22.6: the state restored from a copy older than the journal's floor. The newest receipt
    of each group is still in the journal (adopted byte for byte); the epochs the journal only
    remembers as spent are never signed a second time, nor stated absent (their receipts were
    released: tests/sequencer/test_restore_past_compaction.py), but named in `receipts_lost`."""
    rolled_back_past_a_compaction(tmp_path, monkeypatch)


def test_negative_control_a_journal_that_forgets_its_floor_resigns(tmp_path, monkeypatch):
    """The same history with the receipt floors ignored (a compacted pair reads as never signed):
    the checks above catch the second signing."""
    import dataclasses

    from firmware_bridge import journal
    state = journal.Journal._state_locked
    monkeypatch.setattr(journal.Journal, "_state_locked",
                        lambda self, ident: "absent" if (got := state(self, ident)) == "spent" else got)
    groups = journal.Journal.receipt_groups
    monkeypatch.setattr(journal.Journal, "receipt_groups",
                        lambda self: {g: dataclasses.replace(jg, floor=None) for g, jg in groups(self).items()})
    # the receipt witness outside the home is a second defence against the same rollback
    # (docs/sequencer.md "Receipt witness"): off here, so the journal's floor is what is tested
    from agent.sequencer import witness
    monkeypatch.setattr(witness.ReceiptWitness, "_read", lambda self: None)
    monkeypatch.setattr(witness.ReceiptWitness, "note", lambda self, raws: True)
    with pytest.raises(AssertionError, match="current_epoch"):   # the state stays behind: it would sign epoch 5 again
        rolled_back_past_a_compaction(tmp_path, monkeypatch)


def rolled_back_past_a_compaction(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(seq_home, "JOURNAL_COMPACT_BYTES", 4 * 1024)
    home = tmp_path / "s"
    service.init(home)
    with service.Sequencer(home) as s:
        for g in GROUPS:
            s.register(g, 0)
        run_epochs(s, 0, 4)
    shutil.copy(home / "sequencer.db", tmp_path / "backup.db")     # state at epoch 5
    with service.Sequencer(home) as s:
        got = run_epochs(s, 5, 60)
        assert s.bridge.journal_stats()["compactions"] >= 1
        s.compact_journal()          # and once more, so no receipt below each head stays in full
    assert {rec[1] for rec in outputs(home)} == {ReceiptIdentity(g, 60).encode() for g in GROUPS}
    for suffix in ("-wal", "-shm"):
        (home / ("sequencer.db" + suffix)).unlink(missing_ok=True)
    shutil.copy(tmp_path / "backup.db", home / "sequencer.db")
    with service.Sequencer(home) as s:
        for g in GROUPS:
            st = s.store.group(g)
            assert st.current_epoch == 61
            assert s.receipt(g, 60) == got[(g, 60)]                 # the head: adopted byte for byte
            assert st.discontinuities == ()                          # nothing stated absent
            assert s.receipt(g, 30) == service.Absent(discontinuity=False)
            assert isinstance(s.submit(msg(g, 30, b"again")), service.Rejected)
        kinds = [e["kind"] for e in s.store.events()]
        assert "rollback" in kinds and kinds.count("receipts_lost") == len(GROUPS)
        nxt = s.submit(msg(GROUPS[1], 61))
        assert receipts.parse_receipt(nxt.receipt).previous_receipt_hash == receipts.receipt_hash(got[(GROUPS[1], 60)])
    # the only receipt signed since: epoch 61 of one group (a re-signed epoch would be here)
    assert sorted(rec[1] for rec in outputs(home)) == sorted(
        [ReceiptIdentity(g, 60).encode() for g in GROUPS] + [ReceiptIdentity(GROUPS[1], 61).encode()])


def test_opening_a_compact_journal_does_not_rewrite_it(tmp_path):
    """Every CLI verb opens the sequencer: a journal that holds only each group's last receipt
    (nothing to drop) is left alone on open, however large; one with more entries than groups
    (receipts to drop) is compacted then."""
    home = tmp_path / "s"
    service.init(home)
    many = [i.to_bytes(2, "big") * 8 for i in range(300)]
    with service.Sequencer(home) as s:
        for g in many:
            s.register(g, 0)
        s.submit_many([msg(g, 0) for g in many])
        assert s.bridge.journal_stats()["bytes"] > seq_home.JOURNAL_OPEN_COMPACT_BYTES
    before = (home / "sign-journal").stat()
    with service.Sequencer(home) as s:
        assert s.bridge.journal_stats()["compactions"] == 0
    after = (home / "sign-journal").stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    with service.Sequencer(home) as s:
        s.submit_many([msg(g, 1) for g in many])      # now each group has one receipt to drop
    with service.Sequencer(home) as s:
        assert s.bridge.journal_stats()["compactions"] == 1
        assert s.bridge.journal_stats()["entries"] == len(many)


def test_a_malformed_receipt_floor_is_damage_not_a_floor(tmp_path):
    """Hostile journal bytes (a damaged medium, a tampered file): a FLOOR record whose identity is
    not a well-formed receipt or event identity (a discontinuity statement's, a receipt identity
    with a wrong length) is never taken as a floor: followed by valid records it is damage
    (JournalCorrupt, the file unchanged); as the last record it is a torn tail, cut off, and no
    identity reads spent because of it."""
    import zlib

    from firmware_bridge import JournalCorrupt
    from firmware_bridge.identity import DiscontinuityIdentity
    from firmware_bridge.journal import FLOOR, MAGIC, Journal, encode_floor, encode_intent

    def floor_of(ident: bytes) -> bytes:      # a FLOOR record framed and CRC'd, whatever its identity
        body = bytes([FLOOR]) + len(ident).to_bytes(2, "big") + ident
        return len(body).to_bytes(4, "big") + zlib.crc32(body).to_bytes(4, "big") + body

    good = ReceiptIdentity(GROUPS[0], 7).encode()
    bad = [DiscontinuityIdentity(GROUPS[0], 9, 0).encode(), good[:-1], good + b"\x00", b"R\x00\x10" + GROUPS[0]]
    for n, ident in enumerate(bad):
        path = tmp_path / f"j{n}"
        data = MAGIC + encode_floor(good) + floor_of(ident) + encode_intent(ReceiptIdentity(GROUPS[1], 1).encode(), "receipts")
        path.write_bytes(data)
        with pytest.raises(JournalCorrupt):
            Journal(str(path))
        assert path.read_bytes() == data
        path.write_bytes(MAGIC + encode_floor(good) + floor_of(ident))     # the same as the last record
        j = Journal(str(path))
        try:
            assert j.truncated_bytes == len(floor_of(ident))
            assert j.state(good) == "spent" and j.state(ReceiptIdentity(GROUPS[0], 8).encode()) == "absent"
            assert j.max_receipt_epoch(GROUPS[0]) == 7
        finally:
            j.close()


def test_compaction_waits_for_the_journal_to_grow_by_what_it_keeps(tmp_path, monkeypatch):
    """Each compaction rewrites every group's kept entries (~22 µs a group, 20 000 groups: 0.45 s),
    so compacting each time the journal grew a fixed amount made its cost per Commit grow with the
    groups (~19 µs a Commit at 20 000 groups, docs/sequencer.md "Journal compaction"). It now waits
    until the journal grew by as much as it keeps (at least JOURNAL_COMPACT_BYTES): here, 200
    groups keep ~80 KB against a 4 KiB step, and 20 rounds of their Commits made 76 compactions
    before; now about one a round, as the journal grows by its kept size each round. The journal
    stays within twice what it keeps plus the step."""
    step = 4 * 1024
    monkeypatch.setattr(seq_home, "JOURNAL_COMPACT_BYTES", step)
    groups = [i.to_bytes(16, "big") for i in range(200)]
    home = tmp_path / "s"
    service.init(home)
    with service.Sequencer(home) as s:
        for g in groups:
            s.register(g, 0)
        peak = 0
        for e in range(20):
            assert all(isinstance(a, service.Accepted) for a in s.submit_many([msg(g, e) for g in groups]))
            peak = max(peak, s.bridge.journal_stats()["bytes"])
        stats = s.bridge.journal_stats()
        kept = s.compact_journal()["bytes_after"]
    # a round appends a receipt a group, about what the journal keeps: a compaction a round at most
    # (76 before, one every 4 KiB)
    assert stats["compactions"] <= 20 + 3, (stats, kept)
    assert peak <= 2 * kept + step + 64 * 1024, (peak, kept)


def test_a_serving_process_collects_its_youngest_generation_less_often(tmp_path):
    """`sequencer run` sets pipeline.GC_THRESHOLDS when it starts serving (its Server), so the
    group commit's batches in flight are not walked by the collector every 700 allocations."""
    import gc
    from agent.sequencer import serve, service
    service.init(tmp_path / "seq")
    saved = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        with service.Sequencer(tmp_path / "seq") as seq:
            serve.Server(seq, serve.BrokerSettings("127.0.0.1", 1))   # nothing connects before start()
            assert gc.get_threshold() == service.GC_THRESHOLDS and service.GC_THRESHOLDS[0] > 700
    finally:
        gc.set_threshold(*saved)
