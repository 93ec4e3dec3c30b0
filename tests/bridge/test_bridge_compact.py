"""Journal compaction (docs/keystore.md "Compaction"): receipts kept in full, released events the
caller has recorded replaced by a per-site FLOOR, identities at or below it spent for ever."""
import os
import threading
import time

import pytest

from firmware_bridge import EventIdentity, OutcomeUnknown, ReceiptIdentity, SigningBridge, Status, open_keystore

from bridge_helpers import (assembler, event_payload, event_protected, parse_journal, receipt_payload,
                            receipt_protected, sig_structure)

SITE = bytes.fromhex("00112233445566778899aabbccddeeff")
OTHER = bytes.fromhex("ffeeddccbbaa99887766554433221100")
GROUP = b"group-0001"


@pytest.fixture
def env(tmp_path):
    ks = open_keystore({"kind": "software", "dir": str(tmp_path / "keys")})
    ks.generate_key("site", "ed25519")
    ks.generate_key("seq", "p256")
    path = str(tmp_path / "journal")
    bridge = SigningBridge(ks, path)
    yield ks, bridge, path
    bridge.close()


def ev_item(p, l, v=0, site=SITE):
    prot, pay = event_protected(site), event_payload(p, l, v)
    return EventIdentity(site, p, l), "site", sig_structure(prot, pay), assembler(prot, pay)


def rc_item(ks, epoch):
    prot = receipt_protected(ks.public_key("seq"))
    pay = receipt_payload(GROUP, epoch, bytes(32), None)
    return ReceiptIdentity(GROUP, epoch), "seq", sig_structure(prot, pay), assembler(prot, pay)


def test_compaction_keeps_unrecorded_and_receipts_and_spends_the_rest(env):
    ks, bridge, path = env
    outs = dict(zip(range(100), bridge.release_many([ev_item(1000, k, k) for k in range(100)])))
    rc = bridge.release_many([rc_item(ks, e) for e in range(5)])
    other = bridge.release(*ev_item(5000, 0, site=OTHER))
    # an intent without output (unknown outcome), as a crash leaves it
    bridge._journal.commit([(1, EventIdentity(SITE, 1000, 100).encode(), "site")])
    before = os.path.getsize(path)
    recorded = {EventIdentity(SITE, 1000, k) for k in range(90)}   # 90..99 not yet applied
    stats = bridge.compact_events(lambda i: i in recorded)
    assert stats["events_dropped"] == 91 and os.path.getsize(path) < before / 4
    assert bridge.journal_stats()["entries"] == 10 + 5 + 1
    bridge.close()
    for _round in range(2):   # the live bridge and a reopened one answer alike
        bridge = SigningBridge(ks, path)
        assert bridge.max_event_hlc(SITE) == (1000, 100) and bridge.max_event_hlc(OTHER) == (5000, 0)
        for k in range(90):
            assert bridge.status(EventIdentity(SITE, 1000, k)) is Status.OUTCOME_UNKNOWN
            with pytest.raises(OutcomeUnknown):
                bridge.release(*ev_item(1000, k, k + 1))       # spent: never signed again
        with pytest.raises(OutcomeUnknown):
            bridge.release(*ev_item(1000, 100))                # the unknown outcome stays spent
        with pytest.raises(OutcomeUnknown):
            bridge.release(*ev_item(999, 7))                   # below the floor, never intended: spent
        for k in range(90, 100):
            assert bridge.release(*ev_item(1000, k, k)) == outs[k]   # exact re-transmission
        assert bridge.release_many([rc_item(ks, e) for e in range(5)]) == rc
        assert bridge.release(*ev_item(5000, 0, site=OTHER)) == other  # never recorded: kept
        assert [i for i, _ in bridge.iter_released() if isinstance(i, EventIdentity) and i.site_id == SITE] == \
            [EventIdentity(SITE, 1000, k) for k in range(90, 100)]
        bridge.close()
    bridge = SigningBridge(ks, path)
    new = bridge.release(*ev_item(1000, 101))
    assert bridge.release(*ev_item(1000, 101)) == new
    bridge.close()
    recs = parse_journal(path)
    assert [r for r in recs if r[0] == 3] and all(r[2] in (b"site", b"seq") for r in recs if r[0] == 1)
    env_bridge = SigningBridge(ks, path)
    assert env_bridge.released(EventIdentity(SITE, 1000, 101)) == new
    env_bridge.close()


def test_index_memory_is_bounded_after_compaction(env):
    _, bridge, path = env
    for start in range(0, 20_000, 2000):
        bridge.release_many([ev_item(2000, k) for k in range(start, start + 2000)])
        bridge.compact_events(lambda i: True)
        assert bridge.journal_stats()["entries"] == 0
        assert os.path.getsize(path) < 200
    assert len(bridge._journal._index) == 0 and len(bridge._journal._key_of) == 0
    assert bridge.max_event_hlc(SITE) == (2000, 19_999)


def test_releases_racing_compaction_stay_durable(env):
    ks, bridge, path = env
    got: dict = {}
    lock = threading.Lock()
    stop = threading.Event()

    def writer(t):
        n = 0
        while not stop.is_set() and n < 300:
            items = [ev_item(3000, n * 4 + j, site=bytes([t + 1]) * 16) for j in range(4)]
            outs = bridge.release_many(items)
            with lock:
                got.update({i[0]: o for i, o in zip(items, outs)})
            n += 1

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(3)]
    for th in threads:
        th.start()
    recorded: set = set()
    compactions = 0
    while any(th.is_alive() for th in threads):
        with lock:
            half = list(got)[: len(got) // 2]
        recorded.update(half)
        bridge.compact_events(lambda i: i in recorded)
        compactions += 1
        time.sleep(0.005)
    for th in threads:
        th.join()
    bridge.close()
    bridge = SigningBridge(ks, path)
    for ident, out in got.items():   # every output: durable in the journal, or recorded (and spent)
        if ident in recorded:
            assert bridge.status(ident) is Status.OUTCOME_UNKNOWN
        else:
            assert bridge.released(ident) == out
    assert compactions > 1 and len(got) == 3 * 300 * 4
    bridge.close()


def test_stale_compaction_file_is_ignored_and_removed(env):
    ks, bridge, path = env
    out = bridge.release(*ev_item(4000, 0))
    bridge.close()
    with open(path + ".compact", "wb") as f:
        f.write(b"SSPJRNL1" + b"\x00" * 5)     # a compaction that died before its rename
    bridge = SigningBridge(ks, path)
    assert not os.path.exists(path + ".compact") and bridge.released(EventIdentity(SITE, 4000, 0)) == out
    bridge.close()


def test_compaction_failure_before_rename_leaves_the_journal_usable(env, monkeypatch):
    ks, bridge, path = env
    out = bridge.release(*ev_item(4000, 0))

    def boom(src, dst):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(bridge._journal._ops, "replace", boom)
    from firmware_bridge import JournalError
    with pytest.raises(JournalError, match="unchanged"):
        bridge.compact_events(lambda i: True)
    assert not os.path.exists(path + ".compact")
    assert bridge.released(EventIdentity(SITE, 4000, 0)) == out
    assert bridge.release(*ev_item(4000, 1))   # still works


def test_receipt_compaction_writes_what_encoding_the_kept_entries_again_would(env, monkeypatch):
    """A kept output's record is copied from the old file byte for byte, not encoded again: the
    file a compaction writes is exactly MAGIC, one FLOOR a group (in group order), then each kept
    identity's intent and its output encoded afresh, in the index's order. The intents and the
    outputs were written by separate commits, interleaved across groups, so a record's place in
    the old file says nothing of the new one; the mapping is also replaced by a plain read."""
    from firmware_bridge import journal_format as J
    ks, bridge, path = env
    groups = [b"group-%04d" % g for g in range(7)]
    prot = receipt_protected(ks.public_key("seq"))

    def item(g, e):
        pay = receipt_payload(g, e, bytes([e]) * 32, None)
        return ReceiptIdentity(g, e), "seq", sig_structure(prot, pay), assembler(prot, pay)
    for e in range(6):
        bridge.release_many([item(g, e) for g in groups[e % 3:]])
    # one intent without an output above a group's last receipt (a gap's intent): kept, no output
    bridge._journal.commit([(1, ReceiptIdentity(groups[6], 9).encode(), "seq")])
    jr = bridge._journal
    released = {i: jr.read_released(i) for i in list(jr._index) if jr._index[i] is not None}
    below = {g: 4 for g in groups}                  # every receipt below epoch 4 is recorded
    for mapped in (True, False):
        if not mapped:   # where a file cannot be mapped, it is read: the same bytes come out
            monkeypatch.setattr(J.mmap, "mmap", lambda *a, **k: (_ for _ in ()).throw(OSError(19, "no mmap")))
            for g in groups:
                bridge.release(*item(g, 6))
            jr = bridge._journal
            released = {i: jr.read_released(i) for i in list(jr._index) if jr._index[i] is not None}
            below = {g: 6 for g in groups}
        stats = bridge.compact_receipts(below.get)
        assert stats["receipts_dropped"] > 0
        expected = bytearray(J.MAGIC)
        for g, floor in sorted(jr._receipt_floor.items()):
            expected += J.encode_floor(ReceiptIdentity(g, floor).encode())
        for ident, loc in jr._index.items():
            expected += J.encode_intent(ident, jr._key_of[ident])
            if loc is not None:
                expected += J.encode_released(ident, released[ident])
                assert jr.read_released(ident) == released[ident]
        with open(path, "rb") as f:
            assert f.read() == bytes(expected)
    bridge.close()
    reopened = SigningBridge(ks, path)        # and it opens to the same index
    for ident, cose in released.items():
        if ident in reopened._journal._index:
            assert reopened._journal.read_released(ident) == cose
    reopened.close()


def test_a_journal_cut_short_behind_the_bridge_is_refused_by_compaction_and_left_as_it_is(env):
    """Hostile storage: the journal file loses its tail behind the open bridge (another process,
    a damaged disk). A compaction cannot map past the file's end and reads short: it refuses
    (JournalError, "short read"), writes no `.compact` file and renames nothing; the bridge
    still answers from what it holds, and the file keeps what was left of it."""
    from firmware_bridge import JournalError
    ks, bridge, path = env
    prot = receipt_protected(ks.public_key("seq"))

    def item(e):
        pay = receipt_payload(GROUP, e, bytes([e]) * 32, None)
        return ReceiptIdentity(GROUP, e), "seq", sig_structure(prot, pay), assembler(prot, pay)
    first = bridge.release(*item(0))
    for e in range(1, 4):
        bridge.release(*item(e))
    size = os.path.getsize(path)
    os.truncate(path, size - 10)
    with pytest.raises(JournalError, match="short read"):
        bridge.compact_receipts(lambda g: 4)
    assert not os.path.exists(path + ".compact") and os.path.getsize(path) == size - 10
    assert bridge.released(ReceiptIdentity(GROUP, 0)) == first
