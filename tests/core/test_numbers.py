"""The one strict reader of numbers from outside (agent/core/numbers.py, docs/protocol.md §11
"Numbers from outside"): ASCII digits only, canonical, bounded in length and value; anything
else is None, never an exception."""
from __future__ import annotations

import unicodedata

import pytest

from agent.core import numbers
from agent.core.binding import decode_indices
from agent.core.delivery import split_gaps
from agent.core.exchange import answered_progress
from agent.core.ids import IdFormatError, parse_hlc
from agent.transport.mqtt import parse_body_limit

# Every character str.isdigit() accepts besides ASCII 0-9: superscripts, circled and fullwidth
# digits, Arabic-Indic, Devanagari, ... (categories Nd and No). int() takes some, refuses others.
UNICODE_DIGITS = [chr(c) for c in range(0x80, 0x30000) if chr(c).isdigit()]


def test_the_digit_classes_are_all_there():
    cats = {unicodedata.category(c) for c in UNICODE_DIGITS}
    assert {"Nd", "No"} <= cats and "\u00b2" in UNICODE_DIGITS and "\uff11" in UNICODE_DIGITS
    assert "\u0663" in UNICODE_DIGITS and "\u2460" in UNICODE_DIGITS


@pytest.mark.parametrize("text", ["0", "7", "1234567890", str(2**63 - 1)])
def test_canonical_ascii_numbers_read(text):
    assert numbers.uint(text) == int(text) and numbers.uint(text.encode()) == int(text)


@pytest.mark.parametrize("text", ["", "01", "-1", "+1", " 1", "1 ", "1\n", "1_0", "1.0", "0x1", str(2**63),
                                  "9" * 5000, None, 1, b"\xd9\xa3", "\u00b2", "\uff11", "\u0663", "1\u00b2"])
def test_anything_else_is_no_number(text):
    assert numbers.uint(text) is None


def test_no_unicode_digit_is_a_number_anywhere():
    for c in UNICODE_DIGITS:
        for text in (c, "1" + c, c + "0"):
            assert numbers.uint(text) is None
            assert numbers.hlc(f"{text}.0") is None and numbers.hlc(f"1.{text}") is None
            assert numbers.uint_list(f"0,{text}", 10) is None
            assert parse_body_limit(text) is None
            assert decode_indices(text, 10) is None and decode_indices(f"0,{text}", 10) is None
            assert split_gaps([f"app.readings@{text}.0"]) == ({f"app.readings@{text}.0"}, {})
            assert answered_progress(5, None, text, None) == (0, None)
            with pytest.raises(IdFormatError):
                parse_hlc(f"{text}.0")


def test_bounds():
    assert numbers.uint("300", max_value=299) is None and numbers.uint("299", max_value=299) == 299
    assert numbers.uint("1234", max_digits=3) is None
    assert numbers.uint_list("0,1,2", max_items=2) is None and numbers.uint_list("", 0) == []
    assert numbers.hlc(f"{2**63 - 1}.{2**32 - 1}") == (2**63 - 1, 2**32 - 1)
    assert numbers.hlc(f"1.{2**32}") is None and numbers.hlc("1") is None and numbers.hlc("1.") is None
    assert decode_indices("0,2", 3) == [0, 2] and decode_indices("3", 3) is None and decode_indices("1,1", 3) is None
    assert split_gaps(["app.readings@5.1", "*@3.0", "app.notes"]) == (
        {"app.notes"}, {"app.readings": (5, 1), "*": (3, 0)})
    assert parse_body_limit("262144") == 262144 and parse_body_limit("12345678901") is None
