"""What one hostile broker client can make the sequencer and its members hold in memory
(docs/sequencer.md "Size limits").

Before: `sequencer run` and `commits run` announced no Maximum Packet Size, so the broker handed them
any PUBLISH up to MQTT's 256 MiB. One 100 MiB publish on a `submit` topic took `sequencer run` from
41 MB to 350 MB resident (paho's read buffer and the copies after it); a Pi Zero 2 W has 512 MB, and
the sequencer acknowledges a request only after answering it, so the broker redelivers the request
that killed it on every restart (a crash loop). A retained record on a group's `accepted` topic does
the same to every member that follows the group, on every connection.

Now each announces a Maximum Packet Size (the broker drops larger packets for that client): the
largest MLSMessage a sequencer reads (framing.MAX_MESSAGE_BYTES) or evidence request, plus the
packet's overhead; each member's holds one such Commit with its receipt. A Commit over that size is
refused where it enters (the queue, `sequencer submit`, the framing), so no member waits for an
answer that never comes. What waits between paho's network thread and the loop is bounded in bytes
(agent/inbox.py): QoS 0 publishes are not counted by any Receive Maximum.
"""
from __future__ import annotations

import json
import signal
import subprocess
import threading
import time
import types
import uuid
from contextlib import contextmanager
from typing import Iterator

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from agent import inbox
from agent.sequencer import framing
from agent.sequencer.framing import FramingError, encode_private_message, parse_mls_message
from test_run_broker import Member
from tests.cli_cmd import agent_cmd, agent_env
from tests.waiting import HANG_S

G = bytes.fromhex("5e" * 16)
HOSTILE = 48 << 20          # well above every limit, well below this machine's memory


def agent(home, *args):
    return subprocess.run([*agent_cmd(), "--home", str(home), *args], capture_output=True, text=True,
                          env=agent_env())


def peak_kib(pid: int) -> int:
    """The process's peak resident set (VmHWM) so far, in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    raise AssertionError("no VmHWM")


def hostile_client(port: int) -> paho.Client:
    c = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"mallory-{uuid.uuid4().hex[:8]}", protocol=paho.MQTTv5)
    c.connect("127.0.0.1", port)
    c.loop_start()
    return c


def member_with_a_commit(tmp_path) -> tuple:
    """A sequencer home and a member home whose queue holds one Commit for G at epoch 0."""
    seq_home, member = tmp_path / "seq", tmp_path / "m"
    key = json.loads(agent(seq_home, "sequencer", "init").stdout)["sequencer_key"]
    commit = tmp_path / "c0"
    commit.write_bytes(encode_private_message(G, 0, ciphertext=b"m" * 8))
    assert agent(member, "commits", "queue", str(commit), "--sequencer-key", key).returncode == 0
    return seq_home, member


def spawn(home, *args, env=None) -> subprocess.Popen:
    return subprocess.Popen([*agent_cmd(), "--home", str(home), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=agent_env(env))


def decided(member, within: float = 90) -> dict:
    """`commits status` once the member's Commit is no longer queued (or the time is up)."""
    end = time.monotonic() + within
    while True:
        st = json.loads(agent(member, "commits", "status").stdout)
        if (st["commits"] and st["commits"][0]["state"] != "queued") or time.monotonic() > end:
            return st
        time.sleep(0.3)


@contextmanager
def serving(tmp_path, url: str, port: int, env=None, credentials=None, run_args=()) -> Iterator[tuple]:
    """`sequencer run` on a fresh home (the installed command) and a member's client with group
    G registered at epoch 0; on leaving, SIGTERM and exit 0. Yields (home, process, member)."""
    home = tmp_path / "seq"
    assert agent(home, "sequencer", "init").returncode == 0
    proc = spawn(home, "sequencer", "run", "--broker", url, *run_args, env=env)
    m = None
    try:
        json.loads(proc.stdout.readline())
        m = Member(port, "alice", credentials=credentials)
        assert m.request(f"sovm-seq/{G.hex()}/register", b"0") == {"group": G.hex(), "epoch": 0}
        yield home, proc, m
    finally:
        if m is not None:
            m.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.stderr.read()


def stop(*procs) -> None:
    for p in procs:
        if p is not None:
            p.send_signal(signal.SIGTERM)
            p.wait(30)


def test_an_mls_message_over_the_limit_is_refused_by_the_framing():
    at = encode_private_message(G, 3, ciphertext=b"\x00" * (framing.MAX_MESSAGE_BYTES - 64))
    assert len(at) <= framing.MAX_MESSAGE_BYTES
    assert parse_mls_message(at).epoch == 3
    over = encode_private_message(G, 3, ciphertext=b"\x00" * framing.MAX_MESSAGE_BYTES)
    with pytest.raises(FramingError) as e:
        parse_mls_message(over)
    assert e.value.reason == "too_large"


def test_a_commit_over_the_limit_is_refused_where_it_enters(tmp_path):
    """`commits queue` (exit 2, nothing queued) and `sequencer submit` (unparseable, exit 2)."""
    big = tmp_path / "big"
    big.write_bytes(encode_private_message(G, 0, ciphertext=b"\x01" * framing.MAX_MESSAGE_BYTES))
    seq = tmp_path / "seq"
    key = json.loads(agent(seq, "sequencer", "init").stdout)["sequencer_key"]
    p = agent(tmp_path / "m", "commits", "queue", str(big), "--sequencer-key", key)
    assert p.returncode == 2 and "too_large" in p.stderr, (p.stdout, p.stderr)
    assert json.loads(agent(tmp_path / "m", "commits", "status").stdout)["commits"] == []
    p = agent(seq, "sequencer", "submit", str(big))
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert json.loads(p.stdout)["reason"] == "unparseable"
    assert json.loads(agent(seq, "sequencer", "status").stdout)["groups"] == []


def test_an_oversized_publish_never_reaches_the_sequencer(tmp_path, broker):
    """Through the installed command and a real mosquitto: 48 MiB published on a `submit` topic
    and on an `evidence` topic (QoS 1 and 0) leave `sequencer run`'s peak memory where it was, and
    the next Commit is accepted by the same process."""
    with serving(tmp_path, broker.url, broker.port) as (_home, proc, m):
        before = peak_kib(proc.pid)
        evil = hostile_client(broker.port)
        try:
            blob = b"\x00\x01\x00\x02" + b"\x00" * HOSTILE
            for topic, qos in ((f"sovm-seq/{G.hex()}/submit", 1), (f"sovm-seq/{G.hex()}/evidence", 0)):
                evil.publish(topic, blob, qos=qos).wait_for_publish(60)
        finally:
            evil.loop_stop()
        # delivered in order after the hostile ones: once it is answered, they were dealt with
        ans = m.request(f"sovm-seq/{G.hex()}/submit", encode_private_message(G, 0), timeout=60)
        assert ans["accepted"] is True, ans
        grown = peak_kib(proc.pid) - before
        assert grown < 16 * 1024, f"sequencer run's peak memory grew by {grown} KiB"
        assert proc.poll() is None


def test_a_retained_oversized_record_never_reaches_a_member(tmp_path, broker):
    """A 48 MiB retained record on the `accepted` topic of a group a member follows leaves
    `commits run`'s peak memory where it was; its Commit is still sequenced and decided."""
    seq_home, member = member_with_a_commit(tmp_path)
    evil = hostile_client(broker.port)
    evil.publish(f"sovm-seq/{G.hex()}/accepted", b"\xa0" * HOSTILE, qos=1, retain=True).wait_for_publish(60)
    evil.loop_stop()
    runner = spawn(member, "commits", "run", "--broker", broker.url)
    seq = None
    try:
        assert runner.stdout.readline()
        # the member follows G and has taken its retained records before the sequencer exists
        time.sleep(3)
        before = peak_kib(runner.pid)
        seq = spawn(seq_home, "sequencer", "run", "--broker", broker.url)
        json.loads(seq.stdout.readline())
        got = decided(member)["commits"]
        assert [c["state"] for c in got] == ["accepted"], got
        assert runner.poll() is None
        grown = peak_kib(runner.pid) - max(before, 0)
        assert peak_kib(runner.pid) < 100 * 1024 and grown < 16 * 1024, \
            f"commits run's peak memory is {peak_kib(runner.pid)} KiB (grew by {grown} KiB)"
    finally:
        stop(runner, seq)


def test_the_inbox_holds_at_most_its_budget_beyond_one_item():
    """The network thread waits while the queue holds its budget (so TCP pushes back on the
    broker); one item larger than the budget still passes alone; counted bytes go when taken."""
    box = inbox.Inbox(budget=100, size=len)
    box.put(b"x" * 60)
    box.put(b"y" * 30)
    assert box.held == 90
    done = threading.Event()

    def third():
        box.put(b"z" * 30)          # 120 > 100: waits for the loop to take something
        done.set()
    t = threading.Thread(target=third)
    t.start()
    assert not done.wait(0.3)
    assert box.get(timeout=HANG_S) == b"x" * 60
    assert done.wait(HANG_S)
    t.join()
    assert box.held == 60
    assert box.get_nowait() == b"y" * 30 and box.get_nowait() == b"z" * 30 and box.held == 0
    with pytest.raises(inbox.Empty):
        box.get_nowait()
    with pytest.raises(inbox.Empty):
        box.get(timeout=0.05)
    box.put(b"w" * 500)            # alone, over the budget: passes (it is already in memory)
    assert box.get_nowait() == b"w" * 500


def test_the_delivery_watch_probes_when_quiet_and_reconnects_when_the_probe_is_lost():
    w = inbox.DeliveryWatch(quiet_s=30, wait_s=10)
    assert w.next(100.0) is None                 # the quiet time starts
    w.delivered(120.0)
    assert w.next(149.0) is None
    assert w.next(150.0) == inbox.PROBE
    assert w.next(155.0) is None                 # waiting for it
    w.delivered(156.0)                           # it came back: nothing is stuck
    assert w.next(157.0) is None and w.probe_at is None
    assert w.next(186.0) == inbox.PROBE
    assert w.next(195.9) is None
    assert w.next(196.0) == inbox.RECONNECT      # not back within wait_s
    assert w.next(197.0) is None                 # a fresh quiet time after the reconnect
    assert (w.probes, w.reconnects) == (2, 1)


def test_the_watch_backs_off_while_reconnects_bring_nothing_and_stops_when_its_probe_is_refused():
    """A probe that cannot come back for another reason than stuck slots (an ACL) must not make an
    idle client reconnect every 40 s for ever: each reconnect that brought nothing fresh doubles
    the quiet time (a retained copy or our own probe is not fresh), fresh traffic resets it, and
    a probe the broker refused turns the watch off."""
    w = inbox.DeliveryWatch(quiet_s=30, wait_s=10)
    now = 0.0
    quiet = []
    for _ in range(9):
        start = now
        while w.next(now) != inbox.PROBE:
            now += 1
        quiet.append(now - start)
        while w.next(now) != inbox.RECONNECT:
            now += 1
        w.delivered(now, fresh=False)          # retained copies after the reconnect
    assert quiet == [30, 60, 120, 240, 480, 960, 1920, 3840, 3840], quiet
    w.delivered(now, fresh=True)               # a request from someone: the connection carries traffic
    assert w.backoff == 1
    start = now
    while w.next(now) != inbox.PROBE:
        now += 1
    assert now - start == 30
    w.refused()
    assert all(w.next(now + k) is None for k in range(0, 100_000, 997))


SLOW = {"SSP_AGENT_PROBE_QUIET_S": "2", "SSP_AGENT_PROBE_WAIT_S": "2"}


def test_a_broker_refusing_the_probe_turns_the_watch_off_once(tmp_path):
    """Under an ACL that lets `sequencer run` serve but not publish its probe, the broker refuses
    the probe (PUBACK "not authorized"): the watch is off, said once (`delivery_watch_off`), no
    reconnect is made for it, and requests are still served."""
    from agent.transport.broker import Broker, free_port, write_password_file
    write_password_file(tmp_path / "passwd", {"seq": "s", "alice": "a"})
    acl = ["user seq"] + [f"topic readwrite sovm-seq/+/{k}" for k in
                          ("submit", "register", "receipt", "evidence", "accepted", "lost", "discontinuity/+")]
    (tmp_path / "acl").write_text("\n".join(acl + ["topic write sovm-member/+/answers", "user alice", "topic readwrite #"]) + "\n")
    port = free_port()
    br = Broker(port=port, workdir=tmp_path / "broker", listener_conf=(
        f"listener {port} 127.0.0.1\nallow_anonymous false\npassword_file {tmp_path / 'passwd'}\n"
        f"acl_file {tmp_path / 'acl'}")).start()
    try:
        with serving(tmp_path, f"mqtt://seq:s@127.0.0.1:{port}", port, env=SLOW,
                     credentials=("alice", "a")) as (home, _proc, m):
            time.sleep(12)                          # quiet: several probe times of 2 s + 2 s
            ans = m.request(f"sovm-seq/{G.hex()}/submit", encode_private_message(G, 0), timeout=30)
            assert ans["accepted"] is True, ans
    finally:
        br.close()
    kinds = [e["kind"] for e in json.loads(agent(home, "sequencer", "status").stdout)["events"]]
    assert kinds.count("delivery_watch_off") == 1 and "deliveries_stuck" not in kinds, kinds


def oversized_qos1(port: int, topic: str, n: int = 120) -> None:
    """``n`` QoS 1 publishes over the receivers' Maximum Packet Size: mosquitto 2.0.11 drops each
    but keeps its in-flight slot, and our broker allows 100 in flight to a client."""
    c = hostile_client(port)
    try:
        for _ in range(n):
            c.publish(topic, b"\x00" * (framing.MAX_MESSAGE_BYTES + (64 << 10)), qos=1).wait_for_publish(60)
    finally:
        c.loop_stop()


def test_sequencer_run_comes_back_from_deliveries_stuck_behind_dropped_publishes(tmp_path, broker):
    """120 oversized QoS 1 publishes on a `submit` topic held every in-flight slot of `sequencer
    run` at the broker: nothing reached it any more (before: the next Commit was never answered).
    Its probe to itself does not come back, it reconnects, and the Commit is accepted."""
    with serving(tmp_path, broker.url, broker.port, env=SLOW) as (home, _proc, m):
        oversized_qos1(broker.port, f"sovm-seq/{G.hex()}/submit")
        ans = m.request(f"sovm-seq/{G.hex()}/submit", encode_private_message(G, 0), timeout=90)
        assert ans["accepted"] is True, ans
    events = json.loads(agent(home, "sequencer", "status").stdout)["events"]
    assert [e for e in events if e["kind"] == "deliveries_stuck"], events


def test_a_member_comes_back_from_deliveries_stuck_behind_dropped_publishes(tmp_path, broker):
    """The same against a member: 120 oversized QoS 1 publishes on its answer topic; its queued
    Commit is still sequenced and decided once its probe is lost and it reconnects."""
    seq_home, member = member_with_a_commit(tmp_path)
    member_id = json.loads(agent(member, "commits", "status").stdout)["member_id"]
    runner = spawn(member, "commits", "run", "--broker", broker.url, env=SLOW)
    seq = None
    try:
        assert runner.stdout.readline()
        time.sleep(1)
        oversized_qos1(broker.port, f"sovm-member/{member_id}/answers")
        seq = spawn(seq_home, "sequencer", "run", "--broker", broker.url)
        json.loads(seq.stdout.readline())
        st = decided(member)
        assert st["commits"][0]["state"] == "accepted", st
        assert [e for e in st["events"] if e["kind"] == "deliveries_stuck"], st["events"]
    finally:
        stop(runner, seq)


def test_a_delivery_keeps_and_counts_only_the_bytes_the_loop_needs():
    """A one-byte payload with 100 KB of user properties: the inbox keeps the payload, topic,
    response topic and correlation data (each counted), not paho's message with its properties
    (~7.5 KB beside its bytes, freed on the network thread), so neither a flood of small requests
    nor one of large properties passes the inbox budget as a few hundred bytes each."""
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    m = paho.MQTTMessage(1, b"sovm-seq/ab/submit")
    m.payload = b"x"
    bare = inbox.delivery_size(inbox.delivery(m))
    p = Properties(PacketTypes.PUBLISH)
    p.UserProperty = [("k", "v" * 100_000), ("k2", "w" * 10)]
    p.ResponseTopic = "r" * 1000
    p.CorrelationData = b"c" * 500
    m.properties = p
    d = inbox.delivery(m)
    assert (d.topic, d.payload, d.response_topic, d.correlation) == ("sovm-seq/ab/submit", b"x", "r" * 1000, b"c" * 500)
    assert not hasattr(d, "__dict__")       # slots: nothing else rides along
    assert inbox.delivery_size(d) == bare + 1000 + 500


def test_a_refused_probe_is_seen_even_when_its_puback_beats_the_publish_call():
    """paho's network thread may handle the PUBACK before `publish` returns the probe's mid to
    the loop: the refusal must not be lost to that race (the watch would then reconnect instead
    of turning off)."""
    class Racing:
        """A client whose PUBACK ("not authorized") is handled before publish returns."""
        def __init__(self):
            self.prober = None

        def publish(self, topic, payload, qos=0):
            mid = 7
            self.prober.on_publish(mid, types.SimpleNamespace(is_failure=True))
            return types.SimpleNamespace(mid=mid)

    c = Racing()
    p = inbox.Prober(c, "t/probe", inbox.DeliveryWatch(quiet_s=1, wait_s=1))
    c.prober = p
    assert p.step(0.0) is None          # the quiet time starts
    assert p.step(1.0) is None          # the probe goes out, refused at once
    assert p.step(1.5) == inbox.Prober.OFF
    assert all(p.step(t) is None for t in (3.0, 10.0, 100.0))


def test_a_stale_refusal_with_a_recycled_mid_does_not_turn_the_watch_off():
    """paho recycles packet ids: an earlier publish refused under the id the probe gets later (an
    answer to a topic the ACL denies) must not read as the probe refused."""
    class Client:
        def publish(self, topic, payload, qos=0):
            return types.SimpleNamespace(mid=7)

    p = inbox.Prober(Client(), "t/probe", inbox.DeliveryWatch(quiet_s=1, wait_s=1))
    p.on_publish(7, types.SimpleNamespace(is_failure=True))      # an answer refused long ago
    assert p.step(0.0) is None
    assert p.step(1.0) is None          # the probe goes out (mid 7 again), accepted
    assert p.step(1.5) is None and not p.watch.off


def test_a_closed_inbox_drops_what_the_network_thread_still_holds():
    """Closing (the client stopping) lets a network thread waiting for room go on: the item it
    held is dropped (a QoS 1 message not acknowledged comes again on the next connection), and so
    is anything put after; nothing waits for a loop that is gone."""
    box = inbox.Inbox(budget=10, size=len)
    box.put(b"x" * 10)
    done = threading.Event()

    def blocked():
        box.put(b"y" * 5)          # over the budget: waits
        done.set()
    t = threading.Thread(target=blocked)
    t.start()
    assert not done.wait(0.2)
    box.close()
    assert done.wait(HANG_S)
    t.join()
    box.put(b"z")
    assert box.qsize() == 1 and box.get_nowait() == b"x" * 10 and box.held == 0


def test_qos0_deliveries_do_not_hide_stuck_deliveries():
    """A QoS 0 PUBLISH takes no in-flight slot, so the broker still delivers it while every slot
    is held: a stream of them (a rogue's, or QoS 0 evidence) must not read as deliveries working,
    or the watch would never probe. A QoS 1 delivery, or our probe, does."""
    p = inbox.Prober(types.SimpleNamespace(), "t/probe", inbox.DeliveryWatch(quiet_s=1, wait_s=1))
    assert not p.on_message(types.SimpleNamespace(topic="t/other", qos=0, retain=False))
    assert p.watch.last is None
    assert not p.on_message(types.SimpleNamespace(topic="t/other", qos=1, retain=False))
    assert p.watch.last is not None
    p.watch.last = None
    assert p.on_message(types.SimpleNamespace(topic="t/probe", qos=1, retain=False))
    assert p.watch.last is not None
