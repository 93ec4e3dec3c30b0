"""Waiting in tests without betting on the machine's speed (docs/testing.md "The rule"): a wait is
for an event, and its ceiling only catches a hang; a deadline a test sets on purpose is scaled
from a baseline measured in the same run."""
from __future__ import annotations

import os
import time
from typing import Callable, TypeVar

T = TypeVar("T")

# A ceiling that only says "hung": far above anything a loaded or small machine (a Raspberry Pi
# is several times slower than a laptop) takes for work that does finish. SSP_TEST_HANG_S
# raises it further on an even slower machine.
HANG_S = float(os.environ.get("SSP_TEST_HANG_S", "300"))


def wait_until(cond: Callable[[], T], what: str, ceiling: float = HANG_S, poll: float = 0.02) -> T:
    """Poll ``cond()`` until it returns something true, and return that; after ``ceiling``
    seconds fail with ``what`` (the event that never came: a hang, not slowness)."""
    deadline = time.monotonic() + ceiling
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what}: not within {ceiling:g} s (a hang)")
        time.sleep(poll)


def timed(fn: Callable[[], T]) -> tuple[T, float]:
    """``fn()`` and the wall time it took: a baseline to scale a deadline from."""
    t0 = time.monotonic()
    got = fn()
    return got, time.monotonic() - t0


def scaled(baseline_s: float, factor: float = 20.0, floor: float = 1.0) -> float:
    """A deadline for work like the baseline's: ``factor`` times the measured baseline, never
    below ``floor`` seconds, so a machine as slow as the baseline showed still meets it."""
    return max(floor, factor * baseline_s)
