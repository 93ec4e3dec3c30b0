"""Lost-fsync simulation: the medium holds only what the last completed fsync covered, plus an
arbitrary prefix of later writes (a torn, partially flushed tail).  Every output the bridge ever
returned must be in that state (SOVM §22.5 clause 1; §22.6 names post-commit durability loss)."""
import os
import random
import threading

import pytest

from firmware_bridge import EventIdentity, ReceiptIdentity, SigningBridge, open_keystore
from firmware_bridge.identity import decode_identity
from firmware_bridge.journal import FileOps

from bridge_helpers import (assembler, event_payload, event_protected, receipt_payload, receipt_protected,
                            sig_structure)
from crash_harness import CheckFailed, Checker
from unsafe_bridge import UnsafeBridge

SITE = b"\x42" * 16


class MediumOps(FileOps):
    """Records the file content at every fsync: the 'medium' a power cut would leave."""

    def __init__(self):
        self.lock = threading.Lock()
        self.durable = b""
        self.fsyncs = 0

    def fsync(self, fd):
        os.fsync(fd)
        size = os.fstat(fd).st_size
        with self.lock:
            self.durable = os.pread(fd, size, 0)
            self.fsyncs += 1


def power_cut(ops: MediumOps, journal: str, dest: str, rng: random.Random) -> str:
    with ops.lock:
        durable = ops.durable
    with open(journal, "rb") as f:
        current = f.read()
    tail = current[len(durable):]
    with open(dest, "wb") as f:  # durable part + a random prefix of the unsynced tail
        f.write(durable + tail[:rng.randint(0, len(tail))])
    return dest


def _items(ks, start, n, receipts=False):
    out = []
    for k in range(start, start + n):
        if receipts:
            prot = receipt_protected(ks.public_key("seq"))
            pay = receipt_payload(b"g", k, bytes(32), None)
            out.append((ReceiptIdentity(b"g", k), "seq", sig_structure(prot, pay), assembler(prot, pay)))
        else:
            prot, pay = event_protected(SITE), event_payload(1000, k, k)
            out.append((EventIdentity(SITE, 1000, k), "site", sig_structure(prot, pay), assembler(prot, pay)))
    return out


def _run(tmp_path, bridge_cls, seed):
    rng = random.Random(seed)
    ks = open_keystore({"kind": "software", "dir": str(tmp_path / "keys")})
    ed, p = ks.generate_key("site", "ed25519"), ks.generate_key("seq", "p256")
    ops = MediumOps()
    journal = str(tmp_path / "journal")
    bridge = bridge_cls(ks, journal, file_ops=ops)
    returned: list = []   # (ident, bytes) in the order they left the bridge
    lock = threading.Lock()
    counter = iter(range(10**9))

    stop = threading.Event()

    def worker(receipts):
        for _ in range(25):
            if stop.is_set():
                return
            n = rng.choice([1, 1, 4, 32])
            start = next(counter) * 64
            outs = bridge.release_many(_items(ks, start, n, receipts))
            with lock:
                returned.extend((i[0].encode(), o) for i, o in zip(_items(ks, start, n, receipts), outs))

    threads = [threading.Thread(target=worker, args=(t % 2 == 1,), daemon=True) for t in range(4)]
    for t in threads:
        t.start()
    try:
        _cut_loop(threads, lock, returned, ops, journal, tmp_path, rng, ks, ed, p)
    finally:
        stop.set()
        for t in threads:
            t.join()
        bridge.close()
    return ops.fsyncs, len(returned)


def _cut_loop(threads, lock, returned, ops, journal, tmp_path, rng, ks, ed, p):
    """Cut the power repeatedly while the workers run, and once more after they all finished
    (so every output ever returned is checked by some cut: the unsafe bridge's last outputs are
    never persisted, and a loaded machine could otherwise end the loop before a cut saw any
    output still in its write-behind window, as one CI run did); check each recovered state."""
    cuts = 0
    while True:
        finished = not any(t.is_alive() for t in threads)   # before reading what was released
        with lock:
            seen = list(returned)           # read what has been released *before* the cut...
        cut = power_cut(ops, journal, str(tmp_path / f"cut{cuts}"), rng)  # ...then cut the power
        checker = Checker(cut, ed, p)
        checker.feed([f"REL {i.hex()} {o.hex()}" for i, o in seen])
        checker.check_durable(cut)
        # and the recovered state opens cleanly and re-transmits exactly those bytes
        b2 = SigningBridge(ks, cut)
        for i, o in seen[-20:]:
            assert b2.released(decode_identity(i)) == o
        b2.close()
        cuts += 1
        if finished:
            return


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_released_output_survives_a_power_cut(tmp_path, seed):
    fsyncs, n = _run(tmp_path, SigningBridge, seed)
    assert n > 100
    assert fsyncs < n  # group commit: several outputs shared an fsync


def test_negative_control_unsafe_bridge_loses_outputs(tmp_path):
    with pytest.raises(CheckFailed, match="not durable"):
        _run(tmp_path, UnsafeBridge, 9)


# -- power cuts while the journal is being compacted -----------------------------------------------

class RenameMediumOps(FileOps):
    """A medium that also models the directory: a rename is durable only once the directory is
    fsynced; until then a power cut may leave the name on the old or on the new file. Each file's
    content is what its last fsync covered (plus a random prefix of its unsynced tail)."""

    def __init__(self, journal):
        self.journal = journal
        self.lock = threading.Lock()
        self.durable: dict = {}      # inode -> bytes at its last fsync
        self.dir_ino = None          # inode the name points to on the medium
        self.fsyncs = 0

    def fsync(self, fd):
        os.fsync(fd)
        size = os.fstat(fd).st_size
        with self.lock:
            self.durable[os.fstat(fd).st_ino] = os.pread(fd, size, 0)
            self.fsyncs += 1

    def replace(self, src, dst):
        with self.lock:
            os.replace(src, dst)     # the medium's name stays where it was until fsync_dir

    def fsync_dir(self, path):
        with self.lock:
            super().fsync_dir(path)
            self.dir_ino = os.stat(self.journal).st_ino

    def cut(self, dest, rng):
        with self.lock:
            live_ino = os.stat(self.journal).st_ino
            ino = live_ino
            if self.dir_ino != live_ino:   # a rename not yet durable: the medium may hold either name
                self.flip = not getattr(self, "flip", False)
                ino = self.dir_ino if self.flip else live_ino
            data = self.durable.get(ino, b"")
            if ino == live_ino:
                with open(self.journal, "rb") as f:
                    current = f.read()
                tail = current[len(data):] if current.startswith(data) else b""
                data += tail[:rng.randint(0, len(tail))]
        with open(dest, "wb") as f:
            f.write(data)
        return dest, live_ino != self.dir_ino


def _compaction_run(tmp_path, seed, floorless=False):
    from firmware_bridge import JournalError, OutcomeUnknown, Status
    rng = random.Random(seed)
    ks = open_keystore({"kind": "software", "dir": str(tmp_path / "keys")})
    ks.generate_key("site", "ed25519"), ks.generate_key("seq", "p256")
    journal = str(tmp_path / "journal")
    ops = RenameMediumOps(journal)
    bridge = SigningBridge(ks, journal, file_ops=ops)
    import firmware_bridge.journal_compact as jmod   # the compaction writes the FLOORs
    real_floor = jmod.encode_floor
    if floorless:   # NEGATIVE CONTROL: compaction that writes no FLOOR record
        jmod.encode_floor = lambda ident: b""
    returned: dict = {}
    recorded: set = set()            # "durable in the agent's log"
    lock = threading.Lock()
    stop = threading.Event()
    sites = [bytes([0x50 + t]) * 16 for t in range(3)]

    def worker(t):
        logical = 0
        for _ in range(60):
            if stop.is_set():
                return
            n = rng.choice([1, 4, 16])
            items = []
            for k in range(n):
                prot, pay = event_protected(sites[t]), event_payload(1000, logical + k, k)
                items.append((EventIdentity(sites[t], 1000, logical + k), "site", sig_structure(prot, pay),
                              assembler(prot, pay)))
            logical += n
            try:
                outs = bridge.release_many(items)
            except OutcomeUnknown:
                continue
            except JournalError:   # the check failed inside a compaction: the main thread reports it
                return
            with lock:
                returned.update({i[0]: o for i, o in zip(items, outs)})

    threads = [threading.Thread(target=worker, args=(t,), daemon=True) for t in range(3)]
    for t in threads:
        t.start()
    counts = {"cuts": 0, "mid_rename": 0}

    def cut_and_check(rec):
        with lock:
            seen = dict(returned)   # what was released *before* the cut
        cut, torn_rename = ops.cut(str(tmp_path / f"cut{counts['cuts']}"), rng)
        counts["mid_rename"] += torn_rename
        b2 = SigningBridge(ks, cut)
        for ident, out in seen.items():
            if ident in rec:    # recorded elsewhere: either still here, or spent
                st = b2.status(ident)
                assert st in (Status.RELEASED, Status.OUTCOME_UNKNOWN), f"{ident} re-signable after cut"
                if st is Status.RELEASED:
                    assert b2.released(ident) == out
            else:
                assert b2.released(ident) == out, f"{ident}: released output lost by the cut"
        b2.close()
        counts["cuts"] += 1

    compactions = 0
    try:
        # go on after the writers finish until the run holds enough compactions and a cut in the
        # middle of a rename: how many iterations the writers leave depends on the machine's load
        while (any(t.is_alive() for t in threads) or counts["cuts"] == 0 or compactions < 5
               or (counts["mid_rename"] == 0 and counts["cuts"] < 200)):
            with lock:
                recorded.update(rng.sample(sorted(returned), len(returned) // 2))
                rec = set(recorded)
            if rng.random() < 0.6:
                # cut the power inside the compaction too: at every one of its steps
                point = ["compact_torn_write", "compact_before_fsync", "compact_before_rename",
                         "compact_after_rename", "compact_after_dirsync"][compactions % 5]
                bridge._journal._hook = lambda p: cut_and_check(rec) if p == point else None
                bridge.compact_events(lambda i: i in rec)
                bridge._journal._hook = None
                compactions += 1
            cut_and_check(rec)
    finally:
        stop.set()
        for t in threads:
            t.join()
        bridge.close()
        jmod.encode_floor = real_floor
    return counts["cuts"], counts["mid_rename"], compactions, len(returned)


@pytest.mark.parametrize("seed", [11, 12])
def test_power_cuts_during_compaction_lose_no_unrecorded_output(tmp_path, seed):
    cuts, mid_rename, compactions, n = _compaction_run(tmp_path, seed)
    assert compactions > 3 and n > 100 and cuts > 5 and mid_rename > 0


def test_negative_control_floorless_compaction_is_caught(tmp_path):
    from firmware_bridge import JournalError
    with pytest.raises((AssertionError, JournalError), match="re-signable"):
        _compaction_run(tmp_path, 13, floorless=True)
