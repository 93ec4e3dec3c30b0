"""Mailbox files (`mailbox export` and `mailbox import`): one sync body per file, store-and-forward.

Export selects from the durable per-peer cursor of the `mailbox` path, filtered by policy and
self-echo. The cursor does not move when the file is written: like every path (§14.1) it moves
only on the peer's answer, which travels in the peer's next mailbox files (to this node or to any
node that relays it: a ring of files) as a signed `sovm/ssp-mailbox-ack-v1` record naming the
BLAKE3 of the file's exact bytes and how many of its events reached a final state
(docs/protocol.md §6). So every export re-offers what is not yet acknowledged.

Import parses the whole body strictly before anything touches the store (§32.2), takes the
answers addressed to this node, verifies and stores the other control records, then applies the
events through the node's one apply path. A file carries no authenticated stream, so mailbox
bodies never move applied watermarks (docs/protocol.md §3)."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from .core.codec import encode
from .core.cose import ALG_EDDSA, content_type, protected_header, sig_structure
from .core.ids import UINT64_MAX
from .core.records import RecordError, record_hash, verify_signed_by_site

ACK_CONTENT_TYPE = "sovm/ssp-mailbox-ack-v1"
ACK_MEMBERS = frozenset({"subject_site_id", "answers", "issued_at"})
MAX_ANSWERS = 16  # answers an ack carries (the newest files imported from its subject)

from .core.messages import MAX_MESSAGE_BYTES, ProtocolError
from .infile import InputRefused, read_bytes


def read_file(path: Path) -> bytes:
    """A mailbox file's bytes, refused before reading when it is larger than any message may
    be, so a hostile file cannot make the import read gigabytes.
    Parsing is `import_mailbox_body`'s (agent/sync.py) (the sync body boundary, agent/core/messages.py `parse_body`)."""
    # only a regular file (a FIFO would wait for a writer for ever: agent/infile.py), refused
    # before reading when it is larger than any message may be (`too_large`, the body's own code)
    try:
        return read_bytes(path, MAX_MESSAGE_BYTES, "mailbox file")
    except InputRefused as e:
        if e.reason == "too_large":
            raise ProtocolError("too_large", str(e)) from None
        raise


# ---------------------------------------------------------------- the answer record (pure)
def is_ack(raw: Any) -> bool:
    return content_type(raw) == ACK_CONTENT_TYPE


def body_hash(data: bytes) -> bytes:
    """What an answer names a file by: the BLAKE3 of its exact bytes."""
    return record_hash(bytes(data))


def ack_to_be_signed(issuer: bytes, mesh_id: bytes, subject: bytes, answers: list[tuple[bytes, int]],
                     issued_at: int) -> tuple[bytes, bytes, bytes]:
    """(protected, payload, Sig_structure) of an answer by `issuer` to `subject`'s files."""
    if not 1 <= len(answers) <= MAX_ANSWERS:
        raise ValueError("an ack carries 1 to 16 answers")
    protected = protected_header(ALG_EDDSA, ACK_CONTENT_TYPE, issuer)
    payload = encode({"subject_site_id": subject, "answers": [[h, k] for h, k in answers], "issued_at": issued_at})
    return protected, payload, sig_structure(protected, mesh_id, payload)


def verify_ack(raw: Any, mesh_id: bytes, entry_of: Callable[[bytes], Any]) -> dict:
    """Check one answer record on its own: content type, the issuer's key known and not retired
    (`entry_of(kid)`: keyring entry), the signature over `mesh_id`, the exact member set, and the
    members' shapes. Returns {issuer, subject, answers, issued_at, raw}; raises RecordError."""
    raw, s, p = verify_signed_by_site(raw, mesh_id, ACK_CONTENT_TYPE, "mailbox_ack", ACK_MEMBERS, entry_of)
    subj, answers, at = p["subject_site_id"], p["answers"], p["issued_at"]
    if not (isinstance(subj, bytes) and len(subj) == 16) or subj == s.kid:
        raise RecordError("bad_subject")
    if not (isinstance(answers, list) and 1 <= len(answers) <= MAX_ANSWERS):
        raise RecordError("bad_answers")
    out = []
    for a in answers:
        if not (isinstance(a, list) and len(a) == 2 and isinstance(a[0], bytes) and len(a[0]) == 32
                and isinstance(a[1], int) and not isinstance(a[1], bool) and 0 <= a[1] <= UINT64_MAX):
            raise RecordError("bad_answers")
        out.append((a[0], a[1]))
    if not (isinstance(at, int) and not isinstance(at, bool) and 0 <= at <= UINT64_MAX):
        raise RecordError("bad_issued_at")
    return {"issuer": s.kid, "subject": subj, "answers": out, "issued_at": at, "raw": bytes(raw)}
