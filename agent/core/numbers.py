"""The one reader of a number written as text by someone else (docs/protocol.md §11 "Numbers
from outside"): MQTT user properties (`ssp-body-limit`, `ssp-processed`, `ssp-rejected-at`),
the floors in a frame meta's gap list, HLC text, a request's epoch.

Python's `int()` takes far more than a decimal number: every Unicode `Nd` digit (Arabic-Indic,
fullwidth, ...), signs, surrounding whitespace and underscores, and `str.isdigit()` says yes to
digits `int()` then refuses (`²`, `①`: category `No`), so a check by `isdigit` followed by
`int()` raised on a superscript. Here a number is ASCII `0`-`9` only, canonical (no leading
zero), at most `max_digits` long and at most `max_value`: anything else is no number (None),
never an exception, whatever the input's type.
"""
from __future__ import annotations

from typing import Any

from .codec import INT64_MAX   # what SQLite holds (docs/protocol.md §11 "Integer range")

UINT32_MAX = 2**32 - 1
_ASCII_DIGITS = frozenset("0123456789")


def uint(text: Any, max_value: int = INT64_MAX, max_digits: int | None = None) -> int | None:
    """`text` (str, or ASCII bytes) as an unsigned decimal integer of at most `max_digits`
    digits (default: as many as `max_value` has) and at most `max_value`; None for anything else."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("ascii")
        except UnicodeDecodeError:
            return None
    if not isinstance(text, str):
        return None
    limit = len(str(max_value)) if max_digits is None else max_digits
    if not 0 < len(text) <= limit or not _ASCII_DIGITS.issuperset(text):
        return None
    if len(text) > 1 and text[0] == "0":
        return None      # one spelling per number: what this implementation sends
    n = int(text)        # safe: ASCII digits, bounded length
    return n if n <= max_value else None


def uint_list(text: Any, max_items: int, max_value: int = INT64_MAX, sep: str = ",") -> list[int] | None:
    """`sep`-separated `uint`s, at most `max_items` of them ("" is the empty list); None when
    any is not a number."""
    if not isinstance(text, str):
        return None
    if text == "":
        return []
    if text.count(sep) >= max_items:
        return None
    out = [uint(p, max_value) for p in text.split(sep)]
    return None if any(v is None for v in out) else out  # type: ignore[return-value]


def hlc(text: Any) -> tuple[int, int] | None:
    """`PHYSICAL.LOGICAL` (physical below 2^63, logical uint32) as a pair; None otherwise."""
    if not isinstance(text, str):
        return None
    p, dot, l = text.partition(".")
    pv, lv = uint(p, INT64_MAX), uint(l, UINT32_MAX)
    return (pv, lv) if dot and pv is not None and lv is not None else None


__all__ = ["INT64_MAX", "UINT32_MAX", "uint", "uint_list", "hlc"]
