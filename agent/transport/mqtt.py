"""The MQTT binding of SSP/1 (paho-mqtt 2.x, VERSION2 callbacks, MQTT v5); docs/mqtt.md has the
topic layout, the ACLs and the properties.

Each node has an inbox per sender (`PREFIX/<mesh>/<site>/inbox/req/<from>`, answers on
`inbox/ans/<from>`) and a retained presence (§31 handshake; the last will clears it). The last
segment names the publisher, so a broker ACL can pin it to the authenticated device; only under
such ACLs may the node treat the binding as authenticated (`--secure-binding`).

A push is one QoS 1 PUBLISH of a §32 body with a Response Topic and Correlation Data; it succeeds
only when the peer answers (a broker's PUBACK means nothing: mosquitto loses queued messages on
SIGKILL). The receiver acks an inbound PUBLISH to the broker (`manual_ack`) only after the SQLite
transaction that absorbed it committed, so a node killed mid-apply gets the body again.

This module moves bytes and metadata; it parses no sync body. Everything paho calls back runs on
the link's network thread and only enqueues."""
from __future__ import annotations

import itertools
import logging
import os
import queue
import ssl
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion, MQTTErrorCode
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

# The wire of the binding (user property names, the frame meta, rejected indices) is pure:
# agent/core/binding.py; re-exported here for the link's users.
from .. import inbox, outbox
from ..core.binding import (P_CONN, P_COUNT, P_END, P_FROM, P_KIND, P_META, P_MORE, P_PART,  # noqa: F401
                            P_PROCESSED, P_REASON, P_REJECTED_AT, P_START, P_STATUS, decode_indices)
from ..core.exchange import KIND_BATCH, KIND_PULL, KIND_REALTIME  # noqa: F401 - a request's kinds (the exchange decides)
from ..core.sending import split_sizes  # noqa: F401 - body splitting is pure; re-exported for the runner, benches, tests
from ..timesource import SYSTEM, Clock
from .mqtt_settings import (ADVERTISED_FLOOR, DEFAULT_BODY_LIMIT_BYTES, DEFAULT_MAX_EVENTS,  # noqa: F401 - re-exported
                            DEFAULT_PREFIX, DEFAULT_SESSION_EXPIRY_S, P_BODY_LIMIT, PACKET_OVERHEAD, PRESENCE_TOPICS_MAX,
                            RECEIVE_BUDGET_BYTES, RECEIVE_MAXIMUM_MAX, RECEIVE_MAXIMUM_MIN, Backoff, MqttSettings,
                            Topics, max_packet_size, parse_body_limit, receive_maximum)

log = logging.getLogger("ssp_agent.mqtt")

# What the link holds between paho's network thread and the loop, in bytes (agent/inbox.py): Receive
# Maximum counts no QoS 0 publish, so this, not the broker, bounds what a flood leaves in memory;
# past it the network thread waits and TCP pushes back on the broker (docs/mqtt.md "Memory bound").
INBOX_BUDGET_BYTES = 8 * 1024 * 1024
# The link's publishes the broker has not acknowledged (`outbox.Outbox`): paho holds each until its PUBACK
# (~8 KB for an answer with its MQTT 5 Properties). Past either bound the runner leaves out the
# answers that are a courtesy (docs/mqtt.md "Memory bound": a flood's answers piled up in paho).
UNACKED_BYTES = 8 * 1024 * 1024
UNACKED_ITEMS = 1024

_GENERATIONS = itertools.count(1)


NOT_AUTHORIZED = 0x87  # an MQTT v5 PUBACK reason code: the broker's ACL refused the publish

PRESENT_LIMIT = 1024  # presence payloads kept (MqttLink.present); the oldest go first
PRESENCE_MAX_BYTES = 4096  # a presence payload is cut to this (a handshake is ~150 bytes; a cut one is refused)


class TransportError(RuntimeError):
    """A local transport fault (broker unreachable, TLS files unreadable): never a protocol error."""


# ---------------------------------------------------------------------------- the link
@dataclass
class Inbound:
    """One PUBLISH taken from the broker: bytes and metadata, unparsed."""
    kind: str  # "req" | "ans" | "presence"
    site: bytes  # the site the topic names (the addressee for inbox, the subject for presence)
    payload: bytes
    props: dict[str, str]
    correlation: bytes | None
    response_topic: str | None
    mid: int
    qos: int
    dup: bool
    retain: bool
    generation: int  # the connection it arrived on: acks on a later connection are meaningless
    sender: bytes | None = None  # inbox: the publisher the topic names (pinned by the broker's ACL, if any)
    oversize: int = 0  # a body over the node's body limit: its size (its payload was not kept)
    received: float = 0.0  # when the link took it (its clock's monotonic time)
    seq: int = 0  # the link's receipt number of this message (`MqttLink.received`)


def inbound_size(m: "Inbound") -> int:
    """What one taken message holds while it waits (the link's inbox, the runner's intake): its
    payload, user properties, response topic and correlation data (any of them can be the bulk)."""
    return (len(m.payload) + sum(len(k) + len(v) for k, v in m.props.items()) + len(m.response_topic or "")
            + len(m.correlation or b"") + inbox.ITEM_OVERHEAD)


def _user_props(p: Properties | None) -> dict[str, str]:
    out: dict[str, str] = {}
    if p is not None and hasattr(p, "UserProperty"):
        for k, v in p.UserProperty:
            out.setdefault(k, v)  # first one wins: a repeated name cannot override
    return out


def _publish_props(user: dict[str, str], correlation: bytes | None = None,
                   response_topic: str | None = None) -> Properties:
    p = Properties(PacketTypes.PUBLISH)
    if response_topic is not None:
        p.ResponseTopic = response_topic
    if correlation is not None:
        p.CorrelationData = correlation
    if user:
        p.UserProperty = [(k, str(v)) for k, v in user.items()]
    return p


def _writes_on_the_network_thread(client, userdata, sock) -> None:
    """paho's socket-register-write callback: nothing to do, the network thread's loop() writes
    whatever is queued (MqttLink._make_client says why no other thread may)."""


class MqttLink:
    """One device's connection to the broker: a persistent session (clean_start=False, session
    expiry), QoS 1 everywhere, manual acks, retained presence with a last will, and its own
    reconnect loop (capped exponential backoff with jitter) on a network thread.

    Inbound inbox messages and presence changes go to `self.inbound` (a queue) for one consumer
    thread, which acks each message after its transaction commits (`ack`)."""

    def __init__(self, settings: MqttSettings, mesh_id: bytes, site_id: bytes,
                 presence_payload: Callable[[], bytes] | None = None, clock: Clock = SYSTEM,
                 members: Callable[[], Iterable[bytes]] | None = None) -> None:
        self.s = settings
        self.clock = clock  # connect timeouts and the delivery watch (monotonic), losses (wall)
        self.site_id, self.mesh_id = site_id, mesh_id
        self.topics = Topics(mesh_id, settings.prefix)
        self.presence_payload = presence_payload
        self.inbound: inbox.Inbox[Inbound] = inbox.Inbox(INBOX_BUDGET_BYTES, inbound_size)
        # Called (on the network thread) after each message put in `inbound`: the one runtime loop
        # (agent/runtime.py) that also waits on serial ports is woken by it, not by a poll.
        self.wake: Callable[[], None] = lambda: None
        self.present: dict[bytes, bytes] = {}  # peer site -> its retained presence payload (handshake bytes)
        # Bounded: anyone with broker access can publish presence for made-up sites.
        self.present_limit = PRESENT_LIMIT
        self.present_evicted = 0  # oldest entries dropped past present_limit
        self.broker_max_packet: int | None = None
        self.generation = 0
        self.connected = threading.Event()
        # Set when our own presence, published right after SUBSCRIBE, comes back to us: the broker
        # delivers to one client in order, so everything it held for us then (queued bodies of the
        # persistent session, retained presence) has been delivered (`Runner.sync_once`).
        self.presence_echo = threading.Event()
        self.session_present = False
        # A random name of the current connection, on everything published (`P_CONN`), and the
        # number of messages received so far: a body sent records it, so a peer's pull can tell
        # what was sent before its connection began (docs/mqtt.md "A waking device").
        self.conn_id = ""
        self.received = 0
        # Publishes the broker refused as `Not authorized` (network thread): the login was accepted
        # but the ACL denies this account our own topics (another device's account).
        self.denied = 0
        self.last_error: str | None = None
        self.connects = 0
        # What the Runner surfaces in `ssp-agent events` (kind `link_lost`, reason `broker_lost`):
        # (wall ms, detail) per connection lost, and per outage each different reason a connection
        # attempt failed (a broker down for a day is one row per new reason, not one per retry).
        # Appended on the network thread, taken on the loop's (deque: both ends atomic).
        self.losses: deque = deque(maxlen=1000)
        self._outage_told: str | None = None  # the connect failure last put in `losses` this outage
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._backoff = Backoff(settings.backoff_min_s, settings.backoff_max_s)
        self._client = self._make_client()
        # what paho holds for a PUBACK (every publish of the link goes through it); never waited
        # for: the runner leaves out courtesy answers while it is full (agent/outbox.py)
        self.unacked = outbox.Outbox(self._client, UNACKED_BYTES, UNACKED_ITEMS, own_on_publish=False)
        # Deliveries stuck behind in-flight slots the broker keeps for PUBLISHes it dropped for our
        # Maximum Packet Size: probed on our own inbox, under our own name (what the ACLs let a
        # node publish), stepped on the network thread (agent/inbox.py).
        self._prober = inbox.Prober(self._client, self.topics.requests(site_id, site_id))
        # the Prober took on_publish (a refused probe): chained, so every PUBACK is counted too
        self._probe_puback = self._client.on_publish
        self._client.on_publish = self._on_publish
        self._own_presence = self.topics.presence(site_id)
        # settings.presence "members": the sites whose presence this node follows (its keyring),
        # and the set subscribed on this connection (None: the mesh's wildcard)
        self.members = members if settings.presence == "members" else None
        self._followed: set[bytes] | None = None

    # -------------------------------------------------------------- setup
    def _make_client(self) -> paho.Client:
        s = self.s
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id=s.client_id or self.site_id.hex(),
                        protocol=paho.MQTTv5, manual_ack=True)
        c.max_inflight_messages_set(100)
        c.max_queued_messages_set(0)
        if s.username is not None:
            c.username_pw_set(s.username, s.password)
        if s.tls:
            for f in (s.ca_file, s.cert_file, s.key_file):
                if f and not os.access(f, os.R_OK):
                    raise TransportError(f"TLS file {f} is not readable")
            c.tls_set(ca_certs=s.ca_file, certfile=s.cert_file, keyfile=s.key_file,
                      cert_reqs=ssl.CERT_REQUIRED, tls_version=ssl.PROTOCOL_TLS_CLIENT)
        # The last will: an empty retained presence clears ours when we vanish without a word.
        c.will_set(self.topics.presence(self.site_id), b"", qos=1, retain=True)
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_subscribe = self._on_subscribe
        c.on_message = self._on_message
        # Only the network thread (`_run`) touches the socket. paho's client is not thread-safe:
        # without a loop_start() thread of its own it writes a publish or an ack right away on the
        # calling thread (Client._packet_queue -> loop_write) while `_run`'s loop() reads and
        # writes the same socket; over TLS that is two threads inside one OpenSSL SSL object
        # (undefined: a corrupted record, a lost connection, a corrupted heap). With an external
        # write registration paho only queues the packet and wakes loop()'s select (its socket
        # pair), and the network thread writes it.
        c.on_socket_register_write = _writes_on_the_network_thread
        return c

    def _connect_props(self) -> Properties:
        p = Properties(PacketTypes.CONNECT)
        p.SessionExpiryInterval = int(self.s.session_expiry_s)
        # At most ReceiveMaximum unacknowledged PUBLISHes are out to us, and the
        # link keeps no payload over the body limit (`_on_message`): what waits in memory is at
        # most receive_maximum x max_packet_size (64 MiB), whatever a flood sends.
        if self.s.announce_max_packet:
            p.MaximumPacketSize = max_packet_size(self.s.body_limit_bytes)  # the broker drops larger ones
        p.ReceiveMaximum = int(self.s.receive_maximum or receive_maximum(self.s.body_limit_bytes))
        return p

    # -------------------------------------------------------------- lifecycle
    def start(self) -> "MqttLink":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"mqtt-{self.site_id.hex()[:8]}", daemon=True)
            self._thread.start()
        return self

    def wait_connected(self, timeout: float) -> bool:
        return self.connected.wait(timeout)

    def close(self, clear_presence: bool = True, timeout: float = 2.0) -> None:
        """Leave cleanly: clear our retained presence, then DISCONNECT (the session stays on
        the broker for `session_expiry_s`, so bodies for us keep queueing while we are away)."""
        self.inbound.close()   # the network thread may wait for room: nobody takes any more
        if self.connected.is_set() and clear_presence:
            try:
                self._publish(self.topics.presence(self.site_id), b"", retain=True).wait_for_publish(timeout)
            except (RuntimeError, ValueError):
                pass
        self._stop.set()
        alive = False
        if self._thread is not None:
            self._thread.join(timeout + 2)
            alive = self._thread.is_alive()
            self._thread = None
        if alive:
            return  # a network thread still in paho: never write its socket from here as well
        # The network thread has ended: the DISCONNECT is written on this thread, the only one left.
        try:
            self._client.disconnect()
            self._client.loop_write()
        except Exception:  # noqa: BLE001 - closing a dead socket
            pass

    def abort(self) -> None:
        """Drop the connection without DISCONNECT (tests: a device losing its link; the will fires).
        The socket is closed only once the network thread has ended: closing it under that
        thread's loop() would pull the descriptor (and over TLS the SSL object) from under it, and
        a descriptor number reused meanwhile would have it read or write someone else's file."""
        self._stop.set()
        self.inbound.close()
        alive = False
        if self._thread is not None:
            self._thread.join(3)
            alive = self._thread.is_alive()
            self._thread = None
        if alive:
            return  # a network thread still in paho: never touch its socket from here as well
        sock = self._client.socket()
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def _run(self) -> None:
        first = True
        while not self._stop.is_set():
            if not self._client.is_connected() and not self._connecting:
                try:
                    if first:
                        self._client.connect(self.s.host, self.s.port, self.s.keepalive, clean_start=False,
                                             properties=self._connect_props())
                        first = False
                    else:
                        self._client.reconnect()
                    self._connecting = True
                    self._connect_started = self.clock.mono()
                except (OSError, ssl.SSLError, ValueError) as e:
                    self._connect_failed(f"cannot reach broker {self.s.host}:{self.s.port}: {e}{self._tls_hint(e)}")
                    self._sleep(self._backoff.next())
                    continue
            attempting = self._connecting  # no CONNACK yet: a failure now is the attempt's, not a loss
            rc = self._client.loop(timeout=0.05)
            if rc == MQTTErrorCode.MQTT_ERR_SUCCESS and self.connected.is_set():
                self._watch_deliveries()
            if self._connecting and self.clock.mono() - self._connect_started > 10:
                rc = MQTTErrorCode.MQTT_ERR_CONN_LOST  # no CONNACK: start over
                try:
                    self._client.disconnect()
                    self._client.loop_write()   # this is the network thread: written here, as before
                except Exception:  # noqa: BLE001
                    pass
            if rc != MQTTErrorCode.MQTT_ERR_SUCCESS:
                self._connecting = False
                name = rc.name if hasattr(rc, "name") else rc
                if self.connected.is_set():
                    self._lost(f"connection lost ({name})")
                elif attempting and not (self.last_error or "").startswith("broker refused"):
                    # e.g. TLS 1.3: the broker checks a client certificate after the handshake
                    self._connect_failed(f"the broker at {self.s.host}:{self.s.port} closed the connection before "
                                         f"accepting it ({name}): TLS settings, client certificate or network")
                if not self._stop.is_set():
                    self._sleep(self._backoff.next())
        self.connected.clear()

    _connecting = False
    _connect_started = 0.0

    def _tls_hint(self, e: Exception) -> str:
        """A TLS handshake that a plain MQTT listener drops (a reset, an EOF, a record that is not
        TLS) says nothing about TLS by itself: name the likely cause."""
        if not self.s.tls or isinstance(e, ssl.SSLCertVerificationError) or \
                not isinstance(e, (ConnectionResetError, ConnectionAbortedError, ssl.SSLError)):
            return ""
        return (f" (mqtts:// but the TLS handshake failed: is port {self.s.port} a TLS listener? a plain MQTT "
                f"listener takes mqtt://{self.s.host}:{self.s.port})")

    @property
    def delivery_watch_off(self) -> bool:
        """The broker refused our probe: deliveries are not watched."""
        return self._prober.watch.off

    def _watch_deliveries(self) -> None:
        """The delivery watch's step (network thread): a probe after a quiet spell; a connection
        whose probe did not come back is dropped, and reconnecting frees the slots it held."""
        act = self._prober.step(self.clock.mono())
        if act == inbox.RECONNECT:
            self._lost(f"deliveries stuck: our probe was not back in {self._prober.watch.wait_s:g} s "
                       "(in-flight slots held for oversized messages the broker dropped); reconnecting")
        elif act == inbox.Prober.OFF:
            log.warning("mqtt %s: the broker refused our delivery probe on %s (an ACL?): deliveries are not watched",
                        self.site_id.hex()[:8], self._prober.topic)

    def _sleep(self, secs: float) -> None:
        self._stop.wait(secs)

    def _lost(self, why: str) -> None:
        self.connected.clear()
        self.last_error = why
        self._outage_told = None
        self._note_loss(why)
        log.info("mqtt %s: %s", self.site_id.hex()[:8], why)

    def _connect_failed(self, why: str) -> None:
        """A connection attempt failed: told once per outage and reason (`losses`)."""
        self.last_error = why
        if why != self._outage_told:
            self._outage_told = why
            self._note_loss(why)

    def _note_loss(self, detail: str) -> None:
        if self._stop.is_set():
            return  # our own close (`close`, `abort`): not a loss
        self.losses.append((self.clock.wall_ms(), detail))
        self.wake()

    # -------------------------------------------------------------- paho callbacks (network thread)
    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        self._connecting = False
        if reason_code.is_failure:
            self._connect_failed(f"broker refused the connection: {reason_code}")
            log.warning("mqtt %s: %s", self.site_id.hex()[:8], self.last_error)
            return
        self._outage_told = None
        self.generation = next(_GENERATIONS)  # unique across links: an ack never crosses connections
        self.connects += 1
        self.session_present = bool(getattr(flags, "session_present", False))
        self.conn_id = os.urandom(8).hex()
        mps = getattr(properties, "MaximumPacketSize", None) if properties is not None else None
        self.broker_max_packet = int(mps) if mps else None
        # Usable once the broker confirmed our subscriptions (SUBACK), not at CONNACK: a peer's
        # push must never race a subscription that is still on its way.
        self.presence_echo.clear()
        _rc, self._sub_mid = client.subscribe([(self.topics.inbox_filter(self.site_id), 1),
                                               *((t, 1) for t in self._presence_topics())])
        if self._followed is not None and self.session_present:
            client.unsubscribe(self.topics.presence_filter())   # a resumed session may hold the wildcard
        self.publish_presence()
        self._prober.restart()
        self._backoff.reset()
        log.info("mqtt %s: connected (session present: %s)", self.site_id.hex()[:8], self.session_present)

    def _presence_topics(self) -> list[str]:
        """The presence subscriptions of a new connection: the mesh's wildcard, or (settings
        `presence = "members"`) this node's and each member's topic, up to PRESENCE_TOPICS_MAX."""
        with self._lock:
            sites = None if self.members is None else {self.site_id, *self.members()}
            if sites is None or len(sites) > PRESENCE_TOPICS_MAX:
                self._followed = None
                return [self.topics.presence_filter()]
            self._followed = sites
            return [self.topics.presence(s) for s in sorted(sites)]

    def follow_members(self) -> None:
        """A "members" node whose keyring grew subscribes to the new members' presence (loop
        thread; paho only queues the packet, the network thread writes it); past
        PRESENCE_TOPICS_MAX it moves to the wildcard. A member that left stays followed until the
        next connection (its presence is ignored like a stranger's)."""
        if self._followed is None or not self.connected.is_set():
            return
        with self._lock:   # taken briefly: paho's own locks are taken outside it (no order to keep)
            followed = self._followed
            new = [] if followed is None else [s for s in self.members() if s not in followed]
            if not new:
                return
            wildcard = len(followed) + len(new) > PRESENCE_TOPICS_MAX
            if wildcard:
                self._followed = None
            else:
                followed.update(new)
        if wildcard:
            self._client.subscribe(self.topics.presence_filter(), 1)
            self._client.unsubscribe([self.topics.presence(s) for s in sorted(followed)])
        else:
            self._client.subscribe([(self.topics.presence(s), 1) for s in new])

    def _on_subscribe(self, client, userdata, mid, reason_codes, properties) -> None:
        if mid == self._sub_mid:
            bad = [rc for rc in reason_codes if rc.is_failure]
            if bad:
                self.last_error = f"broker refused our subscriptions: {bad} (check the ACL)"
                log.warning("mqtt %s: %s", self.site_id.hex()[:8], self.last_error)
            self.connected.set()
            self.wake()   # the batch cycle waits for the connection (agent/core/binding.py next_due)

    _sub_mid = -1

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self._connecting = False
        if self.connected.is_set():
            self._lost(f"disconnected: {reason_code}")

    def _on_message(self, client, userdata, msg) -> None:
        # our own presence, echoed on every connection, is not fresh traffic (it would set the
        # watch's quiet time back to its base after every reconnect, inbox.DeliveryWatch)
        if self._prober.on_message(msg, echo=msg.topic == self._own_presence):   # our probe: nothing for the loop
            self._ack_now(msg)
            return
        where = self.topics.classify(msg.topic)
        props = getattr(msg, "properties", None)
        self.received += 1
        if where is None:
            self._ack_now(msg)
            return
        site, kind, sender = where
        if kind == "presence":
            self._ack_now(msg)
            if site == self.site_id:
                if not msg.retain:   # our live publish, not a retained copy from an earlier session
                    self.presence_echo.set()
                return
            self.present.pop(site, None)  # re-inserted: the order is the order of the last presence
            # A handshake is ~150 bytes: a longer payload is cut (and then refused by the presence
            # boundary), so 1 024 fictional sites' presence cannot hold 1 024 large payloads.
            payload = bytes(msg.payload[:PRESENCE_MAX_BYTES])
            if payload:
                self.present[site] = payload
                if len(self.present) > self.present_limit:
                    del self.present[next(iter(self.present))]
                    self.present_evicted += 1
            self.inbound.put(Inbound("presence", site, payload, _user_props(props), None, None, msg.mid, msg.qos,
                                     bool(msg.dup), bool(msg.retain), self.generation, seq=self.received,
                                     received=self.clock.mono()))
            self.wake()
            return
        if site != self.site_id:
            self._ack_now(msg)  # not ours (a wildcard we did not ask for): nothing to keep
            return
        corr = getattr(props, "CorrelationData", None) if props is not None else None
        rt = getattr(props, "ResponseTopic", None) if props is not None else None
        payload, oversize = msg.payload, 0
        if len(payload) > self.s.body_limit_bytes:
            # Refused for its size alone (`too_large`): the bytes are not kept while it waits, so a
            # flood of oversized bodies holds at most Receive Maximum small records in memory.
            payload, oversize = b"", len(payload)
        self.inbound.put(Inbound("req" if kind == "inbox/req" else "ans", site, bytes(payload),
                                 _user_props(props), bytes(corr) if corr is not None else None, rt,
                                 msg.mid, msg.qos, bool(msg.dup), bool(msg.retain), self.generation, sender,
                                 oversize=oversize, seq=self.received, received=self.clock.mono()))
        self.wake()

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        if getattr(reason_code, "value", 0) == NOT_AUTHORIZED:
            self.denied += 1
        self.unacked.acked(mid)
        self._probe_puback(client, userdata, mid, reason_code, properties)

    def _ack_now(self, msg) -> None:
        if msg.qos > 0:
            self._client.ack(msg.mid, msg.qos)

    # -------------------------------------------------------------- operations (any thread)
    def ack(self, m: Inbound) -> bool:
        """Acknowledge an inbound message to the broker: call only after its transaction committed.
        A message from an earlier connection is not acked (the broker redelivers it; it is absorbed)."""
        if m.qos == 0 or m.generation != self.generation or not self.connected.is_set():
            return False
        return self._client.ack(m.mid, m.qos) == MQTTErrorCode.MQTT_ERR_SUCCESS

    def publish_presence(self) -> None:
        if self.presence_payload is not None:
            self._publish(self.topics.presence(self.site_id), self.presence_payload(), retain=True,
                          properties=_publish_props(self._own_meta()))

    def _own_meta(self) -> dict[str, str]:
        """User properties on everything this node publishes to peers: its own body limit."""
        return {P_BODY_LIMIT: str(int(self.s.body_limit_bytes)), P_CONN: self.conn_id}

    def max_payload(self) -> int:
        """The largest body this link may send: the profile's body limit, under the broker's
        maximum packet size when the broker announced one."""
        lim = self.s.body_limit_bytes
        if self.broker_max_packet:
            lim = min(lim, self.broker_max_packet - PACKET_OVERHEAD)
        return max(lim, 1024)

    def push(self, peer: bytes, body: bytes, user: dict[str, str], correlation: bytes | None = None) -> bytes:
        """Publish a body to the peer's inbox with our answer topic; returns the correlation data.
        A PUBACK proves nothing: success is the peer's answer (see the module doc)."""
        corr = correlation or os.urandom(16)
        props = _publish_props({P_FROM: self.site_id.hex(), **self._own_meta(), **user}, corr,
                               self.topics.answers(self.site_id, peer))
        self._publish(self.topics.requests(peer, self.site_id), body, properties=props)
        return corr

    def pull(self, peer: bytes, expiry_s: int) -> bytes:
        """Ask `peer` for what it holds for us (docs/mqtt.md "A waking device"): a request with no
        body, answered like a push. The broker drops it after `expiry_s` in a sleeping peer's
        session (a pull from a wake long over only costs that peer an answer). Returns its
        correlation data."""
        corr = os.urandom(16)
        props = _publish_props({P_FROM: self.site_id.hex(), **self._own_meta(), P_KIND: KIND_PULL}, corr,
                               self.topics.answers(self.site_id, peer))
        props.MessageExpiryInterval = max(1, int(expiry_s))
        self._publish(self.topics.requests(peer, self.site_id), b"", properties=props)
        return corr

    def answer(self, m: Inbound, body: bytes, user: dict[str, str]) -> bool:
        """Answer a request on its Response Topic with its Correlation Data. Refuses a response
        topic that is not the answer topic of the request's sender naming us (a rogue cannot make
        us publish elsewhere); returns whether an answer was sent."""
        rt = m.response_topic
        where = self.topics.classify(rt) if rt else None
        if (where is None or where[1] != "inbox/ans" or where[2] != self.site_id or where[0] != m.sender
                or m.correlation is None or len(m.correlation) > 64):
            return False
        props = _publish_props({P_FROM: self.site_id.hex(), **self._own_meta(), **user}, m.correlation)
        self._publish(rt, body, properties=props)
        return True

    def publish_raw(self, topic: str, payload: bytes, props: Properties | None = None, qos: int = 1):
        """Tests and tools only: publish anything (the rogue-client test uses a separate link)."""
        return self._publish(topic, payload, qos=qos, properties=props)

    def _publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                 properties: Properties | None = None) -> paho.MQTTMessageInfo:
        """Every publish of the link: counted until the broker acknowledges it (`unacked`)."""
        return self.unacked.publish(topic, payload, qos, retain, properties)

    @property
    def client(self) -> paho.Client:
        return self._client


def drain(q: "inbox.Inbox[Inbound]", first_timeout: float, max_items: int = 10_000) -> list[Inbound]:
    """Everything waiting in the queue, waiting up to `first_timeout` for the first item."""
    out: list[Inbound] = []
    try:
        out.append(q.get(timeout=first_timeout) if first_timeout > 0 else q.get_nowait())
    except queue.Empty:
        return out
    while len(out) < max_items:
        try:
            out.append(q.get_nowait())
        except queue.Empty:
            break
    return out


def iter_ranges(items: Iterable, ranges: list[tuple[int, int]]) -> Iterable[list]:
    lst = list(items)
    for a, b in ranges:
        yield lst[a:b]


def wait_for(q: "inbox.Inbox[Inbound]", kind: str, timeout: float, keep: list | None = None,
             clock: Clock = SYSTEM) -> Inbound | None:
    """Tests and tools: the next inbound of `kind`, others set aside in `keep` (or dropped)."""
    deadline = clock.mono() + timeout
    while True:
        left = deadline - clock.mono()
        if left <= 0:
            return None
        try:
            m = q.get(timeout=left)
        except queue.Empty:
            return None
        if m.kind == kind:
            return m
        if keep is not None:
            keep.append(m)
