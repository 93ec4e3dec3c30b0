"""`events.decoded_event` reads the payloads conforming signers produce without the generic strict
decoder (it is on every received event); whatever the bytes, it must answer exactly what the
generic path (docs/protocol.md §0: prescan, decode, re-encode, shape check) answers: the same
event, or the same refusal reason, and the row address `text_map(row_key)`."""
from hypothesis import given, settings, strategies as st

from agent.core import cose, events as ev
from agent.core.codec import INT64_MAX, DecodeError, decode_strict, encode

from .test_events_encoding import hlcs, keys, scalars

RAW = b"\xd2\x84"   # never parsed: the event's bytes only name it


def generic(payload: bytes):
    try:
        obj = decode_strict(payload, shape_checked=True)
    except DecodeError as e:
        return e.reason
    reason = ev.check_payload_shape(obj)
    if reason:
        return reason
    return (obj["table_schema"], obj["table_name"], dict(obj["row_key"]), obj["operation"],
            None if obj["payload"] is None else dict(obj["payload"]), (obj["hlc_physical_ms"], obj["hlc_logical"]))


def decoded(payload: bytes):
    s1 = cose.Sign1(b"", cose.ALG_EDDSA, ev.EVENT_CONTENT_TYPE, b"k" * 16, payload, b"")
    try:
        e, rk = ev.decoded_event(RAW, s1, b"id")
    except DecodeError as err:
        return err.reason
    assert rk == ev.text_map(e.row_key)
    assert (e.event_id, e.raw, e.site_id) == (b"id", RAW, b"k" * 16)
    return e.table_schema, e.table_name, e.row_key, e.operation, e.payload, e.hlc


def same(payload: bytes) -> None:
    a, b = decoded(payload), generic(payload)
    assert a == b
    if not isinstance(a, str):   # equal values of equal types (1 == 1.0 == True in Python)
        assert repr(a) == repr(b)


objects = st.fixed_dictionaries({
    "table_schema": st.one_of(keys, st.just("")), "table_name": keys,
    "row_key": st.dictionaries(keys, st.one_of(scalars, st.none()), max_size=3),
    "operation": st.sampled_from(["upsert", "delete", "purge"]),
    "payload": st.one_of(st.none(), st.dictionaries(keys, st.one_of(st.none(), scalars, st.booleans()), max_size=8)),
    "hlc_physical_ms": st.one_of(hlcs.map(lambda h: h[0]), st.just(-1)),
    "hlc_logical": st.one_of(hlcs.map(lambda h: h[1]), st.just(2**32))})


@settings(max_examples=500, deadline=None)
@given(obj=objects)
def test_any_payload_map_decodes_as_the_generic_path_does(obj):
    same(encode(obj))


@settings(max_examples=500, deadline=None)
@given(obj=objects, at=st.integers(0, 10_000), byte=st.integers(0, 255), cut=st.booleans())
def test_altered_bytes_decode_as_the_generic_path_does(obj, at, byte, cut):
    data = bytearray(encode(obj))
    at %= len(data)
    if cut:
        del data[at:]
    else:
        data[at] = byte
    same(bytes(data))


def test_non_shortest_forms_and_edge_values():
    good = ev.payload_bytes("s", "t", {"k": 1}, "upsert", {"v": 1.5, "w": None, "x": b"\x00", "y": -3}, (5, 0))
    same(good)
    same(good + b"\x00")                                              # trailing byte
    same(good.replace(b"\x61k\x01", b"\x61k\x18\x01"))               # a non-shortest integer
    same(good.replace(b"\xf9\x3e\x00", b"\xfb\x3f\xf8" + bytes(6)))  # a double that fits a half
    same(good.replace(b"\xf9\x3e\x00", b"\xf9\x7c\x00"))             # an infinity
    same(good.replace(b"\xf9\x3e\x00", b"\xf5"))                     # true
    same(good.replace(b"\x61k\x01", b"\x61k\x1b" + (INT64_MAX + 1).to_bytes(8, "big")))
    same(good.replace(b"\x61k\x01", b"\x61k\xc1\x01"))               # a tag
    same(good.replace(b"\x61x\x41\x00", b"\x61x\x5f\x41\x00\xff"))   # an indefinite byte string
    same(good.replace(b"\x61x", b"\x62\xff\xfe"))                    # invalid UTF-8 key
    same(good.replace(b"\x61v", b"\x61z"))                            # keys out of order
    same(good.replace(b"\x61w", b"\x61v"))                            # a key twice
    same(good.replace(b"\x61x\x41", b"\x61x\x58\x01"))                # a non-shortest length
    same(good.replace(b"\x61v", b"\x78\x01v"))                        # a non-shortest text head
    same(good.replace(b"\xa4\x61v", b"\xb8\x04\x61v"))                # a non-shortest map head
    same(good.replace(b"\xf9\x3e\x00", b"\xfa\x3f\xc0\x00\x00"))       # a single that fits a half
    same(good.replace(b"\xf9\x3e\x00", b"\xf9\x80\x00"))              # -0.0
    same(good.replace(b"\x61k\x01", b"\x61k\x3b" + (2**63 - 1).to_bytes(8, "big")))   # INT64_MIN
    long_keys = {"k" * n: n for n in (1, 23, 24, 30, 300)}
    same(ev.payload_bytes("s", "t", {"k": 1}, "upsert", long_keys, (2**40, 70000)))
