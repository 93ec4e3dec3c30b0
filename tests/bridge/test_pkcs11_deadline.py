"""A PKCS#11 token that stops answering (a real SoftHSM2 worker stopped with SIGSTOP: alive, pipes
open, silent) must not hang the keystore's caller for ever: after the reply deadline
(keystore config ``timeout_s``, docs/keystore.md "Reply deadline") the worker is killed, every
outstanding request fails with DeviceTimeout saying so, and the keystore stays unusable until
reopened, so nothing in flight is ever signed a second time (§22.5)."""
from __future__ import annotations

import os
import signal

import pytest

from firmware_bridge import (DeviceTimeout, KeystoreError, KeystoreUnavailable, OutcomeUnknown,
                             SigningBridge, Status, open_keystore)

from bridge_helpers import in_thread, receipt_item, receipt_protected, receipt_requests, softhsm_token
from tests.waiting import HANG_S

GROUP = b"group-pk11-deadline"


def reqs(lo, n):
    return receipt_requests(GROUP, lo, n)
DEADLINE_S = 1.0     # once the worker is stopped: it never answers, so any deadline is missed
JOIN_S = HANG_S      # far above the deadline: a join that runs out means "hung"


@pytest.fixture
def ks(tmp_path):
    # A token that answers, however slowly the machine runs it (open, key generation, the
    # signatures before the stop), has the hang ceiling as its deadline: DEADLINE_S is set when
    # the worker is stopped (stopped()), where nothing slow can miss it.
    k = open_keystore(dict(softhsm_token(tmp_path, "deadline"), timeout_s=HANG_S))
    assert k.timeout_s == HANG_S     # the profile's deadline is the keystore's
    k.generate_key("seq", "p256")
    pid = k._proc.pid
    yield k
    try:   # a test that failed may leave the worker stopped: end it (it is this test's own process)
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    k.close()


def stopped(ks):
    """Stop the worker (SIGSTOP): alive, its pipes open, it answers nothing; from now on the
    reply deadline is DEADLINE_S."""
    pid = ks._proc.pid
    os.kill(pid, signal.SIGSTOP)
    ks.timeout_s = DEADLINE_S
    return pid


def unstick(pid):
    """The worker killed by us if the keystore did not: the hung thread ends and the test fails cleanly."""
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def assert_deadline_message(exc):
    assert isinstance(exc, DeviceTimeout) and isinstance(exc, KeystoreError), exc
    msg = str(exc)
    assert f"did not answer within {DEADLINE_S:g} s" in msg and "killed" in msg
    assert "never signed again" in msg and "timeout_s" in msg


def assert_worker_gone(ks, pid):
    assert ks._proc is None
    with pytest.raises(ProcessLookupError):   # killed and reaped: no such process any more
        os.kill(pid, 0)
    sigs, failure = ks._sign_start(reqs(9000, 3))()           # nothing is sent (or signed) again
    assert sigs == [] and isinstance(failure, KeystoreUnavailable)
    with pytest.raises(KeystoreUnavailable, match="did not answer"):
        ks.public_key("seq")


def test_a_silent_worker_fails_every_outstanding_batch_after_the_deadline(ks):
    pid = stopped(ks)
    w1 = ks._sign_start(reqs(0, 10))       # 10 small requests fit in the pipe
    w2 = ks._sign_start(reqs(100, 10))
    assert len(ks._outstanding) == 2
    done, got = in_thread(w1, JOIN_S)
    if not done:
        unstick(pid)
    assert done, "wait() hung on a silent worker"
    sigs, failure = got
    assert sigs == []
    assert_deadline_message(failure)
    sigs2, failure2 = w2()                   # the other outstanding batch: the same failure, no wait
    assert sigs2 == [] and failure2 is failure
    assert_worker_gone(ks, pid)


def test_a_silent_worker_ends_sign_many_after_the_deadline(ks):
    first, _ = ks._sign_many(reqs(0, 3))     # the worker answers when it runs
    assert len(first) == 3
    pid = stopped(ks)
    done, got = in_thread(lambda: ks._sign_many(reqs(10, 200)), JOIN_S)
    if not done:
        unstick(pid)
    assert done, "_sign_many hung on a silent worker"
    sigs, failure = got
    assert sigs == []
    assert_deadline_message(failure)
    assert_worker_gone(ks, pid)


def test_a_silent_worker_ends_a_plain_call_after_the_deadline(ks):
    pid = stopped(ks)
    done, got = in_thread(lambda: ks.key_names(), JOIN_S)
    if not done:
        unstick(pid)
    assert done, "key_names() hung on a silent worker"
    assert_deadline_message(got)
    assert_worker_gone(ks, pid)


def test_release_pipelined_with_a_silent_worker_leaves_outcomes_unknown(ks, tmp_path):
    pub = ks.public_key("seq")
    prot = receipt_protected(pub)

    first, second = [receipt_item(GROUP, prot, e) for e in range(20)], [receipt_item(GROUP, prot, 100 + e) for e in range(20)]
    with SigningBridge(ks, str(tmp_path / "journal")) as bridge:
        _, t1 = bridge.release_pipelined(None, first)
        assert ks.key_names() == ["seq"]     # reads first's replies into its batch
        pid = stopped(ks)
        outs, t2 = bridge.release_pipelined(t1, second)
        assert len(outs) == 20 and all(bridge.status(i[0]) is Status.RELEASED for i in first)
        done, err = in_thread(lambda: bridge.release_pipelined(t2, []), JOIN_S)
        if not done:
            unstick(pid)
        assert done, "release_pipelined hung on a silent worker"
        assert_deadline_message(err)
        assert all(bridge.status(i[0]) is Status.OUTCOME_UNKNOWN for i in second)
        with pytest.raises(OutcomeUnknown):  # never signed a second time
            bridge.release_many(second[:1])
        assert_worker_gone(ks, pid)


@pytest.mark.parametrize("bad", [0, -1, "60", True, float("nan")])
def test_the_deadline_must_be_a_positive_number(tmp_path, bad):
    with pytest.raises(KeystoreError, match="timeout_s"):
        open_keystore(dict(softhsm_token(tmp_path, "bad"), timeout_s=bad))
