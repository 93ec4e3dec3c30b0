"""Token signatures verified in the verifier process (firmware_bridge/verify_worker.py), not in the
keystore's process (docs/keystore.md "Verified in a verifier process"), against a real SoftHSM2
token: the pipelined path returns exactly the token's signatures, each verified; a bad one is
refused and never persisted; a killed verifier leaves verification to the keystore's process; the
verifier exits with its parent and loads no PKCS#11 library; many outstanding chunks do not
deadlock; the verifier's accept set is verify_p256's (Wycheproof)."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys

import pytest

from firmware_bridge import (KeystoreError, SigningBridge, Status, open_keystore, verify_p256)
from firmware_bridge import pkcs11_keystore
from firmware_bridge.ec import compress_point
from firmware_bridge.pkcs11_keystore import SIGN_MANY_CHUNK, Pkcs11Keystore
from firmware_bridge.pipes import read_exact
from firmware_bridge.verify_worker import ANSWER, encode_items, encode_key

from bridge_helpers import (cose_parts, in_thread, parse_journal, receipt_item, receipt_protected, receipt_requests,
                            sig_structure, softhsm_token)
from tests.waiting import HANG_S, scaled, timed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
GROUP = b"group-pk11-verifier"


def reqs(lo, n, size=40):
    return receipt_requests(GROUP, lo, n, size)


def item(prot, e):
    return receipt_item(GROUP, prot, e)


class FaultyKeystore(Pkcs11Keystore):
    _WORKER_MODULE = "faulty_pkcs11_worker"   # tests/bridge/faulty_pkcs11_worker.py


def faulty(tmp_path, sig_at=0, log=None):
    conf = softhsm_token(tmp_path, "verifier")
    env = dict(conf["env"], PYTHONPATH=HERE, FAULTY_SIG_AT=str(sig_at), FAULTY_LOG=str(log or ""))
    ks = FaultyKeystore(conf["module"], conf["token_label"], conf["pin"], env=env)
    ks.generate_key("seq", "p256")
    return ks


@pytest.fixture
def here_counts(monkeypatch):
    """How many P-256 verifications the keystore's own process made (a probe around the real function)."""
    calls = [0]
    real = pkcs11_keystore.verify_p256

    def counted(*a):
        calls[0] += 1
        return real(*a)
    monkeypatch.setattr(pkcs11_keystore, "verify_p256", counted)
    return calls


def all_verify(pub, requests, sigs):
    return len(sigs) == len(requests) and all(verify_p256(pub, d, s) for (_, _, d), s in zip(requests, sigs))


def test_pipelined_signatures_are_the_tokens_verified_by_the_verifier_not_here(tmp_path, here_counts):
    log = tmp_path / "token-sigs"
    ks = faulty(tmp_path, log=log)
    try:
        pub = ks.public_key("seq")
        batches = [reqs(k * 1000, n) for k, n in enumerate((2 * SIGN_MANY_CHUNK + 5, 1, SIGN_MANY_CHUNK))]
        waits = [ks._sign_start(b) for b in batches]
        assert ks._verifier is not None and ks._verifier.poll() is None
        got = [w() for w in waits]
        assert all(f is None for _, f in got)
        sigs = [s for part, _ in got for s in part]
        assert all(all_verify(pub, b, s) for b, (s, _) in zip(batches, got))
        assert [bytes.fromhex(x) for x in log.read_text().split()] == sigs   # byte for byte the token's
        assert here_counts[0] == 0            # none verified in this process
        assert not ks._vgone
        # the synchronous paths go through the running verifier too
        r = reqs(5000, 3)
        one, failure = ks._sign_many(r)
        assert failure is None and all_verify(pub, r, one) and here_counts[0] == 0
    finally:
        ks.close()


def test_a_bad_token_signature_is_refused_and_never_persisted_by_the_verifier(tmp_path, here_counts):
    bad_at = SIGN_MANY_CHUNK + 6          # the 70th signature: in the second chunk of the second batch
    ks = faulty(tmp_path, sig_at=20 + bad_at)
    try:
        pub = ks.public_key("seq")
        prot = receipt_protected(pub)
        first = [item(prot, e) for e in range(20)]
        second = [item(prot, 100 + e) for e in range(2 * SIGN_MANY_CHUNK)]
        third = [item(prot, 1000 + e) for e in range(10)]
        with SigningBridge(ks, str(tmp_path / "journal")) as bridge:
            assert bridge._verify is False    # the keystore says its outputs are verified
            _, t1 = bridge.release_pipelined(None, first)
            outs, t2 = bridge.release_pipelined(t1, second)
            assert len(outs) == 20
            with pytest.raises(KeystoreError, match="does not verify under key 'seq'"):
                bridge.release_pipelined(t2, third)
            assert here_counts[0] == 0        # the verifier's verdict refused it
            states = [bridge.status(i[0]) for i in second]
            assert states[:bad_at - 1] == [Status.RELEASED] * (bad_at - 1)   # the verified prefix
            assert set(states[bad_at - 1:]) == {Status.OUTCOME_UNKNOWN}       # the bad one and the rest
            assert all(bridge.status(i[0]) is Status.ABSENT for i in third)   # never intended
        released = [cose for kind, _, cose in parse_journal(str(tmp_path / "journal")) if kind == 2]
        assert len(released) == 20 + bad_at - 1
        for cose in released:                 # every persisted output verifies
            p, y, sig = cose_parts(cose)
            assert verify_p256(pub, sig_structure(p, y), sig)
    finally:
        ks.close()


def test_a_bad_token_signature_is_refused_on_the_synchronous_path_without_a_verifier(tmp_path):
    ks = faulty(tmp_path, sig_at=5)
    try:
        pub = ks.public_key("seq")
        r = reqs(0, 10)
        sigs, failure = ks._sign_many(r)
        assert ks._verifier is None           # no pipelined batch yet: checked in this process
        assert len(sigs) == 4 and all_verify(pub, r[:4], sigs)
        assert isinstance(failure, KeystoreError) and "does not verify" in str(failure)
    finally:
        ks.close()


def test_a_killed_verifier_leaves_verification_to_this_process(tmp_path, here_counts):
    n = 3 * SIGN_MANY_CHUNK
    ks = faulty(tmp_path, sig_at=3 * n + 50)   # the 4th batch's 50th signature is bad
    try:
        pub = ks.public_key("seq")
        batches = [reqs(k * 1000, n) for k in range(4)]
        s0, f0 = ks._sign_start(batches[0])()
        assert f0 is None and all_verify(pub, batches[0], s0) and here_counts[0] == 0   # the verifier's work
        waits = [ks._sign_start(b) for b in batches[1:3]]   # outstanding: signed, copied to the verifier
        os.kill(ks._verifier.pid, signal.SIGKILL)         # mid-stream: some copies verified, some not
        waits.append(ks._sign_start(batches[3]))          # its copies meet a dead verifier
        (s1, f1), (s2, f2), (s3, f3) = [w() for w in waits]
        assert ks._vgone and ks._verifier is None
        assert f1 is None and f2 is None and all_verify(pub, batches[1], s1) and all_verify(pub, batches[2], s2)
        assert len(s3) == 49 and all_verify(pub, batches[3][:49], s3)   # never an unverified one
        assert isinstance(f3, KeystoreError) and "does not verify" in str(f3)
        assert here_counts[0] >= 50           # the fallback verified (at least the 4th batch's)
        r = reqs(9000, 70)
        more, failure = ks._sign_start(r)()   # later batches: checked here, the worker stopped copying
        assert failure is None and all_verify(pub, r, more)
    finally:
        ks.close()


def test_many_outstanding_chunks_do_not_deadlock(tmp_path, here_counts):
    """3 x 1 500 requests of 900 bytes outstanding before any reply is read, each chunk copied to
    the verifier: the worker never waits for it, the keystore never waits on a full pipe."""
    ks = faulty(tmp_path)
    pub = ks.public_key("seq")
    big = [reqs(k * 10_000, 1500, size=900) for k in range(3)]

    def run():
        waits = [ks._sign_start(b) for b in big]
        return [w() for w in waits]
    pid = ks._proc.pid
    try:
        done, got = in_thread(run, HANG_S)
        if not done:
            os.kill(pid, signal.SIGKILL)
        assert done, "deadlocked"
        assert [len(s) for s, _ in got] == [1500] * 3 and all(f is None for _, f in got)
        assert all(all_verify(pub, b, s) for b, (s, _) in zip(big, got))
        assert here_counts[0] == 0 and not ks._vgone
    finally:
        ks.close()


CHILD = r"""
import os, sys, json
from firmware_bridge import open_keystore, ReceiptIdentity
ks = open_keystore(json.loads(sys.argv[1]))
ks.generate_key("seq", "p256")
sigs, failure = ks._sign_start([("seq", ReceiptIdentity(b"g", e), b"x%d" % e) for e in range(100)])()
assert failure is None and len(sigs) == 100
print(ks._verifier.pid, ks._proc.pid, flush=True)
sys.stdin.read()     # the test kills this process here
"""


def _gone(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.split()[1:2] == ["Z"] for line in f if line.startswith("State:"))
    except FileNotFoundError:
        return True


def test_the_verifier_exits_with_its_parent_and_loads_no_pkcs11_library(tmp_path):
    conf = softhsm_token(tmp_path, "orphan")
    env = dict(os.environ, PYTHONPATH=ROOT)
    parent = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(conf)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, env=env, text=True)
    try:
        vpid, wpid = map(int, parent.stdout.readline().split())
        with open(f"/proc/{vpid}/maps") as f:
            maps = f.read()
        with open(f"/proc/{wpid}/maps") as f:
            assert "softhsm2" in f.read()     # the probe sees a loaded token library
        assert "softhsm2" not in maps and "_pkcs11" not in maps and "pkcs11" not in maps
        with open(f"/proc/{vpid}/cmdline") as f:
            assert "firmware_bridge.verify_worker" in f.read()
    finally:
        parent.kill()                         # no close(): the parent just dies
        parent.wait()
    for pid in (vpid, wpid):                  # both children follow within moments; HANG_S is "never"
        done, _ = in_thread(lambda: _wait_gone(pid), HANG_S)
        assert done, f"process {pid} outlived its parent"


def _wait_gone(pid):
    import time
    while not _gone(pid):
        time.sleep(0.05)
    return True


def _verifier_verdicts(pairs):
    """[(pub, digest, sig)] through a verifier process, one copy each: its verdicts."""
    r, w = os.pipe()
    proc = subprocess.Popen([sys.executable, "-m", "firmware_bridge.verify_worker", str(r)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, pass_fds=(r,), env=dict(os.environ, PYTHONPATH=ROOT), bufsize=0)
    os.close(r)
    names = {}
    out = []
    try:
        for seq, (pub, digest, sig) in enumerate(pairs, 1):
            if pub not in names:
                names[pub] = "k%d" % len(names)
                proc.stdin.write(encode_key(names[pub], pub))
            body = encode_items([(names[pub].encode(), digest, sig)])
            os.write(w, struct.pack(">IQQ", len(body) + 16, seq, 0) + body)
            aseq, count, ok = ANSWER.unpack(read_exact(proc.stdout.fileno(), 16))
            h = read_exact(proc.stdout.fileno(), 32)
            assert (aseq, count) == (seq, 1) and h == hashlib.sha256(body).digest()
            out.append(ok == 1)
    finally:
        os.close(w)
        proc.stdin.close()
        proc.wait(10)
    return out


def test_the_verifier_accepts_exactly_what_verify_p256_accepts_wycheproof():
    path = os.path.join(ROOT, "tests", "vectors", "wycheproof", "ecdsa_secp256r1_sha256_p1363_test.json")
    with open(path) as f:
        doc = json.load(f)
    pairs, expected, results = [], [], []
    for group in doc["testGroups"]:
        pub = bytes.fromhex(group["publicKey"]["uncompressed"])
        for key in (pub, compress_point(pub)):
            for t in group["tests"]:
                msg, sig = bytes.fromhex(t["msg"]), bytes.fromhex(t["sig"])
                pairs.append((key, hashlib.sha256(msg).digest(), sig))
                expected.append(verify_p256(key, msg, sig))
                results.append(t["result"])
    got = _verifier_verdicts(pairs)
    assert got == expected
    assert all(g for g, r in zip(got, results) if r == "valid") and not any(g for g, r in zip(got, results) if r == "invalid")
    assert sum(results.count(x) for x in ("valid", "invalid")) > 100


def test_the_worker_and_the_verifier_run_this_firmware_bridge_whatever_the_working_directory(tmp_path, monkeypatch):
    """`python -m` puts the working directory first on sys.path: started from a directory that
    holds another `firmware_bridge` (an old checkout, a copy) the worker and the verifier ran
    that one. They must run the keystore's own package."""
    decoy = tmp_path / "cwd" / "firmware_bridge"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise SystemExit('the decoy firmware_bridge was imported')\n")
    conf = softhsm_token(tmp_path, "cwd")
    monkeypatch.chdir(tmp_path / "cwd")
    ks = open_keystore(conf)
    try:
        ks.generate_key("seq", "p256")
        r = reqs(0, 2 * SIGN_MANY_CHUNK)
        sigs, failure = ks._sign_start(r)()
        assert failure is None and all_verify(ks.public_key("seq"), r, sigs)
        assert ks._verifier is not None and ks._verifier.poll() is None and not ks._vgone
    finally:
        ks.close()


def test_a_stopped_verifier_costs_one_deadline_then_this_process_verifies(tmp_path, here_counts):
    """A verifier that stops answering (SIGSTOP) never stops the token (the worker never waits for
    it); after the reply deadline it is killed and the keystore verifies in its own process. The
    deadline is scaled from the same batch signed just before, verifier running: the token meets
    it however slow the machine, the stopped verifier cannot."""
    conf = softhsm_token(tmp_path, "stopped")
    env = dict(conf["env"], PYTHONPATH=HERE)
    ks = FaultyKeystore(conf["module"], conf["token_label"], conf["pin"], env=env, timeout_s=HANG_S)
    try:
        ks.generate_key("seq", "p256")
        pub = ks.public_key("seq")
        first, failure = ks._sign_start(reqs(0, 10))()
        assert failure is None and here_counts[0] == 0
        (_sigs, failure), took = timed(lambda: ks._sign_start(reqs(50, 2 * SIGN_MANY_CHUNK))())
        assert failure is None and here_counts[0] == 0
        ks.timeout_s = scaled(took)
        vpid = ks._verifier.pid
        os.kill(vpid, signal.SIGSTOP)
        r = reqs(100, 2 * SIGN_MANY_CHUNK)
        done, got = in_thread(ks._sign_start(r), HANG_S)
        assert done, "wait() hung on a stopped verifier"
        sigs, failure = got
        assert failure is None and all_verify(pub, r, sigs)
        assert ks._vgone and ks._verifier is None and here_counts[0] == len(r)
        assert _gone(vpid)                    # killed and reaped
    finally:
        ks.close()
