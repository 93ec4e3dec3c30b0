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
    """Cut the power repeatedly while the workers run; check each recovered state."""
    cuts = 0
    while any(t.is_alive() for t in threads) or cuts == 0:
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


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_released_output_survives_a_power_cut(tmp_path, seed):
    fsyncs, n = _run(tmp_path, SigningBridge, seed)
    assert n > 100
    assert fsyncs < n  # group commit: several outputs shared an fsync


def test_negative_control_unsafe_bridge_loses_outputs(tmp_path):
    with pytest.raises(CheckFailed, match="not durable"):
        _run(tmp_path, UnsafeBridge, 9)
