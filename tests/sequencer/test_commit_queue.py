"""The member's Commit queue (§22.7 relay unavailability; agent/sequencer/client.py), with real
processes: `ssp-agent commits ...` against `ssp-agent sequencer run` on a real mosquitto.

- Commits queue durably while the broker is down, one outstanding per group; `commits run`, started
  before the broker exists, submits them when it comes up (resubmission on reconnect).
- Two members race from their queues: one accepted, the other `lost` with the canonical receipt,
  and only then may it queue its rebuilt Commit.
- First-Commit-wins with the answer lost: a Commit the sequencer accepted before the member ever
  heard back (and the group moved on) is `accepted` on resubmission, never `lost`.
"""
from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest

from agent.sequencer import receipts
from agent.sequencer.framing import encode_private_message
from agent.transport.broker import Broker, find_mosquitto, free_port
from tests.cli_cmd import agent_cmd, agent_env

G = bytes.fromhex("c3" * 16)


def agent(home, *args, check=None):
    p = subprocess.run([*agent_cmd(), "--home", str(home), *args], capture_output=True, text=True, env=agent_env())
    if check is not None:
        assert p.returncode == check, (p.stdout, p.stderr)
    return p


def spawn(home, *args):
    p = subprocess.Popen([*agent_cmd(), "--home", str(home), *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=agent_env())
    first = p.stdout.readline()
    assert first, p.stderr.read()
    return p, json.loads(first)


def stop(p) -> None:
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == 0, p.stderr.read()


def status(home) -> list[dict]:
    return json.loads(agent(home, "commits", "status", check=0).stdout)["commits"]


def wait_settled(home, n: int, limit: float = 90.0) -> list[dict]:
    """Poll the queue until n entries have an outcome (a generous bound: the outcome is asserted,
    not the time it took)."""
    end = time.monotonic() + limit
    while True:
        got = status(home)
        if sum(e["state"] != "queued" for e in got) >= n or time.monotonic() > end:
            return got
        time.sleep(0.3)


@pytest.fixture
def mosquitto_ok():
    if find_mosquitto() is None:
        pytest.fail("mosquitto is not installed (apt-get install mosquitto)")


def commit_file(tmp_path, name: str, epoch: int, tag: bytes, gid: bytes = G):
    f = tmp_path / name
    f.write_bytes(encode_private_message(gid, epoch, ciphertext=tag * 8))
    return f


def test_commits_queue_while_the_broker_is_down_and_go_out_on_reconnect(tmp_path, mosquitto_ok):
    seq_home, member = tmp_path / "seq", tmp_path / "member"
    key = json.loads(agent(seq_home, "sequencer", "init", check=0).stdout)["sequencer_key"]
    agent(seq_home, "sequencer", "register", "--group", G.hex(), "--epoch", "0", check=0)
    port = free_port()
    url = f"mqtt://127.0.0.1:{port}"
    c0 = commit_file(tmp_path, "c0", 0, b"m")
    queued = json.loads(agent(member, "commits", "queue", str(c0), "--sequencer-key", key, check=0).stdout)
    assert queued["state"] == "queued" and queued["epoch"] == 0
    # one outstanding Commit per group (§22.7: no divergent offline membership history)
    refused = agent(member, "commits", "queue", str(commit_file(tmp_path, "c1", 1, b"n")), check=2)
    assert "outstanding" in refused.stderr
    # nothing listens on the port: the send gives up, the Commit stays queued
    gone = agent(member, "commits", "send", "--broker", url, "--timeout", "2", check=1)
    assert json.loads(gone.stdout)["outstanding"] == 1 and "still queued" in gone.stderr
    assert [e["state"] for e in status(member)] == ["queued"]
    runner, hello = spawn(member, "commits", "run", "--broker", url)       # broker still down
    broker = Broker(port=port, workdir=tmp_path / "broker")
    seqp = None
    try:
        broker.start()
        seqp, _ = spawn(seq_home, "sequencer", "run", "--broker", url)
        got = wait_settled(member, 1)
        assert [e["state"] for e in got] == ["accepted"], got
        r = receipts.verify_receipt(bytes.fromhex(got[0]["receipt"]), bytes.fromhex(key))
        assert (r.group_id, r.epoch, r.commit_hash) == (G, 0, receipts.commit_hash(c0.read_bytes()))
        # the outcome frees the group: the member's next Commit may be queued, and goes out at once
        agent(member, "commits", "queue", str(commit_file(tmp_path, "c1", 1, b"n")), check=0)
        got = wait_settled(member, 2)
        assert [e["state"] for e in got] == ["accepted", "accepted"], got
        nxt = receipts.verify_receipt(bytes.fromhex(got[1]["receipt"]), bytes.fromhex(key))
        assert nxt.epoch == 1 and nxt.previous_receipt_hash == r.receipt_hash
    finally:
        stop(runner)
        if seqp is not None:
            stop(seqp)
        broker.close()


def test_competing_queued_commits_one_wins_the_other_learns_the_canonical_receipt(tmp_path, mosquitto_ok):
    seq_home = tmp_path / "seq"
    key = json.loads(agent(seq_home, "sequencer", "init", check=0).stdout)["sequencer_key"]
    agent(seq_home, "sequencer", "register", "--group", G.hex(), "--epoch", "4", check=0)
    members = [tmp_path / "alice", tmp_path / "bob"]
    files = [commit_file(tmp_path, f"c-{i}", 4, bytes([65 + i])) for i in range(2)]
    for m, f in zip(members, files):
        agent(m, "commits", "queue", str(f), "--sequencer-key", key, check=0)
    broker = Broker(workdir=tmp_path / "broker").start()
    seqp, _ = spawn(seq_home, "sequencer", "run", "--broker", broker.url)
    try:
        procs = [subprocess.Popen([*agent_cmd(), "--home", str(m), "commits", "send", "--broker", broker.url,
                                   "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=agent_env()) for m in members]
        outs = [json.loads(p.communicate(timeout=120)[0])["commits"][0] for p in procs]
        assert all(p.returncode == 0 for p in procs)
        states = sorted(o["state"] for o in outs)
        assert states == ["accepted", "lost"], outs
        won = next(o for o in outs if o["state"] == "accepted")
        lost = next(o for o in outs if o["state"] == "lost")
        # the loser holds the canonical Commit's receipt: it names the winner's Commit
        assert lost["receipt"] == won["receipt"] and lost["reason"] == "stale_epoch"
        canon = receipts.verify_receipt(bytes.fromhex(lost["receipt"]), bytes.fromhex(key))
        assert canon.commit_hash == bytes.fromhex(won["commit_hash"])
        # the loser rebuilds on the canonical Commit (epoch 5) and its rebuilt Commit is accepted
        loser = members[[o["state"] for o in outs].index("lost")]
        agent(loser, "commits", "queue", str(commit_file(tmp_path, "rebuilt", 5, b"R")), check=0)
        again = json.loads(agent(loser, "commits", "send", "--broker", broker.url, "--timeout", "60",
                                 check=0).stdout)["commits"]
        assert [e["state"] for e in again] == ["lost", "accepted"]
        assert receipts.verify_receipt(bytes.fromhex(again[1]["receipt"])).previous_receipt_hash == canon.receipt_hash
    finally:
        stop(seqp)
        broker.close()


@pytest.mark.parametrize("moved_on", [False, True])
def test_a_commit_accepted_while_its_answer_was_lost_is_accepted_not_lost(tmp_path, mosquitto_ok, moved_on):
    """The sequencer accepted the member's Commit but the answer never reached it (here: the bytes
    reached the sequencer by another path first). Resubmitted, it is answered stale_epoch; the
    member must find its own Commit in the receipt for its epoch — in the head, or (the group moved
    on) by asking for that epoch's receipt."""
    seq_home, member = tmp_path / "seq", tmp_path / "member"
    key = json.loads(agent(seq_home, "sequencer", "init", check=0).stdout)["sequencer_key"]
    agent(seq_home, "sequencer", "register", "--group", G.hex(), "--epoch", "0", check=0)
    mine = commit_file(tmp_path, "mine", 0, b"M")
    agent(member, "commits", "queue", str(mine), "--sequencer-key", key, check=0)
    first = json.loads(agent(seq_home, "sequencer", "submit", str(mine), check=0).stdout)
    if moved_on:
        agent(seq_home, "sequencer", "submit", str(commit_file(tmp_path, "next", 1, b"X")), check=0)
    broker = Broker(workdir=tmp_path / "broker").start()
    seqp, _ = spawn(seq_home, "sequencer", "run", "--broker", broker.url)
    try:
        out = json.loads(agent(member, "commits", "send", "--broker", broker.url, "--timeout", "60",
                               check=0).stdout)["commits"]
        assert [e["state"] for e in out] == ["accepted"], out
        assert out[0]["receipt"] == first["receipt"]      # exactly the receipt released for it
    finally:
        stop(seqp)
        broker.close()


def test_a_member_killed_at_random_times_loses_no_commit_and_misreads_no_outcome(tmp_path, mosquitto_ok):
    """`commits run` SIGKILLed at seeded random times while its Commits are being answered (some
    answers arrive to a dead process, some Commits are submitted twice): after a final `send`,
    every Commit is `accepted` with exactly the receipt the sequencer released for it — never
    `lost` (nothing competed), never queued twice."""
    import random
    rnd = random.Random(1404)
    seq_home, member = tmp_path / "seq", tmp_path / "member"
    key = json.loads(agent(seq_home, "sequencer", "init", check=0).stdout)["sequencer_key"]
    gids = [bytes([0xe0 + i]) * 16 for i in range(6)]
    for g in gids:
        agent(seq_home, "sequencer", "register", "--group", g.hex(), "--epoch", "0", check=0)
    for i, g in enumerate(gids):
        agent(member, "commits", "queue", str(commit_file(tmp_path, f"k{i}", 0, b"k", g)), "--sequencer-key", key,
              check=0)
    broker = Broker(workdir=tmp_path / "broker").start()
    seqp, _ = spawn(seq_home, "sequencer", "run", "--broker", broker.url)
    try:
        for _ in range(10):
            p = subprocess.Popen([*agent_cmd(), "--home", str(member), "commits", "run", "--broker", broker.url],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=agent_env())
            time.sleep(rnd.uniform(0.05, 1.2))
            p.kill()
            p.wait()
        out = json.loads(agent(member, "commits", "send", "--broker", broker.url, "--timeout", "60",
                               check=0).stdout)["commits"]
        assert [e["state"] for e in out] == ["accepted"] * len(gids), out
        for e in out:
            released = json.loads(agent(seq_home, "sequencer", "receipt", "--group", e["group"], "--epoch", "0",
                                        check=0).stdout)["receipt"]
            assert e["receipt"] == released
        st = json.loads(agent(seq_home, "sequencer", "status", check=0).stdout)
        assert sorted(g["current_epoch"] for g in st["groups"]) == [1] * len(gids)
    finally:
        stop(seqp)
        broker.close()


def test_the_member_keeps_the_heads_the_sequencer_publishes_for_its_groups(tmp_path, mosquitto_ok):
    """`commits run` follows the groups the member queued Commits for: every head the sequencer
    publishes there (retained `accepted`) is verified and kept — the Commits of other members
    included — and a head at a queued Commit's epoch decides it; `sequencing gossip --from-queue`
    then spreads them (tests/sequencer/test_gossip.py)."""
    seq_home, x, m = tmp_path / "seq", tmp_path / "x", tmp_path / "m"
    key = json.loads(agent(seq_home, "sequencer", "init", check=0).stdout)["sequencer_key"]
    agent(seq_home, "sequencer", "register", "--group", G.hex(), "--epoch", "0", check=0)
    broker = Broker(workdir=tmp_path / "broker").start()
    seqp, _ = spawn(seq_home, "sequencer", "run", "--broker", broker.url)
    runner = None
    try:
        agent(x, "commits", "queue", str(commit_file(tmp_path, "x0", 0, b"x")), "--sequencer-key", key, check=0)
        x0 = json.loads(agent(x, "commits", "send", "--broker", broker.url, "--timeout", "60", check=0).stdout)
        # m built a Commit for epoch 0 too; it follows G from now on
        agent(m, "commits", "queue", str(commit_file(tmp_path, "m0", 0, b"m")), "--sequencer-key", key, check=0)
        runner, _ = spawn(m, "commits", "run", "--broker", broker.url)
        agent(x, "commits", "queue", str(commit_file(tmp_path, "x1", 1, b"y")), check=0)
        x1 = json.loads(agent(x, "commits", "send", "--broker", broker.url, "--timeout", "60", check=0).stdout)
        want = [x0["commits"][0]["receipt"], x1["commits"][1]["receipt"]]
        end = time.monotonic() + 90
        while True:
            st = json.loads(agent(m, "commits", "status", check=0).stdout)
            if len(st["heads"]) >= 2 or time.monotonic() > end:
                break
            time.sleep(0.3)
        assert [h["receipt"] for h in st["heads"]] == want, st
        assert [(c["state"], c["receipt"]) for c in st["commits"]] == [("lost", want[0])]
    finally:
        if runner is not None:
            stop(runner)
        stop(seqp)
        broker.close()
