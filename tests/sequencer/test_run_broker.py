"""`ssp-agent sequencer run --broker URL` against a real mosquitto: requests and answers over MQTT 5
(response topic + correlation data), the canonical Commit and its receipt published retained,
reads beside the running server, refusal of local writes, SIGTERM."""
from __future__ import annotations

import json
import queue
import signal
import subprocess
import uuid

import cbor2
import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent import inbox
from agent.sequencer import receipts
from agent.sequencer.framing import encode_private_message
from tests.cli_cmd import agent_cmd, agent_env
from tests.waiting import HANG_S

G = bytes.fromhex("a7" * 16)


class Member:
    """A member's MQTT client: requests with a response topic, answers by correlation data."""

    def __init__(self, url_port: int, name: str, credentials: tuple[str, str] | None = None) -> None:
        self.answers: "queue.Queue" = queue.Queue()
        self.published: "queue.Queue" = queue.Queue()
        self.reply_to = f"sovm-member/{name}-{uuid.uuid4().hex[:12]}/answers"
        self.c = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"{name}-{uuid.uuid4().hex[:8]}",
                             protocol=paho.MQTTv5)
        self.c.on_message = self._msg
        if credentials is not None:
            self.c.username_pw_set(*credentials)
        self.c.connect("127.0.0.1", url_port)
        self.c.loop_start()
        self.c.subscribe([(self.reply_to, 1), ("sovm-seq/+/accepted", 1), ("sovm-seq/+/discontinuity/+", 1)])

    def _msg(self, client, userdata, msg) -> None:
        if msg.topic == self.reply_to:
            self.answers.put((bytes(msg.properties.CorrelationData), json.loads(msg.payload)))
        else:
            self.published.put((msg.topic, bytes(msg.payload), msg.retain))

    def request(self, topic: str, payload: bytes, timeout: float = 20.0) -> dict:
        corr = uuid.uuid4().bytes
        p = Properties(PacketTypes.PUBLISH)
        p.ResponseTopic = self.reply_to
        p.CorrelationData = corr
        self.c.publish(topic, payload, qos=1, properties=p)
        got_corr, body = self.answers.get(timeout=timeout)
        assert got_corr == corr
        return body

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def cli(home, *args):
    return subprocess.run([*agent_cmd(), "--home", str(home), "sequencer", *args],
                          capture_output=True, text=True, env=agent_env())


def test_run_serves_groups_through_the_broker(tmp_path, broker):
    home = tmp_path / "seq"
    key = bytes.fromhex(json.loads(cli(home, "init").stdout)["sequencer_key"])
    proc = subprocess.Popen([*agent_cmd(), "--home", str(home), "sequencer", "run",
                             "--broker", broker.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=agent_env())
    members = []
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["sequencer_key"] == key.hex()
        members = [Member(broker.port, n) for n in ("alice", "bob", "carol")]
        assert members[0].request(f"sovm-seq/{G.hex()}/register", b"5") == {"group": G.hex(), "epoch": 5}
        # three members race Commits for epoch 5: exactly one accepted, the others told to rebuild
        for m, tag in zip(members, (b"a", b"b", b"c")):
            p = Properties(PacketTypes.PUBLISH)
            p.ResponseTopic = m.reply_to
            p.CorrelationData = tag
            m.c.publish(f"sovm-seq/{G.hex()}/submit", encode_private_message(G, 5, ciphertext=tag * 8), qos=1,
                        properties=p)
        answers = [m.answers.get(timeout=HANG_S)[1] for m in members]
        won = [a for a in answers if a["accepted"]]
        assert len(won) == 1
        for a in answers:
            if not a["accepted"]:
                assert a["reason"] == "stale_epoch" and a["head"] == won[0]["receipt"] and a["current_epoch"] == 6
        r = receipts.verify_receipt(bytes.fromhex(won[0]["receipt"]), key)
        # every member sees the canonical Commit and its receipt published by the sequencer
        for m in members:
            topic, body, _retain = m.published.get(timeout=HANG_S)
            pub = cbor2.loads(body)
            assert topic == f"sovm-seq/{G.hex()}/accepted" and pub["receipt"] == bytes.fromhex(won[0]["receipt"])
            assert receipts.commit_hash(pub["commit"]) == r.commit_hash and pub["epoch"] == 5
        # a member arriving later gets the retained head
        late = Member(broker.port, "dave")
        members.append(late)
        topic, body, retain = late.published.get(timeout=HANG_S)
        assert retain and cbor2.loads(body)["receipt"] == bytes.fromhex(won[0]["receipt"])
        # the member-side validator keeps the head it heard on the broker, without asking the sequencer
        from agent.sequencer import member as validator
        chain = validator.ReceiptChain(G, key)
        assert chain.observe_head(cbor2.loads(body)["receipt"]) == validator.ACCEPTED
        assert late.request(f"sovm-seq/{G.hex()}/receipt", b"5") == {"receipt": won[0]["receipt"]}
        assert late.request(f"sovm-seq/{G.hex()}/receipt", b"6") == {"receipt": None, "absent": True,
                                                                      "discontinuity": False}
        # beside the running server: reads answer from its committed state; writes are refused
        st = cli(home, "status")
        assert st.returncode == 0, st.stderr
        status = json.loads(st.stdout)
        assert status["serving"] is True and status["groups"][0]["current_epoch"] == 6
        got = cli(home, "receipt", "--group", G.hex(), "--epoch", "5")
        assert json.loads(got.stdout) == {"receipt": won[0]["receipt"]}
        f = tmp_path / "m"
        f.write_bytes(encode_private_message(G, 6))
        refused = cli(home, "submit", str(f))
        assert refused.returncode == 2 and "through the broker" in refused.stderr
    finally:
        for m in members:
            m.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, proc.stderr.read()
    # after the server stopped, the CLI owns the home again and the state is where it left it
    f = tmp_path / "m"
    ok = cli(home, "submit", str(f))
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["epoch"] == 6


def test_commits_queue_while_the_sequencer_is_down(tmp_path, broker):
    """§22.7 relay unavailability: while `sequencer run` is down, members' Commits wait in the
    broker (the sequencer's persistent session keeps its subscription) and are sequenced, in
    order, when it is back: the first accepted, the competing one told to rebuild."""
    home = tmp_path / "seq"
    key = bytes.fromhex(json.loads(cli(home, "init").stdout)["sequencer_key"])
    cli(home, "register", "--group", G.hex(), "--epoch", "0")

    def start():
        p = subprocess.Popen([*agent_cmd(), "--home", str(home), "sequencer", "run",
                              "--broker", broker.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=agent_env())
        assert json.loads(p.stdout.readline())["sequencer_key"] == key.hex()
        return p
    proc = start()                      # creates the persistent session and its subscriptions
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(20) == 0
    m = Member(broker.port, "erin")
    try:
        sent = []
        for tag in (b"first", b"second"):
            p = Properties(PacketTypes.PUBLISH)
            p.ResponseTopic = m.reply_to
            p.CorrelationData = tag
            m.c.publish(f"sovm-seq/{G.hex()}/submit", encode_private_message(G, 0, ciphertext=tag * 4), qos=1,
                        properties=p).wait_for_publish(10)
            sent.append(tag)
        assert m.answers.empty()
        proc = start()
        got = dict(m.answers.get(timeout=HANG_S) for _ in sent)
        assert got[b"first"]["accepted"] is True
        assert got[b"second"]["reason"] == "stale_epoch" and got[b"second"]["head"] == got[b"first"]["receipt"]
    finally:
        m.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(20)


def test_requests_handled_together_keep_their_arrival_order(tmp_path, broker):
    """`sequencer run` takes what has arrived at once: consecutive submits become one group commit
    (Sequencer.submit_many), and a register or receipt request in between still sees exactly the
    submits before it. The batch is handed to the real Server over a real broker; only its
    grouping is chosen here (the broker's delivery timing decides it in production)."""
    from paho.mqtt.client import MQTTMessage
    from agent.sequencer import serve, service
    home = tmp_path / "seq"
    service.init(home)
    seq = service.Sequencer(home, serve=True)
    server = serve.Server(seq, serve.BrokerSettings.from_url(broker.url))
    server.start()
    m = Member(broker.port, "frank")
    H = bytes.fromhex("b8" * 16)

    def msg(topic: str, payload: bytes, corr: bytes) -> inbox.Delivery:
        x = MQTTMessage(topic=topic.encode())
        x.payload, x.qos = payload, 0
        x.properties = Properties(PacketTypes.PUBLISH)
        x.properties.ResponseTopic = m.reply_to
        x.properties.CorrelationData = corr
        return inbox.delivery(x)          # as the network thread hands it to the loop
    try:
        batch = [msg(f"sovm-seq/{G.hex()}/register", b"3", b"reg"),
                 msg(f"sovm-seq/{G.hex()}/submit", encode_private_message(G, 3, ciphertext=b"w" * 8), b"win"),
                 msg(f"sovm-seq/{G.hex()}/submit", encode_private_message(G, 3, ciphertext=b"l" * 8), b"lose"),
                 msg(f"sovm-seq/{H.hex()}/submit", encode_private_message(H, 0), b"other"),
                 msg(f"sovm-seq/{G.hex()}/receipt", b"3", b"rcpt"),
                 msg(f"sovm-seq/{G.hex()}/submit", encode_private_message(G, 4), b"next")]
        server.handle_many(batch)
        got = dict(m.answers.get(timeout=HANG_S) for _ in batch)
        assert got[b"reg"] == {"group": G.hex(), "epoch": 3}
        assert got[b"win"]["accepted"] and got[b"win"]["epoch"] == 3
        assert got[b"lose"]["reason"] == "stale_epoch" and got[b"lose"]["head"] == got[b"win"]["receipt"]
        assert got[b"other"]["accepted"] and got[b"other"]["epoch"] == 0
        assert got[b"rcpt"] == {"receipt": got[b"win"]["receipt"]}
        nxt = receipts.verify_receipt(bytes.fromhex(got[b"next"]["receipt"]), seq.public_key)
        assert nxt.epoch == 4 and nxt.previous_receipt_hash == receipts.receipt_hash(bytes.fromhex(got[b"win"]["receipt"]))
        # the three submits before the receipt request were one group commit, the last one another
        assert server.stats == {"submits": 4, "submit_batches": 2}
    finally:
        m.close()
        server.close()
        seq.close()
