"""The one apply path (§12) and materialization (§13): every event, local or remote, whatever
the batch size, passes `apply_one`'s checks in the spec's order, then its effects are merged
into the row (agent/core/merge.py) inside the batch's transaction. Also what the path surfaces
(`ssp-agent events`), events held for a missing table (§13.6 row 1) and their release.
Functions over the node's state (agent/nodestate.py); the worker pipeline that verifies ahead
is agent/applypipeline.py."""
from __future__ import annotations

import json
import logging
from typing import Any, Iterable

from . import feed, nodeclock
from .clockstate import now_ms
from .core import cose, events as ev, reasons as R
from .core.clock import beyond_skew
from .core.codec import DecodeError, decode_strict
from .core.merge import Effects, RowState, below, merge_delete, merge_upsert, rebuild_columns
from .core.schema import SYNCABLE, TableDef
from .nodestate import Table
from .outcomes import APPLIED, DROPPED, DUPLICATE, HELD, REJECTED, Outcome, to_json
from .store import counters, db, eventlog, reports, rows as rowstore

log = logging.getLogger("ssp_agent")

# Held events (§13.6 row 1) are bounded per signer and in total, so neither fictional tables nor
# one signer can fill the disk or crowd out another signer's holds. What does
# not fit is rejected (surfaced; the sender re-offers it later), never dropped.
HELD_LIMIT_PER_SIGNER = 10_000
HELD_LIMIT_TOTAL = 100_000
ROW_FLUSH = 4096  # rows held in memory by one batch before they are written (bounds its memory)


def apply_batch(st, raws: Iterable[bytes], now: int | None = None, origin: str = "remote",
                built: list | None = None, path: str | None = None) -> list[Outcome]:
    """Apply events in one transaction; each event is atomic on its own (a savepoint:
    log insert, clocks, row and metering commit together or not at all). `built`: for
    local events only (`write_many`), each event's `checked` as `local_checked` made it.
    `path`: the transport the events came by, the metrics' origin label (`origin` is the
    log's tag, `peer:<site_id>` under the secure binding: never a label value)."""
    now = now_ms() if now is None else now
    try:
        with db.transaction(st.conn):
            out = apply_in_txn(st, raws, now, origin) if built is None else \
                apply_built(st, raws, built, now, origin)
            nodeclock.persist_observed(st)
            new = sum(1 for o in out if o.reason == R.APPLIED)
            if new:
                st.applied += new
                db.set_meta(st.conn, "applied_count", st.applied)
            counters.bump_outcomes(st.conn, path or origin, (o.status for o in out))   # the metrics
            due = nodeclock.write_due_meta(st)
    finally:
        st.pipeline.next_raws = None   # a hint for the batch after this one only (`prepare_next`)
    for t in st.tables.values():
        t.rows.committed()   # the rows this batch left are the store's (RowStore `defer`)
    nodeclock.due_meta_committed(st, due)
    if new:
        st.witness.note_applied(st.applied)
    return out


def apply_built(st, raws: list[bytes], built: list, now: int, origin: str) -> list[Outcome]:
    """`apply_in_txn` for local events this node just built and released (`local_checked`):
    fresh identities the bridge held no bytes for, so nothing knows them yet (the log's
    INSERT OR IGNORE still answers a duplicate); parsed, verified and decoded by construction."""
    since: dict[bytes, str] = {}
    out = []
    # As `apply_in_txn`: the batch's rows held in memory and written once each; their
    # current state read up front in one query (the batch names its rows before applying).
    touched = {}
    for checked in built:
        if checked is not None:
            e = checked[3]
            touched.setdefault(e.table, []).append(rowstore.row_key_bytes(e.row_key))
    stores = [t.rows for t in st.tables.values()]
    for rs in stores:
        rs.defer()
    try:
        for table, rks in touched.items():
            tbl = st.tables.get(table)
            if tbl is not None:
                tbl.rows.prefetch(rks)
        for raw, checked in zip(raws, built):
            o = apply_one(st, raw, now, origin, checked, since if checked is not None else None)
            if o.status == APPLIED and o.reason == R.APPLIED:
                since[o.event_id] = "log"
            out.append(o)
        for rs in stores:
            rs.flush(keep=False)
    finally:
        for rs in stores:
            rs.discard()   # after a fault the transaction rolls back: nothing held survives it
    return out


def apply_in_txn(st, raws: Iterable[bytes], now: int, origin: str) -> list[Outcome]:
    """Every event's effects (log insert, clocks, row, metering) are written inside the
    caller's transaction; a local fault rolls the whole batch back, never half an event."""
    raws = raws if isinstance(raws, (list, tuple)) else list(raws)
    if len(raws) < 64:
        return [apply_one(st, raw, now, origin) for raw in raws]
    out: list[Outcome] = []
    # Events this batch put into the log or the held table since their chunk's look-up (the
    # only way one found unknown there becomes known): the duplicate check answers from it
    # exactly as `known` would, without a query per event.
    since: dict[bytes, str] = {}
    # The batch's rows are held in memory and written once each (agent/store/rows.py
    # `defer`), at most ROW_FLUSH of them at a time so a batch over many rows stays bounded;
    # the rows the last committed batch left are read from memory while no other connection
    # has committed since (`PRAGMA data_version`, read under this transaction's write lock).
    stores = [t.rows for t in st.tables.values()]
    version = db.data_version(st.conn)
    for rs in stores:
        rs.defer(version)
    try:
        for raw, checked in st.pipeline.verified_ahead(st, raws):
            o = apply_one(st, raw, now, origin, checked, since if checked is not None else None)
            if o.event_id is not None:
                if o.status == HELD:
                    since.setdefault(o.event_id, "held")
                elif o.status == DUPLICATE or (o.status == APPLIED and o.reason == R.APPLIED):
                    since[o.event_id] = "log"
            out.append(o)
            if len(out) % 256 == 0 and sum(rs.pending() for rs in stores) > ROW_FLUSH:
                for rs in stores:
                    rs.flush()
        for rs in stores:
            rs.flush(keep=False)
    finally:
        for rs in stores:
            rs.discard()   # after a fault the transaction rolls back: nothing held survives it
    return out


def apply_one(st, raw: bytes, now: int, origin: str, checked=None, since: dict | None = None) -> Outcome:
    """The one apply path: §12 steps in the spec's order, then §13 materialization.
    `checked` is this event's (parsed envelope, keyring entry, signature ok, decoded event
    or its shape error, event_id) when `verified_ahead` computed them already; `since` then
    holds what the batch made known after the chunk's one duplicate look-up found this event
    unknown."""
    if not isinstance(raw, (bytes, bytearray)):
        return surface(st, Outcome(DROPPED, R.NOT_BYTES), now)
    raw = bytes(raw)
    eid = checked[4] if checked is not None else ev.event_id(raw)
    # Envelope: tag 18, empty unprotected map, deterministic bytes (docs/protocol.md §0 "Change events"): else dropped.
    if checked is not None:
        sign1 = checked[0]
    else:
        try:
            sign1 = cose.parse_sign1(raw)
        except DecodeError as e:
            return surface(st, Outcome(DROPPED, e.reason, eid), now)
    if sign1.content_type != ev.EVENT_CONTENT_TYPE:
        return surface(st, Outcome(DROPPED, R.NOT_AN_EVENT, eid), now)
    kid = sign1.kid
    # §32.1 self-echo suppression, on every path (local writes are ours by construction).
    if origin != "local" and kid == st.site_id:
        return Outcome(DROPPED, R.SELF_ECHO, eid, kid)
    # Identical bytes were verified when first applied: a known event_id is a no-op (§12.4).
    # Whatever the batch size: the same bytes get the same outcome.
    seen = since.get(eid) if since is not None else known(st, eid)
    if seen == "log":
        return Outcome(DUPLICATE, R.DUPLICATE, eid, kid, verified=True)
    if seen == "held":
        return Outcome(HELD, R.ALREADY_HELD, eid, kid, verified=True)
    # §12.1 signature verification: kid in the keyring, valid signature, retirement cutoff.
    entry = st.keyring.get(kid)
    if entry is None:
        # Rejected, not dropped (docs/protocol.md §5 Trust): the one
        # verification failure that may resolve (a vouch or `peer add` may still come), so the
        # sender re-offers it. Nothing is retained and no watermark is blocked (the event is
        # attributable to no group here); only the delivering link's cursor waits, which costs
        # whoever delivered it, and an honest sender holds it only if it trusts the kid.
        return surface(st, Outcome(REJECTED, R.UNKNOWN_KID, eid, kid), now)
    if checked is not None and checked[1] == entry:
        sig_ok = checked[2]
    else:
        if checked is not None:   # prepared against another keyring entry: start over from the bytes
            sign1, checked = cose.parse_sign1(raw), None
        sig_ok = cose.verify_ed25519(entry[0], sign1.sig_structure(st.mesh_id), sign1.signature)
    if not sig_ok:
        return surface(st, Outcome(DROPPED, R.BAD_SIGNATURE, eid, kid), now)
    decoded = checked[3] if checked is not None and checked[1] == entry else None
    rk = checked[5] if decoded is not None and len(checked) > 5 else None
    if decoded is None:
        try:
            decoded, rk = ev.decoded_event(raw, sign1, eid)
        except DecodeError as err:
            decoded = err
    if isinstance(decoded, DecodeError):
        return surface(st, Outcome(DROPPED, decoded.reason, eid, kid, verified=True), now)
    e = decoded
    table = e.table
    hlc = e.hlc
    # (the verified event's outcomes below carry event_id, site_id, table, hlc, verified=True)
    if entry[1] is not None and hlc > entry[1]:
        return surface(st, Outcome(DROPPED, R.RETIRED_SIGNER, eid, kid, table, hlc, True), now)
    # §12.2 skew bound: rejected and not retained; the sender re-offers it. A local event
    # carries our own clock, which may run ahead of a wall clock that jumped back.
    if origin != "local" and beyond_skew(hlc[0], now):
        return surface(st, Outcome(REJECTED, R.CLOCK_SKEW, eid, kid, table, hlc, True), now)
    # §12.3 scope: a missing table is held (§13.6 row 1); outside the floor is dropped and logged.
    tbl = st.tables.get(table)
    if tbl is None:
        return hold(st, e, now, dict(event_id=eid, site_id=kid, table=table, hlc=hlc, verified=True))
    if tbl.tdef.category != SYNCABLE:
        log.info("dropped %s: table %s is %s (outside the floor)", eid.hex(), table, tbl.tdef.category)
        return surface(st, Outcome(DROPPED, R.OUT_OF_FLOOR, eid, kid, table, hlc, True), now, kind="logged")
    bad_key = tbl.tdef.key_misfit(e.row_key)
    if bad_key:
        return surface(st, Outcome(DROPPED, bad_key[0], eid, kid, table, hlc, True), now, detail=bad_key[2])
    # §3: below the table's eviction horizon counts as applied and writes nothing.
    if below(hlc, tbl.horizon):
        return Outcome(APPLIED, R.BELOW_HORIZON, eid, kid, table, hlc, True)
    # §12.4 idempotent insert keyed on event_id.
    if rk is None:
        rk = rowstore.row_key_bytes(e.row_key)
    cur = st.conn.execute(
        eventlog.INSERT_EVENT, (eid, kid, hlc[0], hlc[1], table, rk, e.operation,
                                        st.log_seal.seal(eid, raw), origin))
    if cur.rowcount == 0:
        return Outcome(DUPLICATE, R.DUPLICATE, eid, kid, table, hlc, True)
    # §12.5 HLC observe.
    st.clock.observe(hlc, now)
    materialize(st, tbl, e, rk, now)
    return Outcome(APPLIED, R.APPLIED, eid, kid, table, hlc, True)


def known_among(st, eids: list[bytes]) -> set[bytes]:
    """The event_ids among `eids` that the log or the held table holds (one query)."""
    return eventlog.known_among(st.conn, eids)


def known(st, eid: bytes) -> str | None:
    in_log, in_held = st.conn.execute(eventlog.KNOWN_EVENT, (eid,)).fetchone()
    return "log" if in_log else "held" if in_held else None


def materialize(st, tbl: Table, e: ev.Event, rk: bytes, now: int) -> None:
    """§13: compute the effects from the row's clocks, then write them."""
    state = tbl.rows.load(rk) or RowState()
    fx: Effects
    if e.operation == "delete":
        fx = merge_delete(tbl.tdef, state, e.stamp)
    else:
        fx = merge_upsert(tbl.tdef, state, e.stamp, e.payload or {})
    writes: dict[str, Any] = fx.writes   # fx is this event's own (the row store copies what it keeps)
    partial = None
    if fx.resurrected:
        rb = rebuild_columns(tbl.tdef, tbl.tdef.value_columns, fx.state.tomb_clock,
                             candidates(st, tbl.tdef, rk), tbl.horizon)
        writes, partial = rb.writes, rb.partial
        row_txt = json.dumps(to_json(e.row_key), sort_keys=True)
        if rb.partial:
            # §13.4 MUST: never present a partial rebuild as complete; name row and horizon.
            h = tbl.horizon
            record(st, "partial_rebuild", "tombstone_below_horizon", e, now,
                         {"row_key": to_json(e.row_key), "horizon": f"{h[0]}.{h[1]}",
                          "tombstone": f"{fx.state.tomb_clock[0]}.{fx.state.tomb_clock[1]}"})
            log.warning("partial resurrection rebuild of %s %s: history below horizon %s.%s is evicted",
                        e.table, row_txt, h[0], h[1])
        else:
            record(st, "resurrection", "resurrected", e, now, {"row_key": to_json(e.row_key)})
    tbl.rows.save(rk, e.row_key, fx.state, writes)
    feed.note_change(st.conn, tbl.tdef, e, rk, state.exists, fx, writes, partial, tbl.horizon)  # same transaction
    if fx.ignored:
        # §13.6: meter ignored columns per (site, table, column).
        st.conn.executemany(
            reports.COUNT_IGNORED_COLUMN,
            [(e.site_id, e.table, c, now, now) for c in fx.ignored])


def candidates(st, t: TableDef, rk: bytes) -> Iterable[tuple[tuple[int, int, bytes], dict]]:
    """Retained upserts of one row that count under the current trust (the rebuild filters
    by tombstone clock and horizon)."""
    for stamp, op, payload in row_events(st, t, rk):
        if op == "upsert" and counts(st, stamp):
            yield stamp, payload


def row_events(st, t: TableDef, rk: bytes) -> Iterable[tuple[tuple[int, int, bytes], str, dict | None]]:
    """Every retained event of one row: (stamp, operation, payload)."""
    for sid, p, l, op, raw in st.conn.execute(eventlog.ROW_EVENTS, (t.qualified, rk)).fetchall():
        payload = decode_strict(cose.parse_sign1(bytes(raw)).payload_bytes)["payload"]
        yield (p, l, bytes(sid)), op, (dict(payload) if payload is not None else None)


def counts(st, stamp: tuple[int, int, bytes]) -> bool:
    """Whether a retained event with this stamp still passes §12.1 under the current trust:
    its signer is trusted and its HLC is not above the signer's cutoff. The log keeps the
    events that do not; they no longer count."""
    entry = st.keyring.get(stamp[2])
    return entry is not None and (entry[1] is None or stamp[:2] <= entry[1])


def hold(st, e: ev.Event, now: int, base: dict) -> Outcome:
    n_signer, n_total = db.held_count(st.conn, e.site_id)
    if n_signer >= HELD_LIMIT_PER_SIGNER or n_total >= HELD_LIMIT_TOTAL:
        # Retain nothing more; the sender moves past it and re-offers it later (agent/sync.py).
        return surface(st, Outcome(REJECTED, R.HELD_LIMIT, **base), now)
    cur = st.conn.execute(eventlog.HOLD_EVENT, (e.event_id, e.site_id, e.table, e.hlc[0], e.hlc[1],
                                                         st.log_seal.seal(e.event_id, e.raw), now))
    if cur.rowcount == 0:
        return Outcome(HELD, R.ALREADY_HELD, **base)
    return surface(st, Outcome(HELD, R.TABLE_MISSING, **base), now, kind="held")


def surface(st, o: Outcome, now: int, kind: str | None = None, detail: dict | None = None) -> Outcome:
    """Record what the spec says to surface (or log) where `ssp-agent events` lists it.
    The store bounds the record (the newest `surfaced_limit` rows are kept, evictions counted:
    agent/store/db.py), in every process: a hostile peer cannot fill the disk."""
    kind = kind or o.status
    st.conn.execute(reports.SURFACE_EVENT,
                      (now, kind, o.reason, o.event_id, o.site_id if o.verified else None, o.table,
                       json.dumps({"status": o.status, "claimed_kid": None if o.verified or o.site_id is None
                                   else o.site_id.hex(), **(detail or {})})))
    feed.note_signal(st.conn, kind, o, detail)   # the application's change feed, same transaction
    if kind != "logged":
        log.warning("%s %s: %s", o.status, o.event_id.hex() if o.event_id else "-", o.reason)
    return o


def record(st, kind: str, reason: str, e: ev.Event, now: int, detail: dict) -> None:
    st.conn.execute(reports.SURFACE_EVENT,
                      (now, kind, reason, e.event_id, e.site_id, e.table, json.dumps(detail, sort_keys=True)))


def surface_clock(st, reason: str, detail: dict) -> None:
    """Surface a clock condition (kind `clock`), e.g. eviction deferred for an untrusted clock."""
    with db.transaction(st.conn):
        reports.surface(st.conn, now_ms(), "clock", reason, json.dumps(detail, sort_keys=True))


def surface_refused(st, source: str, reason: str, detail: str = "", claimed_sender: bytes | None = None,
                    now: int | None = None, kind: str = "refused") -> None:
    """Surface a message from outside that its boundary parser refused (an MQTT body, a
    presence payload, a frame meta, a mailbox file: `source`) where `ssp-agent events` lists it
    (kind `refused`, its reason code), in a transaction of its own. `claimed_sender` is who the
    transport says sent it (a topic segment: not authenticated, so kept in the detail). A serial
    link incarnation that ended comes the same way with kind `link_lost` (docs/serial.md)."""
    now = now_ms() if now is None else now
    with db.transaction(st.conn):
        reports.surface(st.conn, now, kind, reason, json.dumps(
            {"source": source, "detail": detail[:200],
             "claimed_sender": claimed_sender.hex() if claimed_sender else None},
            sort_keys=True))


def retry_held(st, qualified: str, now: int | None = None) -> list[Outcome]:
    now = now_ms() if now is None else now
    if qualified not in st.tables:
        return []
    with db.transaction(st.conn):  # release and re-apply in one transaction: nothing is lost between
        out = apply_in_txn(st, eventlog.take_held(st.conn, qualified), now, "remote")
        counters.bump_outcomes(st.conn, "released", (o.status for o in out))   # held, now applied
        return out
