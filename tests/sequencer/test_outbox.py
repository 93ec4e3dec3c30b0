"""agent/outbox.py: what one connection has published and the broker not yet acknowledged
(`sequencer run`'s answer connection, a node's link)."""
from __future__ import annotations

import threading
import types

from paho.mqtt.enums import MQTTErrorCode

from agent import outbox


class Client:
    """paho's publish side: mids in order, PUBACKs when the test says (``early``: before
    publish returns, as paho's network thread may)."""

    def __init__(self, rc=MQTTErrorCode.MQTT_ERR_SUCCESS) -> None:
        self.on_publish = None
        self.mid, self.rc, self.early = 0, rc, False

    def publish(self, topic, payload, qos=1, retain=False, properties=None):
        self.mid += 1
        if self.early:
            self.on_publish(self, None, self.mid, None, None)
        return types.SimpleNamespace(mid=self.mid, rc=self.rc)

    def ack(self, mid) -> None:
        self.on_publish(self, None, mid, None, None)


def test_a_publish_is_held_until_its_puback_even_one_that_beats_publish():
    c = Client()
    o = outbox.Outbox(c, budget=1 << 20, max_items=3)
    o.publish("t", b"x" * 10)
    assert o.pending() == 1 and o.held == 11 + outbox.ITEM_OVERHEAD
    c.early = True
    o.publish("t", b"y", properties=object())     # acknowledged before publish() returned
    assert o.pending() == 1 and not o._early       # counted as gone, nothing left behind
    c.early = False
    o.publish("t", b"z")
    o.publish("t", b"w")
    assert o.full()                                # 3 unacknowledged: the count bound
    c.ack(1)
    assert not o.full() and o.pending() == 2
    c.ack(3), c.ack(4)
    assert o.pending() == 0 and o.held == 0


def test_the_byte_bound_counts_the_properties_paho_keeps():
    c = Client()
    o = outbox.Outbox(c, budget=outbox.ITEM_OVERHEAD + outbox.PROPERTIES_OVERHEAD + 10, max_items=100)
    o.publish("t", b"", properties=None)
    assert not o.full()
    o.publish("t", b"", properties=object())
    assert o.full()


def test_what_paho_refuses_is_not_counted_and_a_queued_qos1_is():
    o = outbox.Outbox(Client(MQTTErrorCode.MQTT_ERR_NO_CONN), budget=1 << 20, max_items=10)
    o.publish("t", b"a", qos=0)      # QoS 0 while disconnected: dropped by paho, never reported
    assert o.pending() == 0
    o.publish("t", b"b", qos=1)      # QoS 1 while disconnected: kept, sent on the next connection
    assert o.pending() == 1
    full = outbox.Outbox(Client(MQTTErrorCode.MQTT_ERR_QUEUE_SIZE), budget=1 << 20, max_items=10)
    full.publish("t", b"c")
    assert full.pending() == 0


def test_flush_waits_for_the_last_puback_and_gives_up_at_its_timeout():
    c = Client()
    o = outbox.Outbox(c, budget=1 << 20, max_items=10)
    o.publish("t", b"a")
    o.publish("t", b"b")
    assert o.flush(0.05) is False
    threading.Timer(0.1, c.ack, (1,)).start()
    threading.Timer(0.2, c.ack, (2,)).start()
    assert o.flush(5) is True and o.pending() == 0


def test_a_puback_for_a_publish_made_elsewhere_leaves_nothing_behind():
    """A node's link shares its client with the delivery probe, whose PUBACKs reach ``acked``
    too (chained, ``own_on_publish=False``): one that comes while no publish is under way is
    not kept as an early mid (a later publish reusing that mid would never be counted)."""
    c = Client()
    c.on_publish = "the probe's"
    o = outbox.Outbox(c, budget=1 << 20, max_items=10, own_on_publish=False)
    assert c.on_publish == "the probe's"            # not taken
    c.on_publish = lambda _c, _u, mid, *_r: o.acked(mid)
    o.acked(7)                                     # the probe's PUBACK
    assert not o._early
    c.mid = 6
    o.publish("t", b"a")                           # mid 7, acknowledged later
    assert o.pending() == 1
    o.acked(7)
    assert o.pending() == 0
