"""Deterministic CBOR (RFC 8949 §4.2.1) and the one strict decoder (wire-profile.md §2).

Every map in our wire formats has keys of one kind (all text or all unsigned
integers), where cbor2's length-first canonical order equals the bytewise order of
§4.2.1; `encode` refuses mixed-key maps so that the two can never disagree.
"""
from __future__ import annotations

import io
import math
from typing import Any

import cbor2

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


class DecodeError(ValueError):
    """Bytes that are not one strictly and deterministically encoded CBOR item.
    `reason` is a stable code for outcomes and logs."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


def _check_map_keys(obj: dict) -> None:
    kinds = {("int" if isinstance(k, int) and not isinstance(k, bool) else type(k).__name__) for k in obj}
    if len(kinds) > 1:
        raise ValueError("maps must have keys of one kind (all text or all integers)")
    if kinds == {"int"} and any(k < 0 for k in obj):
        raise ValueError("integer map keys must be unsigned")


def _check_encodable(obj: Any) -> None:
    if isinstance(obj, dict):
        _check_map_keys(obj)
        for k, v in obj.items():
            _check_encodable(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _check_encodable(v)
    elif isinstance(obj, cbor2.CBORTag):
        _check_encodable(obj.value)


def encode(obj: Any) -> bytes:
    """Deterministic encoding: preferred (shortest) integer, length and float forms,
    definite lengths, sorted map keys."""
    _check_encodable(obj)
    return cbor2.dumps(obj, canonical=True)


def encode_trusted(obj: Any) -> bytes:
    """`encode` for values built by our own code whose maps are known to be homogeneous
    (hot paths: Sig_structure, row addresses)."""
    return cbor2.dumps(obj, canonical=True)


_ALLOWED_SCALARS = (int, float, str, bytes, type(None))


_MAPS = (dict, cbor2.frozendict)
_SEQS = (list, tuple)


def _check_decoded(obj: Any, allowed_tags: frozenset[int], depth: int = 0) -> None:
    """Refuse what cbor2 can decode but our formats never carry. Type checks are exact
    (`type(x) in ...`): this runs on every received event, so it avoids abc instance checks."""
    if depth > 16:
        raise DecodeError("too_deep", "nesting deeper than 16")
    t = type(obj)
    if t is int:
        if not (INT64_MIN <= obj < 2**64):
            raise DecodeError("int_out_of_range", "integer outside the 64-bit range")
    elif t is str or t is bytes or obj is None or t is bool:
        pass  # bools are valid CBOR; shape checks decide whether they are allowed
    elif t is float:
        if not math.isfinite(obj):
            raise DecodeError("non_finite_float", "NaN and infinities are not allowed")
    elif t in _SEQS:
        for v in obj:
            _check_decoded(v, allowed_tags, depth + 1)
    elif t in _MAPS:
        for k, v in obj.items():
            tk = type(k)
            if tk is not str and tk is not int:
                raise DecodeError("bad_map_key", "map keys must be text or integers")
            _check_decoded(v, allowed_tags, depth + 1)
    elif t is cbor2.CBORTag:
        if obj.tag not in allowed_tags or depth != 0:
            raise DecodeError("unexpected_tag", f"tag {obj.tag} not allowed here")
        _check_decoded(obj.value, frozenset(), depth + 1)
    else:
        # cbor2 turns some semantic tags (bignums, dates, decimals, sets, ...) into objects.
        raise DecodeError("unexpected_type", f"{t.__name__} is not allowed")


def decode_strict(data: bytes, allowed_tags: frozenset[int] = frozenset(), *, deterministic: bool = True,
                  shape_checked: bool = False) -> Any:
    """Decode exactly one CBOR item, refusing trailing bytes, duplicate keys, indefinite
    lengths, unexpected tags, non-finite floats and (unless `deterministic=False`, for message
    envelopes, which §30 lets be non-deterministic) any non-deterministic form.
    `shape_checked=True` skips the generic type walk for callers that check every member's
    exact type themselves right after (COSE envelope, protected header, EventPayload): the
    hot path of every received event."""
    if not isinstance(data, (bytes, bytearray)):
        raise DecodeError("not_bytes")
    fp = io.BytesIO(data)
    try:
        # Unknown tags come back as CBORTag; semantic ones as objects that _check_decoded refuses.
        dec = cbor2.CBORDecoder(fp, allow_duplicate_keys=False, allow_indefinite=False)
        obj = dec.decode()
    except cbor2.CBORDecodeError as e:
        msg = str(e)
        reason = "duplicate_key" if "uplicate" in msg else "indefinite_length" if "ndefinite" in msg else "malformed_cbor"
        raise DecodeError(reason, msg) from None
    except (ValueError, TypeError, OverflowError, RecursionError, MemoryError) as e:
        raise DecodeError("malformed_cbor", str(e)) from None
    if fp.tell() != len(data):
        raise DecodeError("trailing_bytes", f"{len(data) - fp.tell()} bytes after the item")
    if not shape_checked:
        _check_decoded(obj, allowed_tags)
    if not deterministic:
        return obj
    try:
        again = cbor2.dumps(obj, canonical=True)
    except Exception as e:  # noqa: BLE001 - anything cbor2 cannot re-encode is not ours
        raise DecodeError("not_reencodable", str(e)) from None
    if again != bytes(data):
        raise DecodeError("non_deterministic", "bytes are not the deterministic encoding of their value")
    return obj


def thaw(obj: Any) -> Any:
    """cbor2 returns immutable containers inside tags; give plain dicts and lists."""
    if isinstance(obj, (dict, cbor2.frozendict)):
        return {k: thaw(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [thaw(v) for v in obj]
    return obj
