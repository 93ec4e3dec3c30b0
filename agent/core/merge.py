"""The §13 merge rules as pure functions over one row's clocks.

Returns effects; writes nothing. Stamps are (physical_ms, logical, site_id) tuples whose
lexicographic order is the §13.1 total order; None means "no clock yet" and is beaten by
every stamp.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from .events import is_scalar
from .schema import TableDef, value_fits

Stamp = tuple[int, int, bytes]


def beats(a: Stamp, b: Stamp | None) -> bool:
    return b is None or a > b


@dataclass
class RowState:
    exists: bool = False
    exist_clock: Stamp | None = None  # the highest-HLC existence event (§13.2)
    tomb_clock: Stamp | None = None  # the highest-HLC delete ever applied (§13.3)
    cells: dict[str, Stamp] = field(default_factory=dict)  # column clocks (§13.1)


@dataclass
class Effects:
    writes: dict[str, tuple[Any, Stamp]] = field(default_factory=dict)  # column -> (value, clock)
    state: RowState = field(default_factory=RowState)  # the row's clocks after the event
    resurrected: bool = False  # an upsert won existence over a delete: rebuild (§13.4)
    ignored: list[str] = field(default_factory=list)  # unknown or ill-typed payload columns


def merge_upsert(table: TableDef, row: RowState, stamp: Stamp, payload: dict[str, Any]) -> Effects:
    cells = dict(row.cells)
    tomb = row.tomb_clock
    writes: dict[str, tuple[Any, Stamp]] = {}
    ignored: list[str] = []
    types = table.value_types
    # (`value_fits` inlined: this runs for every column of every applied event)
    for col, value in payload.items():
        t = types.get(col)
        if t is None or (value is not None and (type(value) is not t or not is_scalar(value))):
            # §13.6 / docs/protocol.md §0: unknown, ill-typed or key-column entries are ignored,
            # clock untouched, and metered; the rest of the event applies.
            ignored.append(col)
            continue
        # §13.1: written only if it beats both the column clock and the tombstone clock.
        c = cells.get(col)
        if (c is None or stamp > c) and (tomb is None or stamp > tomb):
            writes[col] = (value, stamp)
            cells[col] = stamp
        # else: lost; the clock is left as it is (no-op for this column)
    # §13.2: existence by the highest-HLC existence event, independent of the columns.
    exists, exist_clock, resurrected = row.exists, row.exist_clock, False
    if exist_clock is None or stamp > exist_clock:
        resurrected = not exists and exist_clock is not None  # the previous winner was a delete
        exists, exist_clock = True, stamp
    return Effects(writes, RowState(exists, exist_clock, tomb, cells), resurrected, ignored)


def merge_delete(table: TableDef, row: RowState, stamp: Stamp) -> Effects:
    fx = Effects(state=RowState(row.exists, row.exist_clock, row.tomb_clock, dict(row.cells)))
    st = fx.state
    # §13.3 / docs/apply.md "Materialization": winning or losing, clear every value column it beats
    # (a column with no clock yet is beaten) to a null clocked at the delete.
    for col in table.value_columns:
        if beats(stamp, st.cells.get(col)):
            fx.writes[col] = (None, stamp)
            st.cells[col] = stamp
    if beats(stamp, st.tomb_clock):
        st.tomb_clock = stamp
    if beats(stamp, st.exist_clock):
        st.exists, st.exist_clock = False, stamp
    return fx


def below(hlc: tuple[int, int], horizon: tuple[int, int] | None) -> bool:
    """§3: strictly below a table's eviction horizon."""
    return horizon is not None and hlc < horizon


@dataclass
class Rebuild:
    writes: dict[str, tuple[Any, Stamp] | None]  # None: the column keeps no clock at all
    partial: bool  # §13.4: the tombstone clock lies below the horizon


def rebuild_columns(table: TableDef, columns: Iterable[str], tomb_clock: Stamp | None,
                    candidates: Iterable[tuple[Stamp, dict[str, Any]]],
                    horizon: tuple[int, int] | None) -> Rebuild:
    """§13.4 / §13.6 last paragraphs: each column from the highest-HLC retained upsert that
    carries it (with a fitting type), beats the tombstone clock and is not below the horizon.
    No candidate: the delete's clocked null (docs/apply.md "Materialization"), or no clock if never deleted."""
    cols = list(columns)
    best: dict[str, tuple[Any, Stamp]] = {}
    for stamp, payload in candidates:
        if below(stamp[:2], horizon) or not beats(stamp, tomb_clock):
            continue
        for col in cols:
            if col in payload and value_fits(table.columns[col], payload[col]):
                cur = best.get(col)
                if cur is None or stamp > cur[1]:
                    best[col] = (payload[col], stamp)
    writes: dict[str, tuple[Any, Stamp] | None] = {}
    for col in cols:
        if col in best:
            writes[col] = best[col]
        elif tomb_clock is not None:
            writes[col] = (None, tomb_clock)
        else:
            writes[col] = None
    partial = tomb_clock is not None and below(tomb_clock[:2], horizon)
    return Rebuild(writes, partial)


@dataclass
class TrustRebuild:
    state: RowState
    writes: dict[str, tuple[Any, Stamp] | None]  # re-derived columns (None: no clock any more)
    partial: list[str]  # clocks re-derived with no candidate while a horizon may hide one


def rebuild_without(table: TableDef, row: RowState, void: Callable[[Stamp], bool],
                    events: Iterable[tuple[Stamp, str, dict[str, Any] | None]],
                    horizon: tuple[int, int] | None) -> TrustRebuild:
    """Remove from one row the effects of events that no longer count (their
    signer was retired below their HLC, or its key is trusted no more), so the row equals the
    merge of the retained events that do count, whatever order events and records arrived in.

    `events`: the row's retained events (stamp, operation, payload). Every clock owned by a void
    stamp is re-derived from the events that count and are not below the horizon (§13.4's
    candidate rule): the tombstone clock from the highest delete; existence from the highest
    upsert or delete; a column from the highest upsert carrying it (fitting type) that beats the
    tombstone clock, or else the highest delete's clocked null (docs/apply.md "Materialization"). A clock owned
    by an event that counts stays: it is already the maximum over those events, and lowering the
    tombstone clock cannot unseat it. A re-derived clock found among candidates at or above the
    horizon is exact (anything evicted lies below it); one that finds no candidate while the
    table has a horizon may have had its evidence evicted, and is reported in `partial` (§13.4:
    never present a partial rebuild as complete)."""
    cands = [(s, op, p) for s, op, p in events if not void(s) and not below(s[:2], horizon)]
    st = RowState(row.exists, row.exist_clock, row.tomb_clock, dict(row.cells))
    evicting = horizon is not None
    partial: list[str] = []
    if st.tomb_clock is not None and void(st.tomb_clock):
        dels = [s for s, op, _ in cands if op == "delete"]
        st.tomb_clock = max(dels) if dels else None
        if not dels and evicting:
            partial.append("tombstone")
    if st.exist_clock is not None and void(st.exist_clock):
        best = max(((s, op) for s, op, _ in cands), default=None)
        if best is None:
            st.exists, st.exist_clock = False, None
            if evicting:
                partial.append("existence")
        else:
            st.exists, st.exist_clock = best[1] == "upsert", best[0]
    writes: dict[str, tuple[Any, Stamp] | None] = {}
    for col in table.value_columns:
        clock = st.cells.get(col)
        if clock is None or not void(clock):
            continue
        found: tuple[Any, Stamp] | None = None
        for s, op, p in cands:
            if op == "delete":
                cand = (None, s)
            elif p and col in p and value_fits(table.columns[col], p[col]) and beats(s, st.tomb_clock):
                cand = (p[col], s)
            else:
                continue
            if found is None or s > found[1]:
                found = cand
        writes[col] = found
        if found is None:
            del st.cells[col]
            if evicting:
                partial.append(col)
        else:
            st.cells[col] = found[1]
    return TrustRebuild(st, writes, partial)
