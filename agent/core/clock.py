"""Hybrid logical clock (§13.1 order, §13.5 no-reuse, docs/protocol.md §0).

Pure: the wall clock is always passed in as `now_ms`. Durability is expressed as a
*ceiling*: the clock never issues a physical component above `ceiling` without the
caller first persisting a higher one (see `Hlc.tick`), and on start it resumes above
the persisted ceiling, so no HLC is reissued after a restart or a wall clock jump back.
"""
from __future__ import annotations

from dataclasses import dataclass

from .ids import UINT32_MAX, UINT64_MAX

SKEW_BOUND_MS = 300_000  # §12 step 2
CEILING_WINDOW_MS = 10_000  # how far ahead one durable ceiling write lets the clock run

# A clock value with its tiebreak: (physical_ms, logical, site_id). Tuples compare
# lexicographically, which is exactly the §13.1 total order (docs/protocol.md §0 "Identifiers").
Stamp = tuple[int, int, bytes]


class ClockError(RuntimeError):
    """The clock cannot issue a value without breaking monotonicity (logical overflow)."""


@dataclass
class Hlc:
    physical_ms: int = 0
    logical: int = 0
    ceiling_ms: int = 0  # highest physical_ms durably promised not to be exceeded

    @classmethod
    def resume(cls, persisted_ceiling_ms: int, highest_seen: tuple[int, int] | None = None) -> "Hlc":
        """Start above everything possibly issued before: the durable ceiling bounds every
        physical value released by an earlier run, so resuming at (ceiling, +1) is fresh."""
        # An earlier run may have issued (ceiling, any logical): start one ms above it.
        p, l = (persisted_ceiling_ms + 1, 0) if persisted_ceiling_ms else (0, 0)
        if highest_seen is not None and highest_seen > (p, l):
            p, l = highest_seen
        # The next tick issues strictly above (p, l): logical+1 at least.
        return cls(physical_ms=p, logical=l, ceiling_ms=persisted_ceiling_ms)

    def current(self) -> tuple[int, int]:
        return (self.physical_ms, self.logical)

    def next_value(self, now_ms: int) -> tuple[int, int]:
        """The value the next tick would issue (does not change the clock)."""
        if now_ms > self.physical_ms:
            return (now_ms, 0)
        if self.logical >= UINT32_MAX:
            # Logical exhausted: move physical forward by one ms rather than wrap.
            return (self.physical_ms + 1, 0)
        return (self.physical_ms, self.logical + 1)

    def needs_ceiling(self, now_ms: int) -> int | None:
        """If the next tick would pass the durable ceiling, the new ceiling to persist first."""
        p, _ = self.next_value(now_ms)
        if p > self.ceiling_ms:
            new = p + CEILING_WINDOW_MS
            if new > UINT64_MAX:
                raise ClockError("HLC physical component would exceed uint64")
            return new
        return None

    def set_ceiling(self, ceiling_ms: int) -> None:
        if ceiling_ms < self.ceiling_ms:
            raise ClockError("the durable ceiling never moves back")
        self.ceiling_ms = ceiling_ms

    def tick(self, now_ms: int) -> tuple[int, int]:
        """Issue a new local HLC (strictly above every value issued or observed).
        The caller must have persisted `needs_ceiling(now_ms)` first; this refuses otherwise."""
        p, l = self.next_value(now_ms)
        if p > self.ceiling_ms:
            raise ClockError(f"tick to {p} would pass the durable ceiling {self.ceiling_ms}; persist a new ceiling first")
        self.physical_ms, self.logical = p, l
        return p, l

    def observe(self, remote: tuple[int, int], now_ms: int) -> None:
        """§12 step 5: merge a received HLC. Only remote values within the skew bound
        reach here (step 2), so the clock cannot be dragged arbitrarily far ahead."""
        rp, rl = remote
        if (rp, rl) > (self.physical_ms, self.logical):
            self.physical_ms, self.logical = rp, rl
        # The ceiling is enforced at tick time: an observed value above it is fine
        # (it was issued by someone else), the next tick persists a higher ceiling.


def beyond_skew(hlc_physical_ms: int, now_ms: int) -> bool:
    """§12 step 2: more than 300 000 ms in the receiver's future."""
    return hlc_physical_ms - now_ms > SKEW_BOUND_MS


def signing_time(now_ms: int, evidence_ms: int | None, trusted: bool) -> int:
    """The wall-clock reading a tick may use (docs/apply.md "Clocks without an RTC").

    A trustworthy clock is used as is. An untrustworthy one (no NTP sync yet, no override) may
    not carry the HLC beyond the node's evidence of real time (the highest wall-clock reading
    it took while the clock was trustworthy) plus the §12 step 2 skew bound: every receiver
    whose clock is right accepts such a value, so a bad boot a year ahead cannot stamp events a
    receiver rejects (`clock_skew`) until that year has passed. Only the wall-clock input is
    bounded: the tick still issues strictly above every value issued or observed (never reissue,
    never undercut). No evidence at all (a home made before the rule) leaves `now_ms` as is."""
    if trusted or evidence_ms is None:
        return now_ms
    return min(now_ms, evidence_ms + SKEW_BOUND_MS)
