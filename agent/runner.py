"""The node's MQTT loop: `ssp-agent run` (always on) and `ssp-agent sync --once` (wake, sync, sleep).

One thread owns the node (SQLite); the MQTT link's network thread only enqueues what arrives.

- **Batch** (§32): every `cadence_s`, for every peer in the keyring, offer what the durable
  per-peer cursor selects, split into bodies under the broker's packet size and the body limit,
  a window of bodies in flight at once. Each body is a request; the cursor advances only when
  the peer's answer arrives, by the number of events it processed to a final state
  (`cursor_after`). Unanswered bodies are re-offered (the peer absorbs duplicates).
- **Realtime** (§33): when this node produces events, peers that are present (retained
  presence) and advertised `supports_realtime` (as we do) get a push at once, coalesced over
  `coalesce_s`, or on a fixed cadence (`flush_cadence_s`, §33.3). Pushes are answered like
  batch bodies, so they can advance the cursor; batch keeps running underneath (§33.1).
- **Receiving**: a body is checked (size, realtime mode, strict parse), applied in one SQLite
  transaction through the node's one apply path, answered, and only then acked to the broker.
"""
from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from .core.messages import Handshake, ProtocolError, SyncBody, emit_body, emit_handshake, parse_body, parse_message
from .outcomes import counts
from .transport.mqtt import (KIND_BATCH, KIND_REALTIME, P_COUNT, P_END, P_KIND, P_PART, P_PROCESSED, P_REASON,
                             P_START, P_STATUS, Inbound, MqttLink, MqttSettings, split_sizes)

log = logging.getLogger("ssp_agent.runner")


@dataclass
class RunConfig:
    cadence_s: float = 30.0  # batch cycle
    answer_timeout_s: float = 15.0  # an unanswered body is given up on (re-offered) after this
    window: int = 4  # bodies in flight per peer
    realtime: bool = True  # advertise and use realtime mode (§33)
    coalesce_s: float = 0.05  # realtime: gather what is produced within this interval into one push
    flush_cadence_s: float | None = None  # realtime on a fixed cadence instead of at production (§33.3)
    max_events: int | None = None  # events per body (default: the link settings' max_events)


@dataclass
class _Pending:
    peer: bytes
    kind: str
    start: int
    end: int
    seqs: list[int]
    sent: float


@dataclass
class Offer:
    start: int  # the cursor value the selection started from (seq > start)
    end: int  # last seq examined
    seqs: list[int] = field(default_factory=list)
    events: list[bytes] = field(default_factory=list)


class SyncPort:
    """What the runner needs from the sync layer: durable per-peer cursors on the MQTT path,
    selection, absorbing a body, the handshake. This minimal implementation keeps the cursor in
    the node's meta table (cursor c: every event with seq <= c is dealt with for that peer)."""

    PATH = "mqtt"

    def __init__(self, node) -> None:
        self.node = node
        self.conn = node.conn
        self.peer_watermarks: dict[bytes, list] = {}  # what each peer last reported (advisory)
        from .sync import SyncDriver
        self.driver = SyncDriver(node)

    def peers(self) -> list[bytes]:
        return sorted(s for s in self.node.keyring if s != self.node.site_id)

    def have_max(self) -> tuple[int, int]:
        r = self.conn.execute("SELECT hlc_p, hlc_l FROM events ORDER BY hlc_p DESC, hlc_l DESC LIMIT 1").fetchone()
        return (0, 0) if r is None else (r[0], r[1])

    def handshake(self, supports_realtime: bool) -> bytes:
        return emit_handshake(Handshake(self.node.site_id, self.have_max(), supports_realtime, False, None))

    def _key(self, peer: bytes) -> str:
        return f"cursor:{self.PATH}:{peer.hex()}"

    def cursor(self, peer: bytes) -> int:
        r = self.conn.execute("SELECT value FROM meta WHERE key=?", (self._key(peer),)).fetchone()
        return 0 if r is None else int(r[0])

    def select(self, peer: bytes, start: int, limit: int) -> Offer:
        off = Offer(start, start)
        for seq, sid, raw in self.conn.execute(
                "SELECT seq, site_id, raw FROM events WHERE seq > ? ORDER BY seq LIMIT ?", (start, limit * 2 + 16)):
            if len(off.events) >= limit:
                break
            off.end = seq
            if bytes(sid) == peer:
                continue  # its own events: pointless to send, dropped as self-echo anyway
            off.events.append(bytes(raw))
            off.seqs.append(seq)
        return off

    def backlog(self, peer: bytes) -> int:
        return self.conn.execute("SELECT count(*) FROM events WHERE seq > ? AND site_id != ?",
                                 (self.cursor(peer), peer)).fetchone()[0]

    def advance(self, peer: bytes, start: int, seqs: list[int], end: int, processed: int) -> bool:
        """Advance the durable cursor after a peer's answer. Only contiguous progress counts: an
        answer for a body that starts beyond the cursor (an earlier body is unanswered) moves
        nothing; that range is re-offered."""
        cur = self.cursor(peer)
        if start > cur:
            return False
        new = end if processed >= len(seqs) else max(start, seqs[processed] - 1)
        if new <= cur:
            return False
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            self.conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (self._key(peer), new))
            self.conn.execute("COMMIT")
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        return True

    def receive(self, data: bytes) -> tuple[SyncBody, list, int]:
        """Parse strictly (raises ProtocolError, nothing changes), apply every event in one
        transaction (committed on return). Returns (body, outcomes, processed)."""
        body = parse_body(data)
        # Through the sync driver (agent/sync.py): control records first, then the events through
        # the node's one apply path. The sender is not authenticated by this binding (secure=False),
        # so nothing it reports or streams moves this node's watermarks.
        from .node import now_ms
        processed, outs = self.driver.receive(body.from_site_id, body, None, "batch", now_ms(), self.PATH, False)
        return body, outs, processed

    def answer_body(self) -> bytes:
        return emit_body(SyncBody(self.node.site_id, self.have_max(), (), (), ()))

    def note_answer(self, peer: bytes, data: bytes) -> None:
        try:
            b = parse_body(data)
        except ProtocolError:
            return
        self.peer_watermarks[peer] = list(b.applied_watermarks)


class Runner:
    def __init__(self, node, settings: MqttSettings, config: RunConfig | None = None,
                 port: SyncPort | None = None) -> None:
        self.node = node
        self.cfg = config or RunConfig()
        self.settings = settings
        self.sync = port or SyncPort(node)
        self.link = MqttLink(settings, node.mesh_id, node.site_id,
                             presence_payload=lambda: self.sync.handshake(self.cfg.realtime))
        self.max_events = self.cfg.max_events or settings.max_events
        self.pending: dict[bytes, _Pending] = {}
        self.sent_upto: dict[bytes, int] = {}  # per peer: highest seq offered in flight (volatile)
        self.caps: dict[bytes, Handshake] = {}  # present peers' handshakes
        self.stats: Counter = Counter()
        self.rejections: deque = deque(maxlen=1000)  # (reason, detail) of refused inbound messages
        self._last_local = self._local_max()
        self._next_batch = 0.0
        self._next_flush = 0.0
        self._produced_at: float | None = None

    # -------------------------------------------------------------- lifecycle
    def start(self, connect_timeout: float = 10.0) -> bool:
        self.link.start()
        return self.link.wait_connected(connect_timeout)

    def close(self) -> None:
        self.link.close()

    # -------------------------------------------------------------- the loop
    def step(self, timeout: float = 0.05) -> None:
        """One turn: take in what arrived, expire unanswered bodies, run due cycles and pushes."""
        self.pump(timeout)
        now = time.monotonic()
        self._expire(now)
        if now >= self._next_batch and self.link.connected.is_set():
            self.batch_cycle()
            self._next_batch = now + self.cfg.cadence_s
        if self.cfg.realtime:
            self._realtime(now)

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        while not should_stop():
            self.step()

    def pump(self, timeout: float = 0.0, max_items: int = 10_000) -> int:
        n = 0
        wait = timeout
        while n < max_items:
            try:
                m = self.link.inbound.get(timeout=wait) if wait > 0 else self.link.inbound.get_nowait()
            except Exception:  # queue.Empty
                break
            wait = 0
            n += 1
            if m.kind == "req":
                self._on_request(m)
            elif m.kind == "ans":
                self._on_answer(m)
            else:
                self._on_presence(m)
        return n

    # -------------------------------------------------------------- receiving
    def _reject(self, m: Inbound, reason: str, detail: str = "") -> None:
        self.stats["rejected_bodies"] += 1
        self.stats[f"rejected:{reason}"] += 1
        self.rejections.append((reason, detail))
        log.warning("refused a body in our inbox (%s%s)", reason, f": {detail}" if detail else "")
        if self.link.answer(m, b"", {P_STATUS: "rejected", P_REASON: reason, P_PROCESSED: "0",
                                     P_START: m.props.get(P_START, ""), P_END: m.props.get(P_END, "")}):
            self.stats["answers_sent"] += 1
        self.link.ack(m)

    def _on_request(self, m: Inbound) -> None:
        self.stats["bodies_received"] += 1
        if m.dup:
            self.stats["redelivered"] += 1
        limit = self.settings.body_limit_bytes
        if len(m.payload) > limit:
            return self._reject(m, "too_large", f"{len(m.payload)} bytes > body limit {limit}")
        kind = m.props.get(P_KIND, KIND_BATCH)
        if kind not in (KIND_BATCH, KIND_REALTIME):
            return self._reject(m, "unknown_kind", kind[:40])
        if kind == KIND_REALTIME:
            sender = m.props.get("ssp-from", "")
            peer = bytes.fromhex(sender) if _is_hex32(sender) else None
            hs = self.caps.get(peer) if peer else None
            if not (self.cfg.realtime and hs is not None and hs.supports_realtime):
                # §33: reject, not drop, an unsolicited body without mutual realtime mode.
                return self._reject(m, "realtime_not_established", sender[:40])
        try:
            body, outs, processed = self.sync.receive(m.payload)
        except ProtocolError as e:
            return self._reject(m, e.reason, e.detail)
        # Committed: now answer, then ack (a crash before the ack means redelivery and duplicates).
        c = counts(outs)
        for k, v in c.items():
            self.stats[k] += v
        reasons = Counter(o.reason for o in outs if o.status not in ("applied", "duplicate"))
        for r, v in reasons.items():
            self.stats[f"event:{r}"] += v
        user = {P_STATUS: "ok", P_PROCESSED: str(processed), P_COUNT: str(len(outs)),
                P_START: m.props.get(P_START, ""), P_END: m.props.get(P_END, ""),
                "ssp-applied": str(c["applied"]), "ssp-duplicate": str(c["duplicate"]),
                "ssp-dropped": str(c["dropped"]), "ssp-rejected": str(c["rejected"])}
        if self.link.answer(m, self.sync.answer_body(), user):
            self.stats["answers_sent"] += 1
        self.link.ack(m)

    def _on_answer(self, m: Inbound) -> None:
        self.link.ack(m)
        p = self.pending.pop(m.correlation, None) if m.correlation else None
        if p is None:
            self.stats["unknown_answers"] += 1  # late (a previous run), replayed or forged: ignored
            return
        self.stats["answers"] += 1
        if m.props.get(P_STATUS) != "ok":
            self.stats[f"push_rejected:{m.props.get(P_REASON, '?')}"] += 1
            self._reset_peer(p.peer)
            return
        try:
            processed = max(0, min(len(p.seqs), int(m.props.get(P_PROCESSED, "0"))))
        except ValueError:
            processed = 0
        self.stats["events_acknowledged"] += processed
        self.sync.advance(p.peer, p.start, p.seqs, p.end, processed)
        self.sync.note_answer(p.peer, m.payload)
        if processed < len(p.seqs):
            self._reset_peer(p.peer)  # re-offer from the cursor next cycle
        else:
            self.offer(p.peer, KIND_BATCH)  # keep the window full while there is more (catch-up)

    def _on_presence(self, m: Inbound) -> None:
        if not m.payload:
            self.caps.pop(m.site, None)
            return
        try:
            hs = parse_message(m.payload)
        except ProtocolError:
            self.caps.pop(m.site, None)
            return
        if isinstance(hs, Handshake) and hs.site_id == m.site:
            if not hs.understood:
                hs = Handshake(hs.site_id, hs.have_max_hlc, False, hs.secure_channel, hs.rtt_ms, False)
            self.caps[m.site] = hs

    # -------------------------------------------------------------- sending
    def _reset_peer(self, peer: bytes) -> None:
        for c in [c for c, p in self.pending.items() if p.peer == peer]:
            del self.pending[c]
        self.sent_upto.pop(peer, None)

    def _expire(self, now: float) -> None:
        for peer in {p.peer for p in self.pending.values() if now - p.sent > self.cfg.answer_timeout_s}:
            self.stats["unanswered"] += 1
            self._reset_peer(peer)

    def in_flight(self, peer: bytes) -> int:
        return sum(1 for p in self.pending.values() if p.peer == peer)

    def offer(self, peer: bytes, kind: str = KIND_BATCH, bodies: int | None = None, force: bool = False) -> int:
        """Send up to `bodies` bodies to `peer` from where the in-flight window ends (or the
        durable cursor). Returns events sent. `force` sends one body even when empty (the
        fixed-cadence flush)."""
        bodies = self.cfg.window - self.in_flight(peer) if bodies is None else bodies
        sent = 0
        start = max(self.sync.cursor(peer), self.sent_upto.get(peer, 0))
        limit = self.link.max_payload()
        for _ in range(max(bodies, 0)):
            off = self.sync.select(peer, start, self.max_events)
            if not off.events and not force:
                if off.end > start and not self.in_flight(peer):
                    self.sync.advance(peer, start, [], off.end, 0)  # nothing for this peer in that range
                break
            force = False
            base = len(self.sync.answer_body())
            parts = split_sizes([len(e) for e in off.events], base, limit, self.max_events) or [(0, 0)]
            if len(parts) > 1:  # trim to the first part that fits; the rest goes in the next body
                a, b = parts[0]
                off = Offer(start, off.seqs[b] - 1, off.seqs[:b], off.events[:b])
            self._send(peer, kind, off)
            sent += len(off.events)
            start = off.end
            self.sent_upto[peer] = off.end
        return sent

    def _send(self, peer: bytes, kind: str, off: Offer) -> None:
        body = emit_body(SyncBody(self.node.site_id, self.sync.have_max(), tuple(off.events), (), ()))
        user = {P_KIND: kind, P_START: str(off.start), P_END: str(off.end), P_COUNT: str(len(off.events)),
                P_PART: "1/1"}
        corr = self.link.push(peer, body, user)
        self.pending[corr] = _Pending(peer, kind, off.start, off.end, off.seqs, time.monotonic())
        self.stats["bodies_pushed"] += 1
        self.stats["events_pushed"] += len(off.events)
        self.stats[f"pushed_{kind}"] += 1

    def batch_cycle(self) -> int:
        self.stats["batch_cycles"] += 1
        n = 0
        for peer in self.sync.peers():
            if self.in_flight(peer):
                continue  # its window is still out; answers (or the timeout) decide
            self.sent_upto.pop(peer, None)
            n += self.offer(peer, KIND_BATCH)
        return n

    def realtime_peers(self) -> list[bytes]:
        if not self.cfg.realtime:
            return []
        return [p for p, hs in self.caps.items() if hs.supports_realtime and p in self.node.keyring]

    def _local_max(self) -> int:
        r = self.node.conn.execute("SELECT max(seq) FROM events WHERE origin='local'").fetchone()
        return r[0] or 0

    def _realtime(self, now: float) -> None:
        if self.cfg.flush_cadence_s:
            if now >= self._next_flush:
                self._next_flush = now + self.cfg.flush_cadence_s
                for p in self.realtime_peers():
                    if self.in_flight(p) < self.cfg.window:
                        self.offer(p, KIND_REALTIME, bodies=1, force=True)
            return
        cur = self._local_max()
        if cur > self._last_local and self._produced_at is None:
            self._produced_at = now
        if self._produced_at is not None and now - self._produced_at >= self.cfg.coalesce_s:
            self._produced_at = None
            self._last_local = self._local_max()
            for p in self.realtime_peers():
                if self.in_flight(p) < self.cfg.window:
                    self.offer(p, KIND_REALTIME, bodies=1)
                    self.stats["realtime_pushes"] += 1

    def notify_produced(self) -> None:
        """In-process writers may call this; polling the log finds other processes' writes too."""
        if self._produced_at is None:
            self._produced_at = time.monotonic()

    # -------------------------------------------------------------- one-shot
    def sync_once(self, settle_s: float = 0.5, timeout_s: float = 20.0) -> dict:
        """One full cycle: take in everything waiting for this node, offer every peer what its
        cursor selects (until it is answered, for peers that are present), then return."""
        t0 = time.monotonic()
        # Retained presence and queued bodies arrive right after the subscription.
        idle_since = time.monotonic()
        while time.monotonic() - idle_since < settle_s and time.monotonic() - t0 < timeout_s:
            if self.pump(0.05):
                idle_since = time.monotonic()
        self.batch_cycle()
        while time.monotonic() - t0 < timeout_s:
            self.pump(0.05)
            self._expire(time.monotonic())
            waiting = [p for p in {q.peer for q in self.pending.values()} if p in self.caps]
            if not waiting:
                break
        # A last look for bodies that arrived meanwhile.
        idle_since = time.monotonic()
        while time.monotonic() - idle_since < min(settle_s, 0.2):
            if self.pump(0.05):
                idle_since = time.monotonic()
        return self.summary()

    def summary(self) -> dict[str, Any]:
        s = self.stats
        peers = {}
        for p in self.sync.peers():
            peers[p.hex()] = {"present": p in self.caps, "cursor": self.sync.cursor(p),
                              "behind": self.sync.backlog(p),
                              "realtime": bool(self.caps.get(p) and self.caps[p].supports_realtime)}
        return {"pushed": s["events_acknowledged"], "offered": s["events_pushed"], "applied": s["applied"],
                "duplicate": s["duplicate"], "dropped": s["dropped"], "rejected": s["rejected"],
                "bodies_pushed": s["bodies_pushed"], "bodies_received": s["bodies_received"],
                "answers": s["answers"], "unanswered": len(self.pending),
                "refused_bodies": s["rejected_bodies"], "peers": peers}


def _is_hex32(s: str) -> bool:
    return len(s) == 32 and all(c in "0123456789abcdef" for c in s)


def settings_from_env(url: str, **kw) -> MqttSettings:
    """Broker settings from a URL plus SSP_MQTT_* variables (TLS files, credentials) so that
    secrets need not appear on a command line."""
    env = os.environ
    return MqttSettings.from_url(
        url,
        ca_file=kw.get("ca_file") or env.get("SSP_MQTT_CA_FILE"),
        cert_file=kw.get("cert_file") or env.get("SSP_MQTT_CERT_FILE"),
        key_file=kw.get("key_file") or env.get("SSP_MQTT_KEY_FILE"),
        username=kw.get("username") or env.get("SSP_MQTT_USERNAME"),
        password=kw.get("password") or env.get("SSP_MQTT_PASSWORD"),
        prefix=kw.get("prefix") or env.get("SSP_MQTT_PREFIX"),
    )


def dumps_summary(d: dict) -> str:
    return json.dumps(d, sort_keys=True)
