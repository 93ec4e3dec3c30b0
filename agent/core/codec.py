"""Deterministic CBOR (RFC 8949 §4.2.1) and the one strict decoder (docs/protocol.md §0 "Change events").

Every map in our wire formats has keys of one kind (all text or all unsigned
integers), where cbor2's length-first canonical order equals the bytewise order of
§4.2.1; `encode` refuses mixed-key maps so that the two can never disagree.
"""
from __future__ import annotations

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


# Bounds of the strict decoder (docs/protocol.md "Boundaries and limits"). Canonical SSP bytes
# never come near them: the deepest structure we emit (a body's watermark) nests 3 deep.
MAX_DEPTH = 16  # containers (and the one allowed tag) nested in each other
MAX_ITEMS = 100_000  # data items in one decoded value (a 16 MiB body of 1-byte items would be 16 M)
MAX_BYTES = 16 * 1024 * 1024  # input bytes to one decode (messages.MAX_MESSAGE_BYTES)


def prescan(data: bytes, allowed_tags: frozenset[int] = frozenset(), *, max_depth: int = MAX_DEPTH,
            max_items: int = MAX_ITEMS, max_bytes: int = MAX_BYTES, finite_floats: bool = True) -> None:
    """Walk the CBOR item heads of `data` (major type, additional info, argument) without
    building anything, in time linear in len(data), and refuse what SSP never carries before
    cbor2 sees it (docs/protocol.md §0, "strict decoder"):

    - any tag not in `allowed_tags`, and an allowed tag anywhere but on the outermost item (so
      value sharing, tags 28/29, which turns a few hundred bytes into a graph walked as a tree
      of billions of nodes, and string references never reach cbor2);
    - indefinite lengths and the break byte; reserved additional information (28-30);
    - a length that exceeds the bytes left (each array or map member costs at least one byte,
      so nothing decoded can be larger than the input);
    - nesting deeper than `max_depth`, more than `max_items` items, more than `max_bytes`;
    - integers outside the signed 64-bit range (what SQLite stores: a value above it could pass
      the parse and crash the store);
    - map keys other than integers and text, simple values other than false/true/null, and
      non-finite floats;
    - trailing bytes after the one item.

    Raises DecodeError with a stable reason. Determinism (shortest forms, key order) is checked
    after the decode, by re-encoding."""
    n = len(data)
    if n > max_bytes:
        raise DecodeError("too_large", f"{n} bytes > {max_bytes}")
    if n == 0:
        raise DecodeError("malformed_cbor", "empty input")
    # Every item costs at least one byte, so only an input longer than `max_items` needs counting.
    count = n > max_items
    items = 0
    i = 0
    # Open containers: remaining members of each, and whether it is a map. `left` and `is_map`
    # are the innermost one; the outermost "container" is the one item the input must hold.
    # (Written for speed: it runs over every received event's payload.)
    stack: list[tuple[int, bool]] = []
    left, is_map = 1, False
    try:
        while True:
            ib = data[i]
            i += 1
            major = ib >> 5
            arg = ib & 31
            if arg > 23:
                ai = arg
                if ai == 24:
                    arg = data[i]
                    i += 1
                elif ai < 28:
                    j = i + (1 << (ai - 24))  # 2, 4 or 8 bytes
                    if j > n:
                        raise IndexError
                    arg = int.from_bytes(data[i:j], "big")
                    i = j
                elif ai == 31:
                    raise DecodeError("indefinite_length", "indefinite lengths and break are not allowed")
                else:
                    raise DecodeError("malformed_cbor", f"reserved additional information {ai}")
                if major == 7:
                    if ai == 24:
                        raise DecodeError("unexpected_type", f"simple value {arg} is not allowed")
                    # half, single, double: an all-ones exponent is an infinity or NaN
                    if finite_floats and ((ai == 25 and arg & 0x7C00 == 0x7C00)
                                          or (ai == 26 and arg & 0x7F800000 == 0x7F800000)
                                          or (ai == 27 and arg & 0x7FF0000000000000 == 0x7FF0000000000000)):
                        raise DecodeError("non_finite_float", "NaN and infinities are not allowed")
            elif major == 7 and (arg < 20 or arg == 23):
                raise DecodeError("unexpected_type", f"simple value {arg} is not allowed")
            if count:
                items += 1
                if items > max_items:
                    raise DecodeError("too_many_items", f"more than {max_items} items")
            # `left` counts a map's keys and values down from an even number: even means a key.
            if is_map and not left & 1 and major != 3 and major > 1:
                raise DecodeError("bad_map_key", "map keys must be text or integers")
            if major < 2:
                if arg > INT64_MAX:
                    raise DecodeError("int_out_of_range", "integer outside the signed 64-bit range")
            elif major < 4:
                i += arg
                if i > n:
                    raise DecodeError("malformed_cbor", "string longer than the input")
            elif major < 6:
                if arg:
                    if major == 5:
                        arg <<= 1
                    if arg > n - i:
                        raise DecodeError("malformed_cbor", "more members than bytes left")
                    if len(stack) >= max_depth:
                        raise DecodeError("too_deep", f"nesting deeper than {max_depth}")
                    stack.append((left, is_map))
                    left, is_map = arg, major == 5
                    continue  # the container completes with its last member
            elif major == 6:
                if arg not in allowed_tags or stack or i != (1 if ib & 31 < 24 else 1 + (1 << ((ib & 31) - 24))):
                    raise DecodeError("unexpected_tag", f"tag {arg} not allowed here")
                stack.append((left, is_map))
                left, is_map = 1, False  # the tag's content: one item
                continue
            # one complete item: close every container it completes
            left -= 1
            while not left:
                if not stack:
                    if i != n:
                        raise DecodeError("trailing_bytes", f"{n - i} bytes after the item")
                    return
                left, is_map = stack.pop()
                left -= 1
    except IndexError:
        raise DecodeError("malformed_cbor", "truncated item") from None


def decode_strict(data: bytes, allowed_tags: frozenset[int] = frozenset(), *, deterministic: bool = True,
                  shape_checked: bool = False, max_items: int = MAX_ITEMS, max_bytes: int = MAX_BYTES) -> Any:
    """Decode exactly one CBOR item within the bounds of `prescan` (which runs first, so cbor2
    only ever sees bytes whose decoded size is bounded by their length), refusing duplicate keys
    and (unless `deterministic=False`, for message envelopes, which §30 lets be
    non-deterministic) any non-deterministic form. Raises DecodeError only.
    `shape_checked` is accepted for callers that check every member's exact type themselves
    (the prescan already refuses every type and tag our formats never carry)."""
    if not isinstance(data, (bytes, bytearray)):
        raise DecodeError("not_bytes")
    data = bytes(data)
    # A shape-checked payload types its floats itself (an EventPayload's NaN is `bad_payload_value`).
    prescan(data, allowed_tags, max_items=max_items, max_bytes=max_bytes, finite_floats=not shape_checked)
    try:
        obj = cbor2.loads(data, allow_duplicate_keys=False, allow_indefinite=False)
    except cbor2.CBORDecodeError as e:
        msg = str(e)
        reason = "duplicate_key" if "uplicate" in msg else "malformed_cbor"
        raise DecodeError(reason, msg) from None
    except Exception as e:  # noqa: BLE001 - whatever cbor2 raises on prescanned bytes is a malformed item
        raise DecodeError("malformed_cbor", f"{type(e).__name__}: {e}") from None
    if not deterministic:
        return obj
    try:
        again = cbor2.dumps(obj, canonical=True)
    except Exception as e:  # noqa: BLE001 - anything cbor2 cannot re-encode is not ours
        raise DecodeError("not_reencodable", str(e)) from None
    if again != data:
        raise DecodeError("non_deterministic", "bytes are not the deterministic encoding of their value")
    return obj


def thaw(obj: Any) -> Any:
    """cbor2 returns immutable containers inside tags; give plain dicts and lists."""
    if isinstance(obj, (dict, cbor2.frozendict)):
        return {k: thaw(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [thaw(v) for v in obj]
    return obj
