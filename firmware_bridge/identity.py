"""Signing identities and their canonical byte encoding.

An event's identity is (site_id, HLC) (docs/protocol.md §0 "Identifiers", "Change events"); a receipt's identity is
(group_id, epoch) (SOVM §22.5, docs/protocol.md §0).  The same byte encoding is used as the
journal key and on the serial line, so the device can enforce its own refusal (§22.5 clause 2).

Encoding (big-endian):
  event:   b"E" | site_id (16) | physical_ms (u64) | logical (u32)          = 29 bytes
  receipt: b"R" | len(group_id) (u16) | group_id | epoch (u64)
  discontinuity statement: b"D" | len(group_id) (u16) | group_id | epoch (u64) | attempt (u32)
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Union

_U64 = (1 << 64) - 1
_U32 = (1 << 32) - 1


@dataclass(frozen=True, order=True)
class EventIdentity:
    """A change event: the producer's site_id and the HLC it signs under (docs/protocol.md §0 "Change events")."""

    site_id: bytes
    physical_ms: int
    logical: int

    def __post_init__(self) -> None:
        if not isinstance(self.site_id, bytes) or len(self.site_id) != 16:
            raise ValueError("EventIdentity.site_id must be exactly 16 bytes (docs/protocol.md §0)")
        if not (isinstance(self.physical_ms, int) and 0 <= self.physical_ms <= _U64):
            raise ValueError("EventIdentity.physical_ms must be a uint64")
        if not (isinstance(self.logical, int) and 0 <= self.logical <= _U32):
            raise ValueError("EventIdentity.logical must be a uint32")

    @property
    def hlc(self) -> tuple[int, int]:
        return (self.physical_ms, self.logical)

    def encode(self) -> bytes:
        return b"E" + self.site_id + struct.pack(">QI", self.physical_ms, self.logical)

    def __str__(self) -> str:
        return f"event site_id={self.site_id.hex()} hlc={self.physical_ms}.{self.logical}"


def encode_receipt_identity(group_id: bytes, epoch: int) -> bytes:
    """``ReceiptIdentity(group_id, epoch).encode()`` without building (and checking) the identity:
    for a pair already known valid (a journal compaction writes one floor a group)."""
    return b"R" + struct.pack(">H", len(group_id)) + group_id + struct.pack(">Q", epoch)


@dataclass(frozen=True, order=True)
class ReceiptIdentity:
    """A sequencing receipt: (group_id, epoch); the epoch is dictated by CAS, not chosen (§22.5)."""

    group_id: bytes
    epoch: int

    def __post_init__(self) -> None:
        if not isinstance(self.group_id, bytes) or not 1 <= len(self.group_id) <= 255:
            raise ValueError("ReceiptIdentity.group_id must be 1..255 bytes")
        if not (isinstance(self.epoch, int) and 0 <= self.epoch <= _U64):
            raise ValueError("ReceiptIdentity.epoch must be a uint64")

    def encode(self) -> bytes:
        return encode_receipt_identity(self.group_id, self.epoch)

    def __str__(self) -> str:
        return f"receipt group_id={self.group_id.hex()} epoch={self.epoch}"


@dataclass(frozen=True, order=True)
class DiscontinuityIdentity:
    """A sequencer's signed statement that (group_id, epoch)'s receipt is absent (SOVM §22.6
    "epoch advanced, receipt absent", step 4). Its own identity, never a receipt's: a statement
    must not spend (or be refused by) the receipt identity it speaks about. ``attempt`` numbers
    the signings of the one statement whose earlier attempts have an intent and no output (they
    were never released, so nobody saw them); the sequencer signs attempt n only with the same
    payload and only when every attempt below n is such an unknown outcome
    (agent/sequencer/service.py), so at most one statement per (group_id, epoch) is ever released."""

    group_id: bytes
    epoch: int
    attempt: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.group_id, bytes) or not 1 <= len(self.group_id) <= 255:
            raise ValueError("DiscontinuityIdentity.group_id must be 1..255 bytes")
        if not (isinstance(self.epoch, int) and 0 <= self.epoch <= _U64):
            raise ValueError("DiscontinuityIdentity.epoch must be a uint64")
        if not (isinstance(self.attempt, int) and 0 <= self.attempt <= _U32):
            raise ValueError("DiscontinuityIdentity.attempt must be a uint32")

    def encode(self) -> bytes:
        return (b"D" + struct.pack(">H", len(self.group_id)) + self.group_id
                + struct.pack(">QI", self.epoch, self.attempt))

    def __str__(self) -> str:
        return f"discontinuity group_id={self.group_id.hex()} epoch={self.epoch} attempt={self.attempt}"


Identity = Union[EventIdentity, ReceiptIdentity, DiscontinuityIdentity]


def decode_identity(data: bytes) -> Identity:
    """Inverse of ``Identity.encode``; raises ValueError on anything malformed or trailing."""
    if len(data) == 29 and data[:1] == b"E":
        phys, logical = struct.unpack(">QI", data[17:29])
        return EventIdentity(bytes(data[1:17]), phys, logical)
    if len(data) >= 3 and data[:1] == b"R":
        (n,) = struct.unpack(">H", data[1:3])
        if len(data) == 3 + n + 8:
            (epoch,) = struct.unpack(">Q", data[3 + n:])
            return ReceiptIdentity(bytes(data[3:3 + n]), epoch)
    if len(data) >= 3 and data[:1] == b"D":
        (n,) = struct.unpack(">H", data[1:3])
        if len(data) == 3 + n + 12:
            epoch, attempt = struct.unpack(">QI", data[3 + n:])
            return DiscontinuityIdentity(bytes(data[3:3 + n]), epoch, attempt)
    raise ValueError("malformed identity encoding")
