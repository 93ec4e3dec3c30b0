"""The sequencer service on real SQLite and a real software keystore + bridge journal."""
from __future__ import annotations

import shutil

import pytest

from firmware_bridge.identity import decode_identity
from agent.sequencer import receipts, service
from agent.sequencer.framing import CT_PROPOSAL, encode_private_message
from bridge_helpers import parse_journal

G = bytes.fromhex("b2" * 16)


def msg(epoch, tag=b"", gid=G, ct=3):
    return encode_private_message(gid, epoch, ct, ciphertext=b"c" * 32 + tag)


def test_first_commit_wins_and_the_stale_sender_gets_the_canonical_head(seq):
    seq.register(G, 10)
    a = seq.submit(msg(10, b"alice"))
    b = seq.submit(msg(10, b"bob"))
    assert isinstance(a, service.Accepted) and a.epoch == 10
    assert isinstance(b, service.Rejected) and b.reason == "stale_epoch"
    assert b.current_epoch == 11 and b.head == a.receipt
    assert seq.commit(G, 10) == msg(10, b"alice")          # what the loser processes before rebuilding
    c = seq.submit(msg(11, b"bob-rebuilt"))
    assert isinstance(c, service.Accepted)
    assert receipts.parse_receipt(c.receipt).previous_receipt_hash == receipts.receipt_hash(a.receipt)


def test_register_known_group_refused(seq):
    seq.register(G, 0)
    with pytest.raises(service.SequencerRefused):
        seq.register(G, 3)


def test_refusals_change_nothing(seq):
    seq.register(G, 2)
    for m, reason in [(msg(1), "stale_epoch"), (msg(3), "future_epoch"), (msg(2, ct=CT_PROPOSAL), "not_commit"),
                      (b"\x00\x01\x00\x02junk", "unparseable")]:
        r = seq.submit(m)
        assert isinstance(r, service.Rejected) and r.reason == reason
    assert seq.store.group(G).current_epoch == 2 and seq.store.receipt(G, 2) is None
    assert seq.bridge.max_receipt_epoch(G) is None


def test_bootstrap_by_first_commit_observed(seq):
    other = bytes.fromhex("c3" * 8)
    p = seq.submit(msg(4, gid=other, ct=CT_PROPOSAL))
    assert isinstance(p, service.Rejected) and p.current_epoch is None
    a = seq.submit(msg(4, gid=other))
    assert isinstance(a, service.Accepted) and receipts.parse_receipt(a.receipt).previous_receipt_hash is None
    assert seq.store.group(other).origin == "bootstrap" and seq.store.group(other).current_epoch == 5


def test_receipts_reserved_byte_for_byte_after_reopen(tmp_path):
    home = tmp_path / "s"
    service.init(home)
    with service.Sequencer(home) as s:
        s.register(G, 0)
        got = [s.submit(msg(e)).receipt for e in range(5)]
    with service.Sequencer(home) as s:
        assert [s.receipt(G, e) for e in range(5)] == got
        assert s.receipt(G, 5) == service.Absent(discontinuity=False)
        assert s.store.group(G).current_epoch == 5


def test_init_refuses_an_existing_home(tmp_path):
    service.init(tmp_path / "s")
    with pytest.raises(service.SequencerRefused):
        service.init(tmp_path / "s")


def test_store_rolled_back_is_detected_and_never_resigned(tmp_path):
    """§22.6: the state database restored from an older copy while the journal survived. Receipts
    the journal holds are adopted byte for byte, nothing is signed twice, and the old epochs stay
    closed to competing Commits."""
    home = tmp_path / "s"
    service.init(home)
    with service.Sequencer(home) as s:
        s.register(G, 0)
        s.submit(msg(0))
    shutil.copy(home / "sequencer.db", tmp_path / "backup.db")
    with service.Sequencer(home) as s:
        released = [s.submit(msg(e)).receipt for e in (1, 2, 3)]
    for suffix in ("-wal", "-shm"):
        (home / ("sequencer.db" + suffix)).unlink(missing_ok=True)
    shutil.copy(tmp_path / "backup.db", home / "sequencer.db")
    with service.Sequencer(home) as s:
        assert [e["kind"] for e in s.store.events()] == ["rollback"]
        assert s.store.group(G).current_epoch == 4
        assert [s.receipt(G, e) for e in (1, 2, 3)] == released
        r = s.submit(msg(2, b"competitor"))
        assert isinstance(r, service.Rejected) and r.reason == "stale_epoch"
        assert isinstance(s.submit(msg(4)), service.Accepted)
    outputs = {}
    for rec in parse_journal(str(home / "sign-journal")):
        if rec[0] == 2:
            assert rec[1] not in outputs, "two receipts for one (group, epoch)"
            outputs[rec[1]] = rec[2]
    assert len(outputs) == 5


def test_intent_without_receipt_is_a_discontinuity_never_resigned(tmp_path):
    """§22.6 'epoch advanced, receipt absent': an intent the bridge recorded for a pending
    acceptance, with no output (the crash between intent and persist)."""
    from firmware_bridge.journal import INTENT
    from firmware_bridge import ReceiptIdentity
    home = tmp_path / "s"
    service.init(home)
    with service.Sequencer(home) as s:
        s.register(G, 0)
        r0 = s.submit(msg(0)).receipt
        s.store.put_pending(G, 1, receipts.commit_hash(msg(1)), msg(1), False)
        s.bridge._journal.commit([(INTENT, ReceiptIdentity(G, 1).encode(), service.RECEIPT_KEY)])
    with service.Sequencer(home) as s:
        st = s.store.group(G)
        assert st.current_epoch == 2 and st.discontinuities == (1,)
        assert s.receipt(G, 1) == service.Absent(discontinuity=True)
        assert s.commit(G, 1) == msg(1)                     # the canonical Commit is still forwarded
        a = s.submit(msg(2))
        assert receipts.parse_receipt(a.receipt).previous_receipt_hash == receipts.receipt_hash(r0)
        assert isinstance(s.submit(msg(1, b"other")), service.Rejected)


def test_rollback_over_an_intent_without_receipt_takes_the_discontinuity_path(tmp_path):
    """§22.6: state restored from an older copy; the journal holds receipts for some of the lost
    epochs and only an intent for the last one (a crash between intent and persist after the
    copy was taken). Receipts are adopted byte for byte; the intent-only epoch becomes a recorded
    discontinuity, answered with a stated absence, never signed; the chain continues across it."""
    from firmware_bridge import ReceiptIdentity
    from firmware_bridge.journal import INTENT
    home = tmp_path / "s"
    service.init(home)
    with service.Sequencer(home) as s:
        s.register(G, 0)
        s.submit(msg(0))
    shutil.copy(home / "sequencer.db", tmp_path / "backup.db")
    with service.Sequencer(home) as s:
        released = [s.submit(msg(e)).receipt for e in (1, 2)]
        s.bridge._journal.commit([(INTENT, ReceiptIdentity(G, 3).encode(), service.RECEIPT_KEY)])
    for suffix in ("-wal", "-shm"):
        (home / ("sequencer.db" + suffix)).unlink(missing_ok=True)
    shutil.copy(tmp_path / "backup.db", home / "sequencer.db")
    with service.Sequencer(home) as s:
        st = s.store.group(G)
        assert st.current_epoch == 4 and st.discontinuities == (3,)
        assert [s.receipt(G, e) for e in (1, 2)] == released
        assert s.receipt(G, 3) == service.Absent(discontinuity=True)
        assert isinstance(s.submit(msg(3, b"x")), service.Rejected)
        nxt = s.submit(msg(4)).receipt
        assert receipts.parse_receipt(nxt).previous_receipt_hash == receipts.receipt_hash(released[1])
        kinds = [e["kind"] for e in s.store.events()]
        assert "rollback" in kinds and "discontinuity" in kinds
    outputs = [rec for rec in parse_journal(str(home / "sign-journal")) if rec[0] == 2 and rec[1][:1] == b"R"]
    assert len(outputs) == len({rec[1] for rec in outputs}) == 4     # 0, 1, 2, 4: epoch 3 never signed


def test_a_recorded_gap_gets_one_signed_statement_persisted_before_release_and_never_resigned(tmp_path):
    """§22.6 step 4: the gap is stated in a statement signed by the sequencer (through the bridge:
    durable intent, sign, durable bytes) so members can relay it; re-served byte for byte after a
    restart, never signed again; a statement whose first signing has an intent and no output is
    signed under the next attempt with the same payload, and only one is ever released."""
    from firmware_bridge import DiscontinuityIdentity, ReceiptIdentity
    from firmware_bridge.journal import INTENT
    home = tmp_path / "s"
    service.init(home)
    with service.Sequencer(home) as s:
        s.register(G, 0)
        r0 = s.submit(msg(0)).receipt
        for e in (1, 2):
            s.store.put_pending(G, e, receipts.commit_hash(msg(e)), msg(e), False)
        s.bridge._journal.commit([(INTENT, ReceiptIdentity(G, 1).encode(), service.RECEIPT_KEY),
                                  (INTENT, ReceiptIdentity(G, 2).encode(), service.RECEIPT_KEY),
                                  # the statement for epoch 2 was intended and never persisted
                                  (INTENT, DiscontinuityIdentity(G, 2, 0).encode(), service.RECEIPT_KEY)])
        key = s.public_key
    with service.Sequencer(home) as s:
        assert s.store.group(G).discontinuities == (1, 2)
        got = {e: s.receipt(G, e).statement for e in (1, 2)}
        for e, raw in got.items():
            st = receipts.verify_statement(raw, key)
            assert (st.group_id, st.epoch, st.commit_hash) == (G, e, receipts.commit_hash(msg(e)))
            assert st.previous_receipt_hash == receipts.receipt_hash(r0)    # the last receipt before the gap
        assert s.status()["groups"][0]["statements"] == {"1": got[1].hex(), "2": got[2].hex()}
        with pytest.raises(receipts.ReceiptError):
            receipts.verify_receipt(got[1])        # a statement is never taken for a receipt
    with service.Sequencer(home) as s:             # re-served byte for byte, nothing signed again
        assert {e: s.receipt(G, e).statement for e in (1, 2)} == got
    outputs = [(decode_identity(rec[1]), rec[2]) for rec in parse_journal(str(home / "sign-journal")) if rec[0] == 2]
    stated = [(i, raw) for i, raw in outputs if isinstance(i, DiscontinuityIdentity)]
    assert sorted((i.epoch, i.attempt) for i, _ in stated) == [(1, 0), (2, 1)]
    assert {i.epoch: raw for i, raw in stated} == got


def test_a_statement_released_but_not_stored_is_adopted_from_the_journal(tmp_path):
    """A crash after the bridge persisted the statement and before the state stored it: the
    journal's bytes are adopted, never a second signature (randomised on a token)."""
    from firmware_bridge import DiscontinuityIdentity, ReceiptIdentity
    from firmware_bridge.journal import INTENT
    home = tmp_path / "s"
    service.init(home)
    with service.Sequencer(home) as s:
        s.register(G, 0)
        s.submit(msg(0))
        s.store.put_pending(G, 1, receipts.commit_hash(msg(1)), msg(1), False)
        s.bridge._journal.commit([(INTENT, ReceiptIdentity(G, 1).encode(), service.RECEIPT_KEY)])
    with service.Sequencer(home) as s:
        first = s.receipt(G, 1).statement
        s.store.conn.execute("DELETE FROM statements")        # the state write that never happened
    with service.Sequencer(home) as s:
        assert s.receipt(G, 1).statement == first
    outputs = [rec for rec in parse_journal(str(home / "sign-journal")) if rec[0] == 2 and rec[1][:1] == b"D"]
    assert [decode_identity(rec[1]) for rec in outputs] == [DiscontinuityIdentity(G, 1, 0)]


@pytest.mark.parametrize("kind", ["softhsm", "serial"])
def test_gap_statements_are_signed_inside_a_token_or_the_serial_device(tmp_path, request, kind):
    """The statement of a gap goes through the keystore like a receipt: a SoftHSM2 token
    (randomised ECDSA: the journal's bytes are what is re-served) or the serial device, which
    counts statements under their own identity (never refused as a receipt it already signed)."""
    from firmware_bridge import ReceiptIdentity
    from firmware_bridge.journal import INTENT
    conf = request.getfixturevalue("softhsm_conf" if kind == "softhsm" else "serial_conf")
    home = tmp_path / "s"
    key = service.init(home, conf)
    with service.Sequencer(home) as s:
        s.register(G, 0)
        r0 = s.submit(msg(0)).receipt
        s.store.put_pending(G, 1, receipts.commit_hash(msg(1)), msg(1), False)
        s.bridge._journal.commit([(INTENT, ReceiptIdentity(G, 1).encode(), service.RECEIPT_KEY)])
    with service.Sequencer(home) as s:
        stmt = s.receipt(G, 1).statement
        st = receipts.verify_statement(stmt, key)
        assert (st.epoch, st.previous_receipt_hash) == (1, receipts.receipt_hash(r0))
        r2 = s.submit(msg(2)).receipt                      # the device goes on signing receipts
        assert receipts.parse_receipt(r2).previous_receipt_hash == receipts.receipt_hash(r0)
    with service.Sequencer(home) as s:
        assert s.receipt(G, 1).statement == stmt
