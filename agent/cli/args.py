"""argparse types for the numbers every `ssp-agent` verb takes: out of range is a usage error
(exit 2, one line), never an OverflowError deep in a query or a socket call, nor a wait for ever."""
from __future__ import annotations

import argparse

MAX_SECONDS = 10 ** 7      # ~115 days: longer than any wait or cadence a field device uses


def count_arg(text: str) -> int:
    """An argparse type: a whole number 0..2^63-1 (what SQLite's integers hold); anything else
    is a usage error (exit 2), never an OverflowError deep in a query."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if not 0 <= n < 2 ** 63:
        raise argparse.ArgumentTypeError(f"{text} is out of range (0..{2 ** 63 - 1})")
    return n


def seconds_arg(text: str) -> float:
    """An argparse type: seconds, a finite number 0..MAX_SECONDS (a timeout of 1e400 overflowed
    the C time_t deep in the socket layer; nan waited for ever)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 <= v <= MAX_SECONDS:        # also false for nan
        raise argparse.ArgumentTypeError(f"{text} seconds is out of range (0..{MAX_SECONDS})")
    return v


def interval_arg(text: str) -> float:
    """An argparse type: a cadence or interval in seconds, above 0 (0 would spin) and finite."""
    v = seconds_arg(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{text} seconds: an interval must be above 0")
    return v


def positive_int_arg(text: str) -> int:
    """An argparse type: a whole number 1..2^31-1 (a line rate, a count that must be there)."""
    n = count_arg(text)
    if not 0 < n < 2 ** 31:
        raise argparse.ArgumentTypeError(f"{text} is out of range (1..{2 ** 31 - 1})")
    return n
