"""Rehydration: a node drops its eviction horizons back to zero and takes the history back from the
peers that still hold it (scope excerpt §3, §13.5; docs/protocol.md §8).

The trigger must make a peer re-offer history its cursor has passed, over every transport, and
SSP/1's strict parsing forbids new message members, so it travels as a self-signed control record
in `records` (`sovm/ssp-rehydrate-v1`: subject, generation, predecessor hash, requested_at). A
peer that verifies it handles each generation of a subject once: it resets its per-path cursors
for the subject to genesis, forgets the watermarks the subject reported, stops filtering out
events the subject once delivered to it, and keeps and forwards the record so it reaches peers
through relays.

The subject's side (`start`) zeroes its horizons (`eviction.reset_horizons_in_txn`, the only way a
horizon moves down), clears its own applied watermarks, issues the record, and counts what arrives.
Functions over the node's state (agent/nodestate.py): they call no method of the node."""
from __future__ import annotations

import json
import logging
import sqlite3
from typing import Any

from . import eviction, policy, produce
from .clockstate import now_ms
from .core import reasons as R
from .core.classify import classified
from .core.codec import INT64_MAX, decode_strict, encode
from .core.cose import ALG_EDDSA, content_type, parse_sign1, protected_header, sig_structure
from .core.records import RecordError, record_hash, verify_signed_by_site
from .store import db
from .store import rehydration as rs
from .store.reports import surface

log = logging.getLogger("ssp_agent.rehydrate")

CONTENT_TYPE = "sovm/ssp-rehydrate-v1"
_MEMBERS = frozenset({"subject_site_id", "generation", "previous_record_hash", "requested_at"})
_STATE_KEY = "rehydration"
_PENDING_KEY = "rehydration_pending"   # a start whose request may be released and not yet committed


class RehydrateRecordError(ValueError):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def is_rehydrate_record(raw: Any) -> bool:
    return content_type(raw) == CONTENT_TYPE


def to_be_signed(subject: bytes, mesh_id: bytes, generation: int, previous: bytes | None,
                 requested_at: int) -> tuple[bytes, bytes, bytes]:
    protected = protected_header(ALG_EDDSA, CONTENT_TYPE, subject)
    payload = encode({"subject_site_id": subject, "generation": generation, "previous_record_hash": previous,
                      "requested_at": requested_at})
    return protected, payload, sig_structure(protected, mesh_id, payload)


@classified(lambda reason, detail: RehydrateRecordError(reason), RehydrateRecordError)
def verify(raw: bytes, mesh_id: bytes, keyring: dict) -> dict:
    """The rehydrate record boundary. Check one rehydrate record on its own. Raises RehydrateRecordError (dropped and surfaced).
    A retired device's key is refused like an unknown one: it never pulls history again."""
    try:
        raw, s, p = verify_signed_by_site(raw, mesh_id, CONTENT_TYPE, "rehydrate", _MEMBERS, keyring.get)
    except RecordError as e:
        raise RehydrateRecordError(e.reason) from None
    subj, gen, prev, at = p["subject_site_id"], p["generation"], p["previous_record_hash"], p["requested_at"]
    if subj != s.kid:
        raise RehydrateRecordError("not_self_signed")
    # generation and requested_at reach the store: bounded by SQLite's signed 64-bit
    if not isinstance(gen, int) or isinstance(gen, bool) or not 0 <= gen <= INT64_MAX:
        raise RehydrateRecordError("bad_generation")
    if prev is not None and not (isinstance(prev, bytes) and len(prev) == 32):
        raise RehydrateRecordError("bad_previous_record_hash")
    if (gen == 0) != (prev is None):
        raise RehydrateRecordError("bad_genesis")
    if not isinstance(at, int) or isinstance(at, bool) or not 0 <= at <= INT64_MAX:
        raise RehydrateRecordError("bad_requested_at")
    return {"subject": subj, "generation": gen, "previous": prev, "requested_at": at,
            "record_hash": record_hash(bytes(raw)), "raw": bytes(raw)}


# ---------------------------------------------------------------- store helpers
def latest_requests(conn: sqlite3.Connection) -> list[tuple[bytes, bytes]]:
    """(record_hash, raw) of the latest rehydrate record held per subject (forwarded in every
    body's `records`)."""
    return rs.latest_requests(conn)


def record_raws(conn: sqlite3.Connection) -> list[bytes]:
    return [raw for _h, raw in latest_requests(conn)]


def handle_records(node, raws: list, now: int) -> dict:
    """Verify rehydrate records (each on its own) and act on a new generation once. Runs inside
    `records_apply.apply_records`, before the body's events. Its effect, the subjects whose cursors were
    reset (`subjects_reset`, hex), is returned for the caller to act on (truncation records)."""
    from .store import sync_state as st
    conn = node.conn
    out = {"stored": 0, "known": 0, "dropped": 0, "reset": 0, "refused": 0}
    budget = st.RecordBudget(conn, node.site_id)
    for raw in raws:
        h = record_hash(bytes(raw))
        if rs.has_request(conn, h):
            out["known"] += 1
            continue
        if parse_sign1(bytes(raw)).kid == node.site_id:
            # our own record coming back: keep it (it travels on), never act on it
            try:
                r = verify(raw, node.mesh_id, {node.site_id: (node_public_key(node), None)})
            except RehydrateRecordError:
                out["dropped"] += 1
                continue
            p = pending(conn)
            if p is not None and p["generation"] == r["generation"]:
                # recovered from the signing journal after a kill between its release and the
                # commitment: finish that start here, in the transaction that stores (and so serves) it
                log.warning("finishing the rehydration start (generation %d) a crash interrupted", r["generation"])
                _commit_start(node, r, p)
            else:
                _store(conn, r)
            out["stored"] += 1
            continue
        try:
            r = verify(raw, node.mesh_id, node.keyring)
        except RehydrateRecordError as e:
            out["dropped"] += 1
            surface(conn, now, "record_dropped", e.reason, json.dumps({"type": CONTENT_TYPE}))
            continue
        if not budget.admit(r["subject"], r["raw"], CONTENT_TYPE, r["record_hash"], now):
            out["refused"] += 1   # over the record bound: neither stored nor acted upon
            continue
        _store(conn, r)
        out["stored"] += 1
        done = st.rehydrate_generation(conn, r["subject"])
        if done is not None and r["generation"] <= done:
            continue  # once per generation
        # its cursors and reported watermarks reset; it may have lost its records too: sent again
        upto = rs.serve(conn, r["subject"], r["generation"], now)
        rs.surface_about(conn, now, "rehydration_served", "cursors_reset", r["subject"],
                         json.dumps({"generation": r["generation"], "upto_seq": upto}))
        out["reset"] += 1
        out.setdefault("subjects_reset", []).append(r["subject"].hex())
    return out


def _store(conn: sqlite3.Connection, r: dict) -> None:
    rs.put_request(conn, r)


def node_public_key(node) -> bytes:
    return bytes(db.get_meta(node.conn, "public_key"))


# ---------------------------------------------------------------- the rehydrating node
def state(conn: sqlite3.Connection) -> dict | None:
    r = db.get_meta(conn, _STATE_KEY)
    return None if r is None else json.loads(r)


def _set_state(conn: sqlite3.Connection, s: dict) -> None:
    db.set_meta(conn, _STATE_KEY, json.dumps(s, sort_keys=True))


def pending(conn: sqlite3.Connection) -> dict | None:
    """The start in progress: committed before its request is released, gone with its commitment."""
    r = db.get_meta(conn, _PENDING_KEY)
    return None if r is None else json.loads(r)


def start(node, from_peer: bytes | None, now: int | None = None, *, reset: bool = True,
          cause: str = "operator") -> dict:
    """Zero this node's horizons, clear its own watermarks, issue the next rehydrate record and
    start counting what arrives. Returns the new state."""
    from .store import sync_state as st
    now = now_ms() if now is None else now
    # --from need not be trusted yet: a new device learns its peers' keys from the vouch records
    # that arrive with the first body (records are processed before events).
    st.ensure_schema(node.conn)
    prev = rs.last_request(node.conn, node.site_id)
    gen, prev_hash = (0, None) if prev is None else (prev[0] + 1, prev[1])
    # The start is noted before the request is released: a kill after the release leaves the
    # request in the signing journal, whose recovery stores it (and so serves it) on the next
    # open; that recovery finds this note and makes the same commitment (`handle_records`).
    p = {"generation": gen, "from": from_peer.hex() if from_peer else None, "started_ms": now,
         "reset": reset, "cause": cause}
    with db.transaction(node.conn):
        db.set_meta(node.conn, _PENDING_KEY, json.dumps(p, sort_keys=True))
    _crash_point("noted")
    # A fresh signing identity: persist-before-release, like any release.
    raw = produce.issue_record(node, to_be_signed(node.site_id, node.mesh_id, gen, prev_hash, now), now)
    _crash_point("released")
    try:
        with db.transaction(node.conn):
            s = _commit_start(node, verify(raw, node.mesh_id, {node.site_id: (node_public_key(node), None)}), p)
    except BaseException:
        node.reload_caches()  # the in-memory horizons were lowered with the rolled-back statements
        raise
    return s


def _commit_start(node, r: dict, p: dict) -> dict:
    """One commitment, inside the caller's transaction (docs/operations.md §4, "If `rehydrate`
    is interrupted"): horizons to zero, our watermarks gone (fail closed: they were claims made
    below the old horizon), the request stored (from then on it is served) and the state set.
    Apart, a request served under a standing horizon brings history that lands below it, and
    stale watermarks make serving peers skip exactly the requested history."""
    if p["reset"]:  # a restored home (`reset=False`) keeps its horizons and its consistent watermarks
        eviction.reset_horizons_in_txn(node)
        _crash_point("horizons_reset")
        rs.forget_own_watermarks(node.conn)
    _store(node.conn, r)
    s = {"generation": r["generation"], "from": p["from"], "started_ms": p["started_ms"],
         "events_received": 0, "events_unverified": 0, "events_applied": 0, "events_duplicate": 0, "events_below_horizon": 0,
         "bodies": 0, "bodies_from_source": 0, "last_body_events": None, "rows_at_start": _row_counts(node),
         "record_hash": r["record_hash"].hex(), "caught_up": False, "cause": p["cause"]}
    _set_state(node.conn, s)
    db.del_meta(node.conn, _PENDING_KEY)
    return s


def abandon_unreleased(node) -> None:
    """After the journal's recovery: a start still noted released no request (killed before the
    release returned), so nothing of it left the node; it is dropped and the horizons stand."""
    p = pending(node.conn)
    if p is not None:
        log.warning("a rehydration start (generation %d) was interrupted before its request was issued: "
                    "nothing changed; run `rehydrate` again", p["generation"])
        with db.transaction(node.conn):
            db.del_meta(node.conn, _PENDING_KEY)


def _crash_point(name: str) -> None:
    """Tests name a point here to SIGKILL a real process at it (tests/crashpoint.py)."""
    if _CRASH_HOOK is not None:
        _CRASH_HOOK(name)


_CRASH_HOOK = None


def note_body(conn: sqlite3.Connection, sender: bytes, outcomes: list, source_trusted: bool) -> None:
    """Count what a body brought while a rehydration runs (called by SyncDriver after apply)."""
    verified = [o for o in outcomes if o.verified]
    note_counts(conn, sender, len(verified), sum(1 for o in verified if o.status == "applied" and o.reason == R.APPLIED),
                sum(1 for o in verified if o.reason == R.BELOW_HORIZON),
                sum(1 for o in verified if o.status == "duplicate"), len(outcomes) - len(verified), source_trusted)


def note_counts(conn: sqlite3.Connection, sender: bytes, received: int, applied: int, below: int, dup: int,
                unverified: int, source_trusted: bool) -> None:
    """`note_body` from counts (a mailbox import applies a body a window at a time). `received`:
    the events whose signature verified (§12.1); the others (a forged or unknown signer, bytes that
    are no event) are `events_unverified`, never received. A body counts as the source's only while
    the source is trusted (its key in the keyring, a vouch in that body included): the sender a body
    names is not authenticated, and `--from` may name a site not trusted yet (docs/protocol.md §8)."""
    s = state(conn)
    if s is None or s.get("finished_ms"):
        return
    s["events_received"] += received
    s["events_unverified"] = s.get("events_unverified", 0) + unverified   # a state from before it was counted
    s["events_applied"] += applied
    s["events_below_horizon"] += below
    s["events_duplicate"] += dup
    s["bodies"] += 1
    if s.get("from") == sender.hex() and source_trusted:
        s["bodies_from_source"] += 1
        s["last_body_events"] = received
        # A body from the source with nothing new after it has sent something: caught up
        # (as far as this node can know; the source's own status shows what remains there).
        s["caught_up"] = s["bodies_from_source"] > 1 and applied == 0
    with db.transaction(conn):
        _set_state(conn, s)


def _row_counts(node) -> dict[str, int]:
    return {q: len(t.rows.dump()) for q, t in sorted(node.tables.items())}


def status(node) -> dict:
    """Progress of this node's own rehydration (rows and events received) and, for peers that
    asked this node for their history, what remains to send them (known here exactly)."""
    from .store import sync_state as st
    st.ensure_schema(node.conn)
    s = state(node.conn)
    out: dict[str, Any] = {"site_id": node.site_id.hex(), "rehydrating": None, "serving": []}
    if s is not None:
        rows_now = _row_counts(node)
        s = dict(s)
        s["rows_now"] = rows_now
        s.setdefault("events_unverified", 0)
        s["source_trusted"] = s["from"] is not None and bytes.fromhex(s["from"]) in node.keyring
        s["rows_received"] = sum(max(0, rows_now.get(q, 0) - s["rows_at_start"].get(q, 0)) for q in rows_now)
        s["horizons"] = {q: f"{t.horizon[0]}.{t.horizon[1]}" if t.horizon else "0.0" for q, t in node.tables.items()}
        s["remaining"] = ("unknown here; run `rehydrate --status` on the source" if not s["caught_up"] else 0)
        # Rows a serving peer declared incomplete (its horizon) and every partial rebuild surfaced here.
        s["partial_rebuilds"], s["partial_from_serving_peers"] = rs.partial_rebuilds(node.conn)
        out["rehydrating"] = s
    out["truncations"] = truncation_summary(node.conn, node.site_id)
    for subj, gen, upto, at in rs.served(node.conn):
        paths = rs.remaining_by_path(node.conn, subj, upto)
        out["serving"].append({"subject": subj.hex(), "generation": gen, "reset_ms": at, "upto_seq": upto,
                               "remaining_events_by_path": paths,
                               "remaining_events": min(paths.values()) if paths else
                               rs.remaining(node.conn, subj, upto)})
    return out


# ---------------------------------------------------------------- truncation records (the serving side)
# A peer that serves history (a rehydration, a widening backfill) from a log it has evicted below a
# horizon tells the subject which rows it cannot re-send in full: a signed `sovm/ssp-truncated-v1`
# record per table (agent/core/records.py, docs/protocol.md §8). The subject surfaces each named
# row as `partial_rebuild` (reason `serving_peer_horizon`): never silently incomplete.
from .store.sync_state import TRUNCATION_DDL as _TRUNC_DDL  # noqa: E402 (also made by the store migration to version 2)


def _ensure_trunc(conn: sqlite3.Connection) -> None:
    conn.execute(_TRUNC_DDL)


def truncated_rows(node, subject: bytes, tables: list[str] | None = None) -> dict[str, tuple[tuple[int, int], list[bytes]]]:
    """Per table with a horizon (policy-allowed to `subject`), the rows whose materialized state
    this node cannot fully re-send: a column, existence or tombstone clock whose owning event is no
    longer in its retained log, or a tombstone clock below the horizon. {table: (horizon, [_rk])}."""
    from .core.merge import below
    from .core.schema import SYNCABLE
    from .store import rows as rowstore
    allowed = policy.allowed_fn(node.conn, node.tables, subject)
    out: dict[str, tuple[tuple[int, int], list[bytes]]] = {}
    for q, t in sorted(node.tables.items()):
        if t.horizon is None or t.tdef.category != SYNCABLE or (tables is not None and q not in tables):
            continue
        if not allowed(q):
            continue  # never name rows of a table this peer may not receive
        base = rowstore.q(rowstore.base_name(t.tdef))
        clocks = ["_tomb_c", "_ex_c"] + [rowstore.q("_c_" + c) for c in t.tdef.value_columns]
        rks = []
        for r in rs.row_clocks(node.conn, base, clocks):
            tomb = rowstore.unpack_stamp(r[1])
            bad = tomb is not None and below((tomb[0], tomb[1]), t.horizon)
            if not bad:
                for b in r[1:]:
                    if b is None:
                        continue
                    p, l, sid = rowstore.unpack_stamp(b)
                    if not rs.has_event(node.conn, sid, q, p, l):
                        bad = True
                        break
            if bad:
                rks.append(bytes(r[0]))
        if rks:
            out[q] = (t.horizon, rks)
    return out


def issue_truncations(node, subject: bytes, tables: list[str] | None = None, now: int | None = None,
                      cause: str = "rehydration") -> list[bytes]:
    """Sign and store the truncation records for `subject` (nothing when this node has no horizon,
    e.g. a gateway). Signed with the node's event key through the keystore bridge under fresh HLC
    identities (persist-before-release), like every record this node issues. Must run outside a
    transaction. The records travel in every body from then on."""
    from .core import records as rec
    now = now_ms() if now is None else now
    found = truncated_rows(node, subject, tables)
    if not found:
        return []
    raws = []
    for q, (h, rks) in found.items():
        tdef = node.tables[q].tdef
        keys = [decode_strict(rk) for rk in rks]
        for i in range(0, len(keys), rec.MAX_TRUNCATED_ROWS):
            raws.append(produce.issue_record(node, rec.truncation_to_be_signed(
                node.site_id, node.mesh_id, subject, tdef.schema, tdef.name, h, keys[i:i + rec.MAX_TRUNCATED_ROWS], now),
                now))
    own = bytes(db.get_meta(node.conn, "public_key"))
    with db.transaction(node.conn):
        _ensure_trunc(node.conn)
        for raw in raws:
            _store_trunc(node.conn, rec.verify_truncation(raw, node.mesh_id, lambda k: (own, None) if k == node.site_id else None), now)
        rs.surface_about(node.conn, now, "truncation_issued", cause, subject, json.dumps(
            {"tables": {q: {"horizon": f"{h[0]}.{h[1]}", "rows": len(rks)} for q, (h, rks) in found.items()},
             "records": len(raws)}, sort_keys=True))
    log.warning("serving %s (%s) from a log evicted below its horizon: %s", subject.hex(), cause,
                ", ".join(f"{q}: {len(rks)} row(s) below {h[0]}.{h[1]}" for q, (h, rks) in found.items()))
    return raws


def announce_truncations(node, widened: list[tuple[bytes, str]], now: int) -> None:
    """Backfill from a log evicted below a horizon: tell each peer which rows it cannot get in full."""
    for p in sorted({p for p, _ in widened}):
        issue_truncations(node, p, [q for pp, q in widened if pp == p], now=now, cause="widening_backfill")


def _store_trunc(conn: sqlite3.Connection, t, now: int) -> bool:
    return rs.put_truncation(conn, t)


def truncations_for(conn: sqlite3.Connection, subject: bytes | None = None) -> list[tuple[bytes, bytes]]:
    """(record_hash, raw) of the truncation records for a body to `subject` (only those addressed
    to it); with no subject (a body for nobody in particular) none."""
    return [] if subject is None else rs.truncations_for(conn, subject)


def truncation_raws(conn: sqlite3.Connection, subject: bytes | None = None) -> list[bytes]:
    return [raw for _h, raw in truncations_for(conn, subject)]


# ---------------------------------------------------------------- truncation records (the receiving side)
def handle_truncations(node, raws: list, now: int) -> dict:
    """Verify truncation records (each on its own; issuer in the keyring and not retired), store
    them, and, for records addressed to this node, surface every named row as a partial rebuild.
    Runs inside the caller's transaction, after the body's authority records (a vouch in the same
    body admits the issuer). Records for other subjects are stored and forwarded only."""
    from .core.records import RecordError, record_hash as rh, verify_truncation
    from .outcomes import to_json
    _ensure_trunc(node.conn)
    out = {"stored": 0, "known": 0, "dropped": 0, "surfaced_rows": 0, "refused": 0}
    own = node_public_key(node)
    from .store.sync_state import RecordBudget
    budget = RecordBudget(node.conn, node.site_id)

    def entry_of(kid: bytes):
        return (own, None) if kid == node.site_id else node.keyring.get(kid)

    for raw in raws:
        if not isinstance(raw, (bytes, bytearray)):
            continue
        if rs.has_truncation(node.conn, rh(bytes(raw))):
            out["known"] += 1
            continue
        try:
            t = verify_truncation(bytes(raw), node.mesh_id, entry_of)
        except RecordError as e:
            out["dropped"] += 1
            surface(node.conn, now, "record_dropped", e.reason, json.dumps({"type": "sovm/ssp-truncated-v1",
                                                                            "detail": e.detail}))
            continue
        if not budget.admit(t.issuer, t.raw, "sovm/ssp-truncated-v1", t.record_hash, now):
            out["refused"] += 1   # over the record bound: not stored, its rows not surfaced as partial
            continue
        _store_trunc(node.conn, t, now)
        out["stored"] += 1
        if t.subject != node.site_id:
            continue
        h = f"{t.horizon[0]}.{t.horizon[1]}"
        rs.surface_rows(node.conn, now, "partial_rebuild", "serving_peer_horizon", t.issuer, t.table,
                        [json.dumps({"row_key": to_json(k), "table": t.table, "serving_peer": t.issuer.hex(), "horizon": h,
                                     "record_hash": t.record_hash.hex()}, sort_keys=True) for k in t.row_keys])
        out["surfaced_rows"] += len(t.row_keys)
        log.warning("%d row(s) of %s served by %s depend on history below its horizon %s: partial rebuilds",
                    len(t.row_keys), t.table, t.issuer.hex(), h)
    return out


def truncation_summary(conn: sqlite3.Connection, site_id: bytes) -> dict:
    """Rows flagged to this node by serving peers, per (peer, table), and what this node declared
    to the subjects it served (distinct rows; the highest horizon named)."""
    groups: dict[tuple[str, bytes, str], tuple[tuple[int, int], set]] = {}
    for issuer, subject, q, p, l, raw in rs.truncations_of(conn, site_id):
        side, other = ("received", issuer) if subject == site_id else ("issued", subject)
        rks = decode_strict(parse_sign1(raw).payload_bytes)["row_keys"]
        h, rows = groups.get((side, other, q), ((0, 0), set()))
        rows |= {encode(k) for k in rks}
        groups[(side, other, q)] = (max(h, (p, l)), rows)
    out: dict[str, list] = {"received": [], "issued": []}
    for (side, other, q), (h, rows) in sorted(groups.items()):
        out[side].append({"serving_peer" if side == "received" else "subject": other.hex(), "table": q,
                          "horizon": f"{h[0]}.{h[1]}", "rows": len(rows)})
    return out
