"""Recovering from a clock that ran ahead (docs/apply.md "Clocks without an RTC").

A device whose clock ran years ahead stamped its writes there, and its HLC stays there (§13.5:
never reissued); every peer with a right clock rejects them (§12 step 2) and keeps nothing. Once
the clock is trustworthy (and the mesh's time, if any, agrees), own events beyond now + 300 s that
no peer acknowledged (§14.2 watermarks) reached no one: `recover` withdraws them and re-issues
their content as new events inside the range the clock jump left unissued (the store's holes and
gap, the journal's GAP), where the clock then issues (`resume`, on every open). Each step is
durable before the next, so a kill anywhere re-issues nothing twice and loses nothing."""
from __future__ import annotations

import json
import logging

from firmware_bridge import JournalError, KeystoreError

from . import clockstate, feed, gapwitness, produce
from .clockstate import now_ms
from .core import cose, events as ev, reasons as R
from .core.clock import SKEW_BOUND_MS, Hlc
from .core.codec import decode_strict
from .core.merge import rebuild_without
from .errors import NodeError
from .outcomes import APPLIED
from .store import clockgaps, db, reports, sync_state

log = logging.getLogger("ssp_agent")


def resume(node) -> None:
    """Put the node's clock back inside its gap, if it issues in one: above everything issued in
    the gap (the store's ceiling, the journal's GAP low end, the log), never at or above its top."""
    g = clockgaps.gap(node.conn)
    if g is None:
        return
    low, top, spent = g
    conn = node.conn
    ceiling = int(db.get_meta(conn, "clock_ceiling", 0))
    start = [low]
    if node.bridge is not None:
        jg = node.bridge.event_gap(node.site_id)
        if jg is not None and jg[1] == top:
            start.append(jg[0])
    own = clockgaps.newest_own_below(conn, node.site_id, top)
    if own is not None:
        start.append(own)
    w = gapwitness.read(node.site_id)
    if w is not None and w[0] == top:
        start.append(w[1])     # released by a run this home (restored from an older copy) lost
    closed = _hlc(db.get_meta(conn, "clock_closed"))
    if closed is not None and closed[0] == ceiling and closed < top:
        start.append(closed)   # a clean close at `closed`: nothing issued past it (nodeclock.lower_ceiling)
        ceiling = 0            # the first tick persists a ceiling first
    elif ceiling:
        start.append((ceiling + 1, 0))
    node.clock = Hlc.resume_in_gap(ceiling, max(start), top, max(spent, node.clock.current()))


def recover(node, now: int | None = None) -> dict | None:
    """Withdraw and re-issue own writes stamped beyond the skew bound that no one received, when
    the clock is trustworthy again; finish one a kill interrupted. Returns what was done, or None."""
    if node.read_only or node.bridge is None:
        return None
    now = now_ms() if now is None else now
    todo = clockgaps.pending(node.conn)
    if todo is None:
        if node.clock.current()[0] - now <= SKEW_BOUND_MS:
            return None      # the common case: a clock within the bound
        plan = _plan(node, now)
        if plan is None:
            return None
        todo = _enter(node, now, *plan)
        if todo is None:
            return None
    return _reissue(node, *todo, now)


def _plan(node, now: int):
    """(low, top, spent, originals' ids) of a recovery to make now, or None (surfaced when stuck)."""
    st = clockstate.assess(node, now)
    if not st["trusted"]:
        return None          # a clock nobody vouches for proves nothing about the HLC
    conn, site = node.conn, node.site_id
    bound = now + SKEW_BOUND_MS
    holes = [(b, a) for b, a in clockgaps.holes(conn) if b[0] <= bound < a[0]]
    if not holes:
        return _stranded(node, now, "no_gap", "no recorded range below the first write stamped ahead")
    low, top = max(holes)
    w = gapwitness.read(site)
    if w is not None and w[0] == top and w[1] > low:
        low = w[1]             # a run this home lost (restored from an older copy) issued up to there
    above = clockgaps.own_above(conn, site, low)
    if any((p, l) < top for _e, p, l, _r in above):
        return _stranded(node, now, "gap_used", f"own events inside {_s(low)} .. {_s(top)}")
    for q in node.tables:
        acked = sync_state.acked_by_any(conn, site, q)
        if acked is not None and acked >= top:
            # A peer holds them: withdrawing would diverge from it, and its watermark covers the gap.
            return _stranded(node, now, "acknowledged", f"a peer acknowledged {q} up to {_s(acked)}")
    mesh = node.mesh_time()
    if mesh is not None and mesh - now > SKEW_BOUND_MS:
        # The peers' time is ahead of this clock: it is the clock that is behind, not the HLC ahead.
        return _stranded(node, now, "mesh_ahead", f"the peers vouch for {mesh}, the clock reads {now}")
    if any(h >= top for h in node.own_history_floors().values()):
        return _stranded(node, now, "evicted", "own events stamped ahead were evicted (a peer acknowledged them)")
    if node.bridge.keystore.upward_only:
        return _stranded(node, now, "keystore", "the keystore signs only above its last identity")
    spent = max(node.clock.current(), node.bridge.max_event_hlc(site) or (0, 0))
    return low, top, spent, [e for e, _p, _l, _r in above]


def _enter(node, now: int, low, top, spent, ids: list[bytes]):
    """Record the gap (the journal's GAP first: it alone makes its identities signable), then in
    one store transaction the gap, the withdrawal to make and the ceiling the clock resumes above."""
    try:
        node.bridge.open_event_gap(node.site_id, low, top)
    except (KeystoreError, JournalError) as e:
        return _stranded(node, now, "journal", str(e))
    with db.transaction(node.conn):
        clockgaps.set_gap(node.conn, low, top, spent)
        clockgaps.set_pending(node.conn, ids, low)
        clockgaps.clear_holes(node.conn)        # ranges behind the gap, or inside what it leaves
        db.set_meta(node.conn, "clock_ceiling", low[0])
        # The trustworthy reading `_plan` took is the evidence now (one taken under the clock that
        # stamped the originals is as wrong as they are): it caps the re-issue's ticks should a
        # later open finish it under a wrong clock again (produce.signing_now)
        db.set_meta(node.conn, "clock_evidence", now)
    node.clock_evidence = now
    resume(node)
    log.warning("clock: own writes stamped from %s on reached no peer; re-issuing %d of them above %s",
                _s(top), len(ids), _s(low))
    return ids, low


def _reissue(node, ids: list[bytes], start: tuple[int, int], now: int) -> dict:
    """Re-issue the originals not re-issued yet (a kill after their release left the first ones
    in the log: matched in order by content), then withdraw the originals and rebuild their rows
    in one transaction, so the rows are the merge of what remains, as at every peer."""
    conn, site = node.conn, node.site_id
    g = clockgaps.gap(conn)
    if g is None:
        raise NodeError("a withdrawal is recorded without its clock gap; the store was changed by hand")
    low, top, _spent = g
    held = {e: (p, l, raw) for e, p, l, raw in clockgaps.own_above(conn, site, low)}
    originals = [_event(held[i][2]) for i in ids if i in held and held[i][:2] >= top]
    done = 0
    for _e, p, l, raw in clockgaps.own_above(conn, site, start):
        if (p, l) >= top or done == len(originals) or _content(_event(raw)) != _content(originals[done]):
            break
        done += 1
    rest = originals[done:]
    if rest:
        payloads = []
        for e in rest:
            tbl = node.tables.get(e.table)
            if tbl is None:
                raise NodeError(f"cannot re-issue a write to {e.table}: the table is gone")
            payloads.append((tbl.tdef, e.row_key, e.payload, e.operation))
        raws = produce.issue_events(node, payloads, produce.signing_now(node, now))
        outs = node.apply_batch(raws, now, origin="local")
        if any(o.status != APPLIED or o.reason != R.APPLIED for o in outs):
            raise NodeError(f"a re-issued event was not stored: {[(o.status, o.reason) for o in outs]}")
    # The journal forgets the originals while the log still holds them (its FLOOR keeps them spent),
    # so no later open re-applies them from it as released-but-unapplied (recovery.recover_released).
    node.compact_journal()
    stamps = {e.stamp for e in originals}
    with db.transaction(conn):
        withdrawn = clockgaps.withdraw(conn, [e.event_id for e in originals])
        rebuilt = _rebuild(node, stamps)
        clockgaps.clear_pending(conn)
        detail = {"withdrawn": withdrawn, "reissued": len(originals), "rows_rebuilt": rebuilt,
                  "gap": [_s(low), _s(top)], "hlc": _s(node.clock.current())}
        reports.surface(conn, now, "clock", R.CLOCK_REISSUED, json.dumps(detail, sort_keys=True))
    for t in node.tables.values():
        t.rows.committed()
    log.warning("clock: %d own write(s) stamped ahead withdrawn and re-issued (%s)", withdrawn, detail)
    return detail


def _rebuild(node, void_stamps: set) -> int:
    """Inside the caller's transaction: every row with a clock owned by a withdrawn event becomes
    the merge of the retained events that count (merge.rebuild_without, as for a trust change)."""
    def void(s) -> bool:
        entry = node.keyring.get(s[2])
        return s in void_stamps or entry is None or (entry[1] is not None and s[:2] > entry[1])
    n = 0
    for q, tbl in sorted(node.tables.items()):
        for rk, key in tbl.rows.rows_with_clock_of([node.site_id]):
            state = tbl.rows.load(rk)
            if state is None or not any(c in void_stamps for c in [state.exist_clock, state.tomb_clock,
                                                                    *state.cells.values()] if c is not None):
                continue
            events = [((p, l, s), op, _payload(raw)) for s, p, l, op, raw in clockgaps.row_events(node.conn, q, rk)]
            rb = rebuild_without(tbl.tdef, state, void, events, tbl.horizon)
            if rb.state.exist_clock is None and rb.state.tomb_clock is None and not rb.state.cells:
                tbl.rows.delete(rk)
            else:
                tbl.rows.save(rk, key, rb.state, rb.writes)
            feed.note_rebuild(node.conn, tbl.tdef, key, rk, state.exists, rb.state.exists, rb.writes, "clock_reissued",
                              rb.partial)   # the application's change feed, same transaction
            n += 1
    return n


def _stranded(node, now: int, why: str, detail: str) -> None:
    """Surface (once per cause and day of the HLC) that writes stamped ahead stay as they are:
    kept and re-offered, accepted by peers once real time reaches them."""
    key = f"{why}@{node.clock.current()[0] // 86_400_000}"
    if db.get_meta(node.conn, "clock_stranded") != key:
        with db.transaction(node.conn):
            db.set_meta(node.conn, "clock_stranded", key)
            reports.surface(node.conn, now, "clock", R.CLOCK_STRANDED,
                            json.dumps({"cause": why, "detail": detail, "hlc": _s(node.clock.current())}, sort_keys=True))
        log.warning("clock: own writes stamped ahead cannot be re-issued (%s: %s)", why, detail)
    return None


def _event(raw: bytes) -> ev.Event:
    return ev.event_from_verified(raw, cose.parse_sign1(raw))


def _content(e: ev.Event) -> tuple:
    return (e.table, json.dumps(_plain(e.row_key), sort_keys=True), e.operation,
            json.dumps(_plain(e.payload), sort_keys=True))


def _plain(v):
    """A JSON-comparable form (bytes as tagged hex, floats by their repr)."""
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (bytes, bytearray)):
        return {"b": bytes(v).hex()}
    if isinstance(v, float):
        return {"f": repr(v)}
    return v


def _payload(raw: bytes) -> dict | None:
    p = decode_strict(cose.parse_sign1(raw).payload_bytes)["payload"]
    return dict(p) if p is not None else None


def _hlc(text) -> tuple[int, int] | None:
    if not text:
        return None
    p, _, l = str(text).partition(".")
    return int(p), int(l or 0)


def _s(h) -> str:
    return f"{h[0]}.{h[1]}"
