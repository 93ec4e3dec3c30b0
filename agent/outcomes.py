"""Per-event outcomes of the apply path: values with a reason code, never exceptions (§12, §13.6)."""
from __future__ import annotations

from typing import Any, NamedTuple

APPLIED, DUPLICATE, DROPPED, REJECTED, HELD = "applied", "duplicate", "dropped", "rejected", "held"
STATUSES = (APPLIED, DUPLICATE, DROPPED, REJECTED, HELD)


class Outcome(NamedTuple):
    """One event's outcome (immutable). A NamedTuple rather than a frozen dataclass: the apply path
    makes one per event, and a frozen dataclass's constructor costs several times more."""

    status: str
    reason: str
    event_id: bytes | None = None
    site_id: bytes | None = None  # the signed kid; only trustworthy when `verified`
    table: str | None = None
    hlc: tuple[int, int] | None = None
    verified: bool = False  # the signature verified, so site_id/table/hlc are authentic

    def as_json(self) -> dict:
        d = {"status": self.status, "reason": self.reason}
        if self.event_id is not None:
            d["event_id"] = self.event_id.hex()
        if self.site_id is not None and self.verified:
            d["site_id"] = self.site_id.hex()
        if self.table is not None:
            d["table"] = self.table
        if self.hlc is not None:
            d["hlc"] = f"{self.hlc[0]}.{self.hlc[1]}"
        return d


def counts(outcomes: list[Outcome]) -> dict[str, int]:
    c = {s: 0 for s in STATUSES}
    for o in outcomes:
        c[o.status] += 1
    return c


def to_json(v: Any) -> Any:
    """The JSON form used by every output (docs/cli.md, `dump`): bytes as {"$bytes": hex}."""
    if isinstance(v, (bytes, bytearray)):
        return {"$bytes": bytes(v).hex()}
    if isinstance(v, dict):
        return {k: to_json(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [to_json(x) for x in v]
    return v
