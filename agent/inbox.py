"""What an MQTT client's network thread hands its loop, bounded in bytes, and whether anything can
still arrive (docs/sequencer.md "Size limits", docs/mqtt.md "Memory bound").

A Receive Maximum bounds only the QoS 1 and 2 publishes out to a client; a flood of QoS 0 ones is
not counted by anything, so a plain queue between paho's network thread and the loop grows as
fast as a hostile publisher sends while the loop is busy. Here ``put`` (on the network thread)
waits while what is queued holds the budget: paho stops reading the socket, TCP pushes back on the
broker, and the loop drains what it has. Nothing is dropped (a QoS 1 request is acknowledged only
after its answer). An item arriving at an empty queue always passes, whatever its size: it is in
memory already, and the Maximum Packet Size the client announced bounded it.

Only the network thread waits here; the loop never does while it holds anything paho needs
(with ``loop_start`` a publish or an ack from the loop only queues the packet).
"""
from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from queue import Empty
from typing import Callable, Generic, Optional, TypeVar

T = TypeVar("T")

__all__ = ["BUDGET_BYTES", "Delivery", "DeliveryWatch", "Empty", "Inbox", "PACKET_OVERHEAD", "Prober",
           "delivery", "delivery_size", "drop_connection"]

# What a loop's inbox holds before the network thread waits: a few of the largest packets, and a
# few thousand small ones (a Pi Zero 2 W has 512 MB).
BUDGET_BYTES = 8 << 20
# Counted per message besides its payload and topic: a ``Delivery`` (or the node's own record,
# agent/transport/mqtt.py) and the queue entry (so a flood of empty publishes is bounded too).
ITEM_OVERHEAD = 512
# A PUBLISH beyond its payload: topic, response topic, correlation data, user properties of a
# request or record this project sends (each a few hundred bytes at most), with room to spare.
PACKET_OVERHEAD = 16 << 10


@dataclass(frozen=True, slots=True)
class Delivery:
    """One PUBLISH as a loop needs it. paho's MQTT 5 message holds ~7.5 KB beside its bytes
    (its Properties objects, an MQTTMessageInfo with a Condition); a budget counting ~0.5 KB an
    item let a flood of small requests hold ~15 times the budget (docs/sequencer.md "A flood of
    requests"), so the network thread keeps only this and paho's message is freed at once."""
    topic: str
    payload: bytes
    qos: int
    mid: int
    retain: bool
    response_topic: Optional[str]
    correlation: Optional[bytes]


def delivery(msg) -> Delivery:
    """What the loop keeps of a paho message (on the network thread, before the inbox)."""
    props = getattr(msg, "properties", None)
    rt = getattr(props, "ResponseTopic", None) if props is not None else None
    corr = getattr(props, "CorrelationData", None) if props is not None else None
    return Delivery(msg.topic, bytes(msg.payload), msg.qos, msg.mid, bool(msg.retain), rt or None,
                    None if corr is None else bytes(corr))


def delivery_size(d: Delivery) -> int:
    """The bytes one ``Delivery`` holds while it waits (``Inbox``'s ``size``)."""
    return (len(d.payload) + len(d.topic) + len(d.response_topic or "") + len(d.correlation or b"")
            + ITEM_OVERHEAD)


class Inbox(Generic[T]):
    """A FIFO bounded by the summed ``size`` of its items (``budget`` bytes, one item beyond)."""

    def __init__(self, budget: int, size: Callable[[T], int]) -> None:
        self.budget = int(budget)
        self._size = size
        self._items: deque = deque()
        self.held = 0               # bytes queued now
        self.waits = 0              # times the network thread waited for room (a flood, or a slow loop)
        self.closed = False
        self._cond = threading.Condition()

    def put(self, item: T) -> None:
        """Queue ``item``, waiting while the budget is held; once closed, drop it (nobody will
        take it; a QoS 1 message not acknowledged is delivered again on the next connection)."""
        n = self._size(item)
        with self._cond:
            if self._items and self.held + n > self.budget and not self.closed:
                self.waits += 1
                while self._items and self.held + n > self.budget and not self.closed:
                    self._cond.wait()
            if self.closed:
                return
            self._items.append((item, n))
            self.held += n
            self._cond.notify_all()

    def close(self) -> None:
        """The loop stops taking: a network thread waiting for room goes on (and drops what it
        holds), so the client's thread can end."""
        with self._cond:
            self.closed = True
            self._cond.notify_all()

    def get(self, timeout: Optional[float] = None) -> T:
        """The oldest item, waiting up to ``timeout`` seconds (None: for ever); Empty if none came."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._items, timeout):
                raise Empty
            return self._take()

    def get_nowait(self) -> T:
        with self._cond:
            if not self._items:
                raise Empty
            return self._take()

    def qsize(self) -> int:
        with self._cond:
            return len(self._items)

    def empty(self) -> bool:
        return not self.qsize()

    def _take(self) -> T:
        item, n = self._items.popleft()
        self.held -= n
        self._cond.notify_all()
        return item


# -- whether anything can still arrive ------------------------------------------------------------
# mosquitto 2.0.11 keeps the in-flight slot of every QoS 1 PUBLISH it drops for exceeding the
# Maximum Packet Size a client announced; once the client's Receive Maximum (or the broker's
# max_inflight_messages, 100 in our configuration) of them are held, nothing more is delivered to
# it until it reconnects, which frees them (docs/sequencer.md "Size limits"). A client that has
# heard nothing for QUIET_S publishes a probe to a topic only it subscribes to; a probe not back
# within WAIT_S means deliveries are stuck, and the client drops the connection (its persistent
# session resumes on the reconnect, nothing unacknowledged is lost).
QUIET_S = float(os.environ.get("SSP_AGENT_PROBE_QUIET_S", "30"))
WAIT_S = float(os.environ.get("SSP_AGENT_PROBE_WAIT_S", "10"))
PROBE, RECONNECT = "probe", "reconnect"


class DeliveryWatch:
    """When to probe the broker's deliveries, and when they are stuck (pure: the caller passes
    the monotonic clock; ``delivered`` may be called from the network thread).

    Two guards for a probe that cannot come back for another reason (an ACL that refuses this
    client its probe topic): a probe the broker refuses (PUBACK "not authorized") turns the watch
    off (``refused``); and while reconnects bring nothing new (no delivery that is neither a probe
    nor a retained copy), each doubles the quiet time, up to MAX_BACKOFF times QUIET_S (an idle
    client behind such an ACL reconnects about once an hour, not every 40 s)."""

    MAX_BACKOFF = 128

    def __init__(self, quiet_s: float = QUIET_S, wait_s: float = WAIT_S) -> None:
        self.quiet_s, self.wait_s = quiet_s, wait_s
        self.last: Optional[float] = None        # the last delivery
        self.probe_at: Optional[float] = None    # the probe waiting to come back
        self.backoff = 1                         # the quiet time is quiet_s * backoff
        self.off = False                         # the broker refused our probe: nothing to watch with
        self.probes = self.reconnects = 0

    def delivered(self, now: float, fresh: bool = True) -> None:
        """Something was delivered; ``fresh``: neither our probe nor a retained copy (traffic
        that proves the connection carries what others send: the quiet time is back to its base)."""
        self.last = now
        if fresh:
            self.backoff = 1

    def refused(self) -> None:
        self.off = True

    def restart(self, now: float) -> None:
        """A new connection: nothing is owed, the quiet time starts again."""
        self.last, self.probe_at = now, None

    def next(self, now: float) -> Optional[str]:
        """PROBE: publish one now; RECONNECT: the probe did not come back; None: nothing to do."""
        if self.off:
            return None
        if self.last is None:
            self.last = now
        if self.probe_at is not None:
            if self.last >= self.probe_at:
                self.probe_at = None          # it came back (or something else did)
            elif now - self.probe_at >= self.wait_s:
                self.restart(now)
                self.reconnects += 1
                self.backoff = min(2 * self.backoff, self.MAX_BACKOFF)
                return RECONNECT
            return None
        if now - self.last >= self.quiet_s * self.backoff:
            self.probe_at = now
            self.probes += 1
            return PROBE
        return None


class Prober:
    """A ``DeliveryWatch`` wired to one paho client running its own network thread: its probe
    topic (subscribe to it on every connection), what to call from ``on_message``, and ``step``
    for the loop; it takes the client's ``on_publish`` (a refused probe's PUBACK). ``step`` returns what the caller records: RECONNECT
    (the connection was dropped: deliveries were stuck) or OFF (the broker refused the probe: the
    watch is off for good, say so once)."""

    OFF = "off"

    def __init__(self, client, topic: str, watch: Optional[DeliveryWatch] = None) -> None:
        self.client, self.topic = client, topic
        self.watch = watch or DeliveryWatch()
        self._probe_mid: Optional[int] = None
        self._refused: set[int] = set()     # mids the broker refused (network thread): the probe's
        self._told_off = False              # PUBACK may come before publish() returns its mid
        client.on_publish = lambda _c, _u, mid, reason_code, _p: self.on_publish(mid, reason_code)

    def on_message(self, msg, echo: bool = False) -> bool:
        """Note a delivery (network thread); True: it is our probe, not for the loop. A QoS 0
        delivery is not noted: it takes no in-flight slot, so it proves nothing about them (a
        stream of QoS 0 messages must not hide stuck deliveries). ``echo``: the client's own
        publish come back (a node's presence, sent on every connection): delivered, not fresh."""
        ours = msg.topic == self.topic
        if ours or msg.qos:
            self.watch.delivered(time.monotonic(), fresh=not (ours or msg.retain or echo))
        return ours

    def on_publish(self, mid: int, reason_code) -> None:
        if getattr(reason_code, "is_failure", False):
            self._refused.add(mid)
            if len(self._refused) > 64:       # only the latest matter: keep the set small
                self._refused = {mid}

    def restart(self) -> None:
        self.watch.restart(time.monotonic())

    def step(self, now: float) -> Optional[str]:
        if self._probe_mid is not None and self._probe_mid in self._refused:
            self.watch.refused()
        if self.watch.off:
            if self._told_off:
                return None
            self._told_off = True
            return self.OFF
        act = self.watch.next(now)
        if act == PROBE:
            self._refused.clear()    # only refusals from now on: a stale one may share a recycled mid
            self._probe_mid = self.client.publish(self.topic, b"", qos=1).mid
        elif act == RECONNECT:
            drop_connection(self.client)
            return RECONNECT
        return None


def drop_connection(client) -> None:
    """Make a paho client running its own network thread see its connection lost, so that thread
    reconnects (``loop_start``/``loop_forever`` do): the socket is shut down, not closed, so the
    descriptor is never pulled from under that thread."""
    sock = client.socket()
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
