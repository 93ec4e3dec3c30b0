"""When a node's sends are due and how one offer to a peer goes (§32, §33), pure: the batch
cycle, the realtime push or flush (`Schedule`), and the bodies of one offer (`OfferPlan`). The
exchange (agent/core/exchange.py) plans offers with them; its config is read live."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class Cadences(Protocol):
    """What the schedule reads of the exchange's config (`exchange.ExchangeConfig`)."""
    cadence_s: float
    realtime: bool
    coalesce_s: float
    flush_cadence_s: float | None


class Schedule:
    """When the loop's sends are due: the batch cycle every `cadence_s` while connected (§32), and
    realtime (§33) either a push `coalesce_s` after the node produced events (what is produced
    meanwhile travels in the same push, §33.2) or a flush every `flush_cadence_s` (§33.3)."""

    def __init__(self, cfg: Cadences, local_top: int = 0) -> None:
        self.cfg = cfg
        self.next_batch = 0.0
        self.next_flush = 0.0
        self.produced_at: float | None = None
        self.last_local = local_top  # writes up to here are the batch cycle's

    def batch_due(self, now: float, connected: bool) -> bool:
        if now >= self.next_batch and connected:
            self.next_batch = now + self.cfg.cadence_s
            return True
        return False

    def produced(self, now: float) -> None:
        """The node produced events (an in-process writer says so)."""
        if self.produced_at is None:
            self.produced_at = now

    def realtime_due(self, now: float, local_top: int) -> str | None:
        """"flush" (a fixed-cadence body to every realtime peer, even empty), "push" (what was
        produced, coalesced) or None. `local_top`: the seq of the node's newest own write."""
        if not self.cfg.realtime:
            return None
        if self.cfg.flush_cadence_s:
            if now >= self.next_flush:
                self.next_flush = now + self.cfg.flush_cadence_s
                return "flush"
            return None
        if local_top > self.last_local and self.produced_at is None:
            self.produced_at = now
        if self.produced_at is not None and now - self.produced_at >= self.cfg.coalesce_s:
            self.produced_at = None
            self.last_local = max(self.last_local, local_top)
            return "push"
        return None


@dataclass
class OfferPlan:
    """One offer to one peer (`Exchange.plan_offer`): where the bodies start, how many may go,
    the records budget per body, and whether one goes even with nothing new. The caller selects
    each body (agent/sync.py) and asks `worth_sending`; `sent` moves the start."""
    peer: bytes
    kind: str
    start: int
    bodies: int
    limit: int  # bytes per body for this peer now
    record_budget: int
    force: bool

    def worth_sending(self, end: int, backfill: bool) -> bool:
        """A selection ending at `end` goes out if it reaches past the start (even with nothing for
        the peer: an empty body, so the cursor moves only on an answer), carries backfill rows (or
        the walk's end), or is forced (records the peer lacks; the fixed-cadence flush). Forcing
        sends one body."""
        if end <= self.start and not backfill and not self.force:
            return False
        self.force = False
        return True

    def sent(self, end: int) -> None:
        self.start = end
