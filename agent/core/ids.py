"""Identifier text forms (docs/protocol.md §0 "Identifiers"): site_id, mesh_id, event_id and HLC."""
from __future__ import annotations

import re
from typing import Any

from . import numbers

SITE_ID_LEN = 16
MESH_ID_LEN = 16
EVENT_ID_LEN = 32

_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HLC = re.compile(r"^(0|[1-9][0-9]{0,19})\.(0|[1-9][0-9]{0,9})$")

UINT64_MAX = 2**64 - 1
UINT32_MAX = 2**32 - 1
HLC_PHYSICAL_MAX = 2**63 - 1  # what the store (SQLite, signed 64-bit) holds of the wire's uint64


class IdFormatError(ValueError):
    """A text id or HLC that does not have its docs/protocol.md §0 form."""


def parse_site_id(text: Any, what: str = "site_id") -> bytes:
    if not isinstance(text, str) or not _HEX32.match(text):
        raise IdFormatError(f"{what} must be 32 lowercase hex characters, got {text!r}")
    return bytes.fromhex(text)


def parse_mesh_id(text: Any) -> bytes:
    return parse_site_id(text, "mesh_id")


def parse_public_key(text: str) -> bytes:
    if not isinstance(text, str) or not _HEX64.match(text):
        raise IdFormatError(f"public_key must be 64 lowercase hex characters (Ed25519), got {text!r}")
    return bytes.fromhex(text)


def parse_event_id(text: str) -> bytes:
    if not isinstance(text, str) or not _HEX64.match(text):
        raise IdFormatError(f"event_id must be 64 lowercase hex characters, got {text!r}")
    return bytes.fromhex(text)


def hlc_text(physical_ms: int, logical: int) -> str:
    return f"{physical_ms}.{logical}"


def parse_hlc(text: str) -> tuple[int, int]:
    """`PHYSICAL.LOGICAL` -> (physical_ms, logical), both range-checked (physical below 2**63,
    what the store holds; logical uint32)."""
    h = numbers.hlc(text)   # the one strict reader of numbers from outside
    if h is not None:
        return h
    if isinstance(text, str) and _HLC.fullmatch(text):
        raise IdFormatError(f"HLC out of range (physical below 2**63, logical uint32): {text!r}")
    raise IdFormatError(f"HLC must look like PHYSICAL.LOGICAL (e.g. 1764669600000.3), got {text!r}")
