"""SigningBridge and journal behaviour in one process (SOVM §22.5, docs/protocol.md §0 "Change events")."""
import os
import threading
import time

import pytest

from firmware_bridge import (EventIdentity, KeyExists, KeyNotFound, KeystoreError, OutcomeUnknown,
                             ReceiptIdentity, SigningBridge, Status, UnsupportedAlgorithm, open_keystore,
                             verify_ed25519, verify_p256)
from firmware_bridge.journal import INTENT, FileOps

from bridge_helpers import (assembler, cose_parts, event_payload, event_protected, parse_journal,
                            receipt_payload, receipt_protected, sig_structure)

SITE = bytes.fromhex("00112233445566778899aabbccddeeff")
GROUP = b"group-0001"


@pytest.fixture
def env(tmp_path):
    ks = open_keystore({"kind": "software", "dir": str(tmp_path / "keys")})
    ev_pub = ks.generate_key("site", "ed25519")
    rc_pub = ks.generate_key("seq", "p256")
    bridge = SigningBridge(ks, str(tmp_path / "journal"))
    yield ks, bridge, ev_pub, rc_pub, tmp_path
    bridge.close()


def ev_item(p, l, v=0):
    prot, pay = event_protected(SITE), event_payload(p, l, v)
    return EventIdentity(SITE, p, l), "site", sig_structure(prot, pay), assembler(prot, pay)


def rc_item(ks, epoch, prev=None):
    prot = receipt_protected(ks.public_key("seq"))
    pay = receipt_payload(GROUP, epoch, bytes(32), prev)
    return ReceiptIdentity(GROUP, epoch), "seq", sig_structure(prot, pay), assembler(prot, pay)


def test_key_files_are_0600_and_never_overwritten(env):
    ks, _, _, _, tmp = env
    for name in ("site", "seq"):
        assert os.stat(tmp / "keys" / f"{name}.key").st_mode & 0o777 == 0o600
    with pytest.raises(KeyExists):
        ks.generate_key("site", "ed25519")
    assert len(ks.public_key("seq")) == 33 and ks.public_key("seq")[0] in (2, 3)
    assert "secret" not in repr(ks.describe()) and ks.describe()["keys"] == {"seq": "p256", "site": "ed25519"}


def test_group_readable_key_file_refused(tmp_path):
    ks = open_keystore({"kind": "software", "dir": str(tmp_path)})
    ks.generate_key("k", "ed25519")
    os.chmod(tmp_path / "k.key", 0o644)
    with pytest.raises(KeystoreError, match="chmod 600"):
        open_keystore({"kind": "software", "dir": str(tmp_path)}).public_key("k")


def test_release_signs_persists_and_retransmits_exact_bytes(env):
    ks, bridge, ev_pub, rc_pub, tmp = env
    ident, key, tbs, asm = ev_item(1000, 0)
    out = bridge.release(ident, key, tbs, asm)
    prot, pay, sig = cose_parts(out)
    assert verify_ed25519(ev_pub, sig_structure(prot, pay), sig)
    # a second request, even with other tbs, returns exactly the persisted bytes
    assert bridge.release(ident, key, b"different", asm) == out
    assert bridge.released(ident) == out
    recs = parse_journal(str(tmp / "journal"))
    assert [r[0] for r in recs] == [1, 2] and recs[1][2] == out
    r_ident, r_key, r_tbs, r_asm = rc_item(ks, 0)
    rout = bridge.release(r_ident, r_key, r_tbs, r_asm)
    prot, pay, sig = cose_parts(rout)
    assert verify_p256(rc_pub, sig_structure(prot, pay), sig)
    assert bridge.release(r_ident, r_key, r_tbs, r_asm) == rout


def test_unknown_outcome_is_never_resigned(env):
    ks, bridge, *_ , tmp = env
    e = EventIdentity(SITE, 5, 5)
    r = ReceiptIdentity(GROUP, 7)
    # simulate a crash between intent and persist: the intent alone is in the journal
    bridge._journal.commit([(INTENT, e.encode(), "site"), (INTENT, r.encode(), "seq")])
    bridge.close()
    bridge2 = SigningBridge(ks, str(tmp / "journal"))
    assert bridge2.status(e) is Status.OUTCOME_UNKNOWN
    with pytest.raises(OutcomeUnknown, match="tick the HLC"):
        bridge2.release(*ev_item(5, 5))
    with pytest.raises(OutcomeUnknown, match="§22.6"):
        bridge2.release(*rc_item(ks, 7))
    assert bridge2.max_event_hlc(SITE) == (5, 5) and bridge2.max_receipt_epoch(GROUP) == 7
    assert bridge2.released(r) is None
    bridge2.close()


def test_key_problems_burn_nothing(env):
    ks, bridge, *_ = env
    ident, _, tbs, asm = ev_item(9, 0)
    with pytest.raises(KeyNotFound, match="generate it first"):
        bridge.release(ident, "nokey", tbs, asm)
    with pytest.raises(UnsupportedAlgorithm):
        bridge.release(ident, "seq", tbs, asm)
    assert bridge.status(ident) is Status.ABSENT
    assert bridge.release(ident, "site", tbs, asm)


def test_release_many_uses_two_fsyncs_and_mixes_in_persisted(env):
    ks, bridge, *_ = env
    first = bridge.release(*ev_item(1, 0))
    before = bridge._journal.fsyncs
    items = [ev_item(1, 0)] + [ev_item(2, k, k) for k in range(100)]
    outs = bridge.release_many(items)
    assert bridge._journal.fsyncs - before == 2
    assert outs[0] == first and len(set(outs)) == 101
    listed = list(bridge.iter_released())
    assert [o for _, o in listed] == [first] + outs[1:]
    assert listed[1][0] == EventIdentity(SITE, 2, 0)
    with pytest.raises(ValueError):
        bridge.release_many([ev_item(3, 0), ev_item(3, 0)])


def test_failure_mid_batch_persists_signed_ones_and_burns_the_rest(env):
    ks, bridge, *_ = env
    items = [ev_item(4, k) for k in range(5)]
    ident, key, tbs, _ = items[3]

    def boom(sig):
        raise RuntimeError("encoder bug")
    items[3] = (ident, key, tbs, boom)
    with pytest.raises(RuntimeError):
        bridge.release_many(items)
    assert [bridge.status(i[0]) for i in items] == [Status.RELEASED] * 3 + [Status.OUTCOME_UNKNOWN] * 2


class SlowFsync(FileOps):
    """A 3 ms fsync (an SD card is slower): concurrent callers must pile up behind one leader."""

    def fsync(self, fd):
        os.fsync(fd)
        time.sleep(0.003)


def test_concurrent_releases_share_fsyncs(tmp_path):
    ks = open_keystore({"kind": "software", "dir": str(tmp_path / "keys")})
    ks.generate_key("site", "ed25519")
    bridge = SigningBridge(ks, str(tmp_path / "j"), file_ops=SlowFsync())
    n_threads, per = 8, 25
    outs: dict = {}

    def work(t):
        for k in range(per):
            it = ev_item(100 + t, k)
            outs[it[0]] = bridge.release(*it)
    before = bridge._journal.fsyncs
    th = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    assert len(outs) == n_threads * per
    assert all(bridge.released(i) == o for i, o in outs.items())
    # one release alone costs 2 fsyncs; leader/follower makes 8 threads share them
    assert bridge._journal.fsyncs - before < 2 * n_threads * per / 3
    bridge.close()


def test_same_identity_from_two_threads_signs_once(env):
    ks, bridge, *_ = env
    results = []
    barrier = threading.Barrier(6)

    def work():
        barrier.wait()
        results.append(bridge.release(*rc_item(ks, 42)))
    th = [threading.Thread(target=work) for _ in range(6)]
    for t in th:
        t.start()
    for t in th:
        t.join()
    assert len(results) == 6 and len(set(results)) == 1
    assert sum(1 for r in parse_journal(str(bridge._journal.path)) if r[0] == 2) == 1


def test_journal_is_exclusive(env):
    ks, bridge, *_, tmp = env
    with pytest.raises(KeystoreError, match="in use"):
        SigningBridge(ks, str(tmp / "journal"))


def test_torn_tail_is_truncated_and_earlier_records_survive(env):
    ks, bridge, *_, tmp = env
    outs = bridge.release_many([ev_item(7, k) for k in range(10)])
    bridge.close()
    path = tmp / "journal"
    good = path.read_bytes()
    for cut in (1, 7, 30):
        path.write_bytes(good + good[-60:-cut])  # a partial record after the durable ones
        b = SigningBridge(ks, str(path))
        assert b._journal.truncated_bytes == 60 - cut
        assert [b.released(ev_item(7, k)[0]) for k in range(10)] == outs
        b.close()
        assert path.read_bytes() == good


def _record_offsets(data: bytes) -> list[int]:
    """Start offsets of every record in a journal file (docs/keystore.md "Journal format")."""
    import struct
    pos, out = 8, []
    while pos + 8 <= len(data):
        out.append(pos)
        pos += 8 + struct.unpack_from(">I", data, pos)[0]
    return out


@pytest.mark.parametrize("where", ["crc", "length", "zeroed"])
def test_damage_followed_by_valid_records_is_refused_not_truncated(env, where):
    """A bad record with valid records after it is damage to durable data, not a
    torn tail (a torn tail holds only bytes no completed fsync covered, so nothing valid follows
    it). Truncating there would silently drop every later record (3 of 3 released outputs lost):
    the journal refuses to open, names the damage and changes nothing."""
    from firmware_bridge import JournalCorrupt, JournalError
    ks, bridge, *_, tmp = env
    bridge.release_many([ev_item(7, k) for k in range(3)])   # intents, then outputs, two commits
    bridge.release_many([ev_item(8, k) for k in range(3)])
    bridge.close()
    path = tmp / "journal"
    good = path.read_bytes()
    at = _record_offsets(good)[1]          # the second intent of the first batch
    bad = bytearray(good)
    if where == "crc":
        bad[at + 20] ^= 0x01               # one flipped bit in the body
    elif where == "length":
        bad[at:at + 4] = (2**23).to_bytes(4, "big")   # a length pointing past the end
    else:
        bad[at:at + 48] = bytes(48)        # a zeroed block
    path.write_bytes(bytes(bad))
    with pytest.raises(JournalCorrupt) as ei:
        SigningBridge(ks, str(path))
    assert isinstance(ei.value, JournalError)
    msg = str(ei.value)
    assert "\n" not in msg and f"byte {at}" in msg and "released output" in msg
    assert path.read_bytes() == bytes(bad)   # nothing truncated, nothing rewritten
    path.write_bytes(good)                   # the undamaged file opens as before
    SigningBridge(ks, str(path)).close()


def test_bad_last_record_is_a_torn_tail(env):
    """A complete-length but CRC-failing last record, or garbage to the end: a torn tail (power
    loss may leave unsynced blocks zeroed); truncated as before."""
    ks, bridge, *_, tmp = env
    outs = bridge.release_many([ev_item(7, k) for k in range(4)])
    bridge.close()
    path = tmp / "journal"
    good = path.read_bytes()
    last = _record_offsets(good)[-1]
    for tail in (bytes(len(good) - last), b"\xff" * 5 + bytes(len(good) - last - 5)):
        path.write_bytes(good[:last] + tail)
        b = SigningBridge(ks, str(path))
        assert b._journal.truncated_bytes == len(good) - last
        assert [b.released(ev_item(7, k)[0]) for k in range(3)] == outs[:3]
        assert b.released(ev_item(7, 3)[0]) is None
        b.close()


def test_not_a_journal_is_refused(tmp_path):
    ks = open_keystore({"kind": "software", "dir": str(tmp_path / "k")})
    (tmp_path / "j").write_bytes(b"something else entirely")
    with pytest.raises(KeystoreError, match="bad magic"):
        SigningBridge(ks, str(tmp_path / "j"))


def test_open_keystore_rejects_unknown_kind():
    with pytest.raises(KeystoreError, match="software, pkcs11 or serial"):
        open_keystore({"kind": "tpm"})


def test_no_public_raw_signing():
    from firmware_bridge.keystore import Keystore
    public = [n for n in dir(Keystore) if not n.startswith("_")]
    assert not any("sign" in n for n in public), public
    public_bridge = [n for n in dir(SigningBridge) if not n.startswith("_")]
    assert set(public_bridge) == {"release", "release_many", "release_pipelined", "released", "iter_released", "status", "max_event_hlc",
                                  "max_receipt_epoch", "keystore", "describe", "close", "compact_events", "compact_receipts",
                                  "journal_stats", "public_key", "receipt_groups", "event_gap", "open_event_gap"}


def test_parallel_software_signing_gives_the_sequential_bytes(tmp_path):
    """A big group commit is signed on worker threads (software Ed25519): every output must be the
    one the one-thread path produces (deterministic Ed25519) and verify; P-256 stays sequential."""
    outs = {}
    for threads in (1, 3):
        ks = open_keystore({"kind": "software", "dir": str(tmp_path / "keys")})
        ks._threads = threads
        if threads == 1:
            ks.generate_key("site", "ed25519")
            ks.generate_key("seq", "p256")
        with SigningBridge(ks, str(tmp_path / f"journal-{threads}")) as bridge:
            items = [ev_item(7, k, k) for k in range(200)]
            outs[threads] = bridge.release_many(items)
            rcs = bridge.release_many([rc_item(ks, e) for e in range(1, 70)])
            assert all(verify_p256(ks.public_key("seq"), sig_structure(*cose_parts(o)[:2]), cose_parts(o)[2])
                       for o in rcs)
        if threads > 1:
            assert ks._pool is not None, "the parallel path was not taken"
        ks.close()
        assert ks._pool is None
    assert outs[1] == outs[3]
    pub = open_keystore({"kind": "software", "dir": str(tmp_path / "keys")}).public_key("site")
    for o in outs[3]:
        prot, pay, sig = cose_parts(o)
        assert verify_ed25519(pub, sig_structure(prot, pay), sig)


def test_parallel_signing_failure_keeps_a_prefix(tmp_path):
    """A worker chunk that fails: only a prefix is persisted, the rest stays an unknown outcome."""
    import firmware_bridge.software as sw_mod
    ks = open_keystore({"kind": "software", "dir": str(tmp_path / "keys")})
    ks.generate_key("site", "ed25519")
    ks._threads = 2
    real = sw_mod._sign_chunk
    items = [ev_item(9, k) for k in range(100)]
    calls = []

    def flaky(keys, datas):   # the second chunk (items 50..99) fails, on whichever thread runs it
        calls.append(len(datas))
        if datas[0] == items[50][2]:
            raise RuntimeError("worker fault")
        return real(keys, datas)
    sw_mod._sign_chunk = flaky
    try:
        with SigningBridge(ks, str(tmp_path / "journal")) as bridge:
            with pytest.raises(RuntimeError):
                bridge.release_many(items)
            states = [bridge.status(i[0]) for i in items]
    finally:
        sw_mod._sign_chunk = real
        ks.close()
    assert calls == [50, 50]
    assert states == [Status.RELEASED] * 50 + [Status.OUTCOME_UNKNOWN] * 50


class FullDiskOnce(FileOps):
    """write() refused with ENOSPC once, after writing part of the buffer (a filesystem filling up
    in the middle of a record): nothing reached the platter that an fsync covered."""

    def __init__(self):
        self.armed = False

    def write(self, fd, data):
        if self.armed:
            self.armed = False
            os.write(fd, data[: len(data) // 2])
            raise OSError(28, "No space left on device")
        super().write(fd, data)


def test_a_full_disk_on_append_fails_that_release_only(tmp_path):
    """A journal append refused for want of space (ENOSPC from write(), not a failed fsync) used to
    poison the journal for the life of the process: `run` could not sign again after the disk was
    freed, nor compact its journal in the eviction that frees it. The partial record is cut off and
    that release fails; the journal goes on, and a reopen finds no torn tail."""
    ks = open_keystore({"kind": "software", "dir": str(tmp_path / "keys")})
    ks.generate_key("site", "ed25519")
    ops = FullDiskOnce()
    bridge = SigningBridge(ks, str(tmp_path / "j"), file_ops=ops)
    first = bridge.release(*ev_item(1, 0))
    ops.armed = True
    with pytest.raises(KeystoreError) as e:
        bridge.release(*ev_item(2, 0))
    cause = e.value.__cause__
    assert isinstance(cause, OSError) and cause.errno == 28
    after = bridge.release(*ev_item(3, 0))      # not poisoned
    bridge.compact_events(lambda ident: False)  # nor is the eviction's compaction
    bridge.close()
    reopened = SigningBridge(ks, str(tmp_path / "j"))
    assert reopened._journal.truncated_bytes == 0
    assert reopened.released(EventIdentity(SITE, 1, 0)) == first
    assert reopened.released(EventIdentity(SITE, 3, 0)) == after
    reopened.close()


def test_intended_runs_once_the_intents_are_durable_and_before_signing(env, monkeypatch):
    """release_many's `intended`: called after the batch's intent commit and before its first
    signature; not called when nothing is signed (every identity released already)."""
    ks, bridge, _, _, _ = env
    steps = []
    real_commit, real_many = bridge._journal.commit, ks._sign_many
    monkeypatch.setattr(bridge._journal, "commit", lambda recs: steps.append(
        "intents" if list(recs)[0][0] == INTENT else "outputs") or real_commit(recs))
    monkeypatch.setattr(ks, "_sign_many", lambda reqs: steps.append("sign") or real_many(reqs))
    items = [ev_item(1_000, i) for i in range(3)]
    outs = bridge.release_many(items, lambda: steps.append("intended"))
    assert steps == ["intents", "intended", "sign", "outputs"]
    steps.clear()
    assert bridge.release_many(items, lambda: steps.append("intended")) == outs and steps == []
