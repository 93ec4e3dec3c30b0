"""agent/transport/serial_link.py, sans I/O, over a simulated faulty line (tests/serial/sim.py):
messages arrive whole, in order, once, whatever the line does; a pulled cable or a restarted
peer ends the incarnation and a new one starts; a busy receiver is not overrun."""
from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from agent.transport.serial_link import COMPRESSED, ZDICT, LinkConfig, SerialLink
from firmware_bridge import framing
from serial_relay import LineFaults

from .sim import SimLine, pair, up


def body_like(seed: int, events: int) -> bytes:
    """A sync body's shape: per event the same CBOR structure and a fresh 64-byte signature."""
    r = random.Random(seed)
    return b"".join(ZDICT[200:520] + r.randbytes(64) for _ in range(events))


def msgs(seed: int, n: int, big: int = 5000, compressible: bool = True) -> list[bytes]:
    """Random bytes (incompressible: sent raw) and, one in three, body-like bytes (a random
    signature-sized piece in repeated structure: sent compressed when both ends offer it)."""
    r = random.Random(seed)
    out = []
    for _ in range(n):
        size = r.choice([0, 1, 40, 900, 1100, big])
        if compressible and r.random() < 1 / 3:
            unit = ZDICT[r.randrange(0, 200):][:120] + r.randbytes(64)
            out.append((unit * (size // len(unit) + 1))[:size])
        else:
            out.append(r.randbytes(size))
    return out


def test_clean_line_delivers_in_order_once():
    line = pair()
    t = up(line)
    sent = msgs(1, 30, big=50_000)
    for m in sent:
        line.links[0].send_message(m, t)
    line.run(t, t + 120_000, lambda: len(line.received[1]) == len(sent) and line.links[0].idle())
    assert line.received[1] == sent
    s = line.links[0].stats
    assert s["retransmits"] == s["fast_retransmits"] == 0 and line.links[1].stats["duplicates"] == 0


FAULTS = dict(ber=1e-3, drop=0.03, duplicate=0.03, reorder=0.03, truncate=0.03)


def test_every_fault_at_once_still_delivers_exactly_the_messages_sent():
    for seed in range(1):
        line = pair(seed, LineFaults(seed=seed, **FAULTS), LineFaults(seed=100 + seed, **FAULTS))
        t = up(line)
        sent = [msgs(seed, 12), msgs(seed + 50, 12)]
        for i in (0, 1):
            for m in sent[i]:
                line.links[i].send_message(m, t)
        line.run(t, t + 600_000, lambda: [len(r) for r in line.received] == [12, 12])
        assert line.received[1] == sent[0] and line.received[0] == sent[1], seed  # 0 corrupted, 0 lost, 0 doubled
        assert all(ln.up for ln in line.links)
        assert sum(ln.rejected_frames for ln in line.links) > 0  # the faults did reach the framing
        assert sum(ln.stats["duplicates"] for ln in line.links) > 0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), ber=st.sampled_from([0, 1e-6, 1e-5, 1e-4, 1e-3]),
       drop=st.floats(0, 0.1), dup=st.floats(0, 0.1), reorder=st.floats(0, 0.1), trunc=st.floats(0, 0.1),
       n=st.integers(1, 12))
def test_property_delivery_is_exact_under_random_faults(seed, ber, drop, dup, reorder, trunc, n):
    kw = dict(ber=ber, drop=drop, duplicate=dup, reorder=reorder, truncate=trunc)
    line = pair(seed % 7, LineFaults(seed=seed, **kw), LineFaults(seed=seed + 1, **kw))
    t = up(line)
    sent = msgs(seed, n, big=3000)
    for m in sent:
        line.links[0].send_message(m, t)
    line.run(t, t + 600_000, lambda: len(line.received[1]) >= n)
    assert line.received[1] == sent


def test_pulled_cable_is_detected_and_a_new_incarnation_starts_after_replug():
    line = pair(dead_ms=3000, keepalive_ms=500)
    t = up(line)
    line.pulled = True
    t = line.run(t, t + 10_000, lambda: all(not ln.up for ln in line.links))
    assert all(("down", "peer_silent") in ln.events for ln in line.links)
    line.links[0].send_message(b"lost with the old incarnation? no: sent after", t)
    line.pulled = False
    t = line.run(t, t + 10_000, lambda: all(ln.up for ln in line.links))
    assert all(ln.up for ln in line.links)
    line.links[0].send_message(b"after replug", t)
    line.run(t, t + 10_000, lambda: len(line.received[1]) == 2)
    assert line.received[1] == [b"lost with the old incarnation? no: sent after", b"after replug"]


def test_unacknowledged_messages_are_dropped_with_the_incarnation_never_delivered_twice():
    line = pair(dead_ms=2000, keepalive_ms=400)
    t = up(line)
    line.links[0].send_message(random.Random(0).randbytes(20_000), t)  # incompressible: 1.7 s of line
    t = line.run(t, t + 300)  # part of it is on the line
    line.pulled = True
    t = line.run(t, t + 10_000, lambda: all(not ln.up for ln in line.links))
    line.pulled = False
    t = line.run(t, t + 10_000, lambda: all(ln.up for ln in line.links))
    line.links[0].send_message(b"B", t)
    line.run(t, t + 10_000, lambda: line.received[1])
    assert line.received[1] == [b"B"]  # SSP re-offers what no answer confirmed (at-least-once above)


def test_a_restarted_peer_ends_the_incarnation_at_once():
    line = pair()
    t = up(line)
    old_tag = line.links[0].tag
    line.links[1] = SerialLink(LinkConfig(), 0xBEEF)  # the other end's process restarted
    line.links[1].start(t)
    t = line.run(t, t + 5000, lambda: all(ln.up for ln in line.links))
    assert ("down", "peer_restarted") in line.links[0].events and line.links[0].tag != old_tag
    line.links[1].send_message(b"hello again", t)
    line.run(t, t + 5000, lambda: line.received[0])
    assert line.received[0] == [b"hello again"]


def test_frames_from_an_earlier_incarnation_are_never_delivered():
    line = pair()
    t = up(line)
    line.links[0].send_message(b"first incarnation", t)
    stale = line.links[0].data_to_send()  # captured, never delivered now
    line.links[1] = SerialLink(LinkConfig(), 0xCAFE)
    line.links[1].start(t)
    t = line.run(t, t + 5000, lambda: all(ln.up for ln in line.links))
    line.links[1].receive_bytes(stale, t)  # a replay of the old incarnation's bytes
    assert line.links[1].messages() == [] and line.links[1].stats["stale"] >= 1


def test_a_busy_receiver_is_not_overrun():
    line = pair(window=4096)
    t = up(line)
    line.take[1] = False  # the node is applying a body and takes nothing
    for m in msgs(3, 40, big=2000, compressible=False):  # raw: the stream bytes are the message bytes
        line.links[0].send_message(m, t)
    t = line.run(t, t + 30_000)
    b = line.links[1]
    held = sum(len(m) + 4 for m in b._inbox)
    assert held <= 4096 + 2004  # credit: at most a window of bytes (+ the message completing it) waits
    assert line.links[0].stats["pings"] > 0  # the sender probes the closed window
    line.take[1] = True
    line.run(t, t + 120_000, lambda: len(line.received[1]) == 40)
    assert line.received[1] == msgs(3, 40, big=2000, compressible=False)


def test_crc_clean_garbage_packets_change_nothing():
    line = pair()
    t = up(line)
    r = random.Random(5)
    b = line.links[1]
    for _ in range(500):
        pkt = bytes([r.choice([0, 1, 2, 3, 4, 9])]) + r.randbytes(r.randint(0, 40))
        b.receive_bytes(framing.encode(pkt, 1024, lead=True), t)  # a buggy or hostile peer
    assert b.messages() == []  # nothing delivered, whatever the garbage said
    line.links[0].send_message(b"still works", t)
    line.run(t, t + 10_000, lambda: line.received[1])
    assert line.received[1][-1] == b"still works"


def test_compression_is_negotiated_in_hello_and_delivers_the_same_bytes():
    """Both ends offer it (HELLO flag): body-like messages cross in well under half their bytes
    and arrive byte for byte; a one-event message gains from the preset dictionary too."""
    line = pair()
    t = up(line)
    assert all(ln.peer_zlib for ln in line.links)
    sent = [body_like(1, 50), body_like(2, 1), b"\x00" * 10, random.Random(3).randbytes(4000)]
    for m in sent:
        line.links[0].send_message(m, t)
    line.run(t, t + 60_000, lambda: len(line.received[1]) == len(sent) and line.links[0].idle())
    assert line.received[1] == sent
    s = line.links[0].stats
    assert s["compressed_out"] == 2  # the two bodies; the tiny one and the random one go raw
    assert s["message_wire_bytes_out"] < 0.5 * s["message_bytes_out"]
    one = body_like(2, 1)
    import zlib
    c = zlib.compressobj(6, zlib.DEFLATED, -15, zdict=ZDICT)
    assert len(c.compress(one) + c.flush()) < 0.5 * len(one)  # the dictionary carries the structure


def test_an_end_that_does_not_offer_compression_gets_raw_bytes_both_ways():
    c_on, c_off = LinkConfig(), LinkConfig(compress=False)
    line = SimLine(SerialLink(c_on, 0x11), SerialLink(c_off, 0x22))
    t = up(line)
    assert not any(ln.peer_zlib for ln in line.links)
    sent = [body_like(4, 20), body_like(5, 3)]
    for i in (0, 1):
        for m in sent:
            line.links[i].send_message(m, t)
    line.run(t, t + 60_000, lambda: [len(r) for r in line.received] == [2, 2])
    assert line.received == [sent, sent]
    assert all(ln.stats["compressed_out"] == 0 for ln in line.links)


def _inject_message(line, t, wire_len: int, payload: bytes) -> None:
    """A peer's bug or attack: a message in the stream exactly as given (CRC-clean)."""
    a = line.links[0]
    a._stream += (wire_len).to_bytes(4, "big") + payload
    a.stats["messages_out"] += 1
    a._pump(t)


def test_a_compressed_message_the_receiver_did_not_offer_or_cannot_inflate_ends_the_incarnation():
    import zlib
    for cfg_b, payload in [
            (LinkConfig(compress=False), zlib.compress(b"x" * 100)[2:-4]),   # not offered
            (LinkConfig(), b"\xff" * 50),                                    # not deflate
            (LinkConfig(max_message=10_000), None)]:                         # a deflate bomb
        if payload is None:
            c = zlib.compressobj(9, zlib.DEFLATED, -15, zdict=ZDICT)
            payload = c.compress(b"\x00" * 1_000_000) + c.flush()
            assert len(payload) < 10_000
        line = SimLine(SerialLink(LinkConfig(), 0x31), SerialLink(cfg_b, 0x42))
        t = up(line)
        _inject_message(line, t, len(payload) | COMPRESSED, payload)
        line.run(t, t + 10_000, lambda: any(e == ("down", "bad_compressed_message") for e in line.links[1].events))
        assert ("down", "bad_compressed_message") in line.links[1].events
        assert line.received[1] == []


def _bulk(ber: float, seed: int = 1, nbytes: int = 40_000):
    c = LinkConfig(compress=False)
    line = SimLine(SerialLink(c, 0x1001), SerialLink(c, 0x2002), LineFaults(seed=seed, ber=ber),
                   LineFaults(seed=seed + 1, ber=ber))
    t = up(line)
    sent = [random.Random(seed + k).randbytes(4000) for k in range(nbytes // 4000)]
    for m in sent:
        line.links[0].send_message(m, t)
    line.run(t, t + 3_000_000, lambda: len(line.received[1]) == len(sent) and line.links[0].idle())
    assert line.received[1] == sent
    return line.links[0], line.links[1]


def test_a_noisy_line_is_not_flooded_with_copies_of_what_arrived():
    """BER 1e-3: an ACK names only the lowest MAX_SACK ranges held, so what lies above them is
    not known to be lost (before: taken for lost whenever a retransmission below was
    acknowledged; 82 % of the DATA frames the receiver got were copies of what it held, and the
    sender put 7.2 stream bytes on the line per message byte)."""
    a, b = _bulk(1e-3)
    assert b.stats["duplicates"] < 0.1 * b.stats["data_in"]
    assert a.stats["stream_bytes_out"] < 2.5 * a.stats["message_bytes_out"]


def test_segment_size_follows_the_line_error_rate():
    """The segment size that carries the most per line byte: the largest frame on a clean line,
    ~140 bytes at BER 1e-4, ~40 at 1e-3 (halving on every loss sat at 34-78 at 1e-4)."""
    assert _bulk(0.0)[0].segment_size == LinkConfig().max_payload - 11
    a4 = _bulk(1e-4)[0]
    assert 100 <= a4.segment_size <= 250, a4.segment_size
    a3 = _bulk(1e-3)[0]
    assert 32 <= a3.segment_size <= 70, a3.segment_size


def test_a_peer_sending_one_byte_pieces_in_holes_holds_a_bounded_number_of_pieces():
    """A hostile peer sending 1-byte DATA pieces, each leaving a hole before it, made the receiver
    keep thousands of pieces and sort and merge all of them again for every frame (a 19-byte frame
    cost 546 µs with 4 000 held: 448 KB of line bytes kept `run` busy for 13 s). Now at most
    MAX_HELD_PIECES pieces wait; one more is dropped (`out_of_window`, sent again by an honest
    peer), and the stream still completes exactly when the missing bytes come."""
    from agent.transport.serial_link import _LEN, MAX_HELD_PIECES
    line = pair()
    t = up(line)
    rx = line.links[1]
    start = rx._rcv_next
    payload = bytes(range(256)) * 16
    stream = _LEN.pack(len(payload)) + payload            # one message, as the link frames it
    for k in range(2, min(len(stream), rx.cfg.window), 2):
        rx._on_data(start + k, stream[k:k + 1], t)
    assert len(rx._ooo) <= MAX_HELD_PIECES, len(rx._ooo)
    assert rx.stats["out_of_window"] > 1000
    rx._on_data(start, stream, t)                         # the whole stream, from the first missing byte
    assert rx._rcv_next == start + len(stream) and not rx._ooo
    assert rx.messages() == [payload]
