"""The MQTT acknowledgement record (`sovm/ssp-ack-v1`, docs/protocol.md §5): verified on its own;
anything but the named issuer's signature over these exact members is refused with a reason."""
from __future__ import annotations

import os

import nacl.signing
import pytest

from agent.core.codec import encode
from agent.core.cose import ALG_EDDSA, assemble, protected_header, sig_structure
from agent.core.records import (ACK, MAX_ACK_ANSWERS, AckAnswer, RecordError, ack_to_be_signed, is_ack,
                                verify_ack)

MESH = os.urandom(16)
KEY = nacl.signing.SigningKey.generate()
ISSUER, SUBJECT = os.urandom(16), os.urandom(16)
PK = bytes(KEY.verify_key)


def entry(kid):
    return (PK, None) if kid == ISSUER else None


def sign(tbs: bytes, key=KEY) -> bytes:
    return key.sign(tbs).signature


def make(answers, issuer=ISSUER, subject=SUBJECT, mesh=MESH, key=KEY) -> bytes:
    protected, payload, tbs = ack_to_be_signed(issuer, mesh, subject, answers)
    return assemble(protected, payload, sign(tbs, key))


def raw_payload(payload: dict, issuer=ISSUER) -> bytes:
    protected = protected_header(ALG_EDDSA, ACK, issuer)
    pl = encode(payload)
    return assemble(protected, pl, sign(sig_structure(protected, MESH, pl)))


def test_a_genuine_ack_verifies_and_names_its_bodies():
    h1, h2 = os.urandom(32), os.urandom(32)
    raw = make([AckAnswer(h1, 3, 5, (3,)), AckAnswer(h2, 2, 2, ())])
    assert is_ack(raw)
    a = verify_ack(raw, MESH, entry)
    assert (a.issuer, a.subject) == (ISSUER, SUBJECT)
    assert a.answer_for(h1) == AckAnswer(h1, 3, 5, (3,)) and a.answer_for(os.urandom(32)) is None


@pytest.mark.parametrize("case, reason", [
    ("other_mesh", "bad_signature"),
    ("other_key", "bad_signature"),
    ("unknown_issuer", "unknown_kid"),
    ("retired", "retired_signer"),
])
def test_signature_and_issuer(case, reason):
    answers = [AckAnswer(os.urandom(32), 1, 1, ())]
    raw = make(answers, mesh=os.urandom(16) if case == "other_mesh" else MESH,
               key=nacl.signing.SigningKey.generate() if case == "other_key" else KEY,
               issuer=os.urandom(16) if case == "unknown_issuer" else ISSUER)
    of = (lambda k: (PK, (1, 0)) if k == ISSUER else None) if case == "retired" else entry
    with pytest.raises(RecordError) as e:
        verify_ack(raw, MESH, of)
    assert e.value.reason == reason


def test_a_changed_count_breaks_the_signature():
    raw = bytearray(make([AckAnswer(os.urandom(32), 1, 1, ())]))
    i = raw.rfind(bytes([0x01, 0x01]))  # processed 1, count 1 (CBOR small ints) -> processed 1, count 9
    raw[i + 1] = 0x09
    with pytest.raises(RecordError) as e:
        verify_ack(bytes(raw), MESH, entry)
    assert e.value.reason == "bad_signature"


@pytest.mark.parametrize("payload, reason", [
    ({"subject_site_id": SUBJECT}, "bad_record_members"),
    ({"subject_site_id": SUBJECT, "answers": [], "x": 1}, "bad_record_members"),
    ({"subject_site_id": ISSUER, "answers": [[b"\0" * 32, 1, 1, []]]}, "bad_subject"),
    ({"subject_site_id": b"\0" * 15, "answers": [[b"\0" * 32, 1, 1, []]]}, "bad_subject"),
    ({"subject_site_id": SUBJECT, "answers": []}, "bad_answers"),
    ({"subject_site_id": SUBJECT, "answers": [[b"\0" * 32, 1, 1, []]] * (MAX_ACK_ANSWERS + 1)}, "bad_answers"),
    ({"subject_site_id": SUBJECT, "answers": [[b"\0" * 31, 1, 1, []]]}, "bad_answers"),
    ({"subject_site_id": SUBJECT, "answers": [[b"\0" * 32, 2, 1, []]]}, "bad_answers"),  # processed > count
    ({"subject_site_id": SUBJECT, "answers": [[b"\0" * 32, 0, 2, [1, 0]]]}, "bad_answers"),  # not ascending
    ({"subject_site_id": SUBJECT, "answers": [[b"\0" * 32, 0, 2, [2]]]}, "bad_answers"),  # index >= count
    ({"subject_site_id": SUBJECT, "answers": [[b"\0" * 32, 0, 2, [0, 0]]]}, "bad_answers"),  # repeated
    ({"subject_site_id": SUBJECT, "answers": [[b"\0" * 32, True, 2, []]]}, "bad_answers"),
    ({"subject_site_id": SUBJECT, "answers": [[b"\0" * 32, 1, 1]]}, "bad_answers"),
])
def test_shapes_are_refused(payload, reason):
    with pytest.raises(RecordError) as e:
        verify_ack(raw_payload(payload), MESH, entry)
    assert e.value.reason == reason


def test_not_an_ack():
    with pytest.raises(RecordError) as e:
        verify_ack(b"\xff\x00", MESH, entry)
    assert e.value.reason != "unclassified"
    with pytest.raises(ValueError):
        ack_to_be_signed(ISSUER, MESH, SUBJECT, [])
