"""Deterministic CBOR against material we did not write: the CBOR WG's deterministic-encoding
table (tests/vectors/cbor-cde) and RFC 8949 Appendix A, typed from the RFC.

Every integer and float of the table encodes byte for byte as listed, and decodes to its value or is
refused with the profile's reason; every "bad" row is refused. Every Appendix A item decodes to its
value (and re-encodes to the same bytes) or is refused with the reason pinned here: the SSP/1 profile
(docs/protocol.md "Deterministic CBOR") takes integers in the signed 64-bit range, finite floats,
definite lengths, and no tags or simple values beyond false, true and null."""
from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import NamedTuple

import pytest

from agent.core.codec import DecodeError, decode_strict, encode

TABLE = Path(__file__).resolve().parents[1] / "vectors" / "cbor-cde" / "example-table-input.csv"


class R(NamedTuple):
    """Refused by the strict decoder with this reason."""
    reason: str


# Reasons the profile gives for values the table lists but SSP/1 does not carry.
PROFILE_REFUSALS = {"int_out_of_range", "unexpected_tag", "non_finite_float"}

APPENDIX_A = [
    # (diagnostic notation, encoding, decoded value or refusal): RFC 8949 Appendix A, Table 6
    ('0', "00", 0),
    ('1', "01", 1),
    ('10', "0a", 10),
    ('23', "17", 23),
    ('24', "1818", 24),
    ('25', "1819", 25),
    ('100', "1864", 100),
    ('1000', "1903e8", 1000),
    ('1000000', "1a000f4240", 1000000),
    ('1000000000000', "1b000000e8d4a51000", 1000000000000),
    ('18446744073709551615', "1bffffffffffffffff", R("int_out_of_range")),
    ('18446744073709551616', "c249010000000000000000", R("unexpected_tag")),
    ('-18446744073709551616', "3bffffffffffffffff", R("int_out_of_range")),
    ('-18446744073709551617', "c349010000000000000000", R("unexpected_tag")),
    ('-1', "20", -1),
    ('-10', "29", -10),
    ('-100', "3863", -100),
    ('-1000', "3903e7", -1000),
    ('0.0', "f90000", 0.0),
    ('-0.0', "f98000", -0.0),
    ('1.0', "f93c00", 1.0),
    ('1.1', "fb3ff199999999999a", 1.1),
    ('1.5', "f93e00", 1.5),
    ('65504.0', "f97bff", 65504.0),
    ('100000.0', "fa47c35000", 100000.0),
    ('3.4028234663852886e+38', "fa7f7fffff", 3.4028234663852886e+38),
    ('1.0e+300', "fb7e37e43c8800759c", 1e+300),
    ('5.960464477539063e-8', "f90001", 5.960464477539063e-08),
    ('0.00006103515625', "f90400", 6.103515625e-05),
    ('-4.0', "f9c400", -4.0),
    ('-4.1', "fbc010666666666666", -4.1),
    ('Infinity', "f97c00", R("non_finite_float")),
    ('NaN', "f97e00", R("non_finite_float")),
    ('-Infinity', "f9fc00", R("non_finite_float")),
    ('Infinity', "fa7f800000", R("non_finite_float")),
    ('NaN', "fa7fc00000", R("non_finite_float")),
    ('-Infinity', "faff800000", R("non_finite_float")),
    ('Infinity', "fb7ff0000000000000", R("non_finite_float")),
    ('NaN', "fb7ff8000000000000", R("non_finite_float")),
    ('-Infinity', "fbfff0000000000000", R("non_finite_float")),
    ('false', "f4", False),
    ('true', "f5", True),
    ('null', "f6", None),
    ('undefined', "f7", R("unexpected_type")),
    ('simple(16)', "f0", R("unexpected_type")),
    ('simple(255)', "f8ff", R("unexpected_type")),
    ('0("2013-03-21T20:04:00Z")', "c074323031332d30332d32315432303a30343a30305a", R("unexpected_tag")),
    ('1(1363896240)', "c11a514b67b0", R("unexpected_tag")),
    ('1(1363896240.5)', "c1fb41d452d9ec200000", R("unexpected_tag")),
    ("23(h'01020304')", "d74401020304", R("unexpected_tag")),
    ("24(h'6449455446')", "d818456449455446", R("unexpected_tag")),
    ('32("http://www.example.com")', "d82076687474703a2f2f7777772e6578616d706c652e636f6d", R("unexpected_tag")),
    ("h''", "40", b''),
    ("h'01020304'", "4401020304", b'\x01\x02\x03\x04'),
    ('""', "60", ''),
    ('"a"', "6161", 'a'),
    ('"IETF"', "6449455446", 'IETF'),
    ('"\\"\\\\"', "62225c", '"\\'),
    ('"\\u00fc"', "62c3bc", 'ü'),
    ('"\\u6c34"', "63e6b0b4", '水'),
    ('"\\ud800\\udd51"', "64f0908591", '𐅑'),
    ('[]', "80", []),
    ('[1, 2, 3]', "83010203", [1, 2, 3]),
    ('[1, [2, 3], [4, 5]]', "8301820203820405", [1, [2, 3], [4, 5]]),
    ('[1, 2, ..., 25]', "98190102030405060708090a0b0c0d0e0f101112131415161718181819", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25]),
    ('{}', "a0", {}),
    ('{1: 2, 3: 4}', "a201020304", {1: 2, 3: 4}),
    ('{"a": 1, "b": [2, 3]}', "a26161016162820203", {'a': 1, 'b': [2, 3]}),
    ('["a", {"b": "c"}]', "826161a161626163", ['a', {'b': 'c'}]),
    ('{"a": "A", "b": "B", "c": "C", "d": "D", "e": "E"}', "a56161614161626142616361436164614461656145", {'a': 'A', 'b': 'B', 'c': 'C', 'd': 'D', 'e': 'E'}),
    ("(_ h'0102', h'030405')", "5f42010243030405ff", R("indefinite_length")),
    ('(_ "strea", "ming")', "7f657374726561646d696e67ff", R("indefinite_length")),
    ('[_ ]', "9fff", R("indefinite_length")),
    ('[_ 1, [2, 3], [_ 4, 5]]', "9f018202039f0405ffff", R("indefinite_length")),
    ('[_ 1, [2, 3], [4, 5]]', "9f01820203820405ff", R("indefinite_length")),
    ('[1, [2, 3], [_ 4, 5]]', "83018202039f0405ff", R("indefinite_length")),
    ('[1, [_ 2, 3], [4, 5]]', "83019f0203ff820405", R("indefinite_length")),
    ('[_ 1, 2, ..., 25]', "9f0102030405060708090a0b0c0d0e0f101112131415161718181819ff", R("indefinite_length")),
    ('{_ "a": 1, "b": [_ 2, 3]}', "bf61610161629f0203ffff", R("indefinite_length")),
    ('["a", {_ "b": "c"}]', "826161bf61626163ff", R("indefinite_length")),
    ('{_ "Fun": true, "Amt": -2}', "bf6346756ef563416d7421ff", R("indefinite_length")),
]


def _rows(kind: str):
    with TABLE.open(newline="") as f:
        for i, (k, value, hexa, comment) in enumerate(csv.reader(f)):
            if k == kind:
                yield pytest.param(value, bytes.fromhex(hexa), id=f"{i}-{comment[:40]}")


@pytest.mark.parametrize("value,data", list(_rows("int")))
def test_cde_integer(value, data):
    assert encode(int(value)) == data
    try:
        assert decode_strict(data) == int(value)
    except DecodeError as e:
        # beyond the signed 64-bit range (or a bignum tag): refused by profile
        assert e.reason in PROFILE_REFUSALS and not -(2**63) <= int(value) < 2**63, e.reason


@pytest.mark.parametrize("value,data", list(_rows("flt")))
def test_cde_float(value, data):
    v = float(value)
    if data == bytes.fromhex("f97e01"):
        # a NaN with a payload: Python's float carries none, so ours encodes the one quiet NaN; the
        # decoder refuses every NaN (below), so no payload can cross the profile either way
        assert encode(v) == bytes.fromhex("f97e00")
    else:
        assert encode(v) == data
    try:
        got = decode_strict(data)
    except DecodeError as e:
        assert e.reason == "non_finite_float" and not math.isfinite(v)
        return
    assert got == v and math.copysign(1, got) == math.copysign(1, v)


@pytest.mark.parametrize("value,data", list(_rows("bad")))
def test_cde_bad_encoding_refused(value, data):
    with pytest.raises(DecodeError):
        decode_strict(data)


@pytest.mark.parametrize("diag,hexa,expected", APPENDIX_A, ids=[f"{i}-{d[:24]}" for i, (d, _, _) in enumerate(APPENDIX_A)])
def test_rfc8949_appendix_a(diag, hexa, expected):
    data = bytes.fromhex(hexa)
    if isinstance(expected, R):
        with pytest.raises(DecodeError) as refused:
            decode_strict(data)
        assert refused.value.reason == expected.reason
        return
    got = decode_strict(data)
    assert got == expected and type(got) is type(expected)
    assert encode(got) == data      # Appendix A's accepted items are all in preferred form
