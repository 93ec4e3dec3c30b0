"""SSP/1 messages (§30-§34, docs/protocol.md §0 "Messages"): strict parse, deterministic emit.

A message is a handshake or a sync body according to its member set; anything else is
rejected with a stable reason (§32.2: a malformed body never becomes an empty one)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, TypeVar

from .classify import classified
from .codec import INT64_MAX, DecodeError, decode_strict, encode, prescan
from .ids import UINT32_MAX, UINT64_MAX

SSP_VERSION = 1
HANDSHAKE_MEMBERS = frozenset({"ssp_version", "site_id", "have_max_hlc", "supports_realtime", "secure_channel", "rtt_ms"})
BODY_MEMBERS = frozenset({"ssp_version", "from_site_id", "have_max_hlc", "events", "records", "applied_watermarks"})
WATERMARK_MEMBERS = frozenset({"site_id", "table_schema", "table_name", "hlc_physical_ms", "hlc_logical"})
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class ProtocolError(ValueError):
    """A peer's message that cannot be accepted; `reason` is a stable code (never a crash)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class Watermark:
    site_id: bytes
    table: str  # "schema.table"
    hlc: tuple[int, int]


@dataclass(frozen=True)
class Handshake:
    site_id: bytes
    have_max_hlc: tuple[int, int]
    supports_realtime: bool
    secure_channel: bool | None  # None: a value we did not understand (fail closed)
    rtt_ms: int | None
    understood: bool = True  # False when some member value fell back to batch mode (§31)


@dataclass(frozen=True)
class SyncBody:
    from_site_id: bytes
    have_max_hlc: tuple[int, int]
    events: tuple[bytes, ...] | BodyEvents = ()  # BodyEvents: parsed by `parse_body_streamed`
    records: tuple[bytes, ...] = ()
    applied_watermarks: tuple[Watermark, ...] = field(default_factory=tuple)


def _uint(v: Any, limit: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= limit


def _site(v: Any, what: str) -> bytes:
    if not isinstance(v, str) or len(v) != 32 or any(c not in "0123456789abcdef" for c in v):
        raise ProtocolError("bad_site_id", f"{what} must be 32 lowercase hex characters")
    return bytes.fromhex(v)


# Integers that reach the store are bounded by what SQLite holds (signed 64-bit), not by the
# wire's uint64: an HLC of 2**63 would pass a uint64 check and crash the store.
# The strict decoder refuses such integers first (`int_out_of_range`); these checks say it again
# where the value is used. hlc_logical is a uint32 (docs/protocol.md §0 "Identifiers").
HLC_PHYSICAL_MAX = INT64_MAX


def _hlc_map(v: Any) -> tuple[int, int]:
    if not isinstance(v, dict) or set(v) != {"physical_ms", "logical"}:
        raise ProtocolError("bad_have_max_hlc", "have_max_hlc must be {physical_ms, logical}")
    if not _uint(v["physical_ms"], HLC_PHYSICAL_MAX) or not _uint(v["logical"], UINT32_MAX):
        raise ProtocolError("bad_have_max_hlc", "have_max_hlc members must be unsigned integers (physical < 2**63)")
    return (v["physical_ms"], v["logical"])


@classified(ProtocolError)
def parse_watermark(v: Any) -> Watermark:
    """The watermark boundary (§34): one decoded `applied_watermarks` member, or ProtocolError."""
    if not isinstance(v, dict) or set(v) != WATERMARK_MEMBERS:
        raise ProtocolError("bad_watermark", "a watermark must have exactly the §34 members")
    if not isinstance(v["table_schema"], str) or not isinstance(v["table_name"], str):
        raise ProtocolError("bad_watermark", "table_schema and table_name must be text")
    if not _uint(v["hlc_physical_ms"], HLC_PHYSICAL_MAX) or not _uint(v["hlc_logical"], UINT32_MAX):
        raise ProtocolError("bad_watermark", "watermark HLC members must be unsigned integers (physical < 2**63)")
    return Watermark(_site(v["site_id"], "watermark site_id"), f"{v['table_schema']}.{v['table_name']}",
                     (v["hlc_physical_ms"], v["hlc_logical"]))


@classified(ProtocolError)
def parse_message(data: bytes) -> Handshake | SyncBody:
    """The message boundary: a handshake or a sync body, or ProtocolError (and nothing else)."""
    if not isinstance(data, (bytes, bytearray)):
        raise ProtocolError("not_bytes")
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError("too_large", f"{len(data)} bytes")
    try:
        obj = decode_strict(bytes(data), deterministic=False)
    except DecodeError as e:
        raise ProtocolError("malformed_cbor", e.reason) from None
    return _message(obj)


def _message(obj: Any) -> Handshake | SyncBody:
    """The member checks of a decoded message (both parses of a body end here)."""
    if not isinstance(obj, dict):
        raise ProtocolError("not_a_map", "a message must be a CBOR map")
    if not all(type(k) is str for k in obj):
        raise ProtocolError("bad_members", "member names must be text (§30)")
    if "ssp_version" not in obj:
        raise ProtocolError("missing_ssp_version", "every message carries ssp_version (§30)")
    v = obj["ssp_version"]
    if not _uint(v, UINT64_MAX):
        raise ProtocolError("bad_ssp_version", "ssp_version must be an unsigned integer")
    if v != SSP_VERSION:
        raise ProtocolError("unknown_ssp_version", f"version {v}; this node speaks 1 (§30: fail closed)")
    keys = set(obj)
    if keys == BODY_MEMBERS:
        return _parse_body(obj)
    if keys == HANDSHAKE_MEMBERS:
        return _parse_handshake(obj)
    if keys & {"events", "records", "from_site_id", "applied_watermarks"}:
        missing = sorted(BODY_MEMBERS - keys)
        extra = sorted(keys - BODY_MEMBERS)
        raise ProtocolError("bad_members", f"sync body members: missing {missing}, unexpected {extra} (§32.2)")
    raise ProtocolError("bad_members", f"neither a handshake nor a sync body: {sorted(keys)[:8]}")


@classified(ProtocolError)
def parse_body(data: bytes) -> SyncBody:
    """The sync body boundary (§32, and a mailbox file: exactly one body): SyncBody or ProtocolError."""
    return _expect(parse_message(data), SyncBody, "not_a_body", "expected a sync body, got a handshake")


@classified(ProtocolError)
def parse_handshake(data: bytes) -> Handshake:
    """The handshake boundary (§31): Handshake or ProtocolError."""
    return _expect(parse_message(data), Handshake, "not_a_handshake", "expected a handshake, got a sync body")


class BodyEvents:
    """The `events` of a body parsed by `parse_body_streamed`: the byte strings are read from the
    body's bytes one at a time, as the apply path takes them, instead of all being decoded into a
    list first (a 16 MiB body must import in 64 MB). Iterating yields `bytes`."""

    __slots__ = ("_data", "_start", "_n")

    def __init__(self, data: bytes, start: int, n: int) -> None:
        self._data, self._start, self._n = data, start, n

    def __len__(self) -> int:
        return self._n

    def __iter__(self) -> Iterator[bytes]:
        data, i = self._data, self._start
        for _ in range(self._n):
            s, i = _bstr_span(data, i)
            yield data[s:i]

    def windows(self, max_bytes: int) -> Iterator[list[bytes]]:
        """Consecutive lists of events of at most `max_bytes` together (at least one each)."""
        out: list[bytes] = []
        size = 0
        for e in self:
            if out and size + len(e) > max_bytes:
                yield out
                out, size = [], 0
            out.append(e)
            size += len(e)
        if out:
            yield out


def _head(data: bytes, i: int) -> tuple[int, int, int]:
    """(major type, argument, index after the head) of a definite-length item head at `i`
    (only called on bytes the prescan accepted)."""
    ib = data[i]
    major, ai = ib >> 5, ib & 31
    if ai < 24:
        return major, ai, i + 1
    w = 1 << (ai - 24)
    return major, int.from_bytes(data[i + 1:i + 1 + w], "big"), i + 1 + w


def _bstr_span(data: bytes, i: int) -> tuple[int, int]:
    major, n, j = _head(data, i)
    return j, j + n


def _skip(data: bytes, i: int) -> int:
    """The index after the (prescanned, definite-length) item at `i`."""
    left = 1
    while left:
        major, arg, i = _head(data, i)
        left -= 1
        if major in (2, 3):
            i += arg
        elif major == 4:
            left += arg
        elif major == 5:
            left += 2 * arg
        elif major == 6:
            left += 1
    return i


@classified(ProtocolError)
def parse_body_streamed(data: bytes) -> SyncBody:
    """`parse_body` with the same refusals and the same bounds (the whole body is prescanned
    first, codec.prescan), whose `events` is a `BodyEvents` read from `data` as the
    import goes instead of a decoded list. The members other than `events` are small and decoded
    strictly as before. Anything but a well-formed body takes the whole-body parse, so every
    refusal and its reason stay exactly `parse_body`'s."""
    if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_MESSAGE_BYTES:
        return parse_body(data)
    data = bytes(data)
    try:
        prescan(data)
        major, n, i = _head(data, 0)
        if major != 5 or n != len(BODY_MEMBERS):
            return parse_body(data)
        obj: dict[str, Any] = {}
        for _ in range(n):
            major, ln, i = _head(data, i)
            if major != 3:
                return parse_body(data)
            key = data[i:i + ln].decode("utf-8")
            i += ln
            if key in obj:
                return parse_body(data)
            end = _skip(data, i)
            if key == "events":
                major, count, j = _head(data, i)
                if major != 4:
                    return parse_body(data)
                k = j
                for _ in range(count):
                    if data[k] >> 5 != 2:
                        return parse_body(data)   # `bad_events`, named by the whole-body parse
                    k = _bstr_span(data, k)[1]
                obj[key] = BodyEvents(data, j, count)
            else:
                obj[key] = decode_strict(data[i:end], deterministic=False)
            i = end
    except (DecodeError, ValueError, IndexError):
        return parse_body(data)   # malformed: the whole-body parse names the reason
    if set(obj) != BODY_MEMBERS:
        return parse_body(data)
    return _expect(_message(obj), SyncBody, "not_a_body", "expected a sync body, got a handshake")


_M = TypeVar("_M")


def _expect(m: object, kind: type[_M], reason: str, detail: str) -> _M:
    if not isinstance(m, kind):
        raise ProtocolError(reason, detail)
    return m


@classified(ProtocolError)
def parse_presence(payload: bytes, site: bytes) -> Handshake | None:
    """The presence boundary (a retained §31 handshake on `site`'s presence topic): None when
    the site left (an empty payload), its handshake, or ProtocolError. A handshake naming
    another site is refused (`handshake_site_mismatch`): one site cannot speak for another."""
    if not payload:
        return None
    hs = parse_handshake(payload)
    if hs.site_id != site:
        raise ProtocolError("handshake_site_mismatch", f"handshake of {hs.site_id.hex()} on {site.hex()}'s topic")
    return hs


def _parse_body(obj: dict) -> SyncBody:
    sender = _site(obj["from_site_id"], "from_site_id")
    hmax = _hlc_map(obj["have_max_hlc"])
    evs, recs, wms = obj["events"], obj["records"], obj["applied_watermarks"]
    if isinstance(evs, BodyEvents):
        pass   # every member was checked to be a byte string by `parse_body_streamed`
    elif not isinstance(evs, (list, tuple)) or not all(isinstance(e, bytes) for e in evs):
        raise ProtocolError("bad_events", "events must be an array of byte strings")
    if not isinstance(recs, (list, tuple)) or not all(isinstance(r, bytes) for r in recs):
        raise ProtocolError("bad_records", "records must be an array of byte strings")
    if not isinstance(wms, (list, tuple)):
        raise ProtocolError("bad_watermarks", "applied_watermarks must be an array")
    return SyncBody(sender, hmax, evs if isinstance(evs, BodyEvents) else tuple(evs), tuple(recs),
                    tuple(parse_watermark(w) for w in wms))


def _parse_handshake(obj: dict) -> Handshake:
    site = _site(obj["site_id"], "site_id")  # who is speaking: not a capability, stays strict
    understood = True
    try:
        hmax = _hlc_map(obj["have_max_hlc"])
    except ProtocolError:
        # §31: any unknown member value fails closed to batch mode, never a rejected session;
        # have_max_hlc is advisory and read by nothing (§14.1), so nothing is guessed.
        hmax, understood = (0, 0), False
    rt = obj["supports_realtime"]
    if not isinstance(rt, bool):
        rt, understood = False, False  # §31: unknown member value -> batch mode
    sc = obj["secure_channel"]
    if not isinstance(sc, bool):
        sc, understood = None, False
    rtt = obj["rtt_ms"]
    if rtt is not None and not _uint(rtt, INT64_MAX):
        rtt, understood = None, False
    return Handshake(site, hmax, rt, sc, rtt, understood)


def _hlc_obj(h: tuple[int, int]) -> dict:
    return {"physical_ms": h[0], "logical": h[1]}


def emit_body(b: SyncBody) -> bytes:
    return encode({
        "ssp_version": SSP_VERSION,
        "from_site_id": b.from_site_id.hex(),
        "have_max_hlc": _hlc_obj(b.have_max_hlc),
        "events": list(b.events),
        "records": list(b.records),
        "applied_watermarks": [
            {"site_id": w.site_id.hex(), "table_schema": w.table.split(".", 1)[0],
             "table_name": w.table.split(".", 1)[1], "hlc_physical_ms": w.hlc[0], "hlc_logical": w.hlc[1]}
            for w in b.applied_watermarks],
    })


def emit_handshake(h: Handshake) -> bytes:
    return encode({
        "ssp_version": SSP_VERSION,
        "site_id": h.site_id.hex(),
        "have_max_hlc": _hlc_obj(h.have_max_hlc),
        "supports_realtime": bool(h.supports_realtime),
        "secure_channel": bool(h.secure_channel),
        "rtt_ms": h.rtt_ms,
    })
