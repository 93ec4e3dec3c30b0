"""Byte-stream framing, sans I/O: COBS + CRC-32 with a length bound (docs/serial.md "Frames").

One frame on the wire:   [0x00] COBS( payload | CRC-32(payload), 4 bytes big-endian ) 0x00

Shared by the serial keystore protocol (serial_protocol.py, which frames its requests and
replies with it) and the serial sync link (agent/transport/serial_link.py). It imports nothing
from `agent` (tests/core/test_layout.py) and nothing that does I/O.

Why these choices:
- COBS makes 0x00 an unambiguous delimiter: whatever a line does to the bytes, the receiver is
  back in step at the next 0x00. A sender may also put a 0x00 *before* each frame (`lead=True`):
  then garbage before a frame ends at that delimiter and costs no good frame, so a receiver
  resynchronises within the frame after the garbage (empty frames between delimiters are nothing).
- CRC-32 (the zlib/IEEE polynomial) over the payload rejects every burst of up to 32 flipped
  bits and all but 2^-32 of the rest; the layers above never see a frame whose CRC failed.
- A length bound (`max_payload`) is checked while bytes arrive, before anything is decoded:
  a line that never sends 0x00 costs at most the bound in memory, and every byte is looked at a
  bounded number of times (the decoder is linear in its input).

The only error this module raises is `FrameError` (decode); `Decoder.feed` raises nothing and
counts what it rejected.
"""
from __future__ import annotations

import struct
import zlib

CRC_LEN = 4


class FrameError(ValueError):
    """Bytes between two delimiters that are not a frame: bad COBS, too long, too short or a CRC
    mismatch. `reason` is a stable code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(detail or reason)
        self.reason = reason


def crc32(data: bytes) -> int:
    return zlib.crc32(data) & 0xFFFFFFFF


def cobs_encode(data: bytes) -> bytes:
    """COBS (Cheshire & Baker): no 0x00 in the output. Runs of 254 non-zero bytes take a 0xFF
    code with no implied zero. Works segment by segment (split at zeros) so it is C-speed."""
    out = bytearray()
    for seg in bytes(data).split(b"\x00"):
        while len(seg) >= 254:
            out.append(255)
            out += seg[:254]
            seg = seg[254:]
        out.append(len(seg) + 1)
        out += seg
    return bytes(out)


def cobs_decode(data: bytes) -> bytes:
    """The inverse of `cobs_encode`; FrameError for anything it could not have produced."""
    data = bytes(data)
    out = bytearray()
    i, n = 0, len(data)
    while i < n:
        code = data[i]
        if code == 0:
            raise FrameError("bad_cobs", "zero byte inside COBS data")
        end = i + code
        if end > n:
            raise FrameError("bad_cobs", "truncated COBS block")
        block = data[i + 1:end]
        if 0 in block:
            raise FrameError("bad_cobs", "zero byte inside COBS block")
        out += block
        i = end
        if code != 255 and i < n:
            out.append(0)
    return bytes(out)


def max_encoded_len(max_payload: int) -> int:
    """The longest COBS data (between delimiters) a payload of at most `max_payload` bytes gives:
    one code byte per 254 data bytes, plus one."""
    n = max_payload + CRC_LEN
    return n + n // 254 + 1


def encode(payload: bytes, max_payload: int, *, lead: bool = False) -> bytes:
    """One frame for `payload`; ValueError (a local fault, never a peer's) when it is too long."""
    if len(payload) > max_payload:
        raise ValueError(f"frame payload of {len(payload)} bytes exceeds the bound of {max_payload}")
    body = cobs_encode(bytes(payload) + struct.pack(">I", crc32(payload))) + b"\x00"
    return b"\x00" + body if lead else body


def decode(raw: bytes, max_payload: int) -> bytes:
    """The frame boundary: `raw` is the COBS data between two delimiters. Its payload, or
    FrameError (nothing else escapes, whatever the bytes)."""
    try:
        if len(raw) > max_encoded_len(max_payload):
            raise FrameError("too_long", f"{len(raw)} bytes between delimiters")
        data = cobs_decode(raw)
        if len(data) < CRC_LEN:
            raise FrameError("too_short", "shorter than its CRC")
        payload = data[:-CRC_LEN]
        if len(payload) > max_payload:
            raise FrameError("too_long", f"payload of {len(payload)} bytes")
        if crc32(payload) != struct.unpack(">I", data[-CRC_LEN:])[0]:
            raise FrameError("bad_crc", "CRC mismatch")
        return payload
    except FrameError:
        raise
    except Exception as exc:  # noqa: BLE001 - the catch-and-classify net of this boundary
        raise FrameError("unclassified", type(exc).__name__) from None


class Decoder:
    """Bytes from a line in any chunking -> frame payloads. Holds at most one bounded partial
    frame; an over-long run is dropped as it grows and skipped up to the next delimiter."""

    def __init__(self, max_payload: int) -> None:
        self.max_payload = max_payload
        self.max_raw = max_encoded_len(max_payload)
        self._buf = bytearray()
        self._skipping = False  # inside an over-long run: discard up to the next 0x00
        self.accepted = 0
        self.rejected = 0
        self.rejected_by: dict[str, int] = {}
        self.last_error = ""
        self.work = 0  # bytes handed to `decode` in total (never more than were fed: linear time)

    @property
    def pending(self) -> int:
        """Bytes of a partial frame held (at most `max_raw`)."""
        return len(self._buf)

    def _reject(self, reason: str, detail: str) -> None:
        self.rejected += 1
        self.rejected_by[reason] = self.rejected_by.get(reason, 0) + 1
        self.last_error = f"{reason}: {detail}" if detail and detail != reason else reason

    def feed(self, data: bytes) -> list[bytes]:
        out: list[bytes] = []
        data = bytes(data)
        pos, n = 0, len(data)
        while pos < n:
            z = data.find(0, pos)
            seg_end = n if z < 0 else z
            if not self._skipping:
                self._buf += data[pos:seg_end]
                if len(self._buf) > self.max_raw:
                    self._reject("too_long", f"more than {self.max_raw} bytes without a delimiter")
                    self._buf.clear()
                    self._skipping = True
            if z < 0:
                break
            pos = z + 1
            if self._skipping:
                self._skipping = False  # the over-long run ends here; already counted
                continue
            if self._buf:
                raw = bytes(self._buf)
                self._buf.clear()
                self.work += len(raw)
                try:
                    out.append(decode(raw, self.max_payload))
                    self.accepted += 1
                except FrameError as e:
                    self._reject(e.reason, str(e))
        return out
