"""After a chunk of a batch fails at the token, the later chunks of that batch already queued at
the PKCS#11 worker are not signed (docs/keystore.md "Pipelined signing"): each would burn an
identity as an unknown outcome for nothing, since the batch ends at its first failure. Real
SoftHSM2 through a test-only worker (faulty_pkcs11_worker.py) whose token fails one signature
and which logs every signature it makes."""
from __future__ import annotations

import os

from firmware_bridge import KeystoreError, ReceiptIdentity, verify_p256
from firmware_bridge.pkcs11_keystore import SIGN_MANY_CHUNK, Pkcs11Keystore

from bridge_helpers import softhsm_token

HERE = os.path.dirname(os.path.abspath(__file__))
GROUP = b"group-pk11-failed-batch"


class FaultyKeystore(Pkcs11Keystore):
    _WORKER_MODULE = "faulty_pkcs11_worker"


def faulty(tmp_path, fail_at, log):
    conf = softhsm_token(tmp_path, "failed")
    env = dict(conf["env"], PYTHONPATH=HERE, FAULTY_FAIL_AT=str(fail_at), FAULTY_LOG=str(log))
    ks = FaultyKeystore(conf["module"], conf["token_label"], conf["pin"], env=env)
    ks.generate_key("seq", "p256")
    return ks


def reqs(lo, n):
    return [("seq", ReceiptIdentity(GROUP, e), os.urandom(40)) for e in range(lo, lo + n)]


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
