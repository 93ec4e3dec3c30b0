"""The one body boundary with the sender check, and the one sort of control records by type
(agent/core/incoming.py): pure, and the only place either is written."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from agent.core import incoming
from agent.core.messages import Handshake, ProtocolError, SyncBody, emit_body, emit_handshake
from agent.core.records import ACK

ROOT = Path(__file__).resolve().parents[2]
A, B = bytes.fromhex("aa" * 16), bytes.fromhex("bb" * 16)


def body(sender: bytes, records=()) -> bytes:
    return emit_body(SyncBody(sender, (0, 0), (), tuple(records), ()))


def test_a_body_from_its_sender_is_taken_and_another_is_refused():
    assert incoming.sync_body(body(A), A).from_site_id == A
    assert incoming.sync_body(body(B), None).from_site_id == B  # a mailbox file names its own sender
    with pytest.raises(ProtocolError) as e:
        incoming.sync_body(body(B), A)
    assert e.value.reason == "sender_mismatch"
    assert e.value.detail == f"from_site_id {B.hex()} sent by {A.hex()}"
    with pytest.raises(ProtocolError) as e:
        incoming.sync_body(body(B), A, said=incoming.ON_SESSION)
    assert e.value.detail == f"from_site_id {B.hex()} on a session with {A.hex()}"


def test_a_handshake_is_no_body_and_a_parse_made_already_is_checked_too():
    with pytest.raises(ProtocolError) as e:
        incoming.sync_body(emit_handshake(Handshake(A, (0, 0), False, False, None)), A)
    assert e.value.reason == "not_a_body"
    parsed = SyncBody(B, (0, 0), (), (), ())
    with pytest.raises(ProtocolError):
        incoming.sync_body(b"not parsed again", A, parsed=parsed)
    assert incoming.sync_body(b"not parsed again", B, parsed=parsed) is parsed


def test_records_split_by_type_keep_their_order():
    from agent.core.cose import assemble, protected_header, ALG_EDDSA
    ack1 = assemble(protected_header(ALG_EDDSA, ACK, A), b"1", b"\0" * 64)
    ack2 = assemble(protected_header(ALG_EDDSA, ACK, A), b"2", b"\0" * 64)
    other = assemble(protected_header(ALG_EDDSA, "sovm/ssp-vouch-v1", A), b"3", b"\0" * 64)
    took, rest = incoming.split_records([other, ack1, b"junk", ack2], [ACK])
    assert took == [ack1, ack2] and rest == [other, b"junk"]


def test_the_sender_check_is_written_once():
    """No driver compares a body's from_site_id with its link's peer itself: it calls `sync_body`."""
    found = []
    for f in sorted((ROOT / "agent").rglob("*.py")):
        if f.name == "incoming.py":
            continue
        for n in ast.walk(ast.parse(f.read_text())):
            if isinstance(n, ast.Constant) and n.value == "sender_mismatch":
                found.append(str(f.relative_to(ROOT)))
    assert found == ["agent/core/reasons.py"], found
    for f in ("agent/sync_port.py", "agent/core/session.py"):
        assert "sync_body(" in (ROOT / f).read_text(), f
