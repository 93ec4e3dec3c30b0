"""What a loop has handed one paho client to publish and the broker has not acknowledged yet,
bounded in bytes and publishes (docs/sequencer.md "A flood of requests", docs/mqtt.md "Memory
bound").

paho keeps every QoS 1 publish in memory until the broker's PUBACK, which only that client's
network thread reads, and that thread may be the one waiting for room in the loop's inbox. So
either the answers go out on a connection of their own and the loop takes no new request while
the outbox is ``full`` (`sequencer run`), or, on the one connection, the loop never waits and
leaves out what it may while ``full`` (a node's courtesy answers, agent/runner.py). A PUBACK
handled before ``publish`` returns its mid is kept while a publish is under way, and paho calls
``on_publish`` under its own lock, so this class never calls paho while holding its lock. What
must wait for the broker to hold a publish (acknowledging the request it answers) is its ``then``."""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

__all__ = ["ITEM_OVERHEAD", "Outbox", "PROPERTIES_OVERHEAD"]

# Counted per publish besides its payload and topic (measured with tracemalloc, paho 2.1): its
# MQTTMessage and MQTTMessageInfo (a Condition) ~2.5 KB, and its MQTT 5 Properties, when it has
# any (an answer's correlation data), ~5 KB more.
ITEM_OVERHEAD = 2560
PROPERTIES_OVERHEAD = 5120


class Outbox:
    """Publishes through ``client``, counting each until the broker acknowledges it (QoS 1) or it
    is written (QoS 0). ``own_on_publish``: take the client's ``on_publish``; otherwise the owner
    calls ``acked`` from its own (chained after another user of it, a delivery probe)."""

    def __init__(self, client, budget: int, max_items: int, own_on_publish: bool = True) -> None:
        from paho.mqtt.enums import MQTTErrorCode
        self.client = client
        self.budget, self.max_items = int(budget), int(max_items)
        self.held = 0                      # bytes published and not acknowledged
        self._held: dict[int, int] = {}    # mid -> its bytes
        self._early: set[int] = set()      # mids acknowledged while a publish was under way
        self._then: dict[int, Callable[[], object]] = {}   # mid -> what runs once it is acknowledged
        self._publishing = 0               # publish() calls under way
        self._lock = threading.Lock()
        self.progress = threading.Event()  # set on every acknowledgement
        self._ok, self._no_conn = MQTTErrorCode.MQTT_ERR_SUCCESS, MQTTErrorCode.MQTT_ERR_NO_CONN
        if own_on_publish:
            client.on_publish = lambda _c, _u, mid, *_rest: self.acked(mid)

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False, properties=None,
                then: Optional[Callable[[], object]] = None):
        """paho's publish, counted; returns paho's MQTTMessageInfo. ``then`` runs once the broker
        has acknowledged it (on paho's network thread, or here if that came first); never for a
        publish paho refused outright."""
        with self._lock:
            self._publishing += 1
        info = None
        try:
            info = self.client.publish(topic, payload, qos=qos, retain=retain, properties=properties)
            return info
        finally:
            self._published(info, qos, len(payload) + len(topic) + ITEM_OVERHEAD
                            + (PROPERTIES_OVERHEAD if properties is not None else 0), then)

    def _published(self, info, qos: int, n: int, then: Optional[Callable[[], object]] = None) -> None:
        # counted only if paho will report it: a QoS 1 publish while disconnected is kept and sent
        # on the next connection; one refused outright (QoS 0 disconnected, paho's queue full) is not
        kept = info is not None and (info.rc == self._ok or (qos > 0 and info.rc == self._no_conn))
        now = None
        with self._lock:
            self._publishing -= 1
            if kept and info.mid in self._early:
                self._early.discard(info.mid)      # acknowledged already
                now = then
            elif kept:
                self._held[info.mid] = n
                self.held += n
                if then is not None:
                    self._then[info.mid] = then
            if not self._publishing:
                self._early.clear()
        if now is not None:
            now()

    def acked(self, mid: int) -> None:
        """paho's on_publish (the network thread): the broker acknowledged ``mid`` (or paho wrote it)."""
        with self._lock:
            n = self._held.pop(mid, None)
            if n is not None:
                self.held -= n
            elif self._publishing:
                self._early.add(mid)
            then = self._then.pop(mid, None)
        if then is not None:
            then()
        self.progress.set()

    def full(self) -> bool:
        """The budget is held (bytes or publishes): take nothing that would add to it."""
        with self._lock:
            return self.held >= self.budget or len(self._held) >= self.max_items

    def pending(self) -> int:
        with self._lock:
            return len(self._held)

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` s for the broker to acknowledge everything published (before a
        disconnect, which drops what paho still holds); True once nothing is left."""
        end = time.monotonic() + timeout
        while self.pending():
            left = end - time.monotonic()
            if left <= 0:
                return False
            self.progress.clear()
            if self.pending():
                self.progress.wait(min(left, 0.5))
        return True

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for an acknowledgement, unless there is room already."""
        self.progress.clear()
        if self.full():
            self.progress.wait(timeout)
