"""Producing what this node signs: the only place that ticks its HLC and signs with its event key.

Every event and record the node issues gets a fresh HLC identity (the durable in-home ceiling
first), is released through the keystore bridge (durable intent, signature, persisted output:
persist-before-release, SOVM §22.5) and its HLC is witnessed outside the home before it can leave
the node. Applying what was issued stays with the caller. The functions take the node as their
state (its conn, clock, bridge, witness and ids); the node's own housekeeping (clock evidence,
journal compaction) is reached through its public methods.
"""
from __future__ import annotations

import threading

from firmware_bridge import EventIdentity, OutcomeUnknown

from . import apply, clockstate, gapwitness, nodeclock
from .core import cose, events as ev
from .core.clock import signing_time as clock_signing_time
from .core.records import is_ack, record_hash
from .core.codec import DecodeError
from .core.merge import below
from .errors import NodeError
from .store import clockgaps, db, sync_state

EVENT_KEY = "events"  # the key name of the node's event-signing key in its keystore
JOURNAL_COMPACT_BYTES = 4 * 2**20  # compact the signing journal when it grew this much since the last time
JOURNAL_OPEN_COMPACT_BYTES = 64 * 2**10  # on open, compact only a journal larger than this (or after a recovery)
WITNESS_ASIDE_MIN = 64  # a group this large signs longer than the witness's fdatasync: witnessed aside (WitnessAside)


def issue_record(node, to_be_signed: tuple[bytes, bytes, bytes], now: int, authority=None) -> bytes:
    """One control record (`to_be_signed` = its protected header, payload and Sig_structure, as
    the record's `*_to_be_signed` builds them), signed and persisted before it is returned: by this
    node under a fresh HLC identity, or by a standalone `authority` (agent/authority.py) through its
    own bridge. The caller stores or applies it."""
    protected, payload, tbs = to_be_signed

    def assemble(sig: bytes) -> bytes:
        return cose.assemble(protected, payload, sig)

    if authority is not None:
        return authority.sign(tbs, assemble, now)
    return release_signed(node, tbs, assemble, now)


def release_signed(node, tbs: bytes, assemble, now: int) -> bytes:
    """Sign one control record (rehydrate, truncation, mailbox answer, authority records) under a fresh HLC
    identity through the bridge (persist-before-release), then witness the HLC before the
    record can leave the node."""
    hlc = tick(node, signing_now(node, now))
    raw = node.bridge.release(EventIdentity(node.site_id, hlc[0], hlc[1]), EVENT_KEY, tbs, assemble)
    witness(node, hlc)
    compact_journal_if_grown(node)  # MQTT acknowledgements are signed per answer and stored nowhere else
    return raw


def issue_events(node, payloads: list[tuple], now: int, built: list | None = None) -> list[bytes]:
    """Sign and persist one group of local events (one `release_many`): `payloads` are (table
    definition, key, values or None, operation), checked by the caller. `built`, when given,
    receives what each event was built from: (protected, payload bytes, table, key, values,
    operation, hlc, the COSE_Sign1's bytes before its signature, the row key's encoding)."""
    assert node.bridge is not None, "node opened without a keystore bridge"
    site, mesh = node.site_id, node.mesh_id
    protected = cose.protected_header(cose.ALG_EDDSA, ev.EVENT_CONTENT_TYPE, site)
    payload_bytes, sig_structure, prefix_of = ev.payload_bytes, cose.sig_structure, cose.assemble_prefix
    text_map = ev.text_map
    for _attempt in range(8):
        items = []
        parts = []
        for t, key, values, op in payloads:
            hlc = tick(node, now)
            rk = text_map(key)   # the row's address too (rows.row_key_bytes): encoded once
            # write_many checked the key and values against the table (the shape check's questions)
            pb = payload_bytes(t.schema, t.name, key, op, values, hlc, shape_checked=True, row_key_bytes=rk)
            prefix = prefix_of(protected, pb)   # the COSE_Sign1 up to its signature: assemble = prefix + sig
            items.append((EventIdentity(site, hlc[0], hlc[1]), EVENT_KEY, sig_structure(protected, mesh, pb),
                          prefix.__add__))
            parts.append((protected, pb, t, key, values, op, hlc, prefix, rk))
        top = max(p[6] for p in parts)
        overlap = WitnessAside(node, top) if len(items) >= WITNESS_ASIDE_MIN else None
        try:
            try:
                raws = node.bridge.release_many(items, *(() if overlap is None else (overlap.start,)))
            finally:
                if overlap is not None:
                    overlap.join()
            witness(node, top)   # written aside already (a no-op then), or now
            if built is not None:
                built[:] = parts
            return raws
        except OutcomeUnknown:
            # §13.5 (docs/protocol.md §0): an HLC whose release is unknown is spent; tick past it and
            # sign anew. Inside a gap, past the highest intended there (the journal's GAP low end).
            hi = node.bridge.max_event_hlc(node.site_id)
            gap = node.bridge.event_gap(node.site_id) if node.clock.gap_top is not None else None
            if gap is not None and gap[1] == node.clock.gap_top:
                hi = gap[0]
            if hi is not None:
                node.clock.observe(hi, now)
    raise NodeError("the keystore journal keeps reporting unknown outcomes; check the keystore")


class WitnessAside:
    """`witness` on a thread of its own, started once the batch's intents are durable (the
    witness never lies above what the journal intended: a crash then is no restore), so its
    fdatasync overlaps the signing instead of following it. Joined before anything is
    released to the store; the caller then calls `witness` itself, a no-op unless this failed
    (which it then raises in the caller's thread)."""

    def __init__(self, node, hlc: tuple[int, int]) -> None:
        self.node, self.hlc = node, hlc
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="ssp-witness", daemon=True)
        self.thread.start()

    def run(self) -> None:
        try:
            witness(self.node, self.hlc)
        except BaseException:   # noqa: BLE001 - the caller's own `witness` call raises it again
            pass

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None


def signing_now(node, now: int, defer: bool = False) -> int:
    """The wall-clock input of the next ticks (core/clock.signing_time): bounded by the
    evidence while the clock is not trustworthy; while it is, the reading is new evidence.
    `defer` (local writes): the evidence is written by the write's next transaction (a due
    ceiling's, else the apply's) instead of one of its own: one fsync fewer."""
    st = clockstate.assess(node, now)
    if st["trusted"]:
        nodeclock.record_clock_evidence(node, now, defer=defer, assessed=st)
    evidence = node.clock_evidence
    if not st["trusted"] and evidence is None:
        # Never a trustworthy reading here (a device that never synchronised): the time its
        # peers vouch for is evidence too, so a bad boot ten years ahead does not stamp events
        # every peer rejects (§12 step 2) and the HLC cannot come back from.
        evidence = node.mesh_time()
    return clock_signing_time(now, evidence, st["trusted"])


def tick(node, now: int) -> tuple[int, int]:
    """Issue the next local HLC (the durable in-home ceiling first). Callers release what
    they sign with it through the bridge, then `witness` it before it can leave the node."""
    need = node.clock.needs_ceiling(now)
    if need is not None:
        # Persist the ceiling (and its witness outside the home) before issuing past it; a
        # deferred evidence reading rides in the same commit, and the range a jump leaves unissued
        # (a wrong clock's writes are re-issued there later: clockgap.py).
        jump = node.clock.jump(now)
        with db.transaction(node.conn):
            db.set_meta(node.conn, "clock_ceiling", need)
            if jump is not None:
                clockgaps.add_hole(node.conn, *jump)
            due = nodeclock.write_due_meta(node)
        nodeclock.due_meta_committed(node, due)
        node.clock.set_ceiling(need)
    return node.clock.tick(now)


def witness(node, hlc: tuple[int, int]) -> None:
    """Record a released HLC in the witness outside the home before anything signed with it
    leaves the node (it leaves only from the log or the record store, written after this).
    A crash before this write leaves it in the journal, which the clock resumes above; so the
    witness is above the home's own history only when the home lost some: a restore. Inside a
    clock gap the witness (the highest ever released) lies above it: the gap's own witness
    records what the gap issued (agent/gapwitness.py)."""
    node.witness.advance(hlc)
    top = node.clock.gap_top
    if top is not None and hlc < top:
        gapwitness.advance(node.site_id, top, hlc)


def compact_journal(st) -> dict | None:
    """Drop from the signing journal our released events whose exact bytes the log holds (its
    commits are durable: synchronous=FULL) or that count as applied below their table's
    horizon; the bridge keeps a per-site floor so none of them is ever signed again. The
    events `write_many` applied since the last compaction are known to be in the log without
    reading them back (`logged`); any other entry is read from the journal and looked up."""
    if st.bridge is None:
        return None
    logged = set(st.logged)
    site = st.site_id

    def recorded(identity) -> bool:
        if not isinstance(identity, EventIdentity) or identity.site_id != site:
            return False
        if identity.hlc in logged:
            return True
        raw = st.bridge.released(identity)
        return raw is not None and (
            record_held(st, raw) if not is_event(raw) else
            apply.known(st, ev.event_id(raw)) == "log" or below_own_horizon(st, raw))
    stats = st.bridge.compact_events(recorded)
    st.logged.difference_update(logged)
    st.journal_base = stats["bytes_after"]
    return stats


def record_held(st, raw: bytes) -> bool:
    """A control record this node signed through the bridge (rehydrate, truncation, mailbox answer, authority
    records) that its store holds: done, like an event in the log."""
    if is_ack(raw):
        return True  # an MQTT acknowledgement is done once released: a lost one costs a re-offer
    return sync_state.holds_signed_record(st.conn, record_hash(bytes(raw)))


def below_own_horizon(st, raw: bytes) -> bool:
    try:
        e = ev.event_from_verified(raw, cose.parse_sign1(raw))
    except DecodeError:
        return False
    tbl = st.tables.get(e.table)
    return tbl is not None and below(e.hlc, tbl.horizon)


def compact_journal_if_grown(st) -> None:
    """Compact the signing journal once it grew JOURNAL_COMPACT_BYTES since the last time."""
    if st.bridge.journal_stats()["bytes"] > st.journal_base + JOURNAL_COMPACT_BYTES:
        compact_journal(st)


def is_event(raw: bytes) -> bool:
    """The bridge journal also holds control records this node signed: those are not events."""
    return cose.content_type(raw) == ev.EVENT_CONTENT_TYPE
