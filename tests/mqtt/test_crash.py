"""A node SIGKILLed while absorbing a body: the body was never acked, so the broker redelivers
it and the node absorbs it (before the commit: applied now; after: duplicates)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .helpers import event_ids, make_nodes, runner, step_until, write
from tests.waiting import HANG_S

PROC = Path(__file__).with_name("node_proc.py")


def _spawn(home: Path, url: str, mode: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, str(PROC), str(home), url, mode], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, env=os.environ.copy())
    line = p.stdout.readline()
    assert line.strip() == b"ready", p.stderr.read().decode()[-2000:]
    return p


@pytest.mark.parametrize("mode", ["hang_in_apply", "hang_before_ack"])
def test_node_killed_mid_apply_gets_the_body_again(broker, tmp_path, mode):
    a, b = make_nodes(tmp_path, 2)
    b_home = b.home
    b.close()
    # a waits for b's answer longer than any hang ceiling: what b gets must come from the broker's
    # redelivery, not from a giving up on a slow answer and sending again (on a loaded machine b2
    # can take longer than the default 3 s to answer)
    ra = runner(a, broker, cadence_s=3600, realtime=False, answer_timeout_s=4 * HANG_S)
    proc = _spawn(b_home, broker.url, mode)
    try:
        # b's pull at its start answered first: a body pushed before a heard anything of b's
        # connection is, when b's pull then arrives, rightly taken as lost and sent again
        assert step_until([ra], lambda: ra.stats["pulls_answered"] >= 1, 10), ra.stats
        ids = {write(a, i, "k") for i in range(25)}
        ra.batch_cycle()
        marker = b_home / "hanging"
        deadline = time.monotonic() + HANG_S
        while not marker.exists() and time.monotonic() < deadline:
            ra.step(0.02)
        assert marker.exists(), proc.stderr.read1().decode() if proc.poll() is not None else "no body arrived"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        ra.step(0.05)
        assert ra.sync.cursor(b.site_id) == 0  # no answer, no advance
        from agent.node import Node
        b2 = Node.open(b_home)
        if mode == "hang_in_apply":
            assert event_ids(b2) == set()  # the transaction never committed
        else:
            assert event_ids(b2) == ids
        rb = runner(b2, broker, cadence_s=3600, realtime=False)
        try:
            # redelivered by the broker (DUP), without a new push from a
            assert step_until([ra, rb], lambda: rb.stats["redelivered"] >= 1 and ids <= event_ids(b2), 15)
            assert ra.stats["bodies_pushed"] == 1
            if mode == "hang_before_ack":
                assert rb.stats["duplicate"] == 25 and rb.stats["applied"] == 0
            else:
                assert rb.stats["applied"] == 25
            assert step_until([ra, rb], lambda: ra.sync.backlog(b2.site_id) == 0, 10)  # answered: advanced
            assert a.dump() == b2.dump()
        finally:
            rb.close()
            b2.close()
    finally:
        if proc.poll() is None:
            proc.kill()
        ra.close()
        a.close()
