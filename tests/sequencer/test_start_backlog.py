"""`sequencer run` starting with more requests waiting in its persistent session than its inbox
holds (agent/inbox.py, 8 MiB).

Before: on connecting, the broker delivers what the session kept before the SUBACK of the
subscriptions run makes on every connection; paho's network thread put those requests into the
inbox until it was full and then waited for room, but the loop that empties it starts only once
start() has seen the SUBACK, which that same thread never read: start() timed out, and its
loop_stop() then waited for the thread, which waited for room, for ever. `sequencer run` hung
at start, serving nothing, on every restart while the backlog was there: found after a full disk
stopped run with ~600 Commits of 20 KB waiting (a client allowed to submit gets the same by
publishing 9 MiB of Commits while run is down). Now any delivery proves the session (its
subscriptions are the broker's), so start() returns and the loop takes the backlog; and start()
closes the inbox before stopping paho's thread, so a start that does fail exits.
"""
from __future__ import annotations

import json
import os
import select
import signal
import time

from agent import inbox
from agent.sequencer.framing import encode_private_message
from test_broker_sizes import agent, hostile_client, spawn
from test_run_broker import Member
from tests.waiting import HANG_S

G = bytes.fromhex("5e" * 16)


def test_run_starts_with_more_waiting_than_its_inbox_holds(tmp_path, broker):
    home = tmp_path / "seq"
    assert agent(home, "sequencer", "init").returncode == 0
    proc = spawn(home, "sequencer", "run", "--broker", broker.url)
    json.loads(proc.stdout.readline())          # its session and subscriptions exist now
    proc.send_signal(signal.SIGSTOP)            # a run that stops reading (a full disk, a crash)
    c = hostile_client(broker.port)             # Commits for new groups, delivered to it unread
    size = 1000 * 1000                          # Commits near the framing's 1 MiB
    n = inbox.BUDGET_BYTES // size + 4
    try:
        for _ in range(n):
            g = os.urandom(16)
            c.publish(f"sovm-seq/{g.hex()}/submit", encode_private_message(g, 0, ciphertext=b"x" * size),
                      qos=1).wait_for_publish(10)
    finally:
        c.loop_stop()
        c.disconnect()
    time.sleep(1)
    proc.kill()                                 # never acknowledged: the broker delivers them again
    proc.wait(10)
    proc = spawn(home, "sequencer", "run", "--broker", broker.url)
    m = None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], HANG_S)
        assert ready, f"sequencer run did not start within {HANG_S} s"
        assert "serving" in json.loads(proc.stdout.readline())
        m = Member(broker.port, "alice")
        assert m.request(f"sovm-seq/{G.hex()}/submit", encode_private_message(G, 0), timeout=HANG_S)["accepted"] is True
    finally:
        if m is not None:
            m.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except Exception:
            proc.kill()
            proc.wait(10)
            raise
    assert proc.returncode == 0
    st = json.loads(agent(home, "sequencer", "status").stdout)
    assert len(st["groups"]) == n + 1
