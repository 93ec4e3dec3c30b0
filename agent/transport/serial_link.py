"""A reliable link over one serial line, sans I/O (docs/serial.md "Link": packets, windows, timers).

It carries opaque messages (session frames, `encode_frame` bytes) between the two ends of a cable,
in order, each delivered at most once per link incarnation. Like the session, it never reads a
clock, a port or the randomness source: bytes come in through `receive_bytes(data, now)`, bytes to
write come out of `data_to_send()`, the next deadline is `timer()` and the caller calls
`handle_timer(now)` when it passes (aioquic's shape); the layout test keeps its imports so.

HELLO, DATA, ACK and PING packets travel in COBS + CRC-32 frames. Each incarnation has both ends'
nonces (a tag on every packet, so bytes of a previous one are never taken as this one's); messages
form a byte stream per direction (zlib against a preset dictionary when both ends offer it) cut
into DATA slices, selectively acknowledged, resent only when missing, with credit-based flow
control, a segment size that follows the measured error rate, and timers that account for the
line's baud. Silence for `dead_ms` ends the incarnation; messages not acknowledged by then are
dropped, and the session above re-offers what no answer confirmed (docs/serial.md "What the link guarantees, and what it leaves to SSP")."""
from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, field

from firmware_bridge import framing

from agent.core import reasons as R

VERSION = 1
HELLO, DATA, ACK, PING = 1, 2, 3, 4
F_UP = 1
F_ZLIB = 2  # HELLO flag: this end takes messages compressed with zlib and ZDICT (docs/serial.md "Compression")
COMPRESSED = 0x8000_0000  # in a message's length: its bytes are raw deflate against ZDICT
MAX_SACK = 8  # ranges in one ACK
MIN_SEGMENT = 32
FRAME_OVERHEAD = 6  # leading and closing 0x00, CRC-32; COBS adds a byte per 254 more
LOSS_MEMORY = 256.0  # frames: the error-rate estimate forgets at this pace (a line's state changes)
_HELLO = struct.Struct(">BBIIBHI")
_DATA = struct.Struct(">BHQ")
_ACK = struct.Struct(">BHQIB")
_RANGE = struct.Struct(">II")
_PING = struct.Struct(">BH")
_LEN = struct.Struct(">I")
# Out-of-order pieces the receiver holds at most: an honest peer's pieces are whole segments, and a
# hole per lost frame leaves a few dozen in a default window; a hostile peer's 1-byte pieces, each
# after a hole, made every frame re-sort and re-merge thousands (a 19-byte frame cost 546 µs with
# 4 000 held). One more is dropped (`out_of_window`): an honest peer sends it again.
MAX_HELD_PIECES = 64


# The preset dictionary (zlib `zdict`): what a sync body looks like on the link (a session hello,
# an answer's start, a body frame of one event with a watermark: CBOR member names, the COSE
# event header, the payload's keys). Deflate finds these strings in the dictionary from the
# first message on, so even a one-event push is compressed. Changing it changes the wire:
# a new dictionary needs a new HELLO flag.
ZDICT = bytes.fromhex(
    "a361625887a6667274745f6d73f667736974655f69647820303030303030303030303030303030303030303030303030"
    "30303030303030306b7373705f76657273696f6e016c686176655f6d61785f686c63a2676c6f676963616c006b706879"
    "736963616c5f6d73006e7365637572655f6368616e6e656cf471737570706f7274735f7265616c74696d65f56172f561"
    "746568656c6c6fa56162590208a6666576656e747381590101d2845828a301270371736f766d2f7373702d6576656e74"
    "2d763104500000000000000000000000000000a46162590208a6666576656e747381590101d2845828a301270371736f"
    "766d2f7373702d6576656e742d7631045000000000000000000000000000000000a05890a7677061796c6f6164a2646e"
    "6f7465626e306474656d70f9000067726f775f6b6579a26373657100666465766963656464657630696f706572617469"
    "6f6e667570736572746a7461626c655f6e616d656872656164696e67736b686c635f6c6f676963616c006c7461626c65"
    "5f736368656d61636170706f686c635f706879736963616c5f6d731b000001a0c4506c005840bab8cded6f4547e33ed0"
    "e86fd5af2995d1a2dfd4b70d459e6d24fa11194b7c1b0cafc6579ac02d0bbbcd23d17a78e0adb4e3ded44c98464573d8"
    "d3a1456a9504677265636f726473806b7373705f76657273696f6e016c66726f6d5f736974655f696478203030303030"
    "3030303030303030303030303030303030303030303030303030306c686176655f6d61785f686c63a2676c6f67696361"
    "6c006b706879736963616c5f6d731b000001a0c4506c00726170706c6965645f77617465726d61726b7381a567736974"
    "655f6964782030303030303030303030303030303030303030303030303030303030303030306a7461626c655f6e616d"
    "656872656164696e67736b686c635f6c6f676963616c006c7461626c655f736368656d61636170706f686c635f706879"
    "736963616c5f6d731b000001a0c4506c00616301616da561648101616501616780617300617800617464626f6479"
)


class LinkError(ValueError):
    """A local fault: a message this link cannot carry (over `max_message`)."""


@dataclass
class LinkConfig:
    baud: int = 115_200
    max_payload: int = 1024  # bytes of one packet (link header + segment) inside a frame
    window: int = 8192  # bytes sent and not acknowledged, at most
    max_message: int = 17 * 1024 * 1024  # one message; a peer announcing a longer one ends the incarnation
    hello_ms: int = 500
    keepalive_ms: int = 1_000
    dead_ms: int = 10_000
    min_rto_ms: int = 200
    max_rto_ms: int = 4_000
    compress: bool = True  # offer (HELLO flag) and use zlib with ZDICT when the peer offers it too

    def __post_init__(self) -> None:
        if not 64 <= self.max_payload <= 65_535:
            raise ValueError("max_payload must be 64..65535 bytes")
        if not self.max_payload <= self.window <= 2**31:
            raise ValueError("window must be at least max_payload bytes")


@dataclass
class _Seg:
    start: int  # stream offset of its first byte
    end: int
    sent_at: int  # when the line finishes sending its latest copy (modelled)
    due: int
    tries: int = 1


def _tag(a: int, b: int) -> int:
    x = a ^ b
    return (x ^ (x >> 16)) & 0xFFFF


def _minus(a: int, b: int, covered: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """[a, b) without the ranges in `covered` (sorted, disjoint)."""
    out, pos = [], a
    for s, e in covered:
        if e <= pos or s >= b:
            continue
        if s > pos:
            out.append((pos, s))
        pos = max(pos, e)
    if pos < b:
        out.append((pos, b))
    return out


@dataclass
class SerialLink:
    cfg: LinkConfig
    nonce: int  # this end's first nonce (non-zero); later ones follow from it

    state: str = "connecting"  # connecting -> up -> (down: connecting again)
    peer_nonce: int = 0
    peer_max_payload: int = 0
    peer_zlib: bool = False  # the peer takes compressed messages (its HELLO said so, and so did ours)
    events: list[tuple[str, str]] = field(default_factory=list)  # ("up", "") / ("down", reason)
    stats: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.nonce = (self.nonce & 0xFFFFFFFF) or 1
        self._decoder = framing.Decoder(self.cfg.max_payload)
        self._out = bytearray()
        self._tx_free_at = 0  # when the line will have sent what was queued (modelled from baud)
        self._last_heard: int | None = None
        self._last_ping = 0
        self._next_hello: int | None = None
        self._srtt: float | None = None
        self.stats = {k: 0 for k in ("bytes_in", "bytes_out", "frames_in", "frames_out", "data_out", "retransmits",
                                     "fast_retransmits", "duplicates", "out_of_window", "stale", "bad_packet",
                                     "pings", "messages_in", "messages_out", "downs", "stream_bytes_out", "data_in",
                                     "message_bytes_out", "message_wire_bytes_out", "compressed_out",
                                     "message_bytes_in", "compressed_in")}
        self._reset_sequences()

    def _reset_sequences(self) -> None:
        # sender: the byte stream of length-prefixed messages from offset _snd_base (acknowledged below)
        self._stream = bytearray()
        self._snd_base = 0
        self._snd_next = 0  # first byte never sent
        self._segs: list[_Seg] = []  # in flight, not acknowledged
        self._sacked: list[tuple[int, int]] = []  # acknowledged above _snd_base
        self._peer_credit = self.cfg.window
        self._probe_due: int | None = None
        self._seg_size = self._max_segment()
        # The line's byte error rate, estimated from the DATA frames resolved (acknowledged whole
        # or taken for lost): lost frames / frame bytes, both decaying (LOSS_MEMORY frames).
        self._loss_frames = 0.0
        self._loss_bytes = 0.0
        # receiver
        self._rcv_next = 0
        self._ooo: dict[int, bytes] = {}  # start -> bytes beyond _rcv_next: disjoint, coalesced
        self._ooo_bytes = 0
        self._rbuf = bytearray()  # delivered stream bytes of a message not complete yet
        self._inbox: list[bytes] = []
        self._held = 0  # bytes of delivered messages the node has not taken yet
        self._ack_due = False
        self._ack_at: int | None = None  # a due ACK waits for this end's line to be free

    def _max_segment(self) -> int:
        mp = min(self.cfg.max_payload, self.peer_max_payload or self.cfg.max_payload)
        return mp - _DATA.size

    # ------------------------------------------------------------------ properties
    @property
    def up(self) -> bool:
        return self.state == "up"

    @property
    def tag(self) -> int:
        return _tag(self.nonce, self.peer_nonce)

    @property
    def segment_size(self) -> int:
        """Stream bytes per DATA frame now (adapts to the line's error rate)."""
        return self._seg_size

    def idle(self) -> bool:
        """Nothing waiting to be sent or acknowledged."""
        return not self._stream and not self._out

    def rto_ms(self, tries: int = 1) -> int:
        base = self.cfg.min_rto_ms if self._srtt is None else max(self.cfg.min_rto_ms, int(2 * self._srtt) + 50)
        return min(self.cfg.max_rto_ms, base << min(tries - 1, 8))

    @property
    def stream_received(self) -> int:
        """Stream bytes received in order in this incarnation."""
        return self._rcv_next

    @property
    def rejected_frames(self) -> int:
        return self._decoder.rejected

    # ------------------------------------------------------------------ inputs
    def start(self, now: int) -> None:
        self._send_hello(now)

    def send_message(self, msg: bytes, now: int) -> None:
        """Queue one message: its length and bytes go into the stream as they are (segments are
        cut from the stream when sent, so signed bytes inside are never altered)."""
        if len(msg) > self.cfg.max_message:
            raise LinkError(f"message of {len(msg)} bytes exceeds the link's max_message {self.cfg.max_message}")
        wire, n = msg, len(msg)
        if self.peer_zlib and self.up and len(msg) >= 32:
            # Lossless, per message, only when it saves bytes: the receiver inflates exactly the
            # bytes that were queued, so signed bytes inside are delivered unaltered.
            c = zlib.compressobj(6, zlib.DEFLATED, -15, zdict=ZDICT)
            z = c.compress(msg) + c.flush()
            if len(z) < len(msg):
                wire, n = z, len(z) | COMPRESSED
                self.stats["compressed_out"] += 1
        self._stream += _LEN.pack(n) + wire
        self.stats["messages_out"] += 1
        self.stats["message_bytes_out"] += len(msg)
        self.stats["message_wire_bytes_out"] += len(wire)
        self._pump(now)

    def messages(self) -> list[bytes]:
        """Messages delivered, in order, once each. Taking them frees receive credit."""
        if not self._inbox:
            return []
        out, self._inbox = self._inbox, []
        if self._held:
            self._ack_due = True  # a window update: the peer may have been held at low credit
        self._held = 0
        return out

    def data_to_send(self) -> bytes:
        if self._ack_due and self.up and self._ack_at is None:
            self._send_ack(0)  # a window update after `messages()`
        out, self._out = bytes(self._out), bytearray()
        return out

    def receive_bytes(self, data: bytes, now: int) -> None:
        self.stats["bytes_in"] += len(data)
        for pkt in self._decoder.feed(data):
            self.stats["frames_in"] += 1
            self._packet(pkt, now)
        self._pump(now)
        self._ack_paced(now)

    def timer(self) -> int | None:
        if self.state == "connecting":
            return self._next_hello
        ts = [g.due for g in self._segs]
        if self._ack_at is not None:
            ts.append(self._ack_at)
        if self._last_heard is not None:
            ts.append(self._last_heard + self.cfg.dead_ms)
            ts.append(max(self._last_heard, self._last_ping) + self.cfg.keepalive_ms)
        if self._probe_due is not None:
            ts.append(self._probe_due)
        return min(ts) if ts else None

    def handle_timer(self, now: int) -> None:
        if self.state == "connecting":
            if self._next_hello is not None and now >= self._next_hello:
                self._send_hello(now)
            return
        assert self._last_heard is not None
        if now - self._last_heard >= self.cfg.dead_ms:
            self._down(R.PEER_SILENT, now)  # a pulled cable, a powered-off peer, a half-open line
            return
        expired = [g for g in self._segs if now >= g.due]
        if expired and self._peer_credit == 0:
            # The peer said it holds a whole message it has not taken (it is applying a body):
            # what it has not acknowledged is most likely unread, not lost. Ask, do not resend.
            for g in expired:
                g.tries += 1
                g.due = now + self.rto_ms(g.tries)
            self._ping(now)
        elif expired:
            self._lost(expired, now, "retransmits")
        if now - max(self._last_heard, self._last_ping) >= self.cfg.keepalive_ms:
            self._ping(now)
        if self._probe_due is not None and now >= self._probe_due:
            self._probe_due = None
            self._ping(now)  # zero credit and nothing in flight: ask for a window update
        self._pump(now)
        if self._ack_at is not None and now >= self._ack_at:
            self._ack_at = None
        self._ack_paced(now)

    # ------------------------------------------------------------------ packets
    def _packet(self, p: bytes, now: int) -> None:
        kind = p[0] if p else 0
        try:
            if kind == HELLO:
                self._on_hello(*_HELLO.unpack(p), now)
                return
            if self.state != "up":
                self.stats["stale"] += 1  # DATA/ACK/PING before this incarnation is up
                return
            if kind == DATA:
                _, tag, off = _DATA.unpack_from(p)
                if self._mine(tag, now):
                    self.stats["data_in"] += 1
                    self._on_data(off, p[_DATA.size:], now)
            elif kind == ACK:
                _, tag, cum, credit, n = _ACK.unpack_from(p)
                if len(p) != _ACK.size + n * _RANGE.size or n > MAX_SACK:
                    raise struct.error("ACK length")
                ranges = [_RANGE.unpack_from(p, _ACK.size + i * _RANGE.size) for i in range(n)]
                if self._mine(tag, now):
                    self._on_ack(cum, credit, [(cum + s, cum + e) for s, e in ranges], now)
            elif kind == PING:
                _, tag = _PING.unpack(p)
                if self._mine(tag, now):
                    self._ack_due = True
            else:
                self.stats["bad_packet"] += 1
        except struct.error:
            self.stats["bad_packet"] += 1  # a CRC-clean packet of the wrong length: a peer's bug

    def _mine(self, tag: int, now: int) -> bool:
        if tag != self.tag:
            self.stats["stale"] += 1  # from an earlier incarnation
            return False
        self._last_heard = now
        return True

    def _on_hello(self, _k: int, version: int, nonce: int, seen: int, flags: int, max_payload: int,
                  window: int, now: int) -> None:
        if version != VERSION or nonce == 0 or max_payload < 64:
            self.stats["bad_packet"] += 1
            return
        if nonce != self.peer_nonce:
            if self.state == "up":
                self._down(R.PEER_RESTARTED, now, new_nonce=False, hello=False)
            self.peer_nonce = nonce
        if seen == self.nonce:
            self.peer_zlib = bool(self.cfg.compress and flags & F_ZLIB)
        if seen == self.nonce and self.state != "up":
            self.state = "up"
            self.peer_max_payload = max_payload
            self._seg_size = self._max_segment()
            self._next_hello = None
            self._last_heard = now
            self._last_ping = now
            self._peer_credit = min(self.cfg.window, window)
            self.events.append(("up", ""))
        elif self.state == "up":
            self._last_heard = now
        if seen != self.nonce or not flags & F_UP:
            self._send_hello(now)  # the peer does not know yet that this end has seen it

    def _on_data(self, off: int, data: bytes, now: int) -> None:
        self._ack_due = True  # every DATA is acknowledged (also duplicates: their ACK was lost)
        end = off + len(data)
        limit = self._rcv_next + self.cfg.window
        if end <= self._rcv_next or not data:
            self.stats["duplicates"] += 1
            return
        if off >= limit:
            self.stats["out_of_window"] += 1
            return
        if off < self._rcv_next:  # partly old: keep the new part
            data, off = data[self._rcv_next - off:], self._rcv_next
        if end > limit:
            data, end = data[:limit - off], limit
        # Only bytes not held yet, and held pieces kept disjoint and coalesced: memory is exact
        # (what the credit counts) and the selective acknowledgement names few, long ranges.
        held = sorted((s, s + len(d)) for s, d in self._ooo.items())
        new = _minus(off, end, held)
        if not new:
            self.stats["duplicates"] += 1
            return
        n_new = sum(e - s for s, e in new)
        if off > self._rcv_next and (self._ooo_bytes + n_new > self.cfg.window
                                     or len(self._ooo) + len(new) > MAX_HELD_PIECES):
            # Beyond what the window holds, or more pieces than MAX_HELD_PIECES. Never the piece at
            # _rcv_next: it is what lets the receiver deliver and free the others.
            self.stats["out_of_window"] += 1
            return
        for s, e in new:
            self._ooo[s] = data[s - off:e - off]
        self._ooo_bytes += n_new
        merged: dict[int, bytes] = {}
        for s in sorted(self._ooo):
            d = self._ooo[s]
            if merged:
                ls = next(reversed(merged))
                if ls + len(merged[ls]) == s:
                    merged[ls] += d
                    continue
            merged[s] = d
        self._ooo = merged
        while self._rcv_next in self._ooo and self.state == "up":
            d = self._ooo.pop(self._rcv_next)
            self._ooo_bytes -= len(d)
            self._deliver(d, now)

    def _deliver(self, data: bytes, now: int) -> None:
        self._rcv_next += len(data)
        self._rbuf += data
        while len(self._rbuf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._rbuf)
            compressed, n = bool(n & COMPRESSED), n & ~COMPRESSED
            if n > self.cfg.max_message:
                # Only a broken or hostile peer announces this (the CRC passed): end the incarnation.
                self.stats["bad_packet"] += 1
                self._down(R.MESSAGE_TOO_LARGE, now)
                return
            if len(self._rbuf) < _LEN.size + n:
                return
            with memoryview(self._rbuf) as view:   # one copy of a message up to 17 MiB, not two
                msg = bytes(view[_LEN.size:_LEN.size + n])
            del self._rbuf[:_LEN.size + n]
            if compressed:
                msg = self._inflate(msg)
                if msg is None:
                    self.stats["bad_packet"] += 1
                    self._down(R.BAD_COMPRESSED_MESSAGE, now)
                    return
                self.stats["compressed_in"] += 1
            self._inbox.append(msg)
            # Stream bytes, what the window and the credit count: a node that takes nothing holds
            # at most a window of them (plus the message completing it), inflated at most to
            # max_message each (a hostile peer could send that much raw anyway).
            self._held += n + _LEN.size
            self.stats["messages_in"] += 1
            self.stats["message_bytes_in"] += len(msg)

    def _inflate(self, data: bytes) -> bytes | None:
        """A compressed message, inflated to at most max_message bytes (a deflate bomb costs no
        more than the largest message), or None: compressed without our offer, not one whole
        deflate stream, or longer than max_message."""
        if not self.cfg.compress:
            return None
        try:
            d = zlib.decompressobj(-15, zdict=ZDICT)
            out = d.decompress(data, self.cfg.max_message + 1)
        except zlib.error:
            return None
        if not d.eof or d.unconsumed_tail or d.unused_data or len(out) > self.cfg.max_message:
            return None
        return out

    def _on_ack(self, cum: int, credit: int, ranges: list[tuple[int, int]], now: int) -> None:
        if cum > self._snd_next:
            self.stats["bad_packet"] += 1  # acknowledges what was never sent
            return
        if cum < self._snd_base:
            return  # an older ACK than one already taken (a reordered or duplicated frame)
        if cum > self._snd_base:
            del self._stream[:cum - self._snd_base]
            self._snd_base = cum
        sacked = sorted((max(s, cum), min(e, self._snd_next)) for s, e in ranges if e > s and s < self._snd_next)
        self._sacked = [r for r in sacked if r[1] > r[0]]
        covered = [(0, self._snd_base)] + self._sacked
        newest = None
        keep = []
        for g in self._segs:
            if _minus(g.start, g.end, covered):
                keep.append(g)
                continue
            if g.tries == 1 and now >= g.sent_at:  # Karn: only unambiguous samples
                sample = now - g.sent_at
                self._srtt = sample if self._srtt is None else 0.875 * self._srtt + 0.125 * sample
            newest = g.sent_at if newest is None else max(newest, g.sent_at)
            self._resolved(g, lost=False)
        self._segs = keep
        self._peer_credit = min(self.cfg.window, credit)
        if newest is not None:
            # Segments sent after these arrived; the line keeps order, so these were lost: resend now.
            # Unless the ACK cannot speak for them: it names the lowest MAX_SACK ranges held, so
            # with all of them used, what lies above the last range may have arrived too. (Taking
            # it for lost resent, at BER 10^-3, five of every six DATA frames the receiver already
            # held: each acknowledged retransmission of a low hole "lost" everything above.)
            horizon = ranges[-1][1] if len(ranges) >= MAX_SACK else None
            lost = [g for g in self._segs if g.sent_at < newest and (horizon is None or g.end <= horizon)]
            if lost:
                self._lost(lost, now, "fast_retransmits")

    # ------------------------------------------------------------------ output
    def _ack_paced(self, now: int) -> None:
        """Acknowledge what arrived, one ACK at a time on this end's line: when the line is still
        sending earlier bytes, the ACK waits until it is free and then says everything that
        arrived meanwhile. Acknowledging every DATA frame at once filled the return line with
        ACKs on a noisy line (at BER 10^-3 more ACK bytes went back than data bytes came), so
        they queued, arrived late and stale, and the sender's timers resent data that had arrived."""
        if not (self._ack_due and self.up) or self._ack_at is not None:
            return
        if now >= self._tx_free_at:
            self._send_ack(now)
        else:
            self._ack_at = self._tx_free_at

    def _send_ack(self, now: int) -> None:
        ranges = self._sack()
        self._emit(_ACK.pack(ACK, self.tag, self._rcv_next, self._credit(), len(ranges))
                   + b"".join(_RANGE.pack(s - self._rcv_next, e - self._rcv_next) for s, e in ranges), now)
        self._ack_due = False

    def _credit(self) -> int:
        return max(0, self.cfg.window - self._ooo_bytes - self._held)

    def _sack(self) -> list[tuple[int, int]]:
        ranges: list[tuple[int, int]] = []
        for s in sorted(self._ooo):
            e = s + len(self._ooo[s])
            if ranges and s <= ranges[-1][1]:
                ranges[-1] = (ranges[-1][0], max(ranges[-1][1], e))
            else:
                ranges.append((s, e))
        return ranges[:MAX_SACK]

    def _emit(self, packet: bytes, now: int) -> int:
        """Queue one frame; returns when the line will have finished sending it."""
        f = framing.encode(packet, self.cfg.max_payload, lead=True)
        self._out += f
        self.stats["frames_out"] += 1
        self.stats["bytes_out"] += len(f)
        self._tx_free_at = max(self._tx_free_at, now) + (len(f) * 10_000 + self.cfg.baud - 1) // self.cfg.baud
        return self._tx_free_at

    def _send_segment(self, start: int, end: int, now: int, tries: int) -> None:
        data = bytes(self._stream[start - self._snd_base:end - self._snd_base])
        sent_at = self._emit(_DATA.pack(DATA, self.tag, start) + data, now)
        self._segs.append(_Seg(start, end, sent_at, sent_at + self.rto_ms(tries), tries))
        self.stats["data_out"] += 1
        self.stats["stream_bytes_out"] += end - start

    def _resolved(self, g: _Seg, lost: bool) -> None:
        """A DATA frame's fate is known: update the byte error estimate and, from it, the segment
        size that carries the most stream bytes per line byte. A frame of L bytes arrives whole
        with probability r^L (r = 1 - byte error rate), so a segment of s bytes under h bytes of
        headers and framing carries s/(s+h) * r^(s+h); the best s solves h/(s(s+h)) = -ln r
        (about 38 bytes at BER 10^-3, 140 at 10^-4, the largest frame on a clean line). Halving
        on each loss instead (the first design) sat near 32 bytes at 10^-4, a quarter of that."""
        k = 1.0 - 1.0 / LOSS_MEMORY
        self._loss_frames = self._loss_frames * k + (1.0 if lost else 0.0)
        self._loss_bytes = self._loss_bytes * k + (g.end - g.start + _DATA.size + FRAME_OVERHEAD)
        self._seg_size = self._best_segment()

    def _best_segment(self) -> int:
        top = self._max_segment()
        if self._loss_frames <= 0.0 or self._loss_bytes <= 0.0:
            return top
        b = min(0.5, self._loss_frames / self._loss_bytes)  # per byte (small-rate approximation)
        c = -math.log1p(-b)
        h = _DATA.size + FRAME_OVERHEAD
        best = (-h + math.sqrt(h * h + 4 * h / c)) / 2
        return max(MIN_SEGMENT, min(top, int(best)))

    def _frames_in_flight_cap(self) -> int:
        """At most as many DATA frames unacknowledged as leave about MAX_SACK holes at the line's
        loss rate: an ACK names only the lowest MAX_SACK ranges held, so beyond that what arrived
        cannot be acknowledged and waits for its timer (at BER 10^-3 a third of 55-byte frames
        are lost: 25 frames, still several round trips of a serial line in flight)."""
        if self._loss_frames <= 0.0 or self._loss_bytes <= 0.0:
            return 1 << 30
        b = min(0.5, self._loss_frames / self._loss_bytes)
        p_loss = 1.0 - (1.0 - b) ** (self._seg_size + _DATA.size + FRAME_OVERHEAD)
        return max(MAX_SACK, int(MAX_SACK / max(p_loss, 1e-9)))

    def _lost(self, segs: list[_Seg], now: int, why: str) -> None:
        """Resend what of `segs` is still missing, cut to the segment size the line's error rate
        calls for now (`_resolved`)."""
        for g in segs:
            self._resolved(g, lost=True)
        covered = [(0, self._snd_base)] + self._sacked
        gone = {id(g) for g in segs}
        self._segs = [g for g in self._segs if id(g) not in gone]
        for g in sorted(segs, key=lambda g: g.start):
            for s, e in _minus(g.start, g.end, covered):
                for k in range(s, e, self._seg_size):
                    self.stats[why] += 1
                    self._send_segment(k, min(e, k + self._seg_size), now, g.tries + 1)

    def _pump(self, now: int) -> None:
        """Send new stream bytes the window and the peer's credit allow."""
        if not self.up:
            return
        stream_end = self._snd_base + len(self._stream)
        limit = min(stream_end, self._snd_base + min(self.cfg.window, self._peer_credit))
        cap = self._frames_in_flight_cap()
        while self._snd_next < limit and len(self._segs) < cap:
            end = min(limit, self._snd_next + self._seg_size)
            self._send_segment(self._snd_next, end, now, 1)
            self._snd_next = end
            self._probe_due = None
        if self._snd_next < stream_end and not self._segs and self._probe_due is None:
            self._probe_due = now + self.rto_ms()

    def _ping(self, now: int) -> None:
        self._last_ping = now
        self.stats["pings"] += 1
        self._emit(_PING.pack(PING, self.tag), now)

    def _send_hello(self, now: int) -> None:
        flags = (F_UP if self.up else 0) | (F_ZLIB if self.cfg.compress else 0)
        self._emit(_HELLO.pack(HELLO, VERSION, self.nonce, self.peer_nonce, flags, self.cfg.max_payload,
                               self.cfg.window), now)
        if not self.up:
            self._next_hello = now + self.cfg.hello_ms

    def _down(self, reason: str, now: int, new_nonce: bool = True, hello: bool = True) -> None:
        """End this incarnation: whatever was not acknowledged is dropped (SSP re-offers it)."""
        self.stats["downs"] += 1
        self.events.append(("down", reason))
        self.state = "connecting"
        self.peer_zlib = False
        if new_nonce:
            # A new incarnation the peer can tell apart even if it never noticed the loss.
            self.nonce = (self.nonce * 1_103_515_245 + 12_345) & 0xFFFFFFFF or 1
            self.peer_nonce = 0
        self._last_heard = None
        self._reset_sequences()
        if hello:
            self._send_hello(now)
