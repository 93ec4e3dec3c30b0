"""SIGKILL `sequencer run` while members send competing Commits through a real mosquitto, restart
it, repeat (SOVM §22.5 cl. 1-3 through the broker). Requests are acknowledged to the broker only
once the broker holds their answer, so a request cut by a kill is redelivered to the restarted server.
The checker of test_sequencer_crash.py then holds over every answer any member ever received:
one receipt per (group, epoch), every released receipt durable and re-served byte for byte, the
epoch never ahead of a receipt or a recorded gap, the chain continuous."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import time
import uuid

import pytest

from agent.sequencer import receipts, service
from agent.sequencer.framing import encode_private_message
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from test_run_broker import Member
from test_sequencer_crash import START, Checker
from tests.cli_cmd import agent_cmd, agent_env
from tests.soak import sample
from tests.waiting import HANG_S

GROUPS = list(START)
BARREN = 3
ROUNDS, KILLS = sample(40, 100), sample(10, 20)    # tools/soak.sh runs the whole trial


def start(home, url):
    p = subprocess.Popen([*agent_cmd(), "--home", str(home), "sequencer", "run", "--broker", url],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env())
    line = p.stdout.readline()
    assert line, p.stderr.read()
    return p


def test_kill_run_while_members_race(tmp_path, broker):
    home = tmp_path / "seq"
    service.init(home)
    with service.Sequencer(home) as s:
        s.register(GROUPS[0], START[GROUPS[0]])
        s.register(GROUPS[1], START[GROUPS[1]])
    checker = Checker(str(home))
    member = Member(broker.port, "racer")
    rng = random.Random(1919)
    epochs = dict(START)
    proc = start(home, broker.url)
    kills, lines, deadline_kill = 0, [], time.monotonic() + rng.uniform(0.2, 0.8)
    # Kills come by time; on a slow machine a restarted server killed again and again before it
    # answers anything would never progress. At most BARREN kills in a row land before an answer.
    barren = 0
    try:
        rounds = 0
        # Rounds until both the receipts and the kills are there (kills come by time, so a loaded
        # machine needs more rounds for the same number), bounded.
        while (rounds < ROUNDS or kills < KILLS) and rounds < 10 * ROUNDS:
            rounds += 1
            sent = {}
            for g in GROUPS:
                for who in (b"a", b"b"):
                    corr = uuid.uuid4().bytes
                    p = Properties(PacketTypes.PUBLISH)
                    p.ResponseTopic = member.reply_to
                    p.CorrelationData = corr
                    member.c.publish(f"sovm-seq/{g.hex()}/submit",
                                     encode_private_message(g, epochs[g], ciphertext=who + os.urandom(8)),
                                     qos=1, properties=p)
                    sent[corr] = g
            end = time.monotonic() + HANG_S
            while sent and time.monotonic() < end:
                if time.monotonic() > deadline_kill and barren < BARREN:
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(10)
                    kills += 1
                    barren += 1
                    proc = start(home, broker.url)
                    deadline_kill = time.monotonic() + rng.uniform(0.2, 0.8)
                try:
                    corr, ans = member.answers.get(timeout=0.2)
                except Exception:
                    continue
                barren = 0
                g = sent.pop(corr, None) or bytes.fromhex(ans["group"])
                if ans["accepted"]:
                    lines.append(f"REL {ans['group']} {ans['epoch']} {ans['receipt']}")
                    epochs[g] = max(epochs[g], ans["epoch"] + 1)
                else:
                    if ans["head"] is not None:
                        e = receipts.parse_receipt(bytes.fromhex(ans["head"])).epoch
                        lines.append(f"HEAD {ans['group']} {e} {ans['head']}")
                    if ans["current_epoch"] is not None:
                        epochs[g] = max(epochs[g], ans["current_epoch"])
            assert not sent, f"requests never answered across restarts: {len(sent)}"
            checker.feed(lines)
            lines = []
    finally:
        member.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)
    checker.check_durable()
    print(f"run crash test: {kills} kills, {len(checker.released)} receipts released")
    assert kills >= KILLS and len(checker.released) >= ROUNDS
    with service.Sequencer(home) as s:
        for (g, e), raw in checker.released.items():
            assert s.receipt(g, e) == raw
