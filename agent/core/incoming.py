"""What arrives in a sync body, checked once for every link (MQTT, serial, memory, mailbox).

`sync_body` is the body boundary with the sender check (§32.2: a body's `from_site_id` is the
peer the link is with, docs/protocol.md §1); both session drivers call it, so a link never
takes a body another one would refuse. `split_records` sorts a body's control records by their
COSE content type, the one sort every consumer of records picks its kinds with."""
from __future__ import annotations

from typing import Any, Iterable

from . import reasons
from .cose import content_type
from .messages import ProtocolError, SyncBody, parse_body

# How the sender check names the link in its detail: a binding names who sent the body, a
# session the peer it is with (the text of the error frame a session sends back).
SENT_BY = "sent by"
ON_SESSION = "on a session with"


def sync_body(data: bytes, sender: bytes | None, *, parsed: SyncBody | None = None,
              said: str = SENT_BY) -> SyncBody:
    """The strict parse of `data` (or `parsed`, its parse made already), refused with
    `sender_mismatch` when it names a sender other than `sender` (None: the link knows nobody,
    a mailbox file, and the body names its own). ProtocolError and nothing else."""
    body = parse_body(data) if parsed is None else parsed
    if sender is not None and body.from_site_id != sender:
        raise ProtocolError(reasons.SENDER_MISMATCH, f"from_site_id {body.from_site_id.hex()} {said} {sender.hex()}")
    return body


def split_records(raws: Iterable[Any], kinds: Iterable[str]) -> tuple[list[Any], list[Any]]:
    """(records of one of `kinds`, every other record), each in body order."""
    wanted = set(kinds)
    took: list[Any] = []
    rest: list[Any] = []
    for raw in raws:
        (took if content_type(raw) in wanted else rest).append(raw)
    return took, rest
