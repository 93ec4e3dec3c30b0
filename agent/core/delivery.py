"""Delivery arithmetic (§14, §32, §34, docs/protocol.md §2-§3): cursor selection, cursor advance,
stream continuity and applied-watermark inference. Pure functions over values; the store and
the driver (agent/sync.py) feed them rows and persist what they return.

Positions are the sender's local append order (`events.seq`). A cursor value c means "every
event with seq <= c has been dealt with for this peer on this path": selection takes seq > c,
which is the inclusive bound of §32 on the append order, so an old event relayed late gets a
new, higher seq and is still offered (docs/protocol.md §2, late relays).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from . import numbers, reasons

APPLIED, DUPLICATE, DROPPED, REJECTED, HELD = "applied", "duplicate", "dropped", "rejected", "held"
# Drops whose HLC is not authentic data (or whose signer's later history is void): they never
# set a watermark value, and they never block one either (§13.6 signature row).
UNVERIFIED_DROPS = frozenset({reasons.RETIRED_SIGNER})

Group = tuple[bytes, str]  # (site_id, "schema.table")
Hlc = tuple[int, int]


@dataclass(frozen=True)
class LogRow:
    seq: int
    site_id: bytes
    table: str
    hlc: Hlc
    raw: bytes
    origin: str = ""  # who delivered it here ("peer:<hex>" when an authenticated peer did)


def origin_tag(peer: bytes) -> str:
    return "peer:" + peer.hex()


@dataclass
class Selection:
    events: list[bytes] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)  # local seq of each selected event
    end: int = 0  # last seq examined (the cursor value once everything is processed)
    gaps: set[str] = field(default_factory=set)  # tables whose *own* events were withheld by policy
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> count (self_echo, policy, watermark)
    gap_at: dict[str, int] = field(default_factory=dict)  # policy-gap table -> first seq withheld

    def prefix(self, n: int) -> "Selection":
        """The selection `select` makes of the same rows with `limit` n (1 <= n < the events): its
        first n events, `end` at the last of them, the policy gaps withheld before it (`skipped`
        stays the whole examination's)."""
        end = self.seqs[n - 1]
        gaps = {g for g in self.gaps if self.gap_at.get(g, -1) <= end}
        return Selection(self.events[:n], self.seqs[:n], end, gaps, dict(self.skipped),
                         {q: s for q, s in self.gap_at.items() if s <= end})


def select(rows: Iterable[LogRow], start: int, peer: bytes, self_site: bytes, allowed: Callable[[str], bool],
           peer_watermarks: dict[Group, Hlc], limit: int, counts: Callable[[LogRow], bool] | None = None
           ) -> Selection:
    """Choose what to offer `peer` from log rows with seq > start, in seq order, at most `limit`.

    - never the peer's own events (§32.1: self-echo is pointless to send and dropped anyway);
    - never what that same peer delivered to us over an authenticated link (it selected them
      from its own log, so it holds them: sending them back only doubles the traffic);
    - never what policy denies for that peer *now* (scope §1.2, checked at selection time);
    - may skip what the peer's reported watermark covers (§14.2; a lie only hurts the liar);
    - never what no longer counts here (`counts`: a retained event whose signer this node now
      trusts less, docs/protocol.md §5 Trust), so a peer holding the same records does not reject it.
    `end` is the last seq examined, so filtered rows are not examined again."""
    sel = Selection(end=start)
    from_peer = origin_tag(peer)
    for r in rows:
        if r.seq <= start:
            continue
        if len(sel.events) >= limit:
            break
        sel.end = r.seq
        if r.site_id == peer:
            sel.skipped[reasons.SELF_ECHO] = sel.skipped.get(reasons.SELF_ECHO, 0) + 1
            continue
        if counts is not None and not counts(r):
            sel.skipped["void"] = sel.skipped.get("void", 0) + 1
            continue
        if r.origin == from_peer:
            sel.skipped["from_peer"] = sel.skipped.get("from_peer", 0) + 1
            continue
        if not allowed(r.table):
            sel.skipped["policy"] = sel.skipped.get("policy", 0) + 1
            if r.site_id == self_site:
                sel.gaps.add(r.table)
                sel.gap_at.setdefault(r.table, r.seq)
            continue
        wm = peer_watermarks.get((r.site_id, r.table))
        if wm is not None and r.hlc <= wm:
            sel.skipped["watermark"] = sel.skipped.get("watermark", 0) + 1
            continue
        sel.events.append(r.raw)
        sel.seqs.append(r.seq)
    return sel


def floor_entry(table: str, hlc: Hlc) -> str:
    """A sender's own-history floor as an entry of the meta's gap list (`TABLE@P.L`, `*@P.L` for
    every table): "my own events of TABLE up to this HLC may be missing from my log"."""
    return f"{table}@{hlc[0]}.{hlc[1]}"


def split_gaps(entries: Iterable[str]) -> tuple[set[str], dict[str, Hlc]]:
    """The meta's gap list as (tables withheld by policy, own-history floors). An entry that
    looks like a floor but does not parse is kept as a policy gap: it can only stop inference."""
    gaps: set[str] = set()
    floors: dict[str, Hlc] = {}
    for g in entries:
        table, _at, text = g.rpartition("@")
        h = numbers.hlc(text) if table else None   # the one strict reader: `@².0` is no floor
        if h is not None:
            floors[table] = max(floors.get(table, h), h)
        else:
            gaps.add(g)
    return gaps, floors


def unmet_floors(sender: bytes, floors: dict[str, Hlc], current: dict[Group, Hlc], tables: set[str]) -> set[str]:
    """Tables of `sender`'s stream across which nothing may be inferred now: the sender no longer
    holds its own events up to the floor, so a continuous stream from it shows nothing about
    them; only a receiver whose watermark already covers the floor got them all (§14.2)."""
    out = set()
    for q in set(floors) - {"*"} | (tables if "*" in floors else set()):
        f = max(floors.get(q, (0, 0)), floors.get("*", (0, 0)))
        w = current.get((sender, q))
        if w is None or w < f:
            out.add(q)
    return out


def cursor_after(start: int, seqs: list[int], end: int, processed: int) -> int:
    """The cursor once the peer processed the first `processed` events to a final state (it
    stops before the first rejected one, which is re-offered next cycle)."""
    if processed >= len(seqs):
        return end
    return max(start, seqs[processed] - 1)


@dataclass(frozen=True)
class AnswerMoves:
    """What a peer's answer to one body moves (`answer_moves`), for the store to apply."""
    live: int  # the live cursor the answer proves (moved only past where it is, and only contiguously)
    new_reoffers: tuple[int, ...]  # live events it rejected: re-offered later (§13.6)
    reoffers_done: tuple[int, ...]  # re-offered events that reached a final state
    reoffers_again: tuple[int, ...]  # re-offered events rejected again: later, less often
    rescans_done: bool  # the re-offer walk moves on
    backfill: tuple[tuple[int, int, int, bool], ...]  # per backfill part: (whole rows, their events, last row index, job done)


def answer_moves(start: int, seqs: list[int] | tuple[int, ...], end: int, reoffer_seqs: tuple[int, ...],
                 bf_counts: list[tuple[tuple[int, ...], bool]], processed: int,
                 rejected: list[int] | None) -> AnswerMoves:
    """Which movement an answer proves (§14.1), the same whatever the link (the in-memory and
    serial sessions through `SyncDriver.confirm`, MQTT through `PortAdapter.advance`). A body is
    its live events `seqs` (a range start..end), then re-offered events, then backfill parts
    (`bf_counts`: each part's events per row and whether the walk reached the table's end).
    `processed`: events it processed to a final state before the first rejected one.
    `rejected` (peers that report it): the indices of every event it rejected; then everything
    else counts as processed, the live cursor moves past the rejected events and they are
    re-offered (one rejected event cannot pin the stream behind it). Backfill
    rows commit whole only, up to the first one not fully processed."""
    n_live, n_ro = len(seqs), len(reoffer_seqs)
    total = n_live + n_ro + sum(sum(c) for c, _done in bf_counts)
    if rejected is None:
        rej = set(range(min(processed, total), total))  # all after the prefix: not known
        live_to, new_reoffers = min(processed, n_live), []
    else:
        rej = {i for i in rejected if 0 <= i < total}
        live_to, new_reoffers = n_live, [seqs[i] for i in sorted(rej) if i < n_live]
    live = cursor_after(start, list(seqs), end, live_to)
    ro_rej = [seq for i, seq in enumerate(reoffer_seqs) if n_live + i in rej]
    ro_done = [s for s in reoffer_seqs if s not in ro_rej]
    if rejected is None:
        left = processed - n_live - n_ro  # negative: the prefix ended before the backfill
    else:
        left = min((i for i in rej if i >= n_live + n_ro), default=total) - n_live - n_ro
    bf = []
    for counts, done in bf_counts:
        if left < 0:
            break
        last, nrows, nev, whole = -1, 0, 0, True
        for i, c in enumerate(counts):
            if c > left:
                whole = False
                break
            left -= c
            last, nrows, nev = i, nrows + 1, nev + c
        bf.append((nrows, nev, last, whole and done))
        if not whole:
            break
    return AnswerMoves(live, tuple(new_reoffers), tuple(ro_done), tuple(ro_rej if rejected is not None else ()),
                       rejected is not None or not ro_rej, tuple(bf))


def continues(start: int, completed: int | None) -> bool:
    """A body continues the stream a receiver has completed from that sender on that path."""
    return completed is not None and start <= completed


def completed_after(start: int, end: int, seqs: list[int], processed: int) -> int:
    """How far the sender's stream is complete at the receiver after this body."""
    return cursor_after(start, seqs, end, processed)


@dataclass(frozen=True)
class Processed:
    """One event's outcome as the watermark arithmetic needs it."""

    status: str
    reason: str
    site_id: bytes | None
    table: str | None
    hlc: Hlc | None
    verified: bool


def first_rejected(outcomes: list[Processed]) -> int:
    """How many events reached a final state before the first rejected one."""
    for i, o in enumerate(outcomes):
        if o.status == REJECTED:
            return i
    return len(outcomes)


def infer_watermarks(sender: bytes, outcomes: list[Processed], current: dict[Group, Hlc],
                     held_min: dict[Group, Hlc], gapped: set[str] | frozenset[str]) -> dict[Group, Hlc]:
    """Watermark advances demonstrated by one body from `sender` (§14.2, §13.6).

    Call only for a body sent by `sender` itself over a live session (a batch body or a realtime
    push: the same rules, §33) whose frame shows it continues the stream (`continues`). Per group (sender, table), in body order: advance over
    events whose outcome is final (applied, duplicate, dropped after verification); stop at the
    first held or rejected one, at any event at/above a still-held event of the group, and at any
    event not above the previous one (a site's own stream is HLC-ordered; anything else is not
    demonstrable). Events that failed verification neither set a value nor block. Tables the
    sender withheld some of its own events from (`gapped`) are never inferred. Returns only
    strict increases (monotonic)."""
    blocked: set[Group] = set()
    last: dict[Group, Hlc] = {}
    best: dict[Group, Hlc] = {}
    for o in outcomes:
        if not o.verified or o.site_id != sender or o.table is None or o.hlc is None:
            continue  # forged or foreign: not this stream's data, no block either
        if o.status == DROPPED and o.reason in UNVERIFIED_DROPS:
            continue
        g = (sender, o.table)
        if g in blocked or o.table in gapped:
            continue
        if o.status in (HELD, REJECTED):
            blocked.add(g)
            continue
        hm = held_min.get(g)
        if hm is not None and o.hlc >= hm:
            blocked.add(g)
            continue
        prev = last.get(g)
        if prev is not None and o.hlc <= prev:
            blocked.add(g)
            continue
        last[g] = o.hlc
        best[g] = o.hlc
    return {g: h for g, h in best.items() if current.get(g) is None or h > current[g]}
