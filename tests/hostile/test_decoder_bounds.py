"""The strict decoder's bounds: refused from the item heads, before cbor2
builds anything. Each poison input here decoded (for seconds to hours, or into gigabytes)
before the prescan existed."""
from __future__ import annotations

import cbor2
import pytest

from agent.core.codec import INT64_MAX, MAX_DEPTH, DecodeError, decode_strict, prescan
from agent.core.messages import ProtocolError, parse_message

from .poison import head, shared_events_body, shared_ref, shareable, sharing_bomb


def reason(data: bytes, **kw) -> str:
    with pytest.raises(DecodeError) as e:
        decode_strict(data, **kw)
    return e.value.reason


def test_value_sharing_bomb_is_refused_before_decoding():
    # 196 bytes whose tree walk visits 8**8 nodes (seconds on the old decoder; 244 bytes: hours)
    assert reason(sharing_bomb(8, 8), deterministic=False) == "unexpected_tag"


def test_a_body_of_shared_events_is_refused():
    # 185 KB on the wire, 40 001 events of 64 KiB (2.6 GB) once decoded by the old decoder
    with pytest.raises(ProtocolError) as e:
        parse_message(shared_events_body())
    assert (e.value.reason, e.value.detail) == ("malformed_cbor", "unexpected_tag")


@pytest.mark.parametrize("data, why", [
    (shareable(b"\x01"), "unexpected_tag"),
    (shared_ref(0), "unexpected_tag"),
    (b"\x82\xd2\x80\x00", "unexpected_tag"),  # an allowed tag, but not on the outermost item
    (b"\xd2\xd2\x80", "unexpected_tag"),  # tag 18 in tag 18
    (b"\xc2\x41\x01", "unexpected_tag"),  # bignum
    (b"\x9f\x01\xff", "indefinite_length"),
    (b"\x5f\x41\x00\xff", "indefinite_length"),
    (b"\xff", "indefinite_length"),  # a lone break
    (b"\x1c", "malformed_cbor"),  # reserved additional information
    (b"\x5a\xff\xff\xff\xff", "malformed_cbor"),  # a 4 GiB string in 5 bytes
    (b"\x9b" + (2**40).to_bytes(8, "big"), "malformed_cbor"),  # 2**40 members promised by 9 bytes
    (b"\xbb" + (2**62).to_bytes(8, "big"), "malformed_cbor"),
    (b"\x82\x01", "malformed_cbor"),  # truncated
    (b"", "malformed_cbor"),
    (b"\x01\x02", "trailing_bytes"),
    (b"\x1b" + (2**63).to_bytes(8, "big"), "int_out_of_range"),
    (b"\x3b" + (2**63).to_bytes(8, "big"), "int_out_of_range"),  # -2**63 - 1
    (b"\xa1\x81\x01\x02", "bad_map_key"),
    (b"\xa1\x41\x01\x02", "bad_map_key"),
    (b"\xf7", "unexpected_type"),  # undefined
    (b"\xf8\x20", "unexpected_type"),  # simple value 32
    (b"\xf9\x7e\x00", "non_finite_float"),
    (b"\xfa\x7f\x80\x00\x00", "non_finite_float"),
    (b"\xfb\x7f\xf0\x00\x00\x00\x00\x00\x00", "non_finite_float"),
])
def test_prescan_refusals(data, why):
    assert reason(data, deterministic=False, allowed_tags=frozenset({18})) == why


def test_depth_items_and_size_bounds():
    nested = b"\x81" * MAX_DEPTH + b"\x00"
    assert decode_strict(nested) is not None
    assert reason(b"\x81" + nested) == "too_deep"
    assert reason(cbor2.dumps(list(range(20))), max_items=10) == "too_many_items"
    assert reason(bytes(100), max_bytes=99) == "too_large"


def test_extreme_legal_values_still_decode():
    assert decode_strict(cbor2.dumps(INT64_MAX)) == INT64_MAX
    assert decode_strict(cbor2.dumps(-(2**63))) == -(2**63)
    assert decode_strict(cbor2.dumps({"a": [1.5, None, True, b"x", "y"]}, canonical=True)) == {"a": [1.5, None, True, b"x", "y"]}
    # an allowed tag on the outermost item
    t = decode_strict(b"\xd2\x80", allowed_tags=frozenset({18}), deterministic=False)
    assert (t.tag, list(t.value)) == (18, [])
    prescan(head(2, 3) + b"abc")
