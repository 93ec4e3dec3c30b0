"""Pkcs11Keystore._sign_start against a real SoftHSM2 token (docs/keystore.md "Pipelined signing"):
batches sent to the worker at once and read later, several outstanding, other calls in between, no
deadlock on full pipes, a dead worker reported as the batch's failure and nothing signed again
(§22.5: the token's ECDSA nonces are random, a second signature is a second, different output)."""
from __future__ import annotations

import os
import signal

import pytest

from firmware_bridge import (KeystoreUnavailable, OutcomeUnknown, ReceiptIdentity, SigningBridge, Status,
                             open_keystore, verify_p256)
from firmware_bridge.pkcs11_keystore import SIGN_MANY_CHUNK

from bridge_helpers import cose_parts, in_thread, receipt_item, receipt_protected, receipt_requests, sig_structure, softhsm_token

GROUP = b"group-pk11-pipe"


def reqs(lo, n, size=40):
    return receipt_requests(GROUP, lo, n, size)


@pytest.fixture
def ks(tmp_path):
    k = open_keystore(softhsm_token(tmp_path, "pipe"))
    k.generate_key("seq", "p256")
    k.generate_key("site", "ed25519")
    yield k
    k.close()


def all_verify(ks, requests, sigs):
    pub = ks.public_key("seq")
    return len(sigs) == len(requests) and all(verify_p256(pub, data, sig) for (_, _, data), sig in zip(requests, sigs))


def test_two_batches_outstanding_waited_in_order(ks):
    a, b = reqs(0, 2 * SIGN_MANY_CHUNK + 7), reqs(1000, SIGN_MANY_CHUNK + 1)
    wa = ks._sign_start(a)
    wb = ks._sign_start(b)
    assert len(ks._outstanding) == 2 and not ks._lock.locked()   # nothing read yet, no lock kept
    sa, fa = wa()
    sb, fb = wb()
    assert fa is None and fb is None
    assert all_verify(ks, a, sa) and all_verify(ks, b, sb)
    assert not ks._outstanding and ks._inbuf == b""
    assert ks._sign_start([])() == ([], None)


def test_other_calls_between_start_and_wait_read_the_replies_into_their_batches(ks):
    a, b = reqs(0, 3 * SIGN_MANY_CHUNK), reqs(500, 10)
    pub = ks.public_key("seq")
    wa = ks._sign_start(a)
    wb = ks._sign_start(b)
    assert ks.public_key("seq") == pub                              # not a sign_many reply
    assert ks.key_names() == ["seq", "site"]
    assert not ks._outstanding                                      # read into the batches' buffers
    wc = ks._sign_start(reqs(900, 5))
    one, failure = ks._sign_many(reqs(2000, 3))                     # the synchronous path, in between
    assert failure is None and len(one) == 3
    assert [len(p) for p in ks._sign_chunks(reqs(3000, SIGN_MANY_CHUNK + 2))] == [SIGN_MANY_CHUNK, 2]
    sa, fa = wa()
    sb, fb = wb()
    sc, fc = wc()
    assert (fa, fb, fc) == (None, None, None)
    assert all_verify(ks, a, sa) and all_verify(ks, b, sb) and len(sc) == 5


def test_a_failure_ends_its_batch_and_not_the_next_one(ks):
    bad = reqs(0, SIGN_MANY_CHUNK + 3) + [("seq", ReceiptIdentity(GROUP, 99), b"x")]
    bad[SIGN_MANY_CHUNK + 1] = ("nokey", ReceiptIdentity(GROUP, 77), b"y")   # unknown key: KeystoreError
    good = reqs(200, 20)
    w1 = ks._sign_start(bad)
    w2 = ks._sign_start(good)
    s1, f1 = w1()
    s2, f2 = w2()
    assert f1 is not None and len(s1) == SIGN_MANY_CHUNK + 1 and all_verify(ks, bad[:len(s1)], s1)
    assert f2 is None and all_verify(ks, good, s2)


def test_large_batches_outstanding_do_not_deadlock_on_full_pipes(ks):
    """3 x 1 500 requests of 900 bytes (about 4 MB of requests, far beyond a 64 KiB pipe) sent
    before any reply is read: a writer that blocks while the worker blocks writing its replies
    would hang for ever; this one reads replies meanwhile."""
    big = [reqs(k * 10_000, 1500, size=900) for k in range(3)]

    def run():
        waits = [ks._sign_start(b) for b in big]
        return [w() for w in waits]
    pid = ks._proc.pid
    done, got = in_thread(run, 120)
    if not done:
        os.kill(pid, signal.SIGKILL)   # unblock the stuck writer so the test ends
    assert done, "deadlocked on a full pipe"
    assert [len(s) for s, _ in got] == [1500] * 3 and all(f is None for _, f in got)
    assert all(all_verify(ks, b[:50], s[:50]) and all_verify(ks, b[-50:], s[-50:]) for b, (s, _) in zip(big, got))


def test_a_killed_worker_fails_the_outstanding_batch_promptly_and_nothing_is_signed_again(ks):
    pid = ks._proc.pid
    os.kill(pid, signal.SIGSTOP)            # the batch surely outstanding: the worker reads nothing
    try:
        w = ks._sign_start(reqs(0, 10))     # 10 small requests fit in the pipe
        assert len(ks._outstanding) == 1
    finally:
        os.kill(pid, signal.SIGKILL)
    done, got = in_thread(w, 60)
    assert done, "wait() hung on a dead worker"
    sigs, failure = got
    assert sigs == [] and isinstance(failure, KeystoreUnavailable)
    assert ks._proc is None                 # no new worker: nothing is sent (or signed) again
    sigs, failure = ks._sign_start(reqs(50, 3))()
    assert sigs == [] and isinstance(failure, KeystoreUnavailable)
    with pytest.raises(KeystoreUnavailable):
        ks.public_key("seq")


def test_release_pipelined_through_softhsm(ks, tmp_path):
    pub = ks.public_key("seq")
    prot = receipt_protected(pub)

    def item(e):
        return receipt_item(GROUP, prot, e)
    batches = [[item(k * 1000 + e) for e in range(150)] for k in range(3)]
    outs = []
    with SigningBridge(ks, str(tmp_path / "journal")) as bridge:
        got, t = bridge.release_pipelined(None, batches[0])
        assert got is None
        for b in batches[1:] + [[]]:
            got, t = bridge.release_pipelined(t, b)
            outs += got
        assert t is None
        for it, out in zip([i for b in batches for i in b], outs):
            p2, y2, sig = cose_parts(out)
            assert verify_p256(pub, sig_structure(p2, y2), sig) and p2 == prot
            assert bridge.status(it[0]) is Status.RELEASED and bridge.released(it[0]) == out
        assert len(outs) == 450


def test_release_pipelined_with_the_worker_killed_leaves_outcomes_unknown(ks, tmp_path):
    pub = ks.public_key("seq")
    prot = receipt_protected(pub)

    def item(e):
        return receipt_item(GROUP, prot, e)
    first, second = [item(e) for e in range(20)], [item(100 + e) for e in range(20)]
    with SigningBridge(ks, str(tmp_path / "journal")) as bridge:
        _, t1 = bridge.release_pipelined(None, first)
        assert ks.key_names() == ["seq", "site"]   # reads first's replies into its batch
        pid = ks._proc.pid
        os.kill(pid, signal.SIGSTOP)        # second's replies surely not in
        try:
            outs, t2 = bridge.release_pipelined(t1, second)
        finally:
            os.kill(pid, signal.SIGKILL)
        assert len(outs) == 20 and all(bridge.status(i[0]) is Status.RELEASED for i in first)
        done, err = in_thread(lambda: _raises(lambda: bridge.release_pipelined(t2, [])), 60)
        assert done and isinstance(err, KeystoreUnavailable)
        assert all(bridge.status(i[0]) is Status.OUTCOME_UNKNOWN for i in second)
        with pytest.raises(OutcomeUnknown):   # never signed a second time
            bridge.release_many(second[:1])


def _raises(fn):
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the test inspects it
        return exc
    return None
