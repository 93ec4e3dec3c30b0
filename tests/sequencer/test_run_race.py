"""The sequencer race under kills (the outside hostile run's scenario): two members, each on its
own MQTT connection, race competing Commits for the same epoch of the same groups into a real
`sequencer run` on a real mosquitto, and the sequencer is SIGKILLed at seeded points counted in
answers (after the k-th answer since its start, k drawn from 0 to 15: 0 is a kill while the
round's requests are in flight), then restarted. test_run_crash.py races one client's two Commits
with kills timed by the clock; here the racers are separate clients and the kill points are
events, so a slow machine gets the same schedule.

What must hold over everything either member ever received (answers and the retained `accepted`
publications): one receipt per (group, epoch), each verified and durable and re-served byte for
byte (test_sequencer_crash.Checker), every request answered across the restarts, and for each
(group, epoch) at most one of the racers' Commits accepted."""
from __future__ import annotations

import os
import queue
import random
import signal
import uuid

import cbor2
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.sequencer import receipts, service
from agent.sequencer.framing import encode_private_message

from test_run_broker import Member
from test_run_crash import start
from test_sequencer_crash import START, Checker
from tests.waiting import HANG_S, wait_until

GROUPS = list(START)[:2]
ROUNDS, KILLS = 40, 12


def test_two_members_race_while_the_sequencer_is_killed_at_counted_points(tmp_path, broker):
    home = tmp_path / "seq"
    service.init(home)
    with service.Sequencer(home) as s:
        for g in GROUPS:
            s.register(g, START[g])
    checker = Checker(str(home))
    members = {b"A": Member(broker.port, "racer-a"), b"B": Member(broker.port, "racer-b")}
    rng = random.Random(4711)
    epochs = {g: START[g] for g in GROUPS}
    winners: dict[tuple, set] = {}          # (group, epoch) -> the racers whose Commit it accepted
    proc = start(home, broker.url)
    kills, answers_since, kill_after = 0, 0, rng.randrange(0, 16)
    rounds = 0
    try:
        while rounds < ROUNDS or kills < KILLS:
            assert rounds < 20 * ROUNDS, (rounds, kills)
            rounds += 1
            sent: dict[bytes, tuple] = {}
            order = list(members.items())
            rng.shuffle(order)
            for who, m in order:
                for g in GROUPS:
                    corr = uuid.uuid4().bytes
                    p = Properties(PacketTypes.PUBLISH)
                    p.ResponseTopic = m.reply_to
                    p.CorrelationData = corr
                    m.c.publish(f"sovm-seq/{g.hex()}/submit",
                                encode_private_message(g, epochs[g], ciphertext=who + os.urandom(8)),
                                qos=1, properties=p)
                    sent[corr] = (who, g)
            if kill_after == 0:         # killed with the round's requests in flight
                proc.send_signal(signal.SIGKILL)
                proc.wait(HANG_S)
                kills += 1
                proc = start(home, broker.url)
                answers_since, kill_after = 0, rng.randrange(0, 16)
            lines = []

            def take() -> bool:
                nonlocal proc, kills, answers_since, kill_after
                got = False
                for who, m in members.items():
                    try:
                        corr, ans = m.answers.get_nowait()
                    except queue.Empty:
                        continue
                    got = True
                    if sent.pop(corr, None) is None:
                        continue       # a duplicate answer to a request answered before a kill
                    answers_since += 1
                    if ans["accepted"]:
                        g, e = bytes.fromhex(ans["group"]), ans["epoch"]
                        lines.append(f"REL {ans['group']} {e} {ans['receipt']}")
                        winners.setdefault((g, e), set()).add(who)
                        epochs[g] = max(epochs[g], e + 1)
                    else:
                        if ans["head"] is not None:
                            e = receipts.parse_receipt(bytes.fromhex(ans["head"])).epoch
                            lines.append(f"HEAD {ans['group']} {e} {ans['head']}")
                        if ans["current_epoch"] is not None and ans["group"] is not None:
                            g = bytes.fromhex(ans["group"])
                            epochs[g] = max(epochs[g], ans["current_epoch"])
                    if answers_since >= kill_after > 0:
                        proc.send_signal(signal.SIGKILL)
                        proc.wait(HANG_S)
                        kills += 1
                        proc = start(home, broker.url)
                        answers_since, kill_after = 0, rng.randrange(0, 16)
                return got or not sent

            while sent:
                assert proc.poll() is None, proc.communicate()[1][-3000:]
                wait_until(take, f"answers to {len(sent)} requests across restarts")
            for m in members.values():   # the retained publications: receipts let out as well
                while True:
                    try:
                        topic, body, _retain = m.published.get_nowait()
                    except queue.Empty:
                        break
                    if topic.endswith("/accepted") and body:
                        pub = cbor2.loads(body)
                        lines.append(f"REL {topic.split('/')[1]} {pub['epoch']} {pub['receipt'].hex()}")
            checker.feed(lines)
    finally:
        for m in members.values():
            m.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(HANG_S)
    checker.check_durable()
    print(f"race: {rounds} rounds, {kills} kills, {len(checker.released)} receipts released")
    assert kills >= KILLS and len(checker.released) >= ROUNDS // 2
    assert all(len(w) == 1 for w in winners.values()), {k: v for k, v in winners.items() if len(v) > 1}
    assert {who for w in winners.values() for who in w} == {b"A", b"B"}   # both racers won sometimes
    with service.Sequencer(home) as s:
        for (g, e), raw in checker.released.items():
            assert s.receipt(g, e) == raw
