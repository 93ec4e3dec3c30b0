"""`sequencer run` stopped (SIGTERM) while answers are on their way: every request it counted in
its stop line is answered (docs/sequencer.md "A flood of requests").

Before: on stopping, run finished and answered what was in flight, then disconnected at once;
paho sends 20 QoS 1 publishes at a time and drops what it still holds on disconnect, so the
answers to most of a burst taken just before the stop never left (their requests were already
acknowledged, so the broker did not deliver them again either: members waited for their retry).
Now run waits, up to serve.CLOSE_FLUSH_S, for the broker to acknowledge every answer first.
"""
from __future__ import annotations

import json
import os
import signal
import time

from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.sequencer.framing import encode_private_message
from test_broker_sizes import agent, spawn
from test_run_broker import Member
from tests.waiting import HANG_S


def test_every_request_counted_at_stop_was_answered(tmp_path, broker):
    home = tmp_path / "seq"
    assert agent(home, "sequencer", "init").returncode == 0
    proc = spawn(home, "sequencer", "run", "--broker", broker.url)
    json.loads(proc.stdout.readline())
    m = Member(broker.port, "burst")
    n = 3000
    try:
        p = Properties(PacketTypes.PUBLISH)
        p.ResponseTopic = m.reply_to
        proc.send_signal(signal.SIGSTOP)    # the burst waits for run (the broker's in-flight window
        for i in range(n):                  # of 100 in its socket), so its first turn takes them all
            g = os.urandom(16)
            p.CorrelationData = g
            m.c.publish(f"sovm-seq/{g.hex()}/submit", encode_private_message(g, 0), qos=1, properties=p)
        time.sleep(1)
        proc.send_signal(signal.SIGCONT)
        m.answers.get(timeout=HANG_S)   # run is answering the burst: stop it now
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        stopped = json.loads(out.splitlines()[-1])
        time.sleep(1)               # what the broker had is delivered by now
        got = 1 + m.answers.qsize()
    finally:
        m.close()
        if proc.poll() is None:
            proc.kill()
    assert stopped["submits"] >= 50, stopped        # the stop came in the middle of the burst
    assert got == stopped["submits"], (got, stopped)


def test_run_with_no_broker_there_exits_1_naming_it(tmp_path):
    """Both connections are awaited at start; neither comes: a local fault (exit 1) that names
    the broker, and nothing hangs (both network threads are stopped)."""
    home = tmp_path / "seq"
    assert agent(home, "sequencer", "init").returncode == 0
    t = time.monotonic()
    got = agent(home, "sequencer", "run", "--broker", "mqtt://127.0.0.1:1", "--connect-timeout", "1")
    assert got.returncode == 1, (got.returncode, got.stderr)
    assert "127.0.0.1:1 unreachable" in got.stderr
    assert time.monotonic() - t < 30
