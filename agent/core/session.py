"""The per-link SSP/1 session (§31-§33), sans-I/O: the one state machine of the serial and in-memory
links, on the exchange rules MQTT runs.

A session never reads a clock, a socket or a database: bytes come in through `receive(data,
now)`, bytes to send come out of `data_to_send()`, the next deadline is `timer()`, and the caller
calls `handle_timer(now)` when it passes. What a body contains and what happens to a received one
is the `Provider`'s business (agent/sync.py wires it to a Node). What it decides about what it
sent is its `Exchange`'s (agent/core/exchange.py, the rules the MQTT runner follows too); the
session maps those decisions onto frames, and its own rule beside them is `chain` (after an
exchange that moved events, the next one at once: what ends a `sync --once` over a line).

The SSP/1 messages travel inside a small transport frame that carries what they do not: the frame
type, a correlation id and the sender's stream positions (hello, body, answer, ack, push,
push_ack, refused, error: docs/protocol.md §1). A binding with native metadata (MQTT v5) maps
them onto it; every other binding sends `encode_frame(...)` bytes as they are."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import json

from . import reasons
from .classify import classified
from .codec import INT64_MAX, DecodeError, decode_strict, encode
from .binding import NEVER, next_due
from .incoming import ON_SESSION, sync_body
from .exchange import KIND_BATCH, KIND_REALTIME, BodyLimits, Exchange, ExchangeConfig, InFlight, Schedule
from .messages import Handshake, ProtocolError, SyncBody, emit_handshake, parse_message
from .sending import MIN_BODY_LIMIT

FRAME_TYPES = ("hello", "body", "answer", "ack", "push", "push_ack", "refused", "error")
MAX_FRAME_BYTES = 17 * 1024 * 1024


@dataclass(frozen=True)
class StreamMeta:
    start: int = 0
    end: int = 0
    seqs: tuple[int, ...] = ()
    gaps: tuple[str, ...] = ()
    extra: int = 0  # backfill events following the live ones (not part of the stream)

    def to_wire(self) -> dict:
        d, prev = [], self.start
        for s in self.seqs:
            d.append(s - prev)
            prev = s
        return {"s": self.start, "e": self.end, "d": d, "g": list(self.gaps), "x": self.extra}

    @classmethod
    @classified(ProtocolError)
    def from_wire(cls, m: Any, n_events: int) -> "StreamMeta":
        """The frame meta boundary (a decoded meta): StreamMeta or ProtocolError `bad_frame_meta`.
        Positions are log seqs that reach the store (stream_completed): bounded by what SQLite
        holds, as is their sum (`pos <= e`)."""
        if not isinstance(m, dict) or set(m) != {"s", "e", "d", "g", "x"}:
            raise ProtocolError("bad_frame_meta", "meta must be {s, e, d, g, x}")
        s, e, d, g, x = m["s"], m["e"], m["d"], m["g"], m["x"]
        if not all(_uint(v) for v in (s, e, x)) or not isinstance(d, list) or not all(_uint(v) and v > 0 for v in d):
            raise ProtocolError("bad_frame_meta", "positions must be unsigned, deltas positive")
        if not isinstance(g, list) or not all(isinstance(t, str) for t in g):
            raise ProtocolError("bad_frame_meta", "g must be a list of table names")
        seqs, pos = [], s
        for delta in d:
            pos += delta
            seqs.append(pos)
        if pos > e or len(seqs) + x != n_events:
            raise ProtocolError("bad_frame_meta", "positions do not describe the body's events")
        return cls(s, e, tuple(seqs), tuple(g), x)


@dataclass(frozen=True)
class Outgoing:
    body: bytes  # an emitted sync body
    meta: StreamMeta
    token: Any  # handed back to Provider.confirm once the peer reports what it processed
    n_events: int = 0
    backfill: bool = False  # carries a share of a backfill job (rows, or the walk's end)


class Provider(Protocol):
    def hello_info(self) -> tuple[bytes, tuple[int, int]]: ...  # (site_id, have_max_hlc)
    def cursor(self, peer: bytes) -> int: ...  # the durable cursor on this link's path
    def records_pending(self, peer: bytes) -> bool: ...  # control records not yet delivered to the peer
    # A body from `start`: at most `max_events` events (None: the batch limit), `max_bytes` bytes
    # (cut to fit; one event too large still goes alone), backfill rows only with `backfill`.
    def outgoing(self, peer: bytes, mode: str, now: int, *, start: int, max_events: int | None = None,
                 max_bytes: int | None = None, record_budget: int | None = None,
                 backfill: bool = True) -> Outgoing: ...  # mode: batch | push
    def incoming(self, peer: bytes, body: SyncBody, meta: StreamMeta, mode: str, now: int) -> tuple[int, list[int]]: ...
    def confirm(self, peer: bytes, token: Any, processed: int, rejected: list[int] | None, now: int) -> None: ...
    def protocol_error(self, peer: bytes | None, reason: str, detail: str, now: int) -> None: ...


def _uint(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= INT64_MAX


MAX_META_CHARS = 65_535  # an MQTT user property value cannot be longer (a UTF-8 string, u16 length)


@classified(ProtocolError)
def parse_meta_text(text: Any) -> dict:
    """The meta property boundary (MQTT `ssp-meta`, docs/mqtt.md): the JSON text of a frame meta
    as a dict with the {s, e, d, g, x} members, or ProtocolError `bad_frame_meta`. Deep nesting
    (5 000 `[` made the JSON parser raise RecursionError) is refused before
    parsing: a meta nests two deep. `StreamMeta.from_wire` checks it against the body."""
    if not isinstance(text, str) or len(text) > MAX_META_CHARS:
        raise ProtocolError("bad_frame_meta", "ssp-meta is not text of at most 65 535 characters")
    if text.count("[") + text.count("{") > 3 + text.count('"'):
        # Brackets outside strings: at most one map and two arrays; inside strings (table names
        # in `g`) each comes with quotes. A cheap over-approximation that refuses deep nesting.
        raise ProtocolError("bad_frame_meta", "ssp-meta nests deeper than a frame meta")
    try:
        m = json.loads(text)
    except (ValueError, RecursionError):
        raise ProtocolError("bad_frame_meta", "ssp-meta is not JSON") from None
    if not isinstance(m, dict) or set(m) != {"s", "e", "d", "g", "x"}:
        raise ProtocolError("bad_frame_meta", "meta must be {s, e, d, g, x}")
    return m


def encode_frame(t: str, *, c: int | None = None, b: bytes | None = None, m: dict | None = None,
                 k: int | None = None, r: Any = None, j: list[int] | None = None, f: str | None = None,
                 l: int | None = None) -> bytes:
    fr: dict[str, Any] = {"t": t}
    if c is not None:
        fr["c"] = c
    if b is not None:
        fr["b"] = b
    if m is not None:
        fr["m"] = m
    if k is not None:
        fr["k"] = k
    if r is not None:
        fr["r"] = r
    if j:
        fr["j"] = list(j)
    if f is not None:
        fr["f"] = f
    if l is not None:
        fr["l"] = l
    return encode(fr)


_FRAME_MEMBERS = {"hello": {"t", "b", "r"}, "body": {"t", "c", "b", "m"}, "answer": {"t", "c", "b", "m", "k"},
                  "ack": {"t", "c", "k"}, "push": {"t", "c", "b", "m"}, "push_ack": {"t", "c", "k"},
                  "refused": {"t", "c", "f", "r"}, "error": {"t", "r"}}
# j: the indices of the answered body's events the peer rejected (every other one reached a final
# state). Optional: a peer that omits it is read by `k` alone. l: the sender's
# body limit (bytes of `b` it takes), advertised in its hello as MQTT's `ssp-body-limit` is.
_FRAME_OPTIONAL = {"answer": {"j"}, "ack": {"j"}, "push_ack": {"j"}, "hello": {"l"}}
REFUSABLE = ("body", "answer", "push")  # the frames a `refused` names (f): the ones that carry a body
MAX_REJECTED_INDICES = 100_000


@classified(ProtocolError)
def decode_frame(data: bytes) -> dict:
    """The session frame boundary: a frame dict with its members typed, or ProtocolError."""
    if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_FRAME_BYTES:
        raise ProtocolError("not_bytes" if not isinstance(data, (bytes, bytearray)) else "too_large",
                            f"a frame of at most {MAX_FRAME_BYTES} bytes")
    try:
        f = decode_strict(bytes(data), deterministic=False)
    except DecodeError as e:
        raise ProtocolError("bad_frame", e.reason) from None
    if not isinstance(f, dict) or type(f.get("t")) is not str or f["t"] not in _FRAME_MEMBERS \
            or set(f) - _FRAME_OPTIONAL.get(f["t"], set()) != _FRAME_MEMBERS[f["t"]]:
        raise ProtocolError("bad_frame", "unknown frame type or members")
    if "j" in f and (not isinstance(f["j"], list) or len(f["j"]) > MAX_REJECTED_INDICES
                     or not all(_uint(i) for i in f["j"])):
        raise ProtocolError("bad_frame", "j must be a list of event indices")
    if "c" in f and not _uint(f["c"]):
        raise ProtocolError("bad_frame", "correlation id must be unsigned")
    if "k" in f and not _uint(f["k"]):
        raise ProtocolError("bad_frame", "k must be unsigned")
    if "b" in f and not isinstance(f["b"], bytes):
        raise ProtocolError("bad_frame", "b must be a byte string")
    if f["t"] == "hello" and not isinstance(f["r"], bool):
        raise ProtocolError("bad_frame", "r must be a bool")
    if f["t"] in ("error", "refused") and not isinstance(f["r"], str):
        raise ProtocolError("bad_frame", "r must be text")
    if f["t"] == "refused" and f["f"] not in REFUSABLE:
        raise ProtocolError("bad_frame", "f must name a body, answer or push")
    if "l" in f and not _uint(f["l"]):
        raise ProtocolError("bad_frame", "l must be unsigned")
    return f


@dataclass
class SessionEvent:
    kind: str  # ready | exchanged | pushed | received_push | protocol_error | peer_error | refused | warning | timeout
    detail: str = ""


BODY_LIMIT_FLOOR = 16 * 1024  # an advertised body limit is never taken below this (BodyLimits, as on MQTT)


def _s(now_ms: int) -> float:
    """The exchange keeps time in seconds (ExchangeConfig); a session is given milliseconds."""
    return now_ms / 1000


@dataclass
class Session:
    """One link's SSP/1 session. What it decides about bodies in flight is the exchange's
    (agent/core/exchange.py: `Exchange` for this one peer, `BodyLimits`, `OfferPlan`,
    `InFlight`): the rules MQTT runs, in one place. This class only maps them onto frames."""
    provider: Provider
    peer: bytes | None = None  # expected peer (the link's identity); None: taken from its handshake
    realtime_capable: bool = False  # SOVM-SYNC-RT in this node's module set
    binding_unsolicited: bool = False  # the binding can carry peer-initiated one-way bodies
    secure: bool = False  # the local binding authenticated the peer (what we know, not what it claims)
    cycle_ms: int = 30_000  # batch cadence (kept running under realtime: §33.1)
    coalesce_ms: int = 50  # realtime: pushes produced within this window travel as one body (§33.2)
    flush_ms: int | None = None  # realtime: fixed-cadence flush instead of push-on-production (§33.3)
    answer_timeout_ms: int = 10_000  # a peer silent this long (doubling per give-up) lost its bodies
    hello_retry_ms: int = 2_000
    window: int = ExchangeConfig.window  # bodies in flight to the peer (MQTT's window)
    body_limit: int = 256 * 1024  # the largest body (`b`) this node takes; advertised in its hello
    link_max: int = MAX_FRAME_BYTES  # the largest frame the link carries

    state: str = "hello"  # hello -> ready (-> closed)
    peer_handshake: Handshake | None = None
    realtime: bool = False
    rtt_ms: int | None = None
    events: list[SessionEvent] = field(default_factory=list)
    ex: Exchange = field(init=False)
    sched: Schedule = field(init=False)  # when the cycle and realtime pushes are due (the runner's too)
    _out: list[bytes] = field(default_factory=list)
    _corr: int = 0
    _next_hello: int | None = None
    _push_wanted: bool = False  # produced while the window was full: pushed when an answer frees it
    _then: str | None = None  # what the last settled answer asks for next (`Settled.then`)
    _moved: int = 0  # events sent and received since the last exchange completed (`chain`)
    _settled: bool = False  # an answer or ack just moved the cursor (an exchange completed)
    _chain: bool = False  # an exchange this end started moved events: start the next one (`chain`)

    def __post_init__(self) -> None:
        # On a point-to-point link only the peer at the other end answers (its handshake named it):
        # its answers are evidence, as on the MQTT binding with the broker's ACLs (`secure`).
        cfg = ExchangeConfig(cadence_s=self.cycle_ms / 1000, realtime=self.realtime_capable,
                             coalesce_s=self.coalesce_ms / 1000,
                             flush_cadence_s=None if self.flush_ms is None else self.flush_ms / 1000,
                             window=self.window, answer_timeout_s=self.answer_timeout_ms / 1000, secure=True)
        limits = BodyLimits(BODY_LIMIT_FLOOR, cfg)
        self.ex = Exchange(cfg, limits, stats=limits.stats)
        self.sched = Schedule(cfg)
        self.sched.next_batch = self.sched.next_flush = float("inf")  # nothing before the handshake

    # ------------------------------------------------------------------ inputs
    @property
    def advertises_realtime(self) -> bool:
        """§33: true only with the module and a binding that carries unsolicited bodies."""
        return bool(self.realtime_capable and self.binding_unsolicited)

    @property
    def busy(self) -> bool:
        """Something this end sent awaits its answer (a body, a push) or its ack (an answer)."""
        return bool(self.ex.pending)

    def bodies_out(self) -> int:
        """Bodies and pushes of this end in flight (answers to the peer's bodies not counted)."""
        return sum(1 for key in self.ex.pending if key[0] == "out")

    def start(self, now: int) -> None:
        self._send_hello(True, now)

    def close(self) -> None:
        self.state = "closed"

    def data_to_send(self) -> list[bytes]:
        out, self._out = self._out, []
        return out

    def timer(self) -> int | None:
        ts = [self._next_hello] if self._next_hello is not None else []
        # The exchange's own deadlines, as the MQTT loop asks for them (`binding.next_due`: the
        # batch cycle, a coalesced or fixed-cadence push, giving up on a silent peer). It keeps
        # seconds; +1 ms: the deadline has surely passed then.
        # (The time passed is "as early as it gets": a wait that has not started yet is due at once.)
        due = next_due(self.ex, self.sched, float("-inf"), connected=self.state == "ready")
        if due == float("-inf"):
            ts.append(0)
        elif due != NEVER:
            ts.append(int(due * 1000) + 1)
        return min(ts) if ts else None

    def handle_timer(self, now: int) -> None:
        if self.state == "closed":
            return
        if self.peer is not None:
            n = self.ex.in_flight(self.peer)
            # The peer is reachable (the link is up) and silent: what is in flight to it is given
            # up on and offered again from the cursor (§14.1), the same rule as on MQTT.
            for _ in self.ex.expire(_s(now), self._top()):
                self.events.append(SessionEvent("timeout", f"{n} in flight"))
        if self.state == "hello":
            if self._next_hello is not None and now >= self._next_hello:
                self._send_hello(True, now)
            return
        if self.sched.batch_due(_s(now), True):
            self.cycle(now)
        due = self.sched.realtime_due(_s(now), 0) if self.realtime else None
        if due is not None:
            self._push(now, flush=due == "flush")

    def cycle(self, now: int) -> bool:
        """A batch cycle now (§32): bodies up to the window's room; one even with nothing new
        when none of this end's is in flight (the exchange carries both directions: the answer
        brings the peer's events). Returns whether a body went."""
        self.sched.next_batch = _s(now) + self.sched.cfg.cadence_s
        if self.state != "ready":
            return False
        assert self.peer is not None
        room = self.ex.batch_room(self.peer)  # a full window waits for answers or a give-up
        if not room:
            return False
        return self._offer(KIND_BATCH, now, room, force=not self.bodies_out()) > 0

    def chain(self, now: int) -> bool:
        """The chain rule: after an exchange this end started that moved events either way, more
        may be waiting on either side, so the next one starts now, not a cadence later, until one
        moves nothing (which is what ends a `sync --once` over a line, docs/serial.md). Only the end
        that started one chains, so the two ends never start one each at once (that would send
        the same events twice: a body and an answer selected from one cursor). A driver calls it
        after handing in what arrived; returns whether a body went."""
        want, self._chain = self._chain, False
        if want and self.state == "ready" and not self.bodies_out():
            return self.cycle(now)
        return False

    def local_events(self, now: int) -> None:
        """The node produced (or received) events: in realtime mode, schedule a coalesced push."""
        if self.state != "ready" or not self.realtime or self.flush_ms is not None:
            return
        self.sched.produced(_s(now))  # what is produced meanwhile goes in the same push (§33.2)

    def receive(self, data: bytes, now: int) -> None:
        if self.state == "closed":
            return
        try:
            f = decode_frame(data)
            getattr(self, "_on_" + f["t"])(f, now)
        except ProtocolError as e:
            self._protocol_error(e, now)

    # ------------------------------------------------------------------ frame handlers
    def _on_hello(self, f: dict, now: int) -> None:
        msg = parse_message(f["b"])  # unknown ssp_version fails closed here (§30)
        if not isinstance(msg, Handshake):
            raise ProtocolError("not_a_handshake", "a hello frame must carry a handshake")
        if self.peer is not None and msg.site_id != self.peer:
            raise ProtocolError("handshake_site_mismatch", f"handshake from {msg.site_id.hex()}, expected {self.peer.hex()}")
        local_site, _ = self.provider.hello_info()
        if msg.site_id == local_site:
            raise ProtocolError("self_handshake", "the peer claims this node's own site_id")
        self.peer = msg.site_id
        self.peer_handshake = msg
        # The handshake is the peer's presence on this link (§31), and its body limit what it takes.
        self.ex.presence.arrived(msg.site_id, msg, lambda _site: True)
        self.ex.limits.learn(msg.site_id, f.get("l"))
        if msg.secure_channel is not None and msg.secure_channel != self.secure:
            # §31: advisory only; a disagreement usually means a misconfigured binding.
            self.events.append(SessionEvent("warning", f"secure_channel: peer says {msg.secure_channel}, "
                                                       f"this binding says {self.secure}"))
        self.realtime = bool(self.advertises_realtime and msg.supports_realtime and msg.understood)
        first = self.state != "ready"
        self.state = "ready"
        self._next_hello = None
        if f["r"]:
            self._send_hello(False, now)
        if first:
            self.events.append(SessionEvent("ready", "realtime" if self.realtime else "batch"))
            # Both sides run the cycle; stagger them so a quiet link sees one exchange per period.
            stagger = 0 if local_site < msg.site_id else self.cycle_ms // 2
            self.sched.next_batch = _s(now + stagger)
            if self.realtime and self.flush_ms is not None:
                self.sched.next_flush = _s(now + self.flush_ms)

    def _require_ready(self) -> None:
        if self.state != "ready":
            raise ProtocolError("no_handshake", "a sync body before the capability handshake (§31)")

    def _body(self, f: dict) -> tuple[SyncBody, StreamMeta]:
        assert self.peer is not None  # ready: the handshake named it
        msg = sync_body(f["b"], self.peer, said=ON_SESSION)  # strict (§32.2), the one sender check
        return msg, StreamMeta.from_wire(f["m"], len(msg.events))

    def _fits(self, f: dict, now: int) -> bool:
        """A body over this node's limit is refused before it is parsed (reason `too_large`, as on
        MQTT): the sender halves what it sends and offers the range again."""
        if len(f["b"]) <= self.body_limit:
            return True
        e = ProtocolError(reasons.TOO_LARGE, f"{len(f['b'])} bytes > body limit {self.body_limit}")
        self.events.append(SessionEvent("protocol_error", e.reason))
        self.provider.protocol_error(self.peer, e.reason, e.detail, now)
        self._out.append(encode_frame("refused", c=f["c"], f=f["t"], r=e.reason))
        return False

    def _on_body(self, f: dict, now: int) -> None:
        self._require_ready()
        assert self.peer is not None
        if ("ans", f["c"]) in self.ex.pending:
            return  # a duplicate (a faulty line): its answer is in flight already
        if not self._fits(f, now):
            return
        body, meta = self._body(f)
        k, rejected = self.provider.incoming(self.peer, body, meta, "batch", now)
        self._moved += len(body.events)
        self._answer(f["c"], k, rejected, now)

    def _on_answer(self, f: dict, now: int) -> None:
        self._require_ready()
        assert self.peer is not None
        if not self._fits(f, now):
            # The body it answers is settled by its `k` all the same; its own events come again.
            self._settle(("out", f["c"]), "ok", None, f["k"], f.get("j"), now)
            self.events.append(SessionEvent("exchanged", str(f["c"])))
            self._after_settle(now)
            self._completed(started=True)
            return
        body, meta = self._body(f)
        self._settle(("out", f["c"]), "ok", None, f["k"], f.get("j"), now)
        k, rejected = self.provider.incoming(self.peer, body, meta, "batch", now)
        self._moved += len(body.events)
        self._out.append(encode_frame("ack", c=f["c"], k=k, j=rejected))
        self.events.append(SessionEvent("exchanged", str(f["c"])))
        self._after_settle(now)
        self._completed(started=True)

    def _on_ack(self, f: dict, now: int) -> None:
        self._observed("ans", f, now)  # the outcome of an answer this end sent

    def _on_push(self, f: dict, now: int) -> None:
        self._require_ready()
        if not self.realtime:
            # §33: reject, not drop, so a protocol error surfaces as one.
            raise ProtocolError("realtime_not_established", "realtime mode was not mutually established on this session")
        if not self._fits(f, now):
            return
        body, meta = self._body(f)
        assert self.peer is not None
        # Its meta describes the sender's stream as a batch body's does (a push is a window body
        # sent early, from where the window ends): the stream is followed through it, as on MQTT.
        k, rejected = self.provider.incoming(self.peer, body, meta, "batch", now)
        self._moved += len(body.events)
        # The push's outcome, observed by its sender: its cursor moves on it (§33 "a sender
        # advances its durable cursor only on a successful push, solicited or not").
        self._out.append(encode_frame("push_ack", c=f["c"], k=k, j=rejected))
        self.events.append(SessionEvent("received_push", str(len(body.events))))

    def _on_push_ack(self, f: dict, now: int) -> None:
        self._observed("out", f, now)  # the outcome of a push this end sent

    def _observed(self, sent: str, f: dict, now: int) -> None:
        """The peer's {c, k, j} outcome of a body this end sent (`sent`: "ans" an answer, "out" a
        body or push): the cursor moves on it (§33), then the window refills."""
        self._require_ready()
        self._settle((sent, f["c"]), "ok", None, f["k"], f.get("j"), now)
        self._after_settle(now)
        self._completed(started=False)

    def _on_refused(self, f: dict, now: int) -> None:
        self._require_ready()
        assert self.peer is not None
        self.events.append(SessionEvent("refused", f"{f['f']} {f['c']}: {f['r']}"))
        before = self.ex.limits.limit(self.peer, _s(now), self._top())
        self._settle(("ans" if f["f"] == "answer" else "out", f["c"]), "rejected", f["r"], 0, None, now)
        if self.ex.limits.limit(self.peer, _s(now), self._top()) < before:
            self._offer(KIND_BATCH, now, None, force=False)  # smaller now: the range goes again at once

    def _on_error(self, f: dict, now: int) -> None:
        self.events.append(SessionEvent("peer_error", f["r"]))
        if f["r"].startswith("no_handshake"):
            self._send_hello(True, now)

    # ------------------------------------------------------------------ the exchange's rules
    def _top(self) -> int:
        """The largest body the link carries: its frame bound, less room for the frame's meta."""
        return max(MIN_BODY_LIMIT, self.link_max - self.link_max // 8)

    def _settle(self, key: tuple[str, int], status: str, reason: str | None, k: int,
                rejected: list[int] | None, now: int) -> None:
        """An answer, a push's answer, an ack or a refusal for what this end sent under `key`:
        what it proves is the exchange's to decide (`Exchange.answer`, the one MQTT's answers go
        through); the cursor then moves through the provider (`SyncDriver.confirm`)."""
        assert self.peer is not None
        p, earlier = self.ex.lookup(key)
        d = self.ex.answer(key, self.peer, p, earlier, status=status, reason=reason, processed_text=str(k),
                           rejected=rejected, proof=lambda _body: None, now=_s(now), link_max=self._top())
        if d.ignored is not None:
            return  # given up on already (or never sent): its range is offered again anyway
        self.ex.answered(self.peer, key, still_recorded=False, refused=d.refused is not None)
        self.ex.reachable(self.peer, _s(now))  # the wait for what is still in flight starts again
        if not d.advances:
            return
        assert d.body is not None
        if key[0] == "out":
            self.rtt_ms = max(0, now - int(d.body.sent * 1000))
        # contiguous: with a window in flight, an answer moves the live cursor only when its body
        # started at or before it (an earlier range still unanswered is re-offered), as on MQTT.
        self.provider.confirm(self.peer, d.body.token, d.processed, d.rejected, now)
        self._settled = True
        self._then = d.then

    def _completed(self, started: bool) -> None:
        """An answer or ack was handled: when it completed an exchange (the cursor moved), what
        moved since the last one decides the chain rule (`chain`) for an exchange this end
        `started` (its body answered)."""
        if not self._settled:
            return  # ignored (given up on already): nothing completed
        self._settled = False
        moved, self._moved = self._moved, 0
        if started and moved:
            self._chain = True

    def _after_settle(self, now: int) -> None:
        """After an answer: keep the window full while there is more (catch-up), push what was
        produced while it was full, and restart the wait for what is still in flight."""
        assert self.peer is not None
        then, self._then = self._then, None
        if then == "offer":
            self._offer(KIND_BATCH, now, None, force=False)
        if self._push_wanted and self.realtime and self.ex.room(self.peer) > 0:
            self._push_wanted = False
            self._offer(KIND_REALTIME, now, 1, force=False)
        self.ex.reachable(self.peer, _s(now))

    def _offer(self, kind: str, now: int, bodies: int | None, force: bool) -> int:
        """Bodies (batch) or one push (realtime) from where the window in flight ends, as the
        exchange plans them (`Exchange.plan_offer`, the runner's `offer`): each within the peer's
        body limit now (`BodyLimits`), at most one carrying backfill rows. Returns bodies sent."""
        peer = self.peer
        assert peer is not None
        t = _s(now)
        plan = self.ex.plan_offer(peer, kind, self.provider.cursor(peer), self.ex.limits.limit(peer, t, self._top()),
                                  bodies, force, lambda: self.provider.records_pending(peer))
        sent = 0
        for _ in range(plan.bodies):
            bf = self.ex.may_carry_backfill(peer, kind)
            out = self.provider.outgoing(peer, "push" if kind == KIND_REALTIME else "batch", now, start=plan.start,
                                         max_bytes=plan.limit, record_budget=plan.record_budget, backfill=bf)
            if not plan.worth_sending(out.meta.end, out.backfill):
                break
            c = self._new_corr()
            frame = encode_frame("push" if kind == KIND_REALTIME else "body", c=c, b=out.body, m=out.meta.to_wire())
            if len(frame) > self.link_max:
                # Refused by the link itself: the back-off a peer's refusal causes (BodyLimits).
                self.ex.limits.too_large(peer, t, self._top())
                self.ex.reset(peer)
                self.events.append(SessionEvent("refused", f"{len(frame)} bytes > the link's {self.link_max}"))
                break
            self._sent(("out", c), kind, out, frame, now)
            plan.sent(out.meta.end)
            sent += 1
            if kind == KIND_REALTIME:
                self.events.append(SessionEvent("pushed", str(out.n_events)))
        return sent

    def _answer(self, c: int, k: int, rejected: list[int], now: int) -> None:
        """The answer to the peer's body `c`: `k` (and the rejected indices) for it, and this end's
        events from where its window in flight ends (none while the window is full). It is in
        flight until the peer's ack, like a body."""
        peer = self.peer
        assert peer is not None
        t = _s(now)
        limit = self.ex.limits.limit(peer, t, self._top())
        plan = self.ex.plan_offer(peer, KIND_BATCH, self.provider.cursor(peer), limit, 1)
        room = self.ex.room(peer) > 0
        out = self.provider.outgoing(peer, "batch", now, start=plan.start, max_events=None if room else 0,
                                     max_bytes=limit, record_budget=plan.record_budget,
                                     backfill=room and self.ex.may_carry_backfill(peer, KIND_BATCH))
        frame = encode_frame("answer", c=c, b=out.body, m=out.meta.to_wire(), k=k, j=rejected)
        if len(frame) > self.link_max and out.n_events:
            self.ex.limits.too_large(peer, t, self._top())
            out = self.provider.outgoing(peer, "batch", now, start=plan.start, max_events=0, backfill=False)
            frame = encode_frame("answer", c=c, b=out.body, m=out.meta.to_wire(), k=k, j=rejected)
        self._sent(("ans", c), KIND_BATCH, out, frame, now)

    def _sent(self, key: tuple[str, int], kind: str, out: Outgoing, frame: bytes, now: int) -> None:
        assert self.peer is not None
        m = out.meta
        self.ex.sent(key, InFlight(self.peer, kind, m.start, m.end, list(m.seqs), _s(now), m.extra, out.backfill,
                                   out.token, len(out.body)))
        self.ex.reachable(self.peer, _s(now))
        self._moved += out.n_events
        self._out.append(frame)

    # ------------------------------------------------------------------ helpers
    def _push(self, now: int, flush: bool) -> None:
        assert self.peer is not None
        if self.ex.room(self.peer) <= 0:
            # The window is full: what was produced goes when an answer frees a slot (a flush
            # tick is skipped, as on MQTT: `Exchange.push_targets`).
            self._push_wanted = not flush
            return
        # A push is a window body sent early and answered (push_ack): its answer moves the
        # cursor like a batch body's; the batch cycle is the backstop (§33.1).
        self._offer(KIND_REALTIME, now, 1, force=flush)

    def _send_hello(self, reply: bool, now: int) -> None:
        site, hmax = self.provider.hello_info()
        hs = Handshake(site, hmax, self.advertises_realtime, self.secure, self.rtt_ms)
        self._out.append(encode_frame("hello", b=emit_handshake(hs), r=reply, l=self.body_limit))
        if self.state != "ready":
            self._next_hello = now + self.hello_retry_ms

    def _new_corr(self) -> int:
        self._corr += 1
        return self._corr

    def unhandled(self, detail: str, now: int) -> None:
        """A frame whose handling raised past its boundary parser (the caller's net): refused as
        a protocol error with reason `unclassified`; the peer re-offers what no answer confirmed."""
        self._protocol_error(ProtocolError(reasons.UNCLASSIFIED, detail), now)

    def _protocol_error(self, e: ProtocolError, now: int) -> None:
        self.events.append(SessionEvent("protocol_error", e.reason))
        self.provider.protocol_error(self.peer, e.reason, e.detail, now)
        self._out.append(encode_frame("error", r=f"{e.reason}: {e.detail}"[:200]))
