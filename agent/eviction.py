"""Eviction (scope §3): horizons raised (only ever raised; rehydration alone resets them), the
retained events below them deleted in batches that fit the space the home reserves, the freed
pages returned, and the disk budget watched. It never emits an event and never removes a
materialized row; it needs a trustworthy clock (agent/nodeclock.py). Functions over the node's
state (agent/nodestate.py)."""
from __future__ import annotations

import json
import logging

from . import nodeclock, produce
from .clockstate import now_ms
from .errors import NodeError
from .home import STORE_FILE
from .store import db, eventlog, reports, rows as rowstore, sync_state

log = logging.getLogger("ssp_agent")

# Events one eviction transaction deletes: its WAL (about a page per event it touches) must fit in
# the space the home reserves (db.RESERVE_BYTES) whatever the store's size.
EVICT_BATCH = 1000


def raise_horizon(st, table: str, horizon: tuple[int, int], now: int | None = None) -> None:
    """§3: horizons are monotonic; only rehydration lowers one (to zero). A horizon above
    both the wall clock and the HLC is refused: every later local write would fall below it
    and vanish. An accepted one is observed by the clock (and kept with it), so every later
    local HLC is above it whatever the wall clock does."""
    now = now_ms() if now is None else now
    tbl = st.tables.get(table)
    if tbl is None:
        raise NodeError(f"no table {table!r}")
    if tbl.tdef.retention is None:
        raise NodeError(f"{table} is not declared evictable: give it a retention class in the manifest "
                        "(scope §3: only declared categories may be evicted)")
    cur = tbl.horizon or (0, 0)
    if horizon < cur:
        raise NodeError(f"{table}: horizon {horizon[0]}.{horizon[1]} is below the current {cur[0]}.{cur[1]}; "
                        "horizons never move back (only rehydration resets them)")
    if horizon > (now, 0) and horizon > st.clock.current():
        raise NodeError(f"{table}: horizon {horizon[0]}.{horizon[1]} is above this node's clock "
                        f"({max((now, 0), st.clock.current())[0]}); every later local write would fall "
                        "below it. Check the clock, and give a horizon in the past")
    with db.transaction(st.conn):
        rowstore.set_horizon(st.conn, table, horizon)
        st.clock.observe(horizon, now)
        nodeclock.persist_observed(st)
    tbl.horizon = horizon if horizon != (0, 0) else None


def reset_horizons(st) -> dict[str, str]:
    """Rehydration (scope §3, agent/rehydrate.py): every horizon back to zero, the only way a
    horizon ever moves down. Returns the horizons it replaced. Nothing else changes: rows
    and the retained log stay; history comes back from peers by re-delivery."""
    with db.transaction(st.conn):
        return reset_horizons_in_txn(st)


def reset_horizons_in_txn(st) -> dict[str, str]:
    """`reset_horizons` inside the caller's transaction (rehydration resets the horizons and
    the watermarks that described them as one commitment). The in-memory
    horizons follow once the caller committed (`load_caches` on failure is not needed:
    they are only lowered, and a rolled-back lowering is re-read on the next open)."""
    old = {q: f"{t.horizon[0]}.{t.horizon[1]}" for q, t in st.tables.items() if t.horizon}
    rowstore.zero_horizons(st.conn)
    reports.surface(st.conn, now_ms(), "horizons_reset", "rehydration", json.dumps({"previous": old}))
    for t in st.tables.values():
        t.horizon = None
    return old


def evict_table(st, table: str, horizon: tuple[int, int], now: int | None = None, *,
                clock_override: bool = False, wait_clock_s: float = 0) -> int:
    """Raise one table's horizon and delete the retained events below it. Returns events deleted.
    Needs a trustworthy clock: a horizon is judged against it (raise_horizon)."""
    def work() -> int:   # all of it writes (the clock evidence too): all of it may need the reserve
        a = nodeclock.require_trusted_clock(st, f"evict {table}", override=clock_override, wait_s=wait_clock_s, now=now)
        at = a["now_ms"] if now is None else now
        raise_horizon(st, table, horizon, at)
        n = delete_below_horizon(st, table)
        reclaim(st)
        return n
    return with_reserve(st, work)


def with_reserve(st, work):
    """Run an eviction; on a full disk, release the space the home reserves for it and run it
    once more (it is idempotent: horizons only rise, deletions below them repeat as no-ops).
    Afterwards take the reserve back if there is room (agent/store/db.py)."""
    try:
        out = work()
    except Exception as e:
        if not db.disk_full(e, st.home / STORE_FILE):
            raise
        freed = db.release_reserve(st.home)
        if not freed:
            raise
        log.warning("the disk is full: eviction uses the %d bytes the home reserves for it", freed)
        out = work()
    db.ensure_reserve(st.home)
    return out


def run_eviction(st, now: int | None = None, *, clock_override: bool = False,
                 wait_clock_s: float = 0) -> dict:
    """The eviction job (scope §3): advance each evictable table's horizon to now minus the
    profile's duration for its retention class, delete the retained events below it and
    reclaim the space. It never emits an event and never removes a materialized row (an
    ambiguous marker fails open: rows stay). Horizons only move up. Its horizons are "now
    minus a duration": a clock a year ahead would evict a year of history and set horizons
    no write can get above, so it refuses without a trustworthy clock (ClockUntrusted)."""
    # The automatic job is strict: it runs unattended, and what it deletes does not come back.
    def work() -> dict:   # all of it writes (the clock evidence too): all of it may need the reserve
        a = nodeclock.require_trusted_clock(st, "eviction", override=clock_override, wait_s=wait_clock_s, now=now,
                                        strict=True)
        return evict_due(st, a["now_ms"] if now is None else now)
    return with_reserve(st, work)


def evict_due(st, now: int) -> dict:
    before = store_bytes(st)
    tables = {}
    # A clock that says it is synchronised may still lie: no horizon passes the newest time the
    # mesh vouches for, so a peer's later writes (its HLC only rises) stay above it, and with
    # no such evidence no horizon moves (docs/apply.md "What eviction never does").
    vouched = sync_state.peer_time_evidence(st.conn, st.site_id, st.keyring, st.tables)
    for q, t in sorted(st.tables.items()):
        keep_ms = st.profile.horizons_ms.get(t.tdef.retention) if t.tdef.retention else None
        if keep_ms is None:
            continue  # not declared evictable, or this profile keeps that class in full
        target = (max(0, min(now - keep_ms, vouched)), 0) if vouched is not None else (0, 0)
        if target > (t.horizon or (0, 0)):
            raise_horizon(st, q, target, now)
        h = t.horizon or (0, 0)
        tables[q] = {"horizon": f"{h[0]}.{h[1]}", "events_deleted": delete_below_horizon(st, q)}
    reclaim(st)
    report = {"tables": tables, "bytes_before": before, "bytes_after": store_bytes(st)}
    report["budget"] = check_disk_budget(st, now)
    report["journal"] = produce.compact_journal(st)
    return report


def delete_below_horizon(st, table: str) -> int:
    """Delete the retained events below the table's horizon, a batch per transaction with
    the WAL truncated between them, so the space it needs is one batch's (docs/reliability.md
    "Full disk"). This node's own events that no peer acknowledged stay (their watermarks say
    which, §14.2): they may be all there is of them (docs/apply.md "What eviction never does")."""
    h = st.tables[table].horizon
    if h is None:
        return 0
    keep = (st.site_id, sync_state.acked_by_any(st.conn, st.site_id, table))
    with db.transaction(st.conn):
        own = eventlog.newest_evictable_own(st.conn, st.site_id, table, h, keep[1])
        if own is not None:  # our own history below it is gone from here: say so to receivers (§14.2)
            nodeclock.raise_own_floor(st, table, own)
    total = 0
    while True:
        with db.transaction(st.conn):
            n = eventlog.delete_below(st.conn, table, h, EVICT_BATCH, keep)
        total += n
        if n < EVICT_BATCH:
            return total
        db.checkpoint(st.conn)


def reclaim(st) -> None:
    # auto_vacuum=INCREMENTAL returns freed pages to the filesystem (an older store is converted once).
    if db.reclaim_free_pages(st.conn):
        log.info("the store was converted to return freed pages to the filesystem (one VACUUM)")


def store_bytes(st) -> int:
    wal = st.home / (STORE_FILE + "-wal")
    return db.store_pages_bytes(st.conn) + (wal.stat().st_size if wal.exists() else 0)


def check_disk_budget(st, now: int | None = None) -> dict:
    """Say so loudly when the store nears its budget; writes keep working (never a silent failure)."""
    used, budget = store_bytes(st), st.profile.disk_budget_bytes
    frac = used / budget
    state = "ok" if frac < st.profile.warn_fraction else "near" if frac < 1 else "over"
    if state != "ok":
        msg = (f"store uses {used / 2**20:.1f} MiB of its {budget / 2**20:.0f} MiB budget ({frac:.0%}); "
               "shorten the profile's horizons, run eviction, or move to a larger profile")
        log.warning("DISK BUDGET %s: %s", state.upper(), msg)
        with db.transaction(st.conn):
            reports.surface(st.conn, now_ms() if now is None else now, "disk_budget", state,
                            json.dumps({"used_bytes": used, "budget_bytes": budget, "message": msg}))
    return {"state": state, "used_bytes": used, "budget_bytes": budget}
