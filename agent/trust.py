"""Trust changes (docs/protocol.md §5 Trust): the rows are the merge of the retained events that
count under the current keyring, so a key trusted less (cutoff lowered, removed) or more (a
vouch, a raised cutoff) rebuilds or re-merges the rows it touches; `meta.materialized_trust`
records the keyring the rows reflect. Also the operator's keyring edits (`peer add/remove`).
Functions over the node's state (agent/nodestate.py)."""
from __future__ import annotations

import json
import logging

from . import apply, feed
from .clockstate import now_ms
from .core import cose, events as ev
from .core.merge import below, rebuild_without
from .errors import NodeError
from .outcomes import to_json
from .store import db, eventlog, reports, rows as rowstore, sync_state

log = logging.getLogger("ssp_agent")


def trust_snapshot(st) -> dict:
    return {s.hex(): [pk.hex(), None if c is None else list(c)] for s, (pk, c) in sorted(st.keyring.items())}


def trust_changed(st) -> bool:
    raw = db.get_meta(st.conn, "materialized_trust")
    return raw is None or json.loads(raw) != trust_snapshot(st)


def refresh_trust(st, now: int | None = None) -> dict | None:
    """Re-read the keyring and control records and bring the rows in line (one transaction)."""
    now = now_ms() if now is None else now
    try:
        with db.transaction(st.conn):
            st.reload_caches()
            return reconcile_trust(st, now)
    finally:
        st.reload_caches()


def reconcile_trust(st, now: int) -> dict | None:
    """Inside the caller's transaction, after `reload_caches`: make the rows the merge of the
    retained events that count under the current trust (materialized state is a function of
    the delivered events and records). `meta.materialized_trust` records the
    keyring the rows reflect. Against it: for a signer trusted less now (cutoff lowered, key no
    longer trusted) every row with a clock owned by one of its events that no longer counts is
    rebuilt without them (`merge.rebuild_without`); for a signer trusted more now (a vouch
    whose fork resolved, an operator raising a cutoff) its retained events that count again
    are merged back (merging is idempotent and order-free). Returns a summary, or None."""
    cur = trust_snapshot(st)
    raw = db.get_meta(st.conn, "materialized_trust")
    if raw is not None and json.loads(raw) == cur:
        return None
    if raw is None:
        # Rows made before this record existed may hold effects of any retained event.
        old = {s.hex(): "unknown" for s in eventlog.signers(st.conn)}
    else:
        old = json.loads(raw)
    inf = (float("inf"), 0)

    def cut(e):
        return inf if e[1] is None else tuple(e[1])
    shrunk, grown = [], []
    for h in sorted(set(old) | set(cur)):
        o, n = old.get(h), cur.get(h)
        if o == "unknown":
            if n is None or n[1] is not None:
                shrunk.append(bytes.fromhex(h))
            continue
        if o is not None and (n is None or cut(n) < cut(o) or n[0] != o[0]):
            shrunk.append(bytes.fromhex(h))
        if n is not None and (o is None or cut(n) > cut(o) or n[0] != o[0]):
            grown.append(bytes.fromhex(h))
    summary = {"rows_rebuilt": 0, "events_merged": 0, "partial": 0}
    void = lambda s: not apply.counts(st, s)  # noqa: E731
    for q, tbl in sorted(st.tables.items()):
        for rk, key in tbl.rows.rows_with_clock_of(shrunk):
            state = tbl.rows.load(rk)
            if state is None or not any(void(c) for c in [state.exist_clock, state.tomb_clock,
                                                           *state.cells.values()] if c is not None):
                continue
            rb = rebuild_without(tbl.tdef, state, void, apply.row_events(st, tbl.tdef, rk), tbl.horizon)
            new = rb.state
            if new.exist_clock is None and new.tomb_clock is None and not new.cells:
                tbl.rows.delete(rk)  # nothing that counts ever touched it
            else:
                tbl.rows.save(rk, key, new, rb.writes)
            feed.note_rebuild(st.conn, tbl.tdef, key, rk, state.exists, new.exists, rb.writes, "trust_change",
                              rb.partial)   # the application's change feed, same transaction
            summary["rows_rebuilt"] += 1
            if rb.partial:
                summary["partial"] += 1
                h = tbl.horizon
                reports.surface_table(
                    st.conn, now, "partial_rebuild", "trust_change_below_horizon", q,
                    json.dumps({"row_key": to_json(key), "horizon": f"{h[0]}.{h[1]}", "clocks": rb.partial},
                               sort_keys=True))
    for site in grown:
        for p, l, q, raw in eventlog.events_of(st.conn, site):
            tbl = st.tables.get(q)
            if tbl is None or not apply.counts(st, (p, l, site)) or below((p, l), tbl.horizon):
                continue
            e = ev.event_from_verified(bytes(raw), cose.parse_sign1(bytes(raw)))
            apply.materialize(st, tbl, e, rowstore.row_key_bytes(e.row_key), now)
            summary["events_merged"] += 1
    db.set_meta(st.conn, "materialized_trust", json.dumps(cur, sort_keys=True))
    if summary["rows_rebuilt"] or summary["events_merged"]:
        log.warning("trust changed: %s", summary)
        reports.surface(st.conn, now, "trust_change", "rows_rebuilt",
                        json.dumps({**summary, "less_trusted": [s.hex() for s in shrunk],
                                    "more_trusted": [s.hex() for s in grown]}, sort_keys=True))
    return summary


def add_peer(st, site_id: bytes, public_key: bytes, retired_after: tuple[int, int] | None,
             source: str = "operator", replace: bool = False) -> None:
    if site_id == st.site_id:
        raise NodeError("that is this node's own site_id; a node does not add itself as a peer")
    if len(public_key) != 32:
        raise NodeError("public key must be 32 bytes (Ed25519)")
    known = st.keyring.get(site_id)
    if known is not None and known[0] != public_key and not replace:
        # A different key for a known site_id is either a mistake or a re-keyed device; never silent.
        raise NodeError(f"site {site_id.hex()} is already trusted with another key ({known[0].hex()}); "
                        "pass --replace to replace it (events it signed with the old key stay valid)")
    try:
        with db.transaction(st.conn):
            sync_state.put_keyring(st.conn, site_id, public_key, retired_after, source)
            st.reload_caches()
            reconcile_trust(st, now_ms())  # a lowered cutoff removes what no longer counts
    finally:
        st.reload_caches()


def remove_peer(st, site_id: bytes) -> None:
    """Drop a peer the operator or the manifest put in the keyring. One trusted through a vouch
    record is in-band state: retire it through the mesh authority instead."""
    if site_id == st.site_id:
        raise NodeError("that is this node's own site_id; its key cannot be removed from its keyring")
    if sync_state.keyring_source(st.conn, site_id) is None:
        if site_id in st.keyring:
            raise NodeError(f"site {site_id.hex()} is trusted through a vouch record; retire it with the "
                            "mesh authority (`record issue-retire`)")
        raise NodeError(f"site {site_id.hex()} is not in the keyring (`peer list` shows it)")
    try:
        with db.transaction(st.conn):
            sync_state.drop_keyring(st.conn, site_id)
            st.reload_caches()
            reconcile_trust(st, now_ms())  # its events no longer count: rows rebuilt without them
    finally:
        st.reload_caches()
