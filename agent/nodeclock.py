"""The node's clock around the pure HLC (agent/core/clock.py): where it resumes on open and
where its ceiling goes on close (§13.5), the observed mark kept with each batch (§12 step 5),
the evidence of real time and the wait for a trustworthy wall clock before what needs one
(init, eviction, a horizon change; docs/apply.md "Clocks without an RTC"), and the floors of
own history this home no longer holds (§14.2). Functions over the node's state
(agent/nodestate.py)."""
from __future__ import annotations

import json
import logging
import os
import sqlite3
import sys
import time

from . import clockstate
from .clockstate import now_ms
from .core import reasons as R
from .core.clock import Hlc
from .errors import NodeError
from .store import db, eventlog, reports

log = logging.getLogger("ssp_agent")

CLOCK_WAIT_SAY_S = 5.0   # how often a wait for a synchronised clock says so


class ClockUntrusted(NodeError):
    """Reason code `clock_untrusted`: an operation that needs a trustworthy wall clock (eviction,
    a horizon change, `init`) found none and had no override (docs/apply.md "Clocks without an RTC")."""


def wait_trusted_clock(node, what: str, override: bool, wait_s: float, now: int | None = None,
                           strict: bool = False) -> dict:
    """Wait up to `wait_s` for a trustworthy clock. A clock the node has evidence against (behind
    or far ahead of what it read while trusted) is always refused. A clock that is merely not
    known to be synchronised (no sync source, no contrary evidence: containers, devices without a
    time service) is refused only in strict mode — `strict`, a `--wait-clock`, or
    SSP_AGENT_CLOCK_STRICT=1, which first-boot enrolment and the automatic eviction job use — and
    otherwise accepted with a warning, so the command-line contract (docs/cli.md "The manifest": `init`,
    `evict --horizon`) holds on machines that cannot say."""
    strict = strict or wait_s > 0 or os.environ.get("SSP_AGENT_CLOCK_STRICT", "").strip().lower() in ("1", "true", "yes")
    deadline = time.monotonic() + max(0.0, wait_s)
    say_at = time.monotonic()
    while True:
        st = clockstate.assess(node, now, trusted_override=override)
        if st["trusted"] or time.monotonic() >= deadline:
            break
        if time.monotonic() >= say_at:
            # A wait of up to `wait_s` (enrolment: 600 s) is never silent: the console and the
            # journal say what it waits for.
            say_at += CLOCK_WAIT_SAY_S
            print(f"ssp-agent: {what} waits for a synchronised wall clock ({st['state']}: "
                  f"{st['hint'].split(';')[0]}); {max(0.0, deadline - time.monotonic()):.0f} s left",
                  file=sys.stderr, flush=True)
        time.sleep(1.0)
    if not st["trusted"] and not strict and st["state"] == "unsynced":
        log.warning("%s: the wall clock is not known to be synchronised (%s); proceeding", what, st["hint"])
        st = dict(st, unverified=True)
        return st
    if not st["trusted"]:
        raise ClockUntrusted(f"clock_untrusted: {what} needs a trustworthy wall clock ({st['state']}: {st['hint']}); "
                             "wait for time sync (--wait-clock SECONDS), or pass --clock-trusted if the clock is right")
    return st


def lower_ceiling(st) -> None:
    """On a clean close, bring the durable ceiling down to the clock and keep the clock's exact
    value beside it (`clock_closed`): this run issued nothing above it, so the next open can
    resume exactly there instead of above a window left standing (§13.5; docs/apply.md).
    Only the writer (it holds the journal's lock) does it; a crash leaves the window."""
    if st.read_only or st.bridge is None:
        return
    p, l = st.clock.current()
    try:
        ceiling = int(db.get_meta(st.conn, "clock_ceiling", 0))
        if ceiling > p or (ceiling == p and hlc_meta(db.get_meta(st.conn, "clock_closed")) != (p, l)):
            with db.transaction(st.conn):
                db.set_meta(st.conn, "clock_ceiling", p)
                db.set_meta(st.conn, "clock_closed", f"{p}.{l}")
    except sqlite3.Error as e:   # a full disk: the window stays, which is safe
        log.warning("clock: the ceiling could not be lowered on close (%s)", e)


def resume_clock(st) -> Hlc:
    """§13.5 clock durability and §12 step 5 across processes. The clock resumes above
    everything this site may have released (its log, the signing journal's intents, and the
    witness outside the home, made durable before every release) and everything it has
    observed (the mark kept with each applied batch), so neither a restart, a crash nor a
    restored older home re-issues an HLC or undercuts an observed one (docs/apply.md).
    It also resumes above the in-home ceiling, whichever is higher: a home restored together
    with its witness (a machine snapshot taken while the node ran) lost what it issued after
    the snapshot, possibly above the wall clock after observing a peer, and only the ceiling
    bounds that. After a clean close the ceiling is the clock itself (`lower_ceiling`)."""
    store_ceiling = int(db.get_meta(st.conn, "clock_ceiling", 0))
    closed = hlc_meta(db.get_meta(st.conn, "clock_closed"))
    witness = st.witness.read()
    st.observed = hlc_meta(db.get_meta(st.conn, "clock_observed"))
    seen = [max_own_hlc(st), st.observed, witness]
    if st.bridge is not None:
        seen.append(st.bridge.max_event_hlc(st.site_id))
    highest = max((s for s in seen if s is not None), default=None)
    if not st.read_only:   # it records what it finds (a write), and needs the journal's intents
        detect_lost_history(st, witness)
    if witness is None and store_ceiling > 0:
        log.warning("clock: no witness at %s (lost, or a restored home?); resuming above the ceiling %d",
                    st.witness.path, store_ceiling)
    if closed is not None and closed[0] == store_ceiling:
        # The last writer closed cleanly at `closed` and no run issued past it since (the
        # first tick of any run persists a new ceiling first: `ceiling_ms` 0 makes it due).
        return Hlc.resume(0, closed if highest is None else max(closed, highest))
    return Hlc.resume(store_ceiling, highest)


def own_history_floors(st) -> dict[str, tuple[int, int]]:
    """Per table ("*": every table), the highest own HLC this node may have released and no
    longer holds (evicted, or lost to a restored home). A receiver infers no watermark for
    this node's stream across it unless it already holds everything up to it (§14.2;
    docs/protocol.md "3. Applied watermarks (§14.2, §34)")."""
    raw = db.get_meta(st.conn, "own_history_floors")
    return {q: (v[0], v[1]) for q, v in json.loads(raw).items()} if raw else {}


def raise_own_floor(st, table: str, hlc: tuple[int, int]) -> None:
    """Inside the caller's transaction (with the deletion or the detection that causes it)."""
    floors = own_history_floors(st)
    if table not in floors or hlc > floors[table]:
        floors[table] = hlc
        db.set_meta(st.conn, "own_history_floors", json.dumps({q: list(v) for q, v in sorted(floors.items())}))


def detect_lost_history(st, witness: tuple[int, int] | None) -> None:
    """The witness records every HLC released before it could leave the node; if it is above
    everything the home knows of its own history, the home lost some (a restore): record it."""
    if witness is None or st.witness.legacy:
        return
    known = [max_own_hlc(st), *own_history_floors(st).values()]
    if st.bridge is not None:
        known.append(st.bridge.max_event_hlc(st.site_id))
    highest = max((k for k in known if k is not None), default=None)
    if highest is None or witness > highest:
        log.warning("clock: this home lacks own events released up to %d.%d (restored from an older copy?); "
                    "peers will take them from others", witness[0], witness[1])
        with db.transaction(st.conn):
            raise_own_floor(st, "*", witness)


def max_own_hlc(st) -> tuple[int, int] | None:
    return eventlog.newest_of(st.conn, st.site_id)


def persist_observed(st) -> None:
    """§12 step 5 across processes: the clock's high-water mark is kept with the batch that
    raised it, so the next process resumes above every HLC this node has applied."""
    cur = st.clock.current()
    if st.observed is None or cur > st.observed:
        db.set_meta(st.conn, "clock_observed", f"{cur[0]}.{cur[1]}")
        st.observed = cur


def note_clock(st, now: int | None = None) -> dict:
    """Assess the clock and, when it is trustworthy, keep the reading as evidence (throttled):
    `run` calls it every minute, so a node that only receives still has fresh evidence."""
    now = now_ms() if now is None else now
    a = clockstate.assess(st, now)
    if a["trusted"]:
        record_clock_evidence(st, now, assessed=a)
    return a


def record_clock_evidence(st, now: int, force: bool = False, defer: bool = False,
                          assessed: dict | None = None) -> None:
    """Keep the highest wall-clock reading taken while the clock was trustworthy (meta
    clock_evidence; only rises). Throttled to one store write a minute unless forced.
    `defer`: written by the next transaction that commits anyway (`write_due_meta`).
    `assessed` (clockstate.assess) saying the evidence is contradicted by a synchronised
    reading the peers agree with: the evidence is lowered to the reading, and surfaced."""
    from .clockstate import EVIDENCE_EVERY_MS
    cur = st.clock_evidence
    if assessed is not None and assessed.get("evidence_contradicted") and not st.read_only \
            and cur is not None and now < cur:
        with db.transaction(st.conn):
            db.set_meta(st.conn, "clock_evidence", now)
            reports.surface(st.conn, now, "clock", R.CLOCK_EVIDENCE_RESET, json.dumps(
                {"evidence_ms": cur, "now_ms": now, "mesh_ms": st.mesh_time()}, sort_keys=True))
        log.warning("clock: the evidence %d was taken under a wrong clock (a synchronised reading and "
                    "the peers' time say %d); lowered to it", cur, now)
        st.clock_evidence = now
        st.evidence_due = None
        return
    if st.read_only or (cur is not None and (now <= cur or (not force and now < cur + EVIDENCE_EVERY_MS))):
        return
    if defer:
        st.evidence_due = max(now, st.evidence_due or 0)
        return
    with db.transaction(st.conn):
        db.set_meta(st.conn, "clock_evidence", now)
    st.clock_evidence = now


def write_due_meta(st) -> int | None:
    """Inside the caller's transaction: the deferred evidence reading, if any. Returns it, for
    `due_meta_committed` once the transaction committed."""
    due = st.evidence_due
    if due is not None and (st.clock_evidence is None or due > st.clock_evidence):
        db.set_meta(st.conn, "clock_evidence", due)
        return due
    return None


def due_meta_committed(st, due: int | None) -> None:
    if due is not None:
        st.clock_evidence = max(due, st.clock_evidence or 0)
        if st.evidence_due is not None and st.evidence_due <= due:
            st.evidence_due = None


def require_trusted_clock(st, what: str, *, override: bool = False, wait_s: float = 0,
                          now: int | None = None, strict: bool = False) -> dict:
    """Eviction and horizon changes need a trustworthy wall clock: wait up
    to `wait_s` for one, else refuse (ClockUntrusted). Returns the clock's assessment; a
    trusted reading is recorded as evidence."""
    a = wait_trusted_clock(st, what, override, wait_s, now, strict)
    if a["trusted"]:
        record_clock_evidence(st, a["now_ms"], force=True, assessed=a)
    return a


def hlc_meta(v) -> tuple[int, int] | None:
    if not v:
        return None
    p, l = str(v).split(".")
    return int(p), int(l)
