"""Change events (docs/protocol.md §0): building the signed form and the EventPayload shape check."""
from __future__ import annotations

import math
import struct
from functools import lru_cache
from typing import Any, NamedTuple

import blake3
import cbor2

from .classify import classified
from .codec import INT64_MAX, INT64_MIN, MAX_ITEMS, DecodeError, decode_strict, encode
from .cose import ALG_EDDSA, Sign1, protected_header, sig_structure
from .ids import UINT32_MAX

# hlc_physical_ms reaches the store (events.hlc_p): bounded by SQLite's signed 64-bit, not the
# wire's uint64 (the strict decoder refuses larger integers first).
HLC_PHYSICAL_MAX = INT64_MAX

EVENT_CONTENT_TYPE = "sovm/ssp-event-v1"
PAYLOAD_MEMBERS = frozenset(
    {"table_schema", "table_name", "row_key", "operation", "payload", "hlc_physical_ms", "hlc_logical"}
)
OPERATIONS = ("upsert", "delete")
PURGE = "purge"  # registered, never available (scope excerpt §4.2)

Scalar = int | float | str | bytes


def event_id(raw: bytes) -> bytes:
    """BLAKE3-256 of the exact received COSE_Sign1 bytes (docs/protocol.md §0 "Identifiers")."""
    return blake3.blake3(raw).digest()


class Event(NamedTuple):
    """A verified, shape-checked change event (immutable; a NamedTuple, not a frozen dataclass:
    one is made per applied event, and a frozen dataclass's constructor costs several times more)."""

    event_id: bytes
    raw: bytes
    site_id: bytes  # the signer's kid
    table_schema: str
    table_name: str
    row_key: dict[str, Any]
    operation: str
    payload: dict[str, Any] | None
    hlc: tuple[int, int]

    @property
    def stamp(self) -> tuple[int, int, bytes]:
        return (self.hlc[0], self.hlc[1], self.site_id)

    @property
    def table(self) -> str:
        return f"{self.table_schema}.{self.table_name}"


def is_scalar(v: Any) -> bool:
    """Scalar = int (signed 64-bit) / float (finite) / tstr / bstr. Exact types: bool is an int
    subclass in Python and is refused (docs/protocol.md §0, Shape), as is anything cbor2 decoded from
    a semantic tag."""
    t = type(v)
    if t is int:
        return INT64_MIN <= v <= INT64_MAX
    if t is float:
        return math.isfinite(v)
    return t is str or t is bytes


def check_payload_shape(obj: Any) -> str | None:
    """The EventPayload shape; returns a reason code when the shape is wrong, None when right."""
    if not isinstance(obj, dict):
        return "payload_not_map"
    if obj.keys() != PAYLOAD_MEMBERS:
        return "payload_members"
    if not isinstance(obj["table_schema"], str) or not obj["table_schema"]:
        return "bad_table_schema"
    if not isinstance(obj["table_name"], str) or not obj["table_name"]:
        return "bad_table_name"
    rk = obj["row_key"]
    if rk is None or (isinstance(rk, dict) and len(rk) == 0):
        return "row_key_empty"  # §13.6: a null or empty key addresses nothing
    if not isinstance(rk, dict) or not all(isinstance(k, str) for k in rk):
        return "bad_row_key"
    if not all(is_scalar(v) for v in rk.values()):
        return "bad_row_key_value"
    op = obj["operation"]
    if op not in OPERATIONS or not isinstance(op, str):
        return "bad_operation"
    pl = obj["payload"]
    if op == "delete":
        if pl is not None:
            return "delete_with_payload"
    else:
        if not isinstance(pl, dict) or not all(isinstance(k, str) for k in pl):
            return "bad_payload_map"
        if not all(v is None or is_scalar(v) for v in pl.values()):
            return "bad_payload_value"
    p, l = obj["hlc_physical_ms"], obj["hlc_logical"]
    if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p <= HLC_PHYSICAL_MAX:
        return "bad_hlc"
    if isinstance(l, bool) or not isinstance(l, int) or not 0 <= l <= UINT32_MAX:
        return "bad_hlc"
    return None


@classified(DecodeError)
def event_from_verified(raw: bytes, sign1: Sign1, eid: bytes | None = None) -> Event:
    """The event payload boundary (after the signature verified). Decode and shape-check the payload of a COSE_Sign1 whose signature verified.
    Raises DecodeError (reason) when it can never become a valid event. `eid`: `event_id(raw)`
    when the caller computed it already (the apply path hashes each event once)."""
    return decoded_event(raw, sign1, eid)[0]


@classified(DecodeError)
def decoded_event(raw: bytes, sign1: Sign1, eid: bytes | None = None) -> tuple[Event, bytes]:
    """`event_from_verified` and the event's row address (`text_map(row_key)`, the row store's key)."""
    eid = event_id(raw) if eid is None else eid
    fast = _well_formed_payload(sign1.payload_bytes)
    if fast is not None:
        schema, table, row_key, op, payload, hlc, rk = fast
        return Event(eid, raw, sign1.kid, schema, table, row_key, op, payload, hlc), rk
    obj = decode_strict(sign1.payload_bytes, shape_checked=True)  # the shape check types every member
    reason = check_payload_shape(obj)
    if reason:
        raise DecodeError(reason, "EventPayload shape")
    e = Event(
        event_id=eid,
        raw=raw,
        site_id=sign1.kid,
        table_schema=obj["table_schema"],
        table_name=obj["table_name"],
        row_key=dict(obj["row_key"]),
        operation=obj["operation"],
        payload=None if obj["payload"] is None else dict(obj["payload"]),
        hlc=(obj["hlc_physical_ms"], obj["hlc_logical"]),
    )
    return e, _text_map(e.row_key)


# The strict decode of an EventPayload without the generic decoder, for the payloads every
# conforming signer produces: the seven members in deterministic order, maps of text keys and
# scalar values. It reads the heads directly and checks every deterministic rule on the way
# (shortest heads, keys ordered and unique, shortest floats): the input is then the
# deterministic encoding of the value read, which the generic path (prescan, cbor2, re-encode,
# shape check) would return as well. Anything else (another layout, a shape error, a value out of range) returns
# None and takes the generic path, which names what is wrong.
_FLOAT = {0xF9: (struct.Struct(">e"), 3), 0xFA: (struct.Struct(">f"), 5), 0xFB: (struct.Struct(">d"), 9)}


def _head_arg(d: bytes, i: int) -> tuple[int, int]:
    """(argument, next index) of the head at `i` (additional information < 28; IndexError when short)."""
    ai = d[i] & 31
    if ai < 24:
        return ai, i + 1
    if ai == 24:
        n = d[i + 1]
        if n < 24:   # not the shortest head (RFC 8949 §4.2.1)
            raise IndexError
        return n, i + 2
    if ai > 27:
        raise IndexError
    w = 1 << (ai - 24)
    j = i + 1 + w
    if j > len(d):
        raise IndexError
    n = int.from_bytes(d[i + 1:j], "big")
    if n < _SHORTEST[w]:
        raise IndexError
    return n, j


_SHORTEST = {2: 0x100, 4: 0x10000, 8: 0x100000000}   # the least argument of a head of 2, 4, 8 bytes


def _scalar_at(d: bytes, i: int) -> tuple[Any, int]:
    """A scalar or null at `i` (IndexError for anything else)."""
    ib = d[i]
    if 0x60 <= ib < 0x78:   # the common case first: a short text
        j = i + 1 + ib - 0x60
        if j > len(d):
            raise IndexError
        return d[i + 1:j].decode(), j
    major = ib >> 5
    if major < 2:
        n, i = _head_arg(d, i)
        if n > INT64_MAX:
            raise IndexError
        return (n if major == 0 else -1 - n), i
    if major < 4:
        n, i = _head_arg(d, i)
        j = i + n
        if j > len(d):
            raise IndexError
        return (d[i:j] if major == 2 else d[i:j].decode()), j
    if ib == 0xF6:
        return None, i + 1
    f = _FLOAT.get(ib)
    if f is None:
        raise IndexError
    v = f[0].unpack_from(d, i + 1)[0]
    j = i + f[1]
    # finite, and in the shortest form that keeps the value (the encoder's own choice)
    if not math.isfinite(v) or (ib != 0xF9 and _scalar(v) != d[i:j]):
        raise IndexError
    return v, j


def _text_map_at(d: bytes, i: int) -> tuple[dict, int]:
    ib = d[i]
    if 0xA0 <= ib < 0xB8:
        n, i = ib - 0xA0, i + 1
    elif ib >> 5 == 5:
        n, i = _head_arg(d, i)
    else:
        raise IndexError
    m = {}
    scalar, names = _scalar_at, _NAMES
    last = b""
    for _ in range(n):
        ib = d[i]
        if 0x60 <= ib < 0x78:   # a short text key: a column's name, read once (and one object to pickle)
            j = i + 1 + ib - 0x60
            enc = d[i:j]
            k = names.get(enc)
            if k is None:
                k, j = scalar(d, i)
                if len(names) < 4096:
                    names[enc] = k
        elif ib >> 5 == 3:
            k, j = scalar(d, i)
            enc = d[i:j]
        else:
            raise IndexError
        # keys in the deterministic order: encoded length, then bytewise; none twice
        if len(enc) < len(last) or (len(enc) == len(last) and enc <= last):
            raise IndexError
        last = enc
        m[k], i = scalar(d, j)
    return m, i


_NAMES: dict[bytes, str] = {}   # encoded short text key -> the key


def _text_at(d: bytes, i: int, key: bytes) -> tuple[str, int]:
    if d[i:i + len(key)] != key:
        raise IndexError
    i += len(key)
    ib = d[i]
    if 0x60 <= ib < 0x78:   # a short name (schema, table, operation): read once
        j = i + 1 + ib - 0x60
        name = _NAMES.get(d[i:j])
        if name is not None:
            return name, j
        name, j = _scalar_at(d, i)
        if len(_NAMES) < 4096:
            _NAMES[d[i:j]] = name
        return name, j
    if ib >> 5 != 3:
        raise IndexError
    return _scalar_at(d, i)


def _uint_at(d: bytes, i: int, key: bytes) -> tuple[int, int]:
    if d[i:i + len(key)] != key or d[i + len(key)] >> 5 != 0:
        raise IndexError
    return _scalar_at(d, i + len(key))


def _well_formed_payload(d: bytes) -> tuple | None:
    if len(d) > MAX_ITEMS or not d.startswith(_HEAD_PAYLOAD):
        return None
    try:
        i = len(_HEAD_PAYLOAD)
        if d[i] == 0xF6:
            payload, i = None, i + 1
        else:
            payload, i = _text_map_at(d, i)
        if d[i:i + len(_KEY_ROW_KEY)] != _KEY_ROW_KEY:
            return None
        a = i + len(_KEY_ROW_KEY)
        row_key, b = _text_map_at(d, a)
        op, i = _text_at(d, b, _KEY_OPERATION)
        table, i = _text_at(d, i, _KEY_TABLE_NAME)
        logical, i = _uint_at(d, i, _KEY_LOGICAL)
        schema, i = _text_at(d, i, _KEY_SCHEMA)
        physical, i = _uint_at(d, i, _KEY_PHYSICAL)
    except (IndexError, UnicodeDecodeError, struct.error):
        return None
    # the shape check's rules (`check_payload_shape`), for what the layout does not fix already
    if i != len(d) or not schema or not table or not row_key or logical > UINT32_MAX or \
            None in row_key.values() or (payload is None) != (op == "delete") or op not in OPERATIONS:
        return None
    return schema, table, row_key, op, payload, (physical, logical), d[a:b]


def payload_bytes(schema: str, table: str, row_key: dict, operation: str, payload: dict | None,
                  hlc: tuple[int, int], *, shape_checked: bool = False, row_key_bytes: bytes | None = None) -> bytes:
    """The deterministic encoding of an EventPayload. `shape_checked`: the caller has already
    checked what the shape check would (Node.write_many: the table's key and value columns with
    fitting types, docs/protocol.md §0), so it is not run twice on every local write.
    `row_key_bytes`: `text_map(row_key)` when the caller has it (the row's address, kept)."""
    if not shape_checked:
        reason = check_payload_shape({
            "table_schema": schema,
            "table_name": table,
            "row_key": row_key,
            "operation": operation,
            "payload": payload,
            "hlc_physical_ms": hlc[0],
            "hlc_logical": hlc[1],
        })
        if reason:
            raise ValueError(f"cannot build an event: {reason}")
    # The shape check makes every map text-keyed and every value a scalar (or None), so the
    # deterministic encoding can be put together from parts: equal to `encode(obj)` (tested:
    # tests/core/test_events_encoding.py), about 3x cheaper on every local write.
    return b"".join((_HEAD_PAYLOAD, b"\xf6" if payload is None else _text_map(payload), _KEY_ROW_KEY,
                     _text_map(row_key) if row_key_bytes is None else row_key_bytes,
                     _fixed(schema, table, operation), _uint(hlc[1]),
                     _KEY_SCHEMA, _text(schema), _KEY_PHYSICAL, _uint(hlc[0])))


# The seven members in deterministic order (RFC 8949 §4.2: text keys by encoded length, then
# bytewise): payload, row_key, operation, table_name, hlc_logical, table_schema, hlc_physical_ms.
_HEAD_PAYLOAD = b"\xa7" + cbor2.dumps("payload")
_KEY_ROW_KEY = cbor2.dumps("row_key")
_KEY_SCHEMA = cbor2.dumps("table_schema")
_KEY_PHYSICAL = cbor2.dumps("hlc_physical_ms")
_KEY_OPERATION = cbor2.dumps("operation")
_KEY_TABLE_NAME = cbor2.dumps("table_name")
_KEY_LOGICAL = cbor2.dumps("hlc_logical")


def _uint(n: int, major: int = 0) -> bytes:
    """The shortest head of major type `major` with argument `n` (RFC 8949 §4.2.1)."""
    if n < 24:
        return bytes((major | n,))
    if n < 0x100:
        return bytes((major | 24, n))
    if n < 0x10000:
        return bytes((major | 25,)) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes((major | 26,)) + n.to_bytes(4, "big")
    return bytes((major | 27,)) + n.to_bytes(8, "big")


@lru_cache(maxsize=4096)
def _text(s: str) -> bytes:
    return cbor2.dumps(s)


@lru_cache(maxsize=1024)
def _fixed(schema: str, table: str, operation: str) -> bytes:
    return cbor2.dumps("operation") + cbor2.dumps(operation) + cbor2.dumps("table_name") + cbor2.dumps(table) + \
        cbor2.dumps("hlc_logical")


def _text_map(m: dict) -> bytes:
    """A map with text keys and scalar (or null) values, deterministically encoded: keys in
    encoded-length-then-bytewise order (the order of one key set is computed once), each value
    in its shortest form (`_scalar`)."""
    parts = [_uint(len(m), 0xA0)]
    scalar = _scalar
    for kb, k in _key_order_of(tuple(m)):
        parts.append(kb)
        parts.append(scalar(m[k]))
    return b"".join(parts)


def text_map(m: dict) -> bytes:
    """The deterministic encoding of a map with text keys and scalar (or null) values (a row key)."""
    return _text_map(m)


@lru_cache(maxsize=1024)
def _key_order_of(keys: tuple[str, ...]) -> tuple[tuple[bytes, str], ...]:
    return tuple(sorted(((_text(k), k) for k in keys), key=lambda item: (len(item[0]), item[0])))


def _scalar(v: Any) -> bytes:
    """One scalar (or null) in the deterministic encoding (RFC 8949 §4.2.1): texts, byte strings
    and integers built here (the shortest head), floats by cbor2's canonical encoder (the shortest
    of half, single and double that keeps the value). Equal to cbor2's canonical encoding of each
    (tests/core/test_events_encoding.py), without a C call per text and integer."""
    t = type(v)
    if t is str:
        b = v.encode()
        return _uint(len(b), 0x60) + b
    if t is int:
        return _uint(v) if v >= 0 else _uint(-1 - v, 0x20)
    if t is bytes:
        return _uint(len(v), 0x40) + v
    if v is None:
        return b"\xf6"
    return cbor2.dumps(v, canonical=True)


def to_be_signed(site_id: bytes, mesh_id: bytes, payload: bytes) -> tuple[bytes, bytes]:
    """(protected header bytes, Sig_structure bytes) for an event by `site_id`."""
    protected = protected_header(ALG_EDDSA, EVENT_CONTENT_TYPE, site_id)
    return protected, sig_structure(protected, mesh_id, payload)
