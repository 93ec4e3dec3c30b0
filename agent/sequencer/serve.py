"""`ssp-agent sequencer run --broker URL`: the sequencer served through an MQTT 5 broker (SOVM
§22.5-§22.7; docs/sequencer.md "Serving through the broker" has the topics and payloads).

Requests (`submit`, `register`, `receipt`, `evidence`) carry a response topic and correlation
data and are answered with the JSON the CLI prints for the same verb; the retained `accepted`,
`discontinuity/E` and `lost` records surface the chain to every member alike (§22.6 step 4).
Requests are acknowledged to the broker only once the broker holds their answer, so one the
sequencer never finished or whose answer a crash lost is redelivered and answered then.

Answers leave on a second connection whose network thread reads only their PUBACKs, so they drain
while a flood of requests waits; the loop takes nothing while the outbox is full (agent/outbox.py).
One wildcard subscription per request kind: an idle group costs nothing. Requests are handled on
one thread, in arrival order; submits stream through the pipelined group commit
(pipeline.GroupCommit), and a register or receipt request first lets earlier submits finish."""
from __future__ import annotations

import json
import logging
import math
import re
import ssl
import threading
import time
from dataclasses import dataclass
from typing import Optional
from urllib.parse import unquote, urlparse

from agent import inbox, outbox
from agent.core import codec, numbers
from agent.sequencer import core, framing, heads, recovery, service
from agent.sequencer.client import ANSWER_ROOT

log = logging.getLogger("ssp.sequencer")
DEFAULT_PREFIX = "sovm-seq"


@dataclass
class BrokerSettings:
    host: str
    port: int
    tls: bool = False
    ca_file: Optional[str] = None
    username: Optional[str] = None
    password: Optional[str] = None
    prefix: str = DEFAULT_PREFIX
    session_expiry_s: int = 7 * 86400

    @classmethod
    def from_url(cls, url: str, **kw) -> "BrokerSettings":
        u = urlparse(url)
        if u.scheme not in ("mqtt", "mqtts") or not u.hostname:
            raise ValueError(f"broker URL must be mqtt://HOST:PORT or mqtts://HOST:PORT, got {url!r}")
        tls = u.scheme == "mqtts"
        try:
            port = u.port or (8883 if tls else 1883)
        except ValueError:
            raise ValueError(f"broker URL {url!r} has a bad port") from None
        s = cls(u.hostname, port, tls, username=unquote(u.username) if u.username else None,
                password=unquote(u.password) if u.password else None)
        for k, v in kw.items():
            if v is not None:
                setattr(s, k, v)
        if s.ca_file:
            s.tls = True
        return s


def answer_json(ans: service.Answer) -> dict:
    if isinstance(ans, service.Accepted):
        return {"accepted": True, "group": ans.group_id.hex(), "epoch": ans.epoch, "receipt": ans.receipt.hex()}
    return {"accepted": False, "reason": ans.reason, "group": None if ans.group_id is None else ans.group_id.hex(),
            "current_epoch": ans.current_epoch, "head": None if ans.head is None else ans.head.hex()}


# The groups `sequencer run` tracks unless told otherwise (`--max-groups`): a group costs ~750 bytes
# of sequencer.db, ~330 of sign-journal and ~1.2 KB resident at every start, and anyone allowed to
# submit creates one with each first Commit for a new group_id (§22.6 bootstrap)
DEFAULT_MAX_GROUPS = 100_000
MAX_BATCH = 512          # requests taken from the inbound queue per turn of the loop
# The group commit's undecided Commits (bytes) past which the loop takes nothing more from the inbox:
# a flood then waits in the bounded inbox, and paho's thread (then the broker) waits for room.
BACKLOG_BYTES = 8 << 20
MAX_EVIDENCE_BYTES = 1 << 20   # an evidence request: recovery.MAX_OFFERED receipts in hex fit
MAX_LOST_RUNS = 256            # runs of missing epochs in one `lost` record
# Evidence read and checked, all members together (each receipt costs a signature check, about
# 70 ms for a full request): a client allowed on `evidence` cannot keep the loop busy with it.
# A request over the allowance is answered `retry_after` (members offer again then).
EVIDENCE_BYTES_PER_S = 512 << 10
EVIDENCE_BURST_BYTES = 2 * MAX_EVIDENCE_BYTES
EVIDENCE_MIN_COST = 1 << 10    # what any request for a group with lost receipts is charged
MAX_EPOCH_TEXT = core.EPOCH_LIMIT - 1     # the store's signed 64-bit integers
# `deliveries_stuck` rows kept (the newest): one per reconnect of the delivery watch, which a client
# keeping the broker's in-flight slots full can make recur every 40 s for as long as it goes on
STUCK_EVENTS_KEPT = 100
# The Maximum Packet Size announced at CONNECT: the broker drops any larger PUBLISH for us, so no
# request beyond the largest one served (a Commit, an evidence file) is ever read into memory
# (docs/sequencer.md "Size limits"); the overhead holds the topic, response topic, correlation data.
MAX_PACKET_BYTES = max(framing.MAX_MESSAGE_BYTES, MAX_EVIDENCE_BYTES) + inbox.PACKET_OVERHEAD
# Answers and records published and not yet acknowledged by the broker (agent/outbox.py, which
# counts what paho holds for each, ~7.5 KB for an answer): past either bound the loop takes and
# decides nothing until the broker has acknowledged some. One turn adds at most the answers of
# MAX_BATCH requests or of one group-commit step (its queue's rejections, 2 * CHUNK accepted).
ANSWER_BACKLOG_BYTES = 8 << 20
ANSWER_BACKLOG_ITEMS = 1024
# On stopping, how long to wait for the broker to acknowledge the answers already published
CLOSE_FLUSH_S = 10.0
# On starting, how long to wait for the receipt heads the broker retains (`run --heads-wait`):
# a normal restart reads them in one round trip; a broker that does not answer within it is
# served past only where the receipt witness vouches for every group (``check_heads``)
HEADS_WAIT_S = 30.0
# Commits waiting in the group commit's queue, besides BACKLOG_BYTES: a flood of tiny Commits
# (each ~0.3 KB resident beside its bytes) and the rejections one step answers stay bounded.
BACKLOG_COMMITS = 2048


# A member's own answer topic (docs/sequencer.md "Serving through the broker"), which under the
# ACL pattern only that member reads: the only topic an answer goes to. Any other response topic
# (the retained `accepted` topic every member follows, a wildcard paho refuses to publish to) is
# refused: answering there would make each one-byte request a retained record every member reads.
ANSWER_TOPIC = re.compile(re.escape(ANSWER_ROOT) + r"/[0-9A-Za-z_-]{1,64}/answers")
REFUSED_TOPIC_EVENT_S = 60.0    # at most one `answer_topic_refused` row a minute (each is a transaction)


def answer_topic_ok(topic: object) -> bool:
    """Whether ``topic`` is a member's answer topic, ``sovm-member/MEMBER_ID/answers``."""
    return isinstance(topic, str) and ANSWER_TOPIC.fullmatch(topic) is not None


def epoch_text(payload: bytes) -> Optional[int]:
    """The one classifier of a request's decimal text (``register``, ``receipt``): ASCII digits
    only, no sign, space or underscore (Python's int() takes all three), no leading zero, at most
    MAX_EPOCH_TEXT; None for anything else (answered with an error, never raised)."""
    return numbers.uint(payload, max_value=MAX_EPOCH_TEXT, max_digits=19)


class Allowance:
    """A token bucket in bytes (pure: the caller passes the monotonic clock): ``take`` spends
    ``n`` and returns 0, or spends nothing and returns the seconds until ``n`` will be there."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = float(rate), float(burst)
        self.level, self.at = float(burst), None

    def take(self, n: float, now: float) -> float:
        if self.at is not None:
            self.level = min(self.burst, self.level + (now - self.at) * self.rate)
        self.at = now
        if n <= self.level:
            self.level -= n
            return 0.0
        return (min(n, self.burst) - self.level) / self.rate


def _kind(msg) -> str:
    parts = msg.topic.split("/")
    return parts[-1] if len(parts) >= 3 else ""


class Server:
    def __init__(self, seq: service.Sequencer, settings: BrokerSettings) -> None:
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion
        self.seq, self.s = seq, settings
        self.inbound: inbox.Inbox[inbox.Delivery] = inbox.Inbox(inbox.BUDGET_BYTES, inbox.delivery_size)
        self.stop = threading.Event()
        self.subscribed = threading.Event()
        self.evidence_allowance = Allowance(EVIDENCE_BYTES_PER_S, EVIDENCE_BURST_BYTES)
        self.clock = time.monotonic
        self._gaps_seen = 0                              # the last discontinuities rowid looked at
        # seen, not published yet: (their Commit, whether this sequencer signs their statement)
        self._gaps_unstated: dict[tuple[bytes, int], tuple[Optional[bytes], bool]] = {}
        self._published_lost: dict[bytes, bytes] = {}   # group -> the `lost` record last published
        # groups whose receipts a restored state lost: named only by the resume before serving
        # (`receipts_lost`), so fixed from here on; one dropped once nothing is missing
        self._lost_groups: set[bytes] = set(seq.store.lost_stretches())
        self.stats = {"submits": 0, "submit_batches": 0}
        # the groups the receipt witness does not vouch for, as the resume left them (read before
        # anything is served: a Commit accepted later moves the witness with the state)
        self.unvouched = len(seq.unproven)
        service.tune_collector()
        self.gc = seq.group_commit()
        self._in_gc: dict[int, object] = {}      # tag -> the submit request in the group commit
        self._tags = 0
        self._topic_refused_at: Optional[float] = None   # the last `answer_topic_refused` row
        self._topics_refused_since = 0                   # refused since that row
        client_id = f"sovm-seq-{seq.public_key.hex()[2:26]}"

        def client(cid: str, **kw):
            c = paho.Client(CallbackAPIVersion.VERSION2, client_id=cid, protocol=paho.MQTTv5, **kw)
            if settings.username is not None:
                c.username_pw_set(settings.username, settings.password)
            if settings.tls:
                c.tls_set(ca_certs=settings.ca_file, cert_reqs=ssl.CERT_REQUIRED, tls_version=ssl.PROTOCOL_TLS_CLIENT)
            c.reconnect_delay_set(0.5, 30)
            return c
        # requests arrive on the persistent session (its subscriptions, acknowledged after their
        # answer); answers and records leave on a second connection, whose thread never waits for
        # the inbox, so their PUBACKs are read while a flood of requests waits (agent/outbox.py)
        self._make_client, self.client_id = client, client_id
        c = client(client_id, manual_ack=True)
        c.on_connect = self._on_connect
        c.on_subscribe = lambda *a: self.subscribed.set()
        c.on_message = self._on_message
        self.client = c
        self.out_client_id = client_id + "-out"
        a = client(self.out_client_id)
        self.out_connected = threading.Event()
        a.on_connect = lambda _c, _u, _f, rc, _p: None if rc.is_failure else self.out_connected.set()
        self.out = outbox.Outbox(a, ANSWER_BACKLOG_BYTES, ANSWER_BACKLOG_ITEMS)
        # deliveries stuck behind dropped oversized publishes come back with a reconnect (inbox.py)
        self.prober = inbox.Prober(c, f"{settings.prefix}/_probe/{client_id}")

    def _on_message(self, client, userdata, msg) -> None:
        # a delivery proves the session (its subscriptions are the broker's): start() need not
        # wait for the SUBACK, which comes after what the session kept, and which this thread
        # would never read while it waits for room in the inbox that only the loop empties
        self.subscribed.set()
        if self.prober.on_message(msg):
            client.ack(msg.mid, msg.qos)
            return
        self.inbound.put(inbox.delivery(msg))

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("broker refused the connection: %s", reason_code)
            return
        p = self.s.prefix
        self.prober.restart()
        client.subscribe([(f"{p}/+/submit", 1), (f"{p}/+/register", 1), (f"{p}/+/receipt", 1),
                          (f"{p}/+/evidence", 1), (self.prober.topic, 1)])

    def start(self, timeout: float = 10.0) -> None:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = int(self.s.session_expiry_s)
        props.MaximumPacketSize = MAX_PACKET_BYTES
        self.out.client.connect_async(self.s.host, self.s.port, keepalive=30, clean_start=True)
        self.out.client.loop_start()
        self.client.connect_async(self.s.host, self.s.port, keepalive=30, clean_start=False, properties=props)
        self.client.loop_start()
        end = time.monotonic() + timeout
        answers = self.out_connected.wait(timeout)
        if not (answers and self.subscribed.wait(max(0.0, end - time.monotonic()))):
            self.inbound.close()        # paho's thread may wait for room: it must be able to end
            self.client.loop_stop()
            self.out.client.loop_stop()
            what = "the subscription" if answers else f"the answer connection (client id {self.out_client_id})"
            raise service.SequencerFault(f"broker {self.s.host}:{self.s.port} unreachable or refused {what}")
        self._publish_discontinuities()
        for gid in sorted(self._lost_groups):
            self._publish_lost(gid)

    def check_heads(self, wait: float = HEADS_WAIT_S) -> dict:
        """Before serving (§22.5 cl. 2): the receipt heads the broker retains, read within ``wait``
        seconds, hold every group they show behind (heads.judge). Not read in time: a resume the
        witness vouches for serves on (event `heads_unread`); one it cannot vouch for for some
        group (``Sequencer.unproven``) cannot establish what was released, and stops (a fault)."""
        got = heads.read(self._make_client, self.s.host, self.s.port, self.s.prefix, self.client_id, wait)
        if got is None:
            if self.seq.unproven:
                raise service.SequencerFault(
                    f"the receipt heads retained on {self.s.host}:{self.s.port} were not read within {wait:g} s, and "
                    f"the receipt witness does not vouch for {len(self.seq.unproven)} groups' state: cannot establish "
                    "what was released (§22.5 cl. 2); run again once the broker answers (`--heads-wait`)")
            log.warning("the receipt heads the broker retains were not read within %g s; serving on the witness", wait)
            self.seq.store.record_event("heads_unread", {"wait_s": wait}, keep=STUCK_EVENTS_KEPT)
            return {"heads": None, "held": [], "unsigned": 0}
        held, unsigned = heads.judge(self.seq, got)
        return {"heads": len(got), "held": [g.hex() for g in held], "unsigned": len(unsigned)}

    def serve_forever(self) -> None:
        while not self.stop.is_set():
            self.turn()
        self._answer_submits(self.gc.drain())     # stopping: what is in flight is finished and answered

    def turn(self) -> None:
        """One turn of the loop: take what arrived (up to MAX_BATCH requests, none while the group
        commit's backlog holds BACKLOG_BYTES or BACKLOG_COMMITS), make one group-commit step, watch
        the deliveries; nothing but the watch while the answers not acknowledged yet fill the outbox."""
        if self.out.full():
            # the answers wait for the broker's PUBACKs (read on the answer connection's thread):
            # nothing is taken or decided until some are in; what is at the keystore waits too
            self.out.wait(0.5)
            self._watch_deliveries()
            return
        batch = []
        if self.gc.queued_bytes < BACKLOG_BYTES and len(self.gc.queue) < BACKLOG_COMMITS:
            try:
                # with Commits in flight the loop only looks for more, it never waits for them
                batch.append(self.inbound.get(timeout=0.5) if not self.gc.busy() else self.inbound.get_nowait())
            except inbox.Empty:
                pass
        while batch and len(batch) < MAX_BATCH:
            try:
                batch.append(self.inbound.get_nowait())
            except inbox.Empty:
                break
        self.feed(batch)
        if self.gc.busy():
            self._answer_submits(self.gc.step())
        self._watch_deliveries()

    def _watch_deliveries(self) -> None:
        """Quiet for a while: a probe to ourselves; not back: the broker holds our in-flight slots
        (dropped oversized publishes, inbox.py), and a new connection frees them."""
        if not self.client.is_connected():
            return
        act = self.prober.step(self.clock())
        if act == inbox.RECONNECT:
            log.warning("no delivery from the broker, not even our own probe, for %.0f s: reconnecting",
                        self.prober.watch.wait_s)
            self.seq.store.record_event("deliveries_stuck", {"reconnect": self.prober.watch.reconnects},
                                        keep=STUCK_EVENTS_KEPT)
        elif act == inbox.Prober.OFF:
            log.warning("the broker refuses our delivery probe on %s (its ACL): deliveries stuck behind "
                        "dropped oversized publishes are not detected; allow this client readwrite there",
                        self.prober.topic)
            self.seq.store.record_event("delivery_watch_off", {"topic": self.prober.topic})

    def close(self) -> None:
        self.stop.set()
        self.inbound.close()        # paho's thread may wait for room: it must be able to end
        if self.out.client.is_connected():
            # the answers to what was acknowledged already: a disconnect drops what paho holds,
            # and the broker would not deliver those requests again
            if not self.out.flush(CLOSE_FLUSH_S):
                log.warning("stopping with %d answers not acknowledged by the broker", self.out.pending())
        self.client.disconnect()
        self.client.loop_stop()
        self.out.client.disconnect()
        self.out.client.loop_stop()

    # -- requests ------------------------------------------------------------------------------
    def handle_many(self, msgs: list) -> None:
        """Requests in arrival order, every one answered before this returns (``feed``, then the
        group commit drained)."""
        self.feed(msgs)
        self._answer_submits(self.gc.drain())

    def feed(self, msgs: list) -> None:
        """Requests in arrival order. Submits go into the pipelined group commit (first-Commit-wins
        stays the arrival order); any other request first drains it, so a register or receipt
        request sees every submit that arrived before it. Each request is answered and then
        acknowledged to the broker, after its answer is durable. A request naming a response
        topic that is not a member's answer topic is refused first (`_foreign_topic`)."""
        for msg in msgs:
            if msg.response_topic and not answer_topic_ok(msg.response_topic):
                self._foreign_topic(msg)
                continue
            if _kind(msg) == "submit":
                self._tags += 1
                self._in_gc[self._tags] = msg
                self.gc.put(self._tags, bytes(msg.payload))
                self.stats["submits"] += 1
                continue
            if self.gc.busy():
                self._answer_submits(self.gc.drain())
            self.handle(msg)

    def _foreign_topic(self, msg) -> None:
        """Refuse a request whose response topic is not a member's answer topic: not handled, not
        answered, acknowledged (never redelivered), counted (`answer_topics_refused`) and surfaced
        as the event `answer_topic_refused` in `sequencer status`, at most one row a minute."""
        self.stats["answer_topics_refused"] = self.stats.get("answer_topics_refused", 0) + 1
        self._topics_refused_since += 1
        now = self.clock()
        if self._topic_refused_at is None or now - self._topic_refused_at >= REFUSED_TOPIC_EVENT_S:
            log.warning("refused a %s request answering on %r: not a member's answer topic (%d since the last)",
                        _kind(msg), msg.response_topic[:120], self._topics_refused_since)
            detail = {"topic": msg.response_topic[:120], "request": _kind(msg), "refused": self._topics_refused_since}
            self.seq.store.record_event("answer_topic_refused", detail, keep=STUCK_EVENTS_KEPT)
            self._topic_refused_at, self._topics_refused_since = now, 0
        if msg.qos > 0:
            self.client.ack(msg.mid, msg.qos)

    def _answer_submits(self, answers: list) -> None:
        if not answers:
            return
        self.stats["submit_batches"] = self.gc.batches
        done = [(self._in_gc.pop(tag), ans) for tag, ans in answers]
        for msg, ans in done:
            if isinstance(ans, service.Accepted):
                self._publish_accepted(ans.group_id, ans.epoch, bytes(msg.payload), ans.receipt)
        self._publish_discontinuities()
        for msg, ans in done:
            self._respond(msg, answer_json(ans))

    def handle(self, msg) -> None:
        parts = msg.topic.split("/")
        kind = parts[-1] if len(parts) >= 3 else ""
        try:
            gid = bytes.fromhex(parts[-2])
        except (ValueError, IndexError):
            gid = None
        try:
            if kind == "submit":
                body = self._submit(gid, bytes(msg.payload))
            elif kind == "register":
                body = self._register(gid, bytes(msg.payload))
            elif kind == "receipt":
                body = self._receipt(gid, bytes(msg.payload))
            elif kind == "evidence":
                body = self._evidence(gid, bytes(msg.payload))
            else:
                body = {"error": "unknown request"}
        except service.SequencerRefused as e:
            body = {"error": str(e)}
            if getattr(e, "reason", None):
                body["reason"] = e.reason          # a stable code (group_limit)
        self._respond(msg, body)

    def _respond(self, msg, body: dict) -> None:
        """Answer ``msg``, and acknowledge it to the broker once the broker holds the answer: a
        kill before then has the request redelivered and answered again (its answer is durable)."""
        ack = (lambda: self.client.ack(msg.mid, msg.qos)) if msg.qos > 0 else None
        if not self._reply(msg, body, then=ack) and ack is not None:
            ack()                               # nothing to answer on: acknowledged now

    def _submit(self, gid: Optional[bytes], payload: bytes) -> dict:
        # the framing, not the topic, names the group (§22.5: the sequencer reads the framing)
        ans = self.seq.submit(payload)
        self.stats["submit_batches"] += 1
        self.stats["submits"] += 1
        if isinstance(ans, service.Accepted):
            self._publish_accepted(ans.group_id, ans.epoch, payload, ans.receipt)
        self._publish_discontinuities()
        return answer_json(ans)

    def _register(self, gid: Optional[bytes], payload: bytes) -> dict:
        epoch = epoch_text(payload)
        if epoch is None:
            return {"error": "register: the payload is the initial epoch as decimal text (ASCII digits)"}
        if gid is None:
            return {"error": "register: the topic must name the group in hex"}
        self.seq.register(gid, epoch)
        return {"group": gid.hex(), "epoch": epoch}

    def _receipt(self, gid: Optional[bytes], payload: bytes) -> dict:
        epoch = epoch_text(payload)
        if epoch is None:
            return {"error": f"receipt: the payload is an epoch as decimal text (ASCII digits, at most {MAX_EPOCH_TEXT})"}
        if gid is None:
            return {"error": "receipt: the topic must name the group in hex"}
        got = self.seq.receipt(gid, epoch)
        if isinstance(got, bytes):
            return {"receipt": got.hex()}
        return {"receipt": None, "absent": True, "discontinuity": got.discontinuity}

    def _evidence(self, gid: Optional[bytes], payload: bytes) -> dict:
        """A member's receipts for stretches this sequencer lost: refilled as `sequencer recover`
        does, under this sequencer's own key only (recovery.refill verifies every one, link by
        link to a receipt held here); a group that lost nothing is refused before the bytes are
        read, so a stranger's request costs a set look-up; what is read and checked is bounded by
        the evidence allowance, all members together (over it: ``retry_after``)."""
        if gid is None:
            return {"error": "evidence: the topic must name the group in hex"}
        if len(payload) > MAX_EVIDENCE_BYTES:
            return {"error": f"evidence: too large ({len(payload)} bytes, at most {MAX_EVIDENCE_BYTES})"}
        if gid not in self._lost_groups:
            return {"error": f"evidence: group {gid.hex()} has no receipts lost here"}
        wait = self.evidence_allowance.take(max(len(payload), EVIDENCE_MIN_COST), self.clock())
        if wait:
            after = max(1, math.ceil(wait))
            return {"error": f"evidence: busy with other members' evidence, offer again in {after} s",
                    "retry_after": after}
        try:
            ev = recovery.parse_evidence(payload, gid, recovery.MAX_OFFERED)
        except recovery.EvidenceError as e:
            return {"error": str(e)}
        out = self.seq.refill_offered(gid, ev)
        self._publish_lost(gid)
        return recovery.answer(gid, out)

    # -- publications ------------------------------------------------------------------------
    def _reply(self, msg, body: dict, then=None) -> bool:
        """Publish the answer; ``then`` runs once the broker acknowledged it. False: not answered."""
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties
        if not answer_topic_ok(msg.response_topic):
            return False    # none, or not a member's (`feed` refused it already)
        out = Properties(PacketTypes.PUBLISH)
        if msg.correlation is not None:
            out.CorrelationData = msg.correlation
        self.out.publish(msg.response_topic, json.dumps(body).encode(), qos=1, properties=out, then=then)
        return True

    def _publish_accepted(self, gid: bytes, epoch: int, commit: bytes, receipt: bytes) -> None:
        body = codec.encode({"epoch": epoch, "commit": commit, "receipt": receipt})
        self.out.publish(f"{self.s.prefix}/{gid.hex()}/accepted", body, qos=1, retain=True)

    def _publish_lost(self, gid: bytes) -> None:
        """What ``gid`` still misses of the receipts a restored state lost, retained for every
        member (each answers with what it holds: ``evidence``); cleared once nothing is missing, or
        the group is frozen (evidence no longer refills it)."""
        state = self.seq.store.group(gid)
        runs = self.seq.missing(gid, MAX_LOST_RUNS) if state is not None and not state.failed_closed else []
        body = codec.encode({"missing": [list(x) for x in runs]}) if runs else b""
        if not runs:
            self._lost_groups.discard(gid)
        if self._published_lost.get(gid) == body:
            return
        self.out.publish(f"{self.s.prefix}/{gid.hex()}/lost", body, qos=1, retain=True)
        self._published_lost[gid] = body

    def _publish_discontinuities(self) -> None:
        """§22.6 step 4: every recorded gap, retained on the broker for every member alike. Only
        the gaps recorded since the last look are read, and those still waiting for their signed
        statement looked at again: the cost of an answered batch does not grow with the history."""
        fresh = self.seq.store.discontinuities_since(self._gaps_seen)
        if fresh:
            self._gaps_seen = fresh[-1][0]
            self._gaps_unstated.update(((g, e), (m, signable)) for _r, g, e, m, signable in fresh)
        for key, (m, signable) in list(self._gaps_unstated.items()):
            g, e = key
            st = self.seq.store.statement(g, e)
            if st is None and signable:
                continue            # published once its statement is signed (the next round)
            del self._gaps_unstated[key]
            body = codec.encode({"epoch": e, "commit": m, "statement": st})
            self.out.publish(f"{self.s.prefix}/{g.hex()}/discontinuity/{e}", body, qos=1, retain=True)
