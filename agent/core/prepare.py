"""The verify-ahead part of the one apply path (§12), as a pure function: what `apply.apply_one`
would compute for an event before it touches the store, computed early and in bulk, so that it
can run on another core (agent/applyworker.py) while the thread that holds SQLite applies the
events before it.

For each event it runs, in the apply path's order, the envelope parse (docs/protocol.md §0), the
keyring look-up and the signature verification (§12.1), and, only once the signature verified,
the strict EventPayload decode and shape check. It decides nothing: `apply.apply_one` takes each
result in order and runs every check itself, using the result only for the values it would have
computed, and only when the keyring entry it verified against is still the node's entry."""
from __future__ import annotations

from typing import Any

from . import cose, reasons
from . import events as ev
from .codec import DecodeError

Keyring = dict  # kid -> (public key, retirement cutoff or None)


def prepare(raws: list[bytes], keyring: Keyring, mesh_id: bytes, decode: bool = True) -> list[Any]:
    """One result per event of `raws` (each the exact received bytes), compact so that it crosses a
    pipe cheaply (no envelope bytes, no payload bytes):
        None                                       the envelope does not parse, or its kid is not in
                                                   the keyring: the apply path re-parses and answers
        (kid, content_type, entry, False, None, None)                       the signature failed
        (kid, content_type, entry, True, reason, None)                      verified; shape refused
        (kid, content_type, entry, True, fields, row_key_bytes)             verified and decoded
        (kid, content_type, entry, True, None, (start, end))   verified; not decoded (`decode=False`):
                                                   the payload is raw[start:end], for the apply path
    where `fields` are the Event's (table_schema, table_name, row_key, operation, payload, hlc).
    `decode=False` leaves the payload decode to the apply path: with one worker on two cores the
    work is split more evenly that way (docs/apply.md "Speed")."""
    out: list[Any] = []
    append = out.append
    verify = cose.verify_ed25519
    for raw in raws:
        try:
            s1 = cose.parse_sign1(raw)
        except (DecodeError, TypeError):
            append(None)
            continue
        entry = keyring.get(s1.kid)
        if entry is None:
            append(None)
            continue
        if not verify(entry[0], s1.sig_structure(mesh_id), s1.signature):
            append((s1.kid, s1.content_type, entry, False, None, None))
            continue
        if s1.content_type != ev.EVENT_CONTENT_TYPE:
            # Not an event: the apply path drops it before looking at the payload.
            append((s1.kid, s1.content_type, entry, True, reasons.NOT_AN_EVENT, None))
            continue
        if not decode:
            # The envelope ends with the payload's byte string and the 64-byte signature's
            # (2-byte head): its position, so that the apply path need not parse it again.
            end = len(raw) - 66
            append((s1.kid, s1.content_type, entry, True, None, (end - len(s1.payload_bytes), end)))
            continue
        try:
            e, rk = ev.decoded_event(raw, s1, b"")
        except DecodeError as err:
            append((s1.kid, s1.content_type, entry, True, err.reason, None))
            continue
        append((s1.kid, s1.content_type, entry, True,
                (e.table_schema, e.table_name, e.row_key, e.operation, e.payload, e.hlc), rk))
    return out


def checked_from(result: Any, raw: bytes, eid: bytes, entry_now: Any) -> tuple | None:
    """The apply path's `checked` tuple (envelope, keyring entry, signature ok, decoded event or
    its shape error, event_id, row key bytes) from one `prepare` result, or None when the apply
    path must compute it itself: nothing was prepared, or the keyring entry changed since."""
    if result is None or result[2] != entry_now:
        return None
    kid, ctype, entry, ok, dec, rk = result
    # The envelope as far as the apply path reads it when the entry is unchanged: content type,
    # kid and payload (the signature was checked against this very entry).
    if dec is None and ok:
        s1 = cose.Sign1(b"", cose.ALG_EDDSA, ctype, kid, raw[rk[0]:rk[1]], b"")
        return (s1, entry, ok, None, eid, None)
    s1 = cose.Sign1(b"", cose.ALG_EDDSA, ctype, kid, b"", b"")
    decoded: ev.Event | DecodeError | None
    if not ok:
        decoded = None
    elif type(dec) is str:
        decoded = DecodeError(dec, "EventPayload shape")
    else:
        decoded = ev.Event(eid, raw, kid, dec[0], dec[1], dec[2], dec[3], dec[4], dec[5])
    return (s1, entry, ok, decoded, eid, rk)
