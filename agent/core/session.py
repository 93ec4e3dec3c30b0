"""The per-link SSP/1 session (§31-§33), sans-I/O.

A session never reads a clock, a socket or a database. Bytes come in through `receive(data,
now)`, bytes to send come out of `data_to_send()`, the next deadline is `timer()` and the
caller calls `handle_timer(now)` when it passes. What a body contains and what happens to a
received one is the `Provider`'s business (agent/sync.py wires it to a Node).

Frames. The SSP/1 messages (handshake, sync body) travel inside a small transport frame that
carries what the messages do not: the frame type, a correlation id (an answer and an ack name
the body they answer) and the sender's stream positions. A binding with native metadata (MQTT
v5: response topic + correlation data + user properties) may map these onto it; every other
binding sends `encode_frame(...)` bytes as they are.

  hello   {t, b: handshake, r: reply wanted}
  body    {t, c, b: sync body, m: meta}          batch request (the initiator's events)
  answer  {t, c, b: sync body, m: meta, k}       the responder's events; k = events of `body`
                                                  processed to a final state before the first
                                                  rejected one
  ack     {t, c, k}                              k = events of `answer` processed likewise
  push    {t, c, b: sync body, m: meta}          realtime: unsolicited, nothing awaited (§33)
  error   {t, r: reason}                         a protocol error, surfaced on both sides

meta = {s: start cursor, e: end position, d: seq deltas of the live events, g: tables whose own
events the sender withheld by policy, x: number of backfill events after the live ones}.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import json

from .classify import classified
from .codec import INT64_MAX, DecodeError, decode_strict, encode
from .messages import Handshake, ProtocolError, SyncBody, emit_handshake, parse_message

FRAME_TYPES = ("hello", "body", "answer", "ack", "push", "error")
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


class Provider(Protocol):
    def hello_info(self) -> tuple[bytes, tuple[int, int]]: ...  # (site_id, have_max_hlc)
    def outgoing(self, peer: bytes, mode: str, now: int) -> Outgoing: ...  # mode: batch | push
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
    (5 000 `[` made the JSON parser raise RecursionError, issue 11 item 1) is refused before
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
                 k: int | None = None, r: Any = None, j: list[int] | None = None) -> bytes:
    f: dict[str, Any] = {"t": t}
    if c is not None:
        f["c"] = c
    if b is not None:
        f["b"] = b
    if m is not None:
        f["m"] = m
    if k is not None:
        f["k"] = k
    if r is not None:
        f["r"] = r
    if j:
        f["j"] = list(j)
    return encode(f)


_FRAME_MEMBERS = {"hello": {"t", "b", "r"}, "body": {"t", "c", "b", "m"}, "answer": {"t", "c", "b", "m", "k"},
                  "ack": {"t", "c", "k"}, "push": {"t", "c", "b", "m"}, "error": {"t", "r"}}
# j: the indices of the answered body's events the peer rejected (every other one reached a final
# state). Optional: a peer that omits it is read by `k` alone (issue 10 item 4).
_FRAME_OPTIONAL = {"answer": {"j"}, "ack": {"j"}}
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
    if f["t"] == "error" and not isinstance(f["r"], str):
        raise ProtocolError("bad_frame", "r must be text")
    return f


@dataclass
class SessionEvent:
    kind: str  # ready | exchanged | pushed | received_push | protocol_error | peer_error | warning | timeout
    detail: str = ""


@dataclass
class Session:
    provider: Provider
    peer: bytes | None = None  # expected peer (the link's identity); None: taken from its handshake
    realtime_capable: bool = False  # SOVM-SYNC-RT in this node's module set
    binding_unsolicited: bool = False  # the binding can carry peer-initiated one-way bodies
    secure: bool = False  # the local binding authenticated the peer (what we know, not what it claims)
    cycle_ms: int = 30_000  # batch cadence (kept running under realtime: §33.1)
    coalesce_ms: int = 50  # realtime: pushes produced within this window travel as one body (§33.2)
    flush_ms: int | None = None  # realtime: fixed-cadence flush instead of push-on-production (§33.3)
    answer_timeout_ms: int = 10_000
    hello_retry_ms: int = 2_000

    state: str = "hello"  # hello -> ready (-> closed)
    peer_handshake: Handshake | None = None
    realtime: bool = False
    rtt_ms: int | None = None
    events: list[SessionEvent] = field(default_factory=list)
    _out: list[bytes] = field(default_factory=list)
    _corr: int = 0
    _my_body: dict[int, tuple[Any, int]] = field(default_factory=dict)
    _my_answers: dict[int, tuple[Any, int]] = field(default_factory=dict)
    _next_cycle: int | None = None
    _next_hello: int | None = None
    _push_due: int | None = None

    # ------------------------------------------------------------------ inputs
    @property
    def advertises_realtime(self) -> bool:
        """§33: true only with the module and a binding that carries unsolicited bodies."""
        return bool(self.realtime_capable and self.binding_unsolicited)

    def start(self, now: int) -> None:
        self._send_hello(True, now)

    def close(self) -> None:
        self.state = "closed"

    def data_to_send(self) -> list[bytes]:
        out, self._out = self._out, []
        return out

    def timer(self) -> int | None:
        ts = [t for t in (self._next_cycle, self._next_hello, self._push_due) if t is not None]
        ts += [t0 + self.answer_timeout_ms for _, t0 in list(self._my_body.values()) + list(self._my_answers.values())]
        return min(ts) if ts else None

    def handle_timer(self, now: int) -> None:
        if self.state == "closed":
            return
        for d, what in ((self._my_body, "body"), (self._my_answers, "answer")):
            for c, (_, t0) in list(d.items()):
                if now >= t0 + self.answer_timeout_ms:
                    del d[c]  # the push failed: the cursor stays, the next cycle re-offers (§14.1)
                    self.events.append(SessionEvent("timeout", f"{what} {c}"))
        if self.state == "hello":
            if self._next_hello is not None and now >= self._next_hello:
                self._send_hello(True, now)
            return
        if self._next_cycle is not None and now >= self._next_cycle:
            self.cycle(now)
        if self.realtime and self._push_due is not None and now >= self._push_due:
            self._push(now)

    def cycle(self, now: int) -> bool:
        """Start a batch exchange now (unless one is in flight). Returns whether one started."""
        self._next_cycle = now + self.cycle_ms
        if self.state != "ready" or self._my_body:
            return False
        assert self.peer is not None
        out = self.provider.outgoing(self.peer, "batch", now)
        c = self._new_corr()
        self._my_body[c] = (out.token, now)
        self._out.append(encode_frame("body", c=c, b=out.body, m=out.meta.to_wire()))
        return True

    def local_events(self, now: int) -> None:
        """The node produced (or received) events: in realtime mode, schedule a coalesced push."""
        if self.state != "ready" or not self.realtime or self.flush_ms is not None:
            return
        due = now + self.coalesce_ms
        if self._push_due is None or due < self._push_due:
            self._push_due = due

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
            self._next_cycle = now + stagger
            if self.realtime and self.flush_ms is not None:
                self._push_due = now + self.flush_ms

    def _require_ready(self) -> None:
        if self.state != "ready":
            raise ProtocolError("no_handshake", "a sync body before the capability handshake (§31)")

    def _body(self, f: dict) -> tuple[SyncBody, StreamMeta]:
        msg = parse_message(f["b"])  # strict (§32.2)
        if not isinstance(msg, SyncBody):
            raise ProtocolError("not_a_body", "expected a sync body")
        if msg.from_site_id != self.peer:
            raise ProtocolError("sender_mismatch", f"from_site_id {msg.from_site_id.hex()} on a session with "
                                                   f"{self.peer.hex() if self.peer else '?'}")
        return msg, StreamMeta.from_wire(f["m"], len(msg.events))

    def _on_body(self, f: dict, now: int) -> None:
        self._require_ready()
        body, meta = self._body(f)
        assert self.peer is not None
        k, rejected = self.provider.incoming(self.peer, body, meta, "batch", now)
        out = self.provider.outgoing(self.peer, "batch", now)
        self._my_answers[f["c"]] = (out.token, now)
        self._out.append(encode_frame("answer", c=f["c"], b=out.body, m=out.meta.to_wire(), k=k, j=rejected))

    def _on_answer(self, f: dict, now: int) -> None:
        self._require_ready()
        body, meta = self._body(f)
        assert self.peer is not None
        mine = self._my_body.pop(f["c"], None)
        if mine is not None:
            self.rtt_ms = max(0, now - mine[1])
            self.provider.confirm(self.peer, mine[0], f["k"], f.get("j"), now)
        k, rejected = self.provider.incoming(self.peer, body, meta, "batch", now)
        self._out.append(encode_frame("ack", c=f["c"], k=k, j=rejected))
        self.events.append(SessionEvent("exchanged", str(f["c"])))

    def _on_ack(self, f: dict, now: int) -> None:
        self._require_ready()
        mine = self._my_answers.pop(f["c"], None)
        if mine is not None and self.peer is not None:
            self.provider.confirm(self.peer, mine[0], f["k"], f.get("j"), now)

    def _on_push(self, f: dict, now: int) -> None:
        self._require_ready()
        if not self.realtime:
            # §33: reject, not drop, so a protocol error surfaces as one.
            raise ProtocolError("realtime_not_established", "realtime mode was not mutually established on this session")
        body, meta = self._body(f)
        assert self.peer is not None
        self.provider.incoming(self.peer, body, meta, "push", now)
        self.events.append(SessionEvent("received_push", str(len(body.events))))

    def _on_error(self, f: dict, now: int) -> None:
        self.events.append(SessionEvent("peer_error", f["r"]))
        if f["r"].startswith("no_handshake"):
            self._send_hello(True, now)

    # ------------------------------------------------------------------ helpers
    def _push(self, now: int) -> None:
        assert self.peer is not None
        out = self.provider.outgoing(self.peer, "push", now)
        self._push_due = now + self.flush_ms if self.flush_ms is not None else None
        if out.n_events == 0 and self.flush_ms is None:
            return
        # A push awaits nothing: its cursor does not move; the batch cycle is the backstop (§33.1).
        self._out.append(encode_frame("push", c=self._new_corr(), b=out.body, m=out.meta.to_wire()))
        self.events.append(SessionEvent("pushed", str(out.n_events)))

    def _send_hello(self, reply: bool, now: int) -> None:
        site, hmax = self.provider.hello_info()
        hs = Handshake(site, hmax, self.advertises_realtime, self.secure, self.rtt_ms)
        self._out.append(encode_frame("hello", b=emit_handshake(hs), r=reply))
        if self.state != "ready":
            self._next_hello = now + self.hello_retry_ms

    def _new_corr(self) -> int:
        self._corr += 1
        return self._corr

    def _protocol_error(self, e: ProtocolError, now: int) -> None:
        self.events.append(SessionEvent("protocol_error", e.reason))
        self.provider.protocol_error(self.peer, e.reason, e.detail, now)
        self._out.append(encode_frame("error", r=f"{e.reason}: {e.detail}"[:200]))
