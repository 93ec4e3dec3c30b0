"""A flood of requests from a broker client allowed to make them (docs/sequencer.md "A flood of
requests"): `sequencer run`'s memory stays bounded, and a member is still answered.

Before: run read and answered requests on one MQTT connection. paho keeps every QoS 1 answer
until the broker's PUBACK, which that connection's thread reads only between requests, and it
kept each request as paho's MQTT 5 message (~7.5 KB with its Properties) while the inbox counted
~0.5 KB. 20 000 `receipt` requests grew run's peak resident set by 182 MiB, 20 000 Commits for new
groups by 258 MiB (and 40 000 to 520 MB, with a minute without answers). Stopping intake while
answers were unacknowledged deadlocked: the thread that reads the PUBACKs was the one waiting for
room in the inbox. Now answers leave on a connection of their own (agent/outbox.py), the loop
takes nothing while they fill the outbox, and the inbox keeps a compact Delivery: 4-16 MiB.
"""
from __future__ import annotations

import os
import time

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.sequencer.framing import encode_private_message
from test_broker_sizes import G, peak_kib, serving

# what run may grow by under either flood below: its inbox (agent/inbox.py, 8 MiB) and its answers
# not yet acknowledged (serve.ANSWER_BACKLOG_BYTES, 8 MiB) with one turn's overshoot; measured
# 4-16 MiB, 182-258 MiB before
GROWTH_KIB = 32 << 10


def _flood(port: int, topics, qos: int, within: float = 120) -> int:
    """One request on each of ``topics`` (topic, payload), as fast as the broker takes them; the
    answers counted (every one is awaited, up to ``within`` s)."""
    c = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"mallory-{os.urandom(4).hex()}", protocol=paho.MQTTv5)
    c.max_inflight_messages_set(1000)
    got = []
    c.on_message = lambda _c, _u, message: got.append(1)
    c.connect("127.0.0.1", port)
    c.loop_start()
    c.subscribe("sovm-member/mallory/answers", 1)
    p = Properties(PacketTypes.PUBLISH)
    p.ResponseTopic = "sovm-member/mallory/answers"
    n = 0
    try:
        time.sleep(0.3)
        for topic, payload in topics:
            c.publish(topic, payload, qos=qos, properties=p)
            n += 1
        end = time.monotonic() + within
        while len(got) < n and time.monotonic() < end:
            time.sleep(0.2)
    finally:
        c.loop_stop()
        c.disconnect()
    return len(got)


def _still_answers(m, epoch: int) -> float:
    t = time.monotonic()
    assert m.request(f"sovm-seq/{G.hex()}/submit", encode_private_message(G, epoch))["accepted"] is True
    return time.monotonic() - t


def test_a_flood_of_receipt_requests_leaves_run_s_memory_bounded(tmp_path, broker):
    n = 20000
    with serving(tmp_path, broker.url, broker.port) as (_home, proc, m):
        _still_answers(m, 0)
        before = peak_kib(proc.pid)
        got = _flood(broker.port, ((f"sovm-seq/{os.urandom(16).hex()}/receipt", b"%d" % i) for i in range(n)), qos=1)
        grew = peak_kib(proc.pid) - before
        assert got == n
        assert _still_answers(m, 1) < 5
    assert grew < GROWTH_KIB, f"sequencer run grew {grew >> 10} MiB under {n} receipt requests"


def test_a_flood_of_commits_for_new_groups_leaves_run_s_memory_bounded(tmp_path, broker):
    """With --max-groups 2000 the groups themselves stay small (~1.2 KB each resident, bounded by
    the group limit: tests/sequencer/test_group_limit.py); the other 18 000 are answered
    group_limit, in bursts of one group-commit step's rejections."""
    n = 20000
    with serving(tmp_path, broker.url, broker.port, run_args=("--max-groups", "2000")) as (_home, proc, m):
        _still_answers(m, 0)
        before = peak_kib(proc.pid)
        commits = ((f"sovm-seq/{g.hex()}/submit", encode_private_message(g, 0))
                   for g in (os.urandom(16) for _ in range(n)))
        got = _flood(broker.port, commits, qos=1)
        grew = peak_kib(proc.pid) - before
        assert got == n
        assert _still_answers(m, 1) < 5
    assert grew < GROWTH_KIB, f"sequencer run grew {grew >> 10} MiB under {n} Commits for new groups"
