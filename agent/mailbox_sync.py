"""Sync through files (`mailbox export` / `mailbox import`, docs/protocol.md §6): one body per
file from the mailbox path's cursor, carrying this node's signed answers to the files it
imported; an import applies a window of events at a time through the one apply path, takes the
answers to this node's files (the cursor moves as an MQTT answer moves it, §14.1) and relays
answers meant for other nodes. The file and answer-record formats are agent/mailbox.py's; the
sync driver (agent/sync.py) selects, builds and confirms the bodies."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from firmware_bridge.fsutil import atomic_write

from . import mailbox, produce, rehydrate
from .clockstate import now_ms
from .core import delivery, reasons as R
from .core.incoming import split_records
from .core.messages import SyncBody, parse_body_streamed
from .core.records import RecordError, record_hash
from .outcomes import counts
from .store import db, reports, sync_state as st
from .sync_tokens import token_from_json, token_to_json

MAILBOX_PATH = "mailbox"
# The events a mailbox import applies per batch (one transaction each), by their bytes: bounds the
# import's memory whatever the body holds, and is large enough that the commit
# per window costs little beside the window's verification.
MAILBOX_WINDOW_BYTES = 1 << 20
# `mailbox import` lists at most this many of the events that did not simply apply (the counts
# cover them all; `events_not_listed` says how many more): what it holds and prints stays bounded
MAILBOX_DETAIL_MAX = 1000


def export(drv, peer: bytes, out: Path) -> dict:
    """One sync body for `peer` from the mailbox path's cursor, carrying this node's answer to
    the files it imported from `peer` (agent/mailbox.py). Written whole and durably or not at
    all: OSError, and nothing moved or kept. The cursor does not move here: it moves when
    `peer`'s answer to this file comes back in one of its files (§14.1), so every export
    re-offers what is not yet acknowledged."""
    now = now_ms()
    # This node's answers: to the peer's files first, then to every other node's (files may go
    # round a ring, never straight back: the next node relays them on). Then the answers of
    # other nodes that reached this node, the peer's first.
    ack = answer_record(drv, peer, now)
    others = [answer_record(drv, s, now) for s in st.mailbox_owed_peers(drv.conn)
              if s != peer and s in drv.node.keyring]
    extra = tuple(r for r in [ack, *others] if r is not None) + tuple(st.relayed_mailbox_acks(drv.conn, peer))
    o = drv.build(peer, MAILBOX_PATH, "batch", extra_records=extra)
    write_durably(Path(out), o.body)
    h = mailbox.body_hash(o.body)
    with db.transaction(drv.conn):
        st.put_sent_body(drv.conn, MAILBOX_PATH, h, peer, "mailbox", token_to_json(replace(o.token, sent_key=h)),
                         now)
    return {"peer": peer.hex(), "events": o.n_events, "bytes": len(o.body), "file": str(out),
            "body_hash": h.hex(), "answers": len(st.owed_mailbox_answers(drv.conn, peer)) if ack else 0,
            "cursor": st.cursor(drv.conn, peer, MAILBOX_PATH)[0]}

def answer_record(drv, peer: bytes, now: int) -> bytes | None:
    """The answer record to `peer`'s files imported here (the newest 16), signed through the
    keystore bridge under a fresh identity (persist-before-release, like every record this node
    issues) and stored; the held one is re-used while the answers are unchanged."""
    answers = st.owed_mailbox_answers(drv.conn, peer)
    if not answers:
        return None
    raw = st.mailbox_ack_saying(drv.conn, peer, answers)
    if raw is not None:
        return raw
    node = drv.node
    raw = produce.issue_record(node, mailbox.ack_to_be_signed(node.site_id, node.mesh_id, peer, answers, now), now)
    with db.transaction(drv.conn):
        st.put_mailbox_ack(drv.conn, record_hash(raw), peer, answers, raw, now)
    return raw

def take_answers(drv, sender: bytes, raws, now: int) -> dict:
    """The answer records in a file from `sender`: each verified on its own (issuer's key in the
    keyring, not retired; signature over mesh_id; exact members), else dropped and surfaced. One
    addressed to this node counts for the files this node wrote for its issuer and has not had
    answered (`sent_bodies`): the cursor then moves as the MQTT answer moves it (`confirm`,
    §14.1). It may come from the issuer or through any node that relays it (the signature is
    the issuer's); one addressed to a third node is kept and relayed to it in this node's files."""
    out = {"bodies": 0, "events": 0, "relayed": 0}
    node = drv.node
    for raw in raws:
        try:
            a = mailbox.verify_ack(raw, node.mesh_id, node.keyring.get)
        except RecordError as e:
            with db.transaction(drv.conn):
                _surface(drv.conn, now, "record_dropped", e.reason,
                         {"type": mailbox.ACK_CONTENT_TYPE, "detail": e.detail})
            continue
        issuer, subject = a["issuer"], a["subject"]
        if subject != node.site_id:
            if issuer != node.site_id:
                with db.transaction(drv.conn):
                    out["relayed"] += st.relay_mailbox_ack(drv.conn, subject, issuer, a["issued_at"], a["raw"])
            continue
        for h, k in a["answers"]:
            r = st.sent_body(drv.conn, MAILBOX_PATH, h)
            if r is None or r[0] != issuer:
                continue  # answered already, forgotten, or not a file written for the issuer
            tok, _extra = token_from_json(r[2])
            n = max(0, min(k, len(tok.seqs) + sum(sum(p.counts) for p in tok.bf_parts)))
            drv.confirm(issuer, tok, n)
            out["bodies"] += 1
            out["events"] += n
    return out

def import_body(drv, data: bytes, now: int | None = None, body: SyncBody | None = None) -> dict:
    """Parse the whole body strictly first (nothing changes on a malformed one: the streamed
    parse prescans and walks all of it before returning), then records,
    then the answers to this node's files, then events through the one apply path; then owe
    the sender an answer for this file (carried by the next export to it). Mailbox bodies never
    move watermarks. `body`: the parse of `data` already made (agent/mailbox.py parses before
    making a driver)."""
    body = parse_body_streamed(data) if body is None else body
    now = now_ms() if now is None else now
    # The import is several transactions (records, answer records, one per window of events,
    # the answer owed, rehydration counts): a full disk in a later one must not be reported as
    # "nothing was changed", so the steps that committed are tracked.
    done: dict[str, Any] = {"applied": 0, "processed": 0, "step": "records", "committed": False}
    try:
        return _import(drv, data, now, body, done)
    except Exception as e:
        if not done["committed"] or not db.disk_full(e, drv.node.home / drv.node.STORE_FILE):
            raise       # nothing committed yet: the generic full-disk line is true
        raise db.StoreError(_partial_import_line(drv.node.home, len(body.events), done)) from e

def _import(drv, data: bytes, now: int, body: SyncBody, done: dict) -> dict:
    sender = body.from_site_id
    acks, others = split_records(body.records, [mailbox.ACK_CONTENT_TYPE])
    recs = drv.apply_records(others, now) if others else None
    if others:
        done["step"], done["committed"] = "records_noted", True
        drv.note_records_received(sender, MAILBOX_PATH, others)
    done["step"] = "acks"
    acked = take_answers(drv, sender, acks, now)  # after the records: a vouch admits its issuer
    done["step"], done["committed"] = "events", done["committed"] or bool(acks)
    # The events go through the one apply path a window at a time: a body
    # parsed by `parse_body_streamed` yields them from its bytes, so at most one window of
    # events and of their outcomes is in memory; each window is a batch (one transaction),
    # and only the counts and what did not simply apply are kept.
    tally: dict[str, Any] = {"received": 0, "applied": 0, "below_horizon": 0, "duplicate": 0, "verified": 0}
    result: dict[str, Any] = counts([])
    detail: list[dict] = []
    not_listed = 0
    k = None
    events = body.events
    windows = events.windows(MAILBOX_WINDOW_BYTES) if hasattr(events, "windows") else [events]
    for window in windows:
        outcomes = drv.node.apply_batch(window, now, origin="mailbox")
        if k is None:
            i = delivery.first_rejected(outcomes)   # reads `status` only
            k = None if i == len(outcomes) else tally["received"] + i
        for o in outcomes:
            result[o.status] += 1
            tally["verified"] += o.verified
            if o.reason != R.APPLIED:
                # Detail for what did not simply apply (reasons, event ids), the first
                # MAILBOX_DETAIL_MAX of them: a file of 50 000 duplicates must not cost 50 000
                # objects in memory and on stdout; the counts cover every event.
                if len(detail) < MAILBOX_DETAIL_MAX:
                    detail.append(o.as_json())
                else:
                    not_listed += 1
                if o.reason == R.BELOW_HORIZON:
                    tally["below_horizon"] += 1
                elif o.status == "duplicate":
                    tally["duplicate"] += 1
            elif o.status == "applied":
                tally["applied"] += 1
        tally["received"] += len(outcomes)
        done["applied"], done["processed"], done["committed"] = tally["applied"], tally["received"], True
        del outcomes
    k = tally["received"] if k is None else k
    if sender != drv.node.site_id and sender in drv.node.keyring:
        # Owed only to a site this node trusts: a file naming any other sender (a stranger,
        # another mesh) must not make this node sign and carry answers to it in every file.
        done["step"] = "answer"
        with db.transaction(drv.conn):
            st.owe_mailbox_answer(drv.conn, sender, mailbox.body_hash(data), k, now)
    done["step"] = "counts"
    rehydrate.note_counts(drv.conn, sender, tally["verified"], tally["applied"], tally["below_horizon"],
                          tally["duplicate"], tally["received"] - tally["verified"], sender in drv.node.keyring)
    result["from_site_id"] = sender.hex()
    result["events"] = detail
    result["events_not_listed"] = not_listed
    if recs is not None:
        result["records"] = recs
    result["acknowledged"] = acked
    return result


def _partial_import_line(home: Path, total: int, done: dict) -> str:
    """The full-disk line of an import that committed some of its steps: what is kept, what is
    not, and that importing the file again is safe (its applied events are then duplicates, its
    records already held, and the answer is owed once it commits)."""
    free = db.free_bytes(home)
    failed = {
        "records_noted": "the note of its records for their sender was not recorded",
        "acks": "the answers it carries from peers were not taken",
        "events": f"the other {total - done['processed']} event(s) were not processed",
        "answer": "the answer owed to its sender was not recorded (the sender offers the events again until "
                  "it has one)",
        "counts": "the rehydration's progress counts were not recorded (its answer was)",
    }[done["step"]]
    return (f"the filesystem holding {home} is full ({free if free is not None else '?'} bytes free) during the "
            f"import: {done['applied']} of {total} event(s) of the file were applied and are kept "
            f"({done['processed']} processed), but {failed}. Importing the same file again "
            "once there is space is safe (what was applied counts as duplicates) and completes it. Free space "
            "there, or run `ssp-agent evict --auto` (it uses the space the home reserves for it)")


def write_durably(path: Path, data: bytes) -> None:
    """Written whole or not at all, and durable before the mailbox cursor moves."""
    atomic_write(str(path), data, 0o644)


def _surface(conn, now: int, kind: str, reason: str, detail: dict) -> None:
    reports.surface(conn, now, kind, reason, json.dumps(detail, sort_keys=True))
