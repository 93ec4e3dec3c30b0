"""Opening a node's state: built from the store, the clock resumed above everything this site
may have released (agent/nodeclock.py), and, for a writing open, the repairs a crash or an
older home leaves for it: the log sealed at rest, stale views, the rows brought in line with
the trust they reflect, held events released for tables that exist, signed events and records
the store lacks applied through the one apply path (persist-before-release), the journal
re-sealed, and a restored home's history asked of its peers again."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from firmware_bridge import EventIdentity

from . import apply, clockgap, identity as ident, nodeclock, produce, records_apply, rehydrate, trust
from .applypipeline import Pipeline
from .clockstate import now_ms
from .core import events as ev
from .nodestate import NodeState
from .store import atrest, db, eventlog, reports, rows as rowstore, sync_state

log = logging.getLogger("ssp_agent")


def start(home: Path, conn, bridge, log_seal: atrest.LogSeal | None, read_only: bool) -> NodeState:
    """The state a node runs on, its repairs done (none in a read view: they write)."""
    if log_seal is not None:
        atrest.install(conn, log_seal)
    st = NodeState(home, conn, bridge, log_seal, read_only, Pipeline())
    if not read_only:   # a read view writes nothing (an older layout is read as it is)
        db.scrub_superseded(conn, st.profile.secure_delete)
        db.ensure_held_counts(conn)
    st.reload_caches()
    st.witness = ident.ClockWitness(st.site_id)
    st.clock = nodeclock.resume_clock(st)
    clockgap.resume(st)   # inside the gap a wrong clock left, if it issues there
    if read_only:
        return st   # a read view: the repairs below write, and are left to the next writing open
    repair(st)
    return st


def repair(st: NodeState) -> None:
    conn, log_seal = st.conn, st.log_seal
    if log_seal is not None and atrest.pending(conn) is not None:
        # A store written before the log was sealed, or a data-key rotation: (re)seal every
        # row in batches, each committed with its cursor (a crash resumes here).
        done = atrest.reseal(conn, log_seal)
        log.warning("event log sealed at rest under data key %d (%d rows rewritten)",
                    log_seal.sealer.current, done["rewritten"])
    stale = rowstore.stale_views(conn, [t.tdef for t in st.tables.values()])
    if stale:  # views made before they carried "C$state" (docs/apply.md)
        with db.transaction(conn):
            for tdef in stale:
                rowstore.create_view(conn, tdef)
    if trust.trust_changed(st):  # e.g. a home written before trust changes were rebuilt
        with db.transaction(st.conn):
            trust.reconcile_trust(st, now_ms())
    # A crash between creating a table and releasing its held events: finish it now.
    for q in eventlog.held_tables(conn):
        if q in st.tables:
            apply.retry_held(st, q)
    if st.bridge is not None:
        recover_released(st)
        if log_seal is not None:
            if atrest.journal_pending(conn):
                # a migrated store or a rotation: compaction re-seals the journal's outputs
                # under the current key, after which the older keys can go
                produce.compact_journal(st)
                atrest.journal_resealed(conn)
            atrest.drop_retired_keys(conn, log_seal)
        redeliver_if_restored(st)


def redeliver_if_restored(st) -> None:
    """A home restored from an older copy lost events it had applied, and its peers' cursors
    are past them: ask every peer to offer its history again (a rehydrate request that keeps
    the horizons, agent/rehydrate.py). Detected by the applied count kept beside the witness,
    outside the home. The node's own events signed after the copy cannot come back to it
    (§32.1 drops them unconditionally); peers keep them, and the lost-history floor keeps
    receivers from counting them as held here (docs/protocol.md §3)."""
    mirrored = st.witness.read_applied()
    if mirrored is None or mirrored <= st.applied:
        return
    log.warning("this home applied %d events before and holds %d now (restored from an older copy?): "
                "asking peers to offer their history again", mirrored, st.applied)
    rehydrate.start(st, None, reset=False, cause="restored_home")
    with db.transaction(st.conn):
        st.applied = mirrored
        db.set_meta(st.conn, "applied_count", mirrored)
        reports.surface(st.conn, now_ms(), "restored_home", "applied_count_behind_witness",
                        json.dumps({"applied_before": mirrored}))


def recover_released(st) -> None:
    """A crash between the bridge's release and the apply left signed, persisted local events
    the log lacks: apply them through the one apply path (docs/keystore.md), then compact the
    journal for everything the log now holds."""
    events: list[bytes] = []
    records: list[bytes] = []   # control records this node signed (authority, rehydrate, truncation)
    for identity, raw in st.bridge.iter_released():   # one read of the journal
        if isinstance(identity, EventIdentity) and identity.site_id == st.site_id:
            (events if produce.is_event(raw) else records).append(raw)
    missing = [raw for raw in events if apply.known(st, ev.event_id(raw)) is None]
    if missing:
        log.warning("applying %d local event(s) released before a crash but never applied", len(missing))
        apply.apply_batch(st, missing, origin="local")
    # Control records the store lacks: store them, so a re-issue extends their chain.
    records = [raw for raw in records if not produce.record_held(st, raw)]
    if records:
        sync_state.ensure_schema(st.conn)
        log.warning("storing %d control record(s) released before a crash but never stored", len(records))
        records_apply.apply_records(st, records, now_ms())
    rehydrate.abandon_unreleased(st)   # a rehydration start killed before its release
    # Compaction rewrites the journal (two fsyncs: the new file, its directory). On open only
    # after a recovery or once the journal outgrew JOURNAL_OPEN_COMPACT_BYTES: a `write` per
    # process would otherwise pay both for the one entry the previous one left. The entries that wait are
    # read by every open (above), which the bound keeps cheap.
    if missing or records or st.bridge.journal_stats()["bytes"] > produce.JOURNAL_OPEN_COMPACT_BYTES:
        produce.compact_journal(st)
