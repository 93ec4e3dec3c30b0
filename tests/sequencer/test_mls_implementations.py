"""Commits from MLS implementations we did not write, raced through `ssp-agent sequencer run` over a
real broker (§22.5, §22.7): mls-rs (UpdatePath Commits, PublicMessage), ts-mls (UpdatePath Commits,
PrivateMessage), and one group whose members mix the two (same cipher suite, 0x0001).

In every round two members build a Commit for the same epoch and submit them at once: exactly one is
accepted with a receipt, the other is told to rebuild (stale, with the winner's receipt); every member
takes the canonical Commit the sequencer published and reaches the same next epoch, which the equal
exporter secrets and the next round's framing show. The sequencer reads each Commit blind (framing
only), whatever implementation wrote it. rfc9420 (Python) races through `sequencer submit` in
test_real_mls.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess

import cbor2
import pytest
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.sequencer import member as validator
from agent.sequencer import receipts
from agent.sequencer.framing import CT_COMMIT, WIRE_PRIVATE, WIRE_PUBLIC, parse_mls_message
from tests.cli_cmd import agent_cmd, agent_env
from tests.sequencer.mls_impls import RsMember, TsHost, TsMember, found
from tests.sequencer.test_run_broker import Member as BrokerClient

ROUNDS = 20
CEILING = 300   # only catches a hang


@pytest.fixture
def sequencer(tmp_path, broker):
    home = tmp_path / "seq"
    init = subprocess.run([*agent_cmd(), "--home", str(home), "sequencer", "init"], capture_output=True,
                          text=True, env=agent_env())
    assert init.returncode == 0, init.stderr
    proc = subprocess.Popen([*agent_cmd(), "--home", str(home), "sequencer", "run", "--broker", broker.url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env())
    try:
        ready = json.loads(proc.stdout.readline())
        yield bytes.fromhex(ready["sequencer_key"]), broker
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(CEILING) == 0, proc.stderr.read()


@pytest.fixture
def ts_host():
    host = TsHost()
    yield host
    host.close()


def race(sequencer, members: list, gid: bytes, wire: dict) -> None:
    key, broker = sequencer
    clients = {m.name: BrokerClient(broker.port, m.name) for m in members}
    try:
        epoch = 1                                   # after the founding Commit
        first = clients[members[0].name]
        assert first.request(f"sovm-seq/{gid.hex()}/register", str(epoch).encode(), timeout=CEILING) == \
            {"group": gid.hex(), "epoch": epoch}
        chains = {m.name: validator.ReceiptChain(gid, key) for m in members}
        for rnd in range(ROUNDS):
            racers = [members[rnd % len(members)], members[(rnd + 1) % len(members)]]
            commits = {m.name: m.commit() for m in racers}
            for m in racers:
                f = parse_mls_message(commits[m.name])       # the implementation's framing, read blind
                assert (f.wire_format, f.group_id, f.epoch, f.content_type) == (wire[m.name], gid, epoch, CT_COMMIT)
            for m in racers:
                p = Properties(PacketTypes.PUBLISH)
                p.ResponseTopic, p.CorrelationData = clients[m.name].reply_to, m.name.encode()
                clients[m.name].c.publish(f"sovm-seq/{gid.hex()}/submit", commits[m.name], qos=1, properties=p)
            answers = {m.name: clients[m.name].answers.get(timeout=CEILING)[1] for m in racers}
            winners = [m for m in racers if answers[m.name]["accepted"]]
            assert len(winners) == 1, answers
            winner, receipt = winners[0], answers[winners[0].name]["receipt"]
            assert answers[winner.name]["epoch"] == epoch
            for m in racers:
                if m is not winner:
                    a = answers[m.name]
                    assert (a["reason"], a["head"], a["current_epoch"]) == ("stale_epoch", receipt, epoch + 1), a
            r = receipts.verify_receipt(bytes.fromhex(receipt), key)
            winner.accepted()
            for m in members:
                # every member takes the canonical Commit the sequencer published with its receipt
                topic, body, _retain = clients[m.name].published.get(timeout=CEILING)
                pub = cbor2.loads(body)
                assert topic == f"sovm-seq/{gid.hex()}/accepted" and pub["epoch"] == epoch
                assert pub["receipt"] == bytes.fromhex(receipt) and pub["commit"] == commits[winner.name]
                assert receipts.commit_hash(pub["commit"]) == r.commit_hash
                if m is not winner:
                    if m in racers:
                        m.rejected()
                    m.process(pub["commit"])
                assert chains[m.name].add(bytes.fromhex(receipt)) == validator.ACCEPTED
            assert len({m.secret() for m in members}) == 1, f"round {rnd}: the members' group states differ"
            epoch += 1
        assert not any(c.equivocation for c in chains.values())
        assert epoch == 1 + ROUNDS
    finally:
        for c in clients.values():
            c.close()


def test_mls_rs_members(sequencer):
    members = [RsMember(n) for n in ("alice", "bob", "carol")]
    found(gid := os.urandom(16), members)
    race(sequencer, members, gid, {m.name: WIRE_PUBLIC for m in members})


def test_ts_mls_members(sequencer, ts_host):
    members = [TsMember(ts_host, n) for n in ("alice", "bob", "carol")]
    found(gid := os.urandom(16), members)
    race(sequencer, members, gid, {m.name: WIRE_PRIVATE for m in members})


def test_mixed_group_mls_rs_and_ts_mls(sequencer, ts_host):
    """One group, two implementations: an mls-rs member founds it, a ts-mls member joins from its
    Welcome, and Commits of both kinds of framing race for the same epochs."""
    members = [RsMember("alice"), TsMember(ts_host, "bob"), RsMember("carol")]
    found(gid := os.urandom(16), members)
    race(sequencer, members, gid, {"alice": WIRE_PUBLIC, "bob": WIRE_PRIVATE, "carol": WIRE_PUBLIC})
