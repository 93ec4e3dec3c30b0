"""After a chunk of a batch fails at the token, the later chunks of that batch already queued at
the PKCS#11 worker are not signed (docs/keystore.md "Pipelined signing"): each would burn an
identity as an unknown outcome for nothing, since the batch ends at its first failure. Real
SoftHSM2 through a test-only worker (faulty_pkcs11_worker.py) whose token fails one signature
and which logs every signature it makes."""
from __future__ import annotations

import os
import threading
import time

from firmware_bridge import KeystoreError, verify_p256
from firmware_bridge.pkcs11_keystore import SIGN_MANY_CHUNK, Pkcs11Keystore

from bridge_helpers import receipt_requests, softhsm_token

HERE = os.path.dirname(os.path.abspath(__file__))
GROUP = b"group-pk11-failed-batch"


def reqs(lo, n):
    return receipt_requests(GROUP, lo, n)


class FaultyKeystore(Pkcs11Keystore):
    _WORKER_MODULE = "faulty_pkcs11_worker"


def faulty(tmp_path, fail_at, log, sig_at=0, hold=False):
    conf = softhsm_token(tmp_path, "failed")
    env = dict(conf["env"], PYTHONPATH=HERE, FAULTY_FAIL_AT=str(fail_at), FAULTY_LOG=str(log),
               FAULTY_SIG_AT=str(sig_at), FAULTY_HOLD="1" if hold else "0")
    ks = FaultyKeystore(conf["module"], conf["token_label"], conf["pin"], env=env)
    ks.generate_key("seq", "p256")
    return ks


def made(log):
    return len(log.read_text().split()) if log.exists() else 0


def test_the_rest_of_a_failed_pipelined_batch_is_not_signed_and_the_next_batch_is(tmp_path):
    log = tmp_path / "token-sigs"
    ks = faulty(tmp_path, SIGN_MANY_CHUNK + 2, log)   # the 2nd chunk's 2nd signature fails
    try:
        pub = ks.public_key("seq")
        a, b = reqs(0, 4 * SIGN_MANY_CHUNK), reqs(1000, 10)
        wa, wb = ks._sign_start(a), ks._sign_start(b)     # a's 4 chunks and b queued at the worker
        sa, fa = wa()
        sb, fb = wb()
        assert len(sa) == SIGN_MANY_CHUNK + 1 and isinstance(fa, KeystoreError) and "CKR_DEVICE_ERROR" in str(fa)
        assert fb is None and len(sb) == 10 and all(verify_p256(pub, d, s) for (_, _, d), s in zip(b, sb))
        # a's 3rd and 4th chunks were never signed: a's 65 and b's 10, nothing else
        assert made(log) == SIGN_MANY_CHUNK + 1 + 10
    finally:
        ks.close()


def test_the_chunk_in_flight_after_a_failure_in_a_stream_is_not_signed(tmp_path):
    log = tmp_path / "token-sigs"
    ks = faulty(tmp_path, 3, log)                     # the first chunk's 3rd signature fails
    try:
        sigs, failure = ks._sign_many(reqs(0, 3 * SIGN_MANY_CHUNK))   # chunk 2 is sent before chunk 1 is read
        assert len(sigs) == 2 and isinstance(failure, KeystoreError)
        assert made(log) == 2
        again, failure = ks._sign_many(reqs(500, 5))   # the next call signs
        assert failure is None and len(again) == 5 and made(log) == 7
    finally:
        ks.close()


def _until(cond, timeout=60):
    """Wait for ``cond`` in a thread joined with ``timeout`` (far above what it needs)."""
    def run():
        while not cond():
            time.sleep(0.02)
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout)
    return not th.is_alive()


def test_the_verifier_stops_the_rest_of_a_batch_whose_signature_does_not_verify(tmp_path):
    """The verifier finds the bad signature while the parent has read nothing: it tells the worker,
    which skips the batch's queued chunks and signs the next batch. (The test worker holds after
    the bad chunk until a cancellation arrives, at most 30 s: without one it signs on, and the
    count is wrong.)"""
    log = tmp_path / "token-sigs"
    ks = faulty(tmp_path, 0, log, sig_at=5 + 10, hold=True)   # the 10th signature of batch a
    try:
        pub = ks.public_key("seq")
        warm, failure = ks._sign_start(reqs(0, 5))()           # starts the verifier
        assert failure is None and ks._verifier is not None
        a, b = reqs(100, 4 * SIGN_MANY_CHUNK), reqs(1000, 10)
        wa, wb = ks._sign_start(a), ks._sign_start(b)
        assert _until(lambda: made(log) >= 5 + SIGN_MANY_CHUNK + 10), "the worker never went on"
        assert made(log) == 5 + SIGN_MANY_CHUNK + 10            # a's chunks 2-4 skipped, b signed
        sa, fa = wa()
        sb, fb = wb()
        assert len(sa) == 9 and all(verify_p256(pub, d, s) for (_, _, d), s in zip(a, sa))
        assert isinstance(fa, KeystoreError) and "does not verify" in str(fa)
        assert fb is None and len(sb) == 10
        assert made(log) == 5 + SIGN_MANY_CHUNK + 10
    finally:
        ks.close()


def test_the_keystore_stops_the_rest_of_a_stream_whose_signature_does_not_verify(tmp_path):
    """Without a verifier (a synchronous call verifies in the keystore's process) the keystore
    tells the worker when it finds the bad signature: the chunk in flight is not signed."""
    log = tmp_path / "token-sigs"
    ks = faulty(tmp_path, 0, log, sig_at=10, hold=True)
    try:
        sigs, failure = ks._sign_many(reqs(0, 3 * SIGN_MANY_CHUNK))
        assert ks._verifier is None
        assert len(sigs) == 9 and isinstance(failure, KeystoreError) and "does not verify" in str(failure)
        assert made(log) == SIGN_MANY_CHUNK                     # the 2nd chunk, sent before, not signed
        again, failure = ks._sign_many(reqs(500, 5))
        assert failure is None and len(again) == 5 and made(log) == SIGN_MANY_CHUNK + 5
    finally:
        ks.close()
