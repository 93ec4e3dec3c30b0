"""Records processing: the control records a body (or a crash recovery) brings, verified and
stored each on its own (docs/protocol.md §5), with what that changes returned as **effects**
for the caller to act on, never by calling up into the node or the sync driver:

- `trust_changed`: a record this node did not hold was stored; the keyring overlay and the rows
  under the new trust must be rebuilt (`records_apply.apply_records` does it in the same transaction);
- `widened`: (peer, table) pairs a role record widened; their backfill jobs are enqueued here,
  the truncation records they may need are the caller's (they sign through the keystore bridge);
- `subjects_reset` (from agent/rehydrate.py `handle_records`): the peers whose cursors a
  rehydrate request reset.

Below agent/records_apply.py and agent/sync.py; it reads the node's state (conn, site_id, mesh_id,
authorities, keyring, tables) and calls none of its methods."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from . import policy
from .core.records import RecordError, record_hash, verify_record
from .mailbox import verify_ack
from .store import db, reports, sync_state as st

log = logging.getLogger("ssp_agent.sync")


@dataclass
class RecordEffects:
    trust_changed: bool = False
    widened: list[tuple[bytes, str]] = field(default_factory=list)
    subjects_reset: list[bytes] = field(default_factory=list)


def issuer_key(conn, site_id: bytes, issuer: bytes) -> bytes | None:
    """An authority's key from the provisioned keyring (never from a vouch: a record cannot vouch
    for its own issuer)."""
    if issuer == site_id:
        return bytes(db.get_meta(conn, "public_key"))
    return reports.keyring_key(conn, issuer)


def surface(conn, now: int, kind: str, reason: str, detail: dict) -> None:
    reports.surface(conn, now, kind, reason, json.dumps(detail, sort_keys=True))


def store_authority_records(node, raws: list, now: int) -> tuple[dict, RecordEffects]:
    """Vouch, retire and role records: inside the caller's transaction, each verified on its own
    (a bad one is dropped and surfaced without affecting the rest), stored, forks surfaced, and a
    widening a role record makes enqueued as backfill (scope §2). Returns the counts and effects."""
    out = {"stored": 0, "known": 0, "dropped": 0, "forks": 0, "refused": 0}
    fx = RecordEffects()
    if not raws:
        return out, fx
    conn = node.conn
    before = {k for k, c in st.trust(conn, node.site_id).chains.items() if c.forked}
    # A role record can widen policy (the role layer): such a widening backfills too (scope §2).
    policy_before = policy.snapshot(node)
    retired = st.trust(conn, node.site_id).retired_authorities
    budget = st.RecordBudget(conn, node.site_id)
    for raw in raws:
        if not isinstance(raw, (bytes, bytearray)):
            continue
        if st.has_record(conn, record_hash(bytes(raw))):
            out["known"] += 1
            continue
        try:
            r = verify_record(bytes(raw), node.mesh_id, node.authorities,
                              lambda issuer: issuer_key(conn, node.site_id, issuer))
        except RecordError as e:
            out["dropped"] += 1
            surface(conn, now, "record_dropped", e.reason, {"detail": e.detail})
            continue
        if not budget.admit(r.issuer, r.raw, r.kind, r.record_hash, now):
            out["refused"] += 1   # over the record bound: not stored, surfaced (agent/store/sync_state.py)
            continue
        if r.kind != "retire" and r.issuer in retired:
            # A retired authority issues nothing that counts (docs/protocol.md §5 Trust). Stored
            # all the same, void: what a node holds then stays a function of the records it
            # received (a second key for a site still withdraws that site).
            surface(conn, now, "record_refused", "issuer_retired",
                    {"issuer": r.issuer.hex(), "kind": r.kind, "subject": r.subject.hex(),
                     "record_hash": r.record_hash.hex()})
        if st.put_record(conn, r):
            out["stored"] += 1
            fx.trust_changed = True
            if r.kind == "retire":
                retired = st.trust(conn, node.site_id).retired_authorities
    if fx.trust_changed:
        # A record this node did not hold can make one a peer dropped acceptable there (a vouch
        # admits a subject or issuer): every record goes to every peer again, once.
        st.clear_all_records_delivered(conn)
        for k, c in st.trust(conn, node.site_id).chains.items():
            if c.forked and k not in before:
                out["forks"] += 1
                log.warning("control record fork: %s chain of %s; treated as absent", k[0], k[1].hex())
                surface(conn, now, "record_fork", f"{k[0]}_fork",
                        {"subject": k[1].hex(), "records": [h.hex() for h in c.fork_records]})
        fx.widened = policy.enqueue_widenings(node, policy_before, now)
        if fx.widened:
            out["widened"] = [(p.hex(), q) for p, q in fx.widened]
    return out, fx


def keep_own_acks(node, raws, now: int) -> None:
    """Mailbox answer records this node signed and released but did not store (a crash between
    the two): stored, unpruned, so the signing journal can drop them on this open. Anyone else's
    are taken by the mailbox import only (they speak to one node about its files)."""
    own = bytes(db.get_meta(node.conn, "public_key"))
    with db.transaction(node.conn):
        for raw in raws:
            try:
                a = verify_ack(raw, node.mesh_id, lambda k: (own, None) if k == node.site_id else None)
            except RecordError:
                continue  # someone else's: not taken on this path
            st.put_mailbox_ack(node.conn, record_hash(a["raw"]), a["subject"], a["answers"], a["raw"],
                               a["issued_at"], prune=False)
