"""SigningBridge.release_pipelined and the software keystore's P-256 signing process
(docs/keystore.md "Pipelined release and pipelined P-256 signing"; the sequencer's pipelined group commit)."""
from __future__ import annotations

import os
import signal
import threading

import pytest

from firmware_bridge import KeystoreError, ReceiptIdentity, SigningBridge, Status, open_keystore, verify_p256
from firmware_bridge.software import PROCESS_MIN, SoftwareKeystore

from bridge_helpers import assembler, cose_parts, receipt_payload, receipt_protected, sig_structure

GROUP = b"group-pipe"


@pytest.fixture
def env(tmp_path):
    ks = open_keystore({"kind": "software", "dir": str(tmp_path / "keys")})
    pub = ks.generate_key("seq", "p256")
    bridge = SigningBridge(ks, str(tmp_path / "journal"))
    yield ks, bridge, pub, tmp_path
    bridge.close()
    ks.close()


def item(ks, epoch, group=GROUP):
    prot = receipt_protected(ks.public_key("seq"))
    pay = receipt_payload(group, epoch, bytes(32), None)
    return ReceiptIdentity(group, epoch), "seq", sig_structure(prot, pay), assembler(prot, pay)


def batch(ks, lo, n):
    return [item(ks, e) for e in range(lo, lo + n)]


def test_one_journal_commit_holds_one_batchs_outputs_and_the_next_ones_intents(env):
    ks, bridge, pub, _ = env
    a, b = batch(ks, 0, 40), batch(ks, 100, 40)
    f0 = bridge._journal.fsyncs
    none, ta = bridge.release_pipelined(None, a)
    assert none is None and bridge._journal.fsyncs - f0 == 1            # a's intents
    assert all(bridge.status(i[0]) is Status.IN_FLIGHT for i in a)
    outs_a, tb = bridge.release_pipelined(ta, b)
    assert bridge._journal.fsyncs - f0 == 2                             # a's outputs + b's intents: one fsync
    assert all(bridge.status(i[0]) is Status.RELEASED for i in a)
    assert all(bridge.status(i[0]) is Status.IN_FLIGHT for i in b)
    outs_b, none = bridge.release_pipelined(tb, [])
    assert none is None and bridge._journal.fsyncs - f0 == 3
    for it, out in zip(a + b, outs_a + outs_b):
        prot, pay, sig = cose_parts(out)
        assert verify_p256(pub, it[2], sig)
        assert bridge.released(it[0]) == out                            # exactly the persisted bytes
    # RFC 6979: the bytes release_many gives in another journal are the same ones
    other = SigningBridge(ks, str(env[3] / "journal2"))
    try:
        assert other.release_many(a) == outs_a
    finally:
        other.close()


def test_nothing_is_signed_before_its_intent_is_durable(env):
    ks, bridge, _pub, _ = env
    seen = []
    orig = ks._sign_start

    def spy(requests):
        seen.extend(bridge._journal.state(ReceiptIdentity(GROUP, r[1].epoch).encode()) for r in requests)
        return orig(requests)
    ks._sign_start = spy
    _, t = bridge.release_pipelined(None, batch(ks, 0, 20))
    _, t = bridge.release_pipelined(t, batch(ks, 50, 20))
    bridge.release_pipelined(t, [])
    assert seen == ["intent"] * 40


def test_a_failed_batch_persists_its_verified_prefix_and_the_next_gets_no_intent(env):
    ks, bridge, _pub, _ = env
    a, b = batch(ks, 0, 5), batch(ks, 10, 5)
    ident, key, tbs, _ = a[3]

    def boom(sig):
        raise RuntimeError("encoder bug")
    a[3] = (ident, key, tbs, boom)
    _, ta = bridge.release_pipelined(None, a)
    with pytest.raises(RuntimeError):
        bridge.release_pipelined(ta, b)
    assert [bridge.status(i[0]) for i in a] == [Status.RELEASED] * 3 + [Status.OUTCOME_UNKNOWN] * 2
    assert [bridge.status(i[0]) for i in b] == [Status.ABSENT] * 5     # no intent, claims dropped
    assert bridge.release_many(b)                                       # and signable later


def test_a_refused_next_batch_still_persists_the_finished_one(env):
    ks, bridge, _pub, _ = env
    a = batch(ks, 0, 5)
    bridge._journal.commit([(1, ReceiptIdentity(GROUP, 99).encode(), "seq")])   # an intent without output
    _, ta = bridge.release_pipelined(None, a)
    with pytest.raises(KeystoreError):                                  # OutcomeUnknown for epoch 99
        bridge.release_pipelined(ta, [item(ks, 99)])
    assert all(bridge.status(i[0]) is Status.RELEASED for i in a)


def test_p256_batches_are_signed_in_another_process_with_the_same_bytes(tmp_path):
    ks = SoftwareKeystore(str(tmp_path / "keys"), sign_threads=2)
    ks.generate_key("seq", "p256")
    reqs = [("seq", ReceiptIdentity(GROUP, e), os.urandom(150)) for e in range(PROCESS_MIN + 9)]
    try:
        wait = ks._sign_start(reqs)
        worker = ks._workers["seq"]
        assert worker._proc is not None and worker._proc.pid != os.getpid()
        sigs, failure = wait()
        assert failure is None
        assert sigs == ks._sign_many(reqs)[0]                           # RFC 6979, in this process
    finally:
        ks.close()
    assert worker._proc is None                                         # closed with the keystore


def test_a_dead_signing_process_falls_back_to_the_same_bytes(tmp_path):
    ks = SoftwareKeystore(str(tmp_path / "keys"), sign_threads=2)
    ks.generate_key("seq", "p256")
    reqs = [("seq", ReceiptIdentity(GROUP, e), os.urandom(150)) for e in range(40)]
    try:
        ks._sign_start(reqs)()                                          # the process is up
        worker = ks._workers["seq"]
        os.kill(worker._proc.pid, signal.SIGKILL)
        worker._proc.wait()
        sigs, failure = ks._sign_start(reqs)()
        assert failure is None and sigs == ks._sign_many(reqs)[0]
        assert ks._workers["seq"].dead
        again = ks._sign_start(reqs)                                    # a new process next time
        assert ks._workers["seq"] is not worker and not ks._workers["seq"].dead
        assert again() == (sigs, None)
    finally:
        ks.close()


def test_batches_larger_than_a_pipe_queue_behind_each_other_without_deadlock(tmp_path):
    """Two batches at the signing process at once, each several pipe buffers long, the answers not
    read until both are sent: the writer reads answers meanwhile instead of blocking for ever."""
    ks = SoftwareKeystore(str(tmp_path / "keys"), sign_threads=2)
    ks.generate_key("seq", "p256")
    big = [[("seq", ReceiptIdentity(GROUP, k * 10_000 + e), os.urandom(900)) for e in range(1200)] for k in range(3)]
    got = []

    def run():
        waits = [ks._sign_start(b) for b in big]
        got.extend(w() for w in waits)
    th = threading.Thread(target=run, daemon=True)
    try:
        th.start()
        th.join(120)
        assert not th.is_alive(), "deadlocked on a full pipe"
        assert [len(s) for s, f in got] == [1200] * 3 and all(f is None for _, f in got)
        assert got[2][0][:5] == ks._sign_many(big[2][:5])[0]
        assert not ks._workers["seq"].dead
    finally:
        ks.close()


@pytest.mark.parametrize("request_bytes", [
    b"\xff\xff\xff\xff",                                  # a count no keystore sends
    b"\x00\x00\x00\x01\xff\xff\xff\xff",                  # a Sig_structure length no keystore sends
    b"\x00\x00\x00\x02\x00\x00\x00\x03abc",               # cut short: the pipe ends mid-request
])
def test_the_signing_process_signs_nothing_for_a_malformed_request(tmp_path, request_bytes):
    """The signing process's only input is its keystore's pipe; anything but a well-formed request
    ends it without an answer (the keystore then signs in-process), never a signature."""
    import subprocess
    import sys
    ks = SoftwareKeystore(str(tmp_path / "keys"))
    ks.generate_key("seq", "p256")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-m", "firmware_bridge.sign_worker", str(tmp_path / "keys"), "seq"],
                       input=request_bytes, capture_output=True, timeout=60, cwd=root,
                       env=dict(os.environ, PYTHONPATH=root))
    assert p.stdout == b"R"                                # ready, then nothing: no answer, no signature
    assert p.returncode in (0, 2)


def test_the_signing_process_reads_requests_however_the_pipe_cuts_them(tmp_path):
    """Requests come in chunks that need not end where a request does: three requests written at
    once (the second larger than a read), and a stream of one-byte writes, are each answered in
    order with signatures that verify, and the end of the pipe ends the process."""
    import subprocess
    import sys
    import time
    from firmware_bridge.pipes import ReadAhead
    from firmware_bridge.pipes import encode_request
    ks = SoftwareKeystore(str(tmp_path / "keys"))
    ks.generate_key("seq", "p256")
    pub = ks.public_key("seq")
    batches = [[b"a" * 10, b""], [bytes([i % 251]) * (i * 7) for i in range(400)], [b"z" * (ReadAhead.READ_CHUNK + 5)]]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for dribble in (False, True):
        p = subprocess.Popen([sys.executable, "-m", "firmware_bridge.sign_worker", str(tmp_path / "keys"), "seq"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=root, env=dict(os.environ, PYTHONPATH=root))
        assert p.stdout.read(1) == b"R"
        wire = b"".join(encode_request(b) for b in batches)
        if dribble:
            for i in range(0, 200):
                p.stdin.write(wire[i:i + 1])
                p.stdin.flush()
                time.sleep(0.001)
            p.stdin.write(wire[200:])
        else:
            p.stdin.write(wire)
        p.stdin.close()
        for b in batches:
            assert p.stdout.read(1) == b"\x00"
            sigs = p.stdout.read(64 * len(b))
            assert all(verify_p256(pub, d, sigs[i * 64:(i + 1) * 64]) for i, d in enumerate(b))
        assert p.stdout.read() == b"" and p.wait(30) == 0
    ks.close()
