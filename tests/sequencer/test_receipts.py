"""Receipts exactly per docs/protocol.md §0 "Sequencing receipts", and the verification entry point
(Wycheproof P1363)."""
from __future__ import annotations

import json
from pathlib import Path

import blake3
import cbor2
import pytest
from hypothesis import given, strategies as st

from agent.sequencer import receipts, service
from agent.sequencer.framing import encode_private_message
from firmware_bridge.ec import compress_point

G = bytes.fromhex("a1" * 16)
VEC = Path(__file__).resolve().parents[1] / "vectors" / "wycheproof" / "ecdsa_secp256r1_sha256_p1363_test.json"


def test_receipt_bytes_are_exactly_the_profile(seq):
    m0 = encode_private_message(G, 0)
    a = seq.submit(m0)
    assert isinstance(a, service.Accepted)
    tag = cbor2.loads(a.receipt)
    assert isinstance(tag, cbor2.CBORTag) and tag.tag == 18
    protected, unprotected, payload, sig = tag.value
    assert unprotected == {} and len(sig) == 64
    hdr = cbor2.loads(protected)
    assert hdr == {1: -7, 3: "sovm/sequencing-receipt-v1", 4: seq.public_key}
    assert len(seq.public_key) == 33 and seq.public_key[0] in (2, 3)
    body = cbor2.loads(payload)
    assert body == {"group_id": G, "epoch": 0, "commit_hash": blake3.blake3(m0).digest(),
                    "previous_receipt_hash": None}
    # deterministic: canonical re-encoding of every layer gives the same bytes
    assert cbor2.dumps(body, canonical=True) == payload
    assert cbor2.dumps(hdr, canonical=True) == protected
    assert cbor2.dumps(cbor2.CBORTag(18, [protected, {}, payload, sig]), canonical=True) == a.receipt
    # external_aad is the empty byte string
    tbs = cbor2.dumps(["Signature1", protected, b"", payload], canonical=True)
    assert receipts.signature_valid(seq.public_key, tbs, sig)
    # hash chain: the next receipt names the BLAKE3 of these exact bytes
    b = seq.submit(encode_private_message(G, 1))
    assert receipts.verify_receipt(b.receipt, seq.public_key).previous_receipt_hash == blake3.blake3(a.receipt).digest()


def test_verify_receipt_refuses_tampering_and_other_keys(seq, tmp_path):
    raw = seq.submit(encode_private_message(G, 0)).receipt
    assert receipts.verify_receipt(raw, seq.public_key).epoch == 0
    flipped = bytearray(raw)
    flipped[-1] ^= 1
    with pytest.raises(receipts.ReceiptError) as e:
        receipts.verify_receipt(bytes(flipped), seq.public_key)
    assert e.value.reason == "bad_signature"
    other = service.init(tmp_path / "other")
    with pytest.raises(receipts.ReceiptError) as e:
        receipts.verify_receipt(raw, other)
    assert e.value.reason == "wrong_sequencer"
    with pytest.raises(receipts.ReceiptError):
        receipts.verify_receipt(raw + b"\x00")
    with pytest.raises(receipts.ReceiptError):
        receipts.verify_receipt(b"\xd2\x84")


def test_wycheproof_p256_p1363_through_the_receipt_entry_point():
    """Every receipt signature is checked by receipts.signature_valid: Wycheproof's valid vectors
    pass, its invalid ones fail, under the registered 33-byte compressed key (§22.5)."""
    doc = json.loads(VEC.read_text())
    counts = {"valid": 0, "invalid": 0, "acceptable": 0}
    for group in doc["testGroups"]:
        pub = bytes.fromhex(group["publicKey"]["uncompressed"])
        kid = compress_point(pub)
        for t in group["tests"]:
            msg, sig = bytes.fromhex(t["msg"]), bytes.fromhex(t["sig"])
            got = receipts.signature_valid(kid, msg, sig)
            if t["result"] == "valid":
                assert got, (t["tcId"], t["comment"])
            elif t["result"] == "invalid":
                assert not got, (t["tcId"], t["comment"])
            assert not receipts.signature_valid(pub, msg, sig)   # only the compressed form is a kid
            counts[t["result"]] += 1
    assert counts["valid"] > 50 and counts["invalid"] > 50
    assert sum(counts.values()) == doc["numberOfTests"]


@given(st.binary(min_size=1, max_size=255), st.integers(0, 2**64 - 1),
       st.binary(min_size=32, max_size=32) | st.binary(max_size=40),
       st.none() | st.binary(min_size=32, max_size=32) | st.binary(max_size=40))
def test_payload_built_directly_equals_the_deterministic_encoder(gid, epoch, ch, prev):
    # receipts.payload_bytes builds the map by hand on the hot path; it must be exactly codec.encode
    from agent.core import codec
    assert receipts.payload_bytes(gid, epoch, ch, prev) == codec.encode(
        {"group_id": gid, "epoch": epoch, "commit_hash": ch, "previous_receipt_hash": prev})


@given(st.binary(min_size=1, max_size=255), st.integers(0, 2**64 - 1), st.binary(min_size=32, max_size=32),
       st.none() | st.binary(min_size=32, max_size=32), st.binary(min_size=64, max_size=64))
def test_signing_parts_equal_the_sig_structure_and_the_assembled_receipt(gid, epoch, ch, prev, sig):
    # receipts.Signing precomputes the header parts of every receipt under one key (hot path)
    kid = b"\x02" + bytes(range(32))
    protected = receipts.protected_header(kid)
    payload = receipts.payload_bytes(gid, epoch, ch, prev)
    tbs, assemble = receipts.Signing(protected).parts(payload)
    assert tbs == receipts.sig_structure(protected, payload)
    assert assemble(sig) == receipts.assemble(protected, payload, sig)
