"""A request to `sequencer run` is acknowledged to the broker only once the broker holds its
answer: acknowledged on the answer's queueing, a kill between the two lost both (the request was
never redelivered, the answer never left), and the member waited for nothing."""
from __future__ import annotations

import types

from agent import inbox, outbox
from agent.sequencer import serve

G = bytes.fromhex("a7" * 16)


class Held:
    """paho's side of the answer connection: publishes are kept until ``puback`` (the broker's)."""

    def __init__(self) -> None:
        self.published: list = []
        self.on_publish = None

    def publish(self, topic, payload, qos=0, retain=False, properties=None):
        self.published.append(topic)
        return types.SimpleNamespace(rc=0, mid=len(self.published))

    def puback(self, mid: int) -> None:
        self.on_publish(self, None, mid)


class Requests:
    def __init__(self) -> None:
        self.acked: list = []

    def ack(self, mid, qos):
        self.acked.append(mid)

    def is_connected(self):
        return False


def request(kind: str, payload: bytes, mid: int):
    props = types.SimpleNamespace(ResponseTopic=f"{serve.ANSWER_ROOT}/m1/answers", CorrelationData=b"c%d" % mid)
    return inbox.delivery(types.SimpleNamespace(topic=f"sovm-seq/{G.hex()}/{kind}", payload=payload, qos=1,
                                                mid=mid, retain=False, properties=props))


def test_a_request_is_acknowledged_once_the_broker_holds_its_answer(seq):
    srv = serve.Server(seq, serve.BrokerSettings("127.0.0.1", 1))
    srv.client, answers = Requests(), Held()
    srv.out = outbox.Outbox(answers, serve.ANSWER_BACKLOG_BYTES, serve.ANSWER_BACKLOG_ITEMS)
    seq.register(G, 0)
    srv.handle_many([request("receipt", b"0", 7), request("register", b"1", 8)])
    assert answers.published == [f"{serve.ANSWER_ROOT}/m1/answers"] * 2
    assert srv.client.acked == []                # a kill now: both requests come back
    answers.puback(2)
    assert srv.client.acked == [8]
    answers.puback(1)
    assert srv.client.acked == [8, 7]


def test_an_answer_acknowledged_while_it_is_published_acknowledges_its_request(seq):
    srv = serve.Server(seq, serve.BrokerSettings("127.0.0.1", 1))
    srv.client, answers = Requests(), Held()
    srv.out = outbox.Outbox(answers, serve.ANSWER_BACKLOG_BYTES, serve.ANSWER_BACKLOG_ITEMS)
    publish = answers.publish

    def early(*a, **kw):                       # the PUBACK read before publish() returned
        info = publish(*a, **kw)
        answers.puback(info.mid)
        return info
    answers.publish = early
    srv.handle_many([request("receipt", b"0", 3)])
    assert srv.client.acked == [3]
