"""What the sender side of a sync link decides without I/O (the runner's own
state moving beside agent/core/session.py): how a selection is split into bodies that fit the
peer's limit, and the per-peer body limit after `too_large` refusals. Pure: time is passed in.
agent/core/exchange.py (the exchange state machine of every link) uses both."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

MIN_BODY_LIMIT = 1024  # never send a peer less than this per body (MqttLink.max_payload's floor)


def _cbor_head(n: int) -> int:
    return 1 if n < 24 else 2 if n < 256 else 3 if n < 65536 else 5 if n < 2 ** 32 else 9


def split_sizes(sizes: Sequence[int], base_size: int, limit: int, max_events: int) -> list[tuple[int, int]]:
    """Split consecutive items (their encoded sizes) into [start, end) ranges whose body stays
    within `limit` bytes and `max_events` items. A single item too large for any body still
    forms a body of its own (the caller decides whether to send it)."""
    out: list[tuple[int, int]] = []
    start, size = 0, base_size + 8  # + the events array's length head growing
    for i, s in enumerate(sizes):
        cost = s + _cbor_head(s)
        if i > start and (size + cost > limit or i - start >= max_events):
            out.append((start, i))
            start, size = i, base_size + 8
        size += cost
    if start < len(sizes):
        out.append((start, len(sizes)))
    return out


def first_body(sizes: Sequence[int], base_size: int, limit: int, max_events: int) -> int | None:
    """How many of the selected items the first body takes when they do not all fit one body
    (`split_sizes`); None when they do. The rest goes in the next body."""
    parts = split_sizes(sizes, base_size, limit, max_events)
    return parts[0][1] if len(parts) > 1 else None


@dataclass
class PeerLimit:
    """The body size this node sends one peer after `too_large` refusals.

    A refusal halves it. But an answer is not authenticated without the broker's ACLs: a client
    that reads inbox topics sees the correlation data and can answer first, so a refusal is no
    evidence that the peer cannot take bigger bodies. A reduction is therefore provisional: after
    `wait` seconds without a refusal the limit doubles (a probe), until it is back at the link's
    maximum and forgotten. A peer whose limit really is lower refuses the probe, which halves the
    limit again and doubles the wait (up to `limit_probe_max_s`): it costs one refused, re-offered
    body per wait at most. An answer `ok` to a body larger than the last reduction shows the peer
    takes that size: the wait starts again from `limit_probe_s`. A forger must keep forging to
    keep the limit down, and the limit is back within about `limit_probe_max_s` plus
    log2(maximum / MIN_BODY_LIMIT) waits of its last forgery."""
    limit: int
    probe_at: float
    wait: float
    floor_seen: int  # the lowest limit since the last probe (an ok above it is evidence)

    def refused(self, now: float, probe_max_s: float) -> None:
        self.limit = max(MIN_BODY_LIMIT, self.limit // 2)
        self.floor_seen = min(self.floor_seen, self.limit)
        self.wait = min(probe_max_s, self.wait * 2)
        self.probe_at = now + self.wait

    def answered_ok(self, size: int, probe_s: float) -> None:
        if size > self.floor_seen:
            self.wait, self.floor_seen = probe_s, self.limit

    def current(self, now: float, top: int) -> int:
        """The limit now (doubled once per `wait` elapsed since the last refusal, up to `top`)."""
        while now >= self.probe_at and self.limit < top:
            self.limit *= 2
            self.probe_at += self.wait
        return min(self.limit, top)

    def to_json(self, now: float, wall_ms: int) -> dict:
        """What the store keeps (sync_state.peer_links.limit_state): the probe time on the wall
        clock (`now` is the monotonic time, `wall_ms` the wall clock, both passed in)."""
        return {"limit": self.limit, "wait": self.wait, "floor_seen": self.floor_seen,
                "probe_at_ms": wall_ms + int((self.probe_at - now) * 1000)}

    @classmethod
    def from_json(cls, d: dict, now: float, wall_ms: int) -> "PeerLimit | None":
        """`to_json` read back (None for anything malformed: the limit is learned again)."""
        try:
            return cls(max(MIN_BODY_LIMIT, int(d["limit"])), now + (int(d["probe_at_ms"]) - wall_ms) / 1000,
                       float(d["wait"]), int(d["floor_seen"]))
        except (KeyError, TypeError, ValueError):
            return None
