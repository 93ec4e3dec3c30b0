"""Members' evidence on resume: the receipt heads the broker retains (SOVM §22.5 cl. 2, §22.6 "a
restore from backup"; docs/sequencer.md "Evidence from members on resume").

`sequencer run` publishes each group's canonical Commit and receipt retained on
``PREFIX/GROUP/accepted``. A broker usually runs elsewhere, so it outlives a restore of the
sequencer's whole machine (home and receipt witness together), which nothing local can detect.
Before serving, `run` reads every retained head (``read``) and holds each group for which one is a
receipt valid under its own key at or beyond the group's epoch, or differs from the receipt the
home holds for that epoch (``judge``): that pair was released and this state does not know it. A
retained record that is not such a receipt is a hostile client's (or garbage): it is surfaced
(`accepted_unsigned`) and changes nothing, so no client allowed on the topic can freeze a group.
"""
from __future__ import annotations

import logging
import threading
import uuid
from typing import Callable, Optional

import cbor2

from agent.sequencer import core, receipts, service

log = logging.getLogger("ssp.sequencer")

UNSIGNED = "accepted_unsigned"      # the event naming a retained record that is not our receipt
UNSIGNED_EVENTS_KEPT = 100          # its rows kept (the newest): a hostile client can make many


def read(make_client: Callable, host: str, port: int, prefix: str, client_id: str,
         wait: float) -> Optional[dict[bytes, list[bytes]]]:
    """Every record the broker retains on ``PREFIX/+/accepted``: group_id -> [its receipt bytes,
    or b"" for a record of another shape] (``receipt_of``), or None
    when they were not all read within ``wait`` seconds (or the broker refused the marker). One
    short connection (CLIENT_ID-heads, clean start); a marker it publishes after the SUBACK to the
    sequencer's probe topic (which broker ACLs already give `run`) comes back after the retained
    records, which the broker sends first, in order, on that connection (QoS 0), so its return
    means every one was read."""
    got: dict[bytes, list[bytes]] = {}
    done, refused = threading.Event(), threading.Event()
    marker = f"{prefix}/_probe/{client_id}"
    token = uuid.uuid4().bytes
    c = make_client(f"{client_id}-heads")

    def on_connect(client, userdata, flags, reason_code, properties) -> None:
        if not reason_code.is_failure:
            client.subscribe([(f"{prefix}/+/accepted", 0), (marker, 0)])

    def on_publish(client, userdata, mid, reason_code, properties) -> None:
        if getattr(reason_code, "is_failure", False):
            refused.set()       # an ACL refusing the marker: it never comes back
            done.set()

    def on_message(client, userdata, msg) -> None:
        if msg.topic == marker:
            if bytes(msg.payload) == token:
                done.set()
            return
        parts = msg.topic.split("/")
        try:
            gid = bytes.fromhex(parts[-2])
        except (ValueError, IndexError):
            return
        if msg.retain and msg.payload and 1 <= len(gid) <= 255:
            # only the receipt is kept (a retained record carries its Commit too): b"" for a
            # record that is not one of ours in shape
            got.setdefault(gid, []).append(receipt_of(bytes(msg.payload)))

    c.on_connect = on_connect
    def on_subscribe(client, userdata, mid, reason_codes, properties) -> None:
        if any(getattr(rc, "is_failure", False) for rc in reason_codes):
            refused.set()       # an ACL denying the heads (or the marker): nothing read proves anything
            done.set()
            return
        client.publish(marker, token, qos=1)

    c.on_subscribe = on_subscribe
    c.on_publish = on_publish
    c.on_message = on_message
    c.connect_async(host, port, keepalive=30, clean_start=True)
    c.loop_start()
    try:
        ok = done.wait(wait) and not refused.is_set()
    finally:
        c.disconnect()
        c.loop_stop()
    if refused.is_set():
        log.warning("the broker refused %s/+/accepted or the marker on %s (its ACL): the retained heads "
                    "cannot be read", prefix, marker)
    return dict(got) if ok else None


def receipt_of(payload: bytes) -> bytes:
    """The receipt bytes of an `accepted` record (CBOR {"epoch", "commit", "receipt"}); b"" for
    anything else a client retained there."""
    try:
        rec = cbor2.loads(payload)
    except Exception:           # any bytes a client retained: not a record of ours
        return b""
    raw = rec.get("receipt") if isinstance(rec, dict) else None
    return raw if isinstance(raw, bytes) else b""


def judge(seq: "service.Sequencer", heads: dict[bytes, list[bytes]]) -> tuple[list[bytes], list[dict]]:
    """Hold every group a retained head (``heads``, what ``read`` returns) shows behind
    (``seq.hold``, core.BROKER_HEAD); returns
    (the groups held now, the records that are not this sequencer's receipt for their group).
    Only a head that would hold its group is verified (a signature check): one below the state's
    epoch that matches or cannot be compared changes nothing either way."""
    held, unsigned = [], []
    for gid, payloads in sorted(heads.items()):
        state = seq.store.group(gid)
        if gid in seq.held or (state is not None and (state.failed_closed or state.migrated)):
            continue
        if state is None and seq.store.retired(gid) is not None:
            continue        # never served again without a recovery (§22.6)
        for raw in payloads:
            why = None
            try:
                r = receipts.parse_receipt(raw) if raw else None
            except receipts.ReceiptError:
                r = None
            if r is None:
                why = "not an accepted record"
            elif r.group_id != gid:
                why = "a receipt for another group"
            else:
                mine = None if state is None else seq.store.receipt(gid, r.epoch)
                ahead = state is None or r.epoch >= state.current_epoch
                differs = (mine is not None and mine != raw) or \
                    (state is not None and mine is None and r.epoch in state.discontinuities)
                if not (ahead or differs):
                    continue
                try:
                    receipts.verify_receipt(raw, seq.public_key)
                except receipts.ReceiptError:
                    why = "not signed by this sequencer's key"
                else:
                    seq.hold(gid, core.BROKER_HEAD, {"epoch": r.epoch, "receipt": raw.hex(),
                                                     "current_epoch": None if state is None else state.current_epoch})
                    held.append(gid)
                    break
            if why is not None:
                unsigned.append({"group": gid.hex(), "why": why})
    for u in unsigned:
        seq.store.record_event(UNSIGNED, u, keep=UNSIGNED_EVENTS_KEPT)
    return held, unsigned
