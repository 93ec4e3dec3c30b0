"""Control records as a body (or a crash recovery) brings them: sorted by kind, verified and
stored each on its own, and the effects the records processing returns (agent/records_in.py)
acted on in the order the protocol needs (docs/protocol.md §5): trust first, so a vouch
travelling with what it admits counts."""
from __future__ import annotations

from . import rehydrate, records_in, sequencing, trust
from .core.incoming import split_records
from .core.records import ACK as MQTT_ACK, TRUNCATED
from .mailbox import ACK_CONTENT_TYPE
from .store import db


def apply_records(st, raws, now: int) -> dict:
    """Verify and store control records, each on its own (a bad one is dropped and surfaced
    without affecting the rest), and act on what they change. Runs before a body's events so
    a vouch travelling with its subject's events admits them. The processing (agent/records_in.py,
    agent/rehydrate.py, agent/sequencing.py) returns effects; they are acted on here: keyring and
    trust rebuilt in the records' own transaction, then rehydrate requests
    (verified under the new keyring), then the truncation records a widening or a served
    rehydration calls for (signed through the bridge, outside any transaction)."""
    # MQTT acknowledgements speak to one node about one body: the runner takes them from the
    # answer (agent/mqtt_acks.py); anywhere else (recovery from the journal included) they are inert.
    _, raws = split_records(raws, (MQTT_ACK,))
    rh, raws = split_records(raws, (rehydrate.CONTENT_TYPE,))
    tr, raws = split_records(raws, (TRUNCATED,))
    acks, raws = split_records(raws, (ACK_CONTENT_TYPE,))
    sq, raws = split_records(raws, sequencing.CONTENT_TYPES)
    if acks:
        # Mailbox answers are taken by the mailbox import only (they speak to one node about its
        # files). Here: this node's own, released before a crash and not stored (recovery).
        records_in.keep_own_acks(st, acks, now)
    fx = records_in.RecordEffects()
    try:
        with db.transaction(st.conn):
            out, fx = records_in.store_authority_records(st, raws, now)
            if fx.trust_changed:
                # Trust changed: rows become the merge of the retained events that still count
                # (a retire removes its subject's events above the cutoff, whenever it arrives).
                st.reload_caches()
                changed = trust.reconcile_trust(st, now)
                if changed:
                    out["trust"] = changed
    finally:
        if fx.trust_changed:
            st.reload_caches()  # keyring rebuilt from the store, records overlaid
    if rh:
        # After the vouches: a request travelling with the vouch for its subject is verified.
        with db.transaction(st.conn):
            out["rehydrate"] = rehydrate.handle_records(st, rh, now)
        fx.subjects_reset = [bytes.fromhex(s) for s in out["rehydrate"].get("subjects_reset", [])]
    if sq:
        # Receipt heads and sequencer bindings (agent/sequencing.py), after the authority
        # records: a vouch in the same body admits a head's issuer.
        with db.transaction(st.conn):
            out["sequencing"] = sequencing.store_records(st, sq, now)
    if fx.widened:
        rehydrate.announce_truncations(st, fx.widened, now)
    if tr:
        # After the authority records: a vouch in the same body admits the truncation's issuer.
        with db.transaction(st.conn):
            out["truncation"] = rehydrate.handle_truncations(st, tr, now)
    for subj in fx.subjects_reset:
        # Serving a rehydration from a log evicted below a horizon: say which rows are incomplete.
        n = len(rehydrate.issue_truncations(st, subj, now=now, cause="rehydration"))
        if n:
            out["truncation_issued"] = out.get("truncation_issued", 0) + n
    return out
