"""firmware_bridge/framing.py: COBS + CRC-32 framing shared by the serial keystore and the serial
sync link (docs/serial.md "Frames"). The decoder is fuzzed: whatever the bytes, it raises only
FrameError (decode) or nothing (Decoder.feed), holds at most one bounded frame and looks at each
byte a bounded number of times."""
from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from firmware_bridge import framing
from firmware_bridge import serial_protocol as sp

MAX = 1024


@given(st.binary(max_size=3000))
def test_cobs_round_trip_and_same_bytes_as_the_keystore_encoder_had(data):
    enc = framing.cobs_encode(data)
    assert 0 not in enc and framing.cobs_decode(enc) == data
    assert sp.cobs_encode is framing.cobs_encode  # one implementation for both protocols
    assert len(enc) <= len(data) + len(data) // 254 + 1


@given(st.lists(st.binary(max_size=MAX), max_size=6), st.integers(1, 300), st.booleans())
def test_frames_survive_any_chunking(payloads, chunk, lead):
    stream = b"".join(framing.encode(p, MAX, lead=lead) for p in payloads)
    dec = framing.Decoder(MAX)
    got = []
    for i in range(0, len(stream), chunk):
        got += dec.feed(stream[i:i + chunk])
    assert got == payloads and dec.rejected == 0


@settings(max_examples=300)
@given(st.binary(max_size=3 * MAX))
def test_decode_raises_only_frame_error(raw):
    try:
        framing.decode(raw, MAX)
    except framing.FrameError as e:
        assert e.reason in ("bad_cobs", "too_long", "too_short", "bad_crc", "unclassified")


@settings(max_examples=300)
@given(st.lists(st.binary(max_size=2 * MAX + 50), max_size=8))
def test_decoder_never_raises_stays_bounded_and_linear(chunks):
    dec = framing.Decoder(MAX)
    fed = 0
    for c in chunks:
        dec.feed(c)  # nothing escapes
        fed += len(c)
        assert dec.pending <= dec.max_raw  # one bounded partial frame at most
    assert dec.work <= fed  # every byte is decoded at most once: linear in the input


def test_a_line_without_delimiters_costs_the_bound_not_the_input():
    dec = framing.Decoder(MAX)
    for _ in range(5000):  # byte by byte: the old keystore reader rescanned its buffer each time
        dec.feed(b"\x55")
        assert dec.pending <= dec.max_raw
    assert dec.rejected == 1 and dec.rejected_by == {"too_long": 1}
    p = b"after the noise"
    assert dec.feed(b"\x00" + framing.encode(p, MAX)) == [p]  # the over-long run ends at its 0x00


@given(st.binary(min_size=1, max_size=MAX), st.data())
def test_every_burst_of_up_to_32_bit_errors_is_rejected(payload, data):
    frame = framing.encode(payload, MAX, lead=True)
    start = data.draw(st.integers(0, len(frame) * 8 - 1))
    width = data.draw(st.integers(1, 32))
    bits = [b for b in range(start, min(start + width, len(frame) * 8))]
    mask = data.draw(st.integers(1, 2 ** len(bits) - 1))
    bad = bytearray(frame)
    for i, b in enumerate(bits):
        if mask >> i & 1:
            bad[b // 8] ^= 0x80 >> (b % 8)
    got = framing.Decoder(MAX).feed(bytes(bad) + b"\x00")
    assert payload not in got or bytes(bad) == frame  # the frame is lost, never altered
    assert got == [] or got == [payload]  # nothing else is accepted either (CRC-32: bursts <= 32 bits)


@given(st.binary(max_size=400), st.binary(max_size=MAX), st.binary(min_size=1, max_size=MAX))
def test_resync_within_one_frame_after_garbage_or_a_truncated_frame(garbage, cut_payload, payload):
    """Garbage, then a frame cut short (a pulled cable), then a good frame: the good frame is
    taken, because every frame starts with its own delimiter (lead=True)."""
    cut = framing.encode(cut_payload, MAX, lead=True)
    cut = cut[:len(cut) // 2]
    got = framing.Decoder(MAX).feed(garbage + cut + framing.encode(payload, MAX, lead=True))
    assert got[-1] == payload


def test_random_bit_error_rates_accept_no_corrupted_frame():
    rng = random.Random(7)
    payloads = [rng.randbytes(rng.randint(1, MAX)) for _ in range(300)]
    for ber in (1e-4, 1e-3, 1e-2):
        line = bytearray(b"".join(framing.encode(p, MAX, lead=True) for p in payloads))
        flips = 0
        for i in range(len(line) * 8):
            if rng.random() < ber:
                line[i // 8] ^= 0x80 >> (i % 8)
                flips += 1
        dec = framing.Decoder(MAX)
        got = []
        for i in range(0, len(line), 97):
            got += dec.feed(bytes(line[i:i + 97]))
        assert flips and set(got) <= set(payloads), ber  # 0 corrupted frames accepted
        assert dec.rejected > 0 and len(got) + dec.rejected >= len(payloads) - flips
