"""Hybrid logical clock (§13.1 order, §13.5 no-reuse, docs/protocol.md §0).

Pure: the wall clock is always passed in as `now_ms`. Durability is expressed as a
*ceiling*: the clock never issues a physical component above `ceiling` without the
caller first persisting a higher one (see `Hlc.tick`), and on start it resumes above
the persisted ceiling, so no HLC is reissued after a restart or a wall clock jump back.
After a wrong clock it may issue inside a *gap* below values it released (`resume_in_gap`,
docs/apply.md "Clocks without an RTC"): never at or above the gap's top, so never reissued.
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
    # Issuing inside a never-issued range: below `gap_top`; `spent` bounds what this site may have
    # issued at or above it (where the clock continues once the gap is used up). None: no gap.
    gap_top: tuple[int, int] | None = None
    spent: tuple[int, int] | None = None

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

    @classmethod
    def resume_in_gap(cls, persisted_ceiling_ms: int, start: tuple[int, int], top: tuple[int, int],
                      spent: tuple[int, int]) -> "Hlc":
        """Resume inside a recorded never-issued range below `top`: `start` is at or above every
        value this site may have issued below `top` (ticks issue strictly above it), `spent` at or
        above every value it may have issued at all. A gap already used up resumes above `spent`."""
        if start >= top:
            p, l = max(start, spent)
            return cls(physical_ms=p, logical=l, ceiling_ms=persisted_ceiling_ms)
        return cls(physical_ms=start[0], logical=start[1], ceiling_ms=persisted_ceiling_ms, gap_top=top, spent=spent)

    def current(self) -> tuple[int, int]:
        return (self.physical_ms, self.logical)

    def next_value(self, now_ms: int) -> tuple[int, int]:
        """The value the next tick would issue (does not change the clock)."""
        v = _above(self.physical_ms, self.logical, now_ms)
        if self.gap_top is not None and v >= self.gap_top:
            # The gap is used up (real time, or a peer's HLC, reached its top): continue above
            # everything this site may have issued (§13.5), never inside [top, spent].
            sp = max(self.spent or (0, 0), (self.physical_ms, self.logical))
            v = _above(sp[0], sp[1], now_ms)
        return v

    def jump(self, now_ms: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
        """(below, value) when the next tick would land more than the §12 step 2 bound above
        every value this site may have issued (`below`): nothing in between was ever issued, a
        range a later recovery may issue in (docs/apply.md "Clocks without an RTC"). Else None."""
        v = self.next_value(now_ms)
        below = self.current()
        if self.gap_top is not None and v >= self.gap_top:
            below = max(below, self.spent or below)
        return (below, v) if v[0] - below[0] > SKEW_BOUND_MS else None

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
        if self.gap_top is not None and (p, l) >= self.gap_top:
            self.gap_top = None   # left the gap above `spent` (next_value)
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


def _above(physical_ms: int, logical: int, now_ms: int) -> tuple[int, int]:
    """The least value a tick may issue above (physical_ms, logical) at wall-clock `now_ms`."""
    if now_ms > physical_ms:
        return (now_ms, 0)
    if logical >= UINT32_MAX:
        # Logical exhausted: move physical forward by one ms rather than wrap.
        return (physical_ms + 1, 0)
    return (physical_ms, logical + 1)


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
