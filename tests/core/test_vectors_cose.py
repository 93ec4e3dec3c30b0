"""COSE_Sign1 against the COSE WG examples (RFC 9052 §4.4): our Sig_structure is byte for byte the
examples' ToBeSign, their signatures verify through our Ed25519 (events) and ES256 (receipts) entry
points, and each sign-fail case is refused.

Our envelope parser refuses every example's envelope by profile, never by accident: the examples
carry the kid in the unprotected header, where SSP/1 envelopes have the empty map and the kid
protected (tag 18, the unprotected map empty, protected = exactly alg, content type and kid), and two
examples change the tag. Those reasons are pinned below."""
from __future__ import annotations

import base64
import json
from pathlib import Path

import cbor2
import pytest
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from agent.core import cose
from agent.core.codec import DecodeError
from agent.sequencer import receipts

HERE = Path(__file__).resolve().parents[1] / "vectors" / "cose"
ALGS = {"EdDSA": cose.ALG_EDDSA, "ES256": cose.ALG_ES256}

# Why our strict parser refuses each envelope (the profile, not the signature).
PROFILE_REFUSAL = {
    "eddsa-sig-01": "unprotected_not_empty", "ecdsa-sig-01": "unprotected_not_empty",
    "sign-pass-01": "unprotected_not_empty", "sign-pass-02": "unprotected_not_empty",
    "sign-pass-03": "untagged_cose",          # an untagged COSE_Sign1: SSP/1 requires tag 18
    "sign-fail-01": "unexpected_tag",         # tag 998 instead of 18
    "sign-fail-02": "unprotected_not_empty", "sign-fail-03": "unprotected_not_empty",
    "sign-fail-04": "unprotected_not_empty", "sign-fail-06": "unprotected_not_empty",
    "sign-fail-07": "unprotected_not_empty",
}


def _b64(s: str) -> bytes:
    return base64.urlsafe_b64decode(s + "=" * (-len(s) % 4))


def _examples():
    for path in sorted(HERE.glob("*/*.json")):
        yield pytest.param(json.loads(path.read_text()), id=path.stem)


def _parts(example: dict) -> tuple[bytes, bytes, bytes]:
    """(protected, payload, signature) of the example's envelope, read by a generic decoder."""
    obj = cbor2.loads(bytes.fromhex(example["output"]["cbor"]))
    arr = obj.value if isinstance(obj, cbor2.CBORTag) else obj
    protected, _unprotected, payload, signature = arr
    return protected, payload, signature


def _verify(example: dict, message: bytes, signature: bytes) -> bool:
    s0 = example["input"]["sign0"]
    key = s0["key"]
    if s0["alg"] == "EdDSA":
        return cose.verify_ed25519(bytes.fromhex(key["x_hex"]), message, signature)
    pub = ec.EllipticCurvePublicNumbers(int.from_bytes(_b64(key["x"]), "big"), int.from_bytes(_b64(key["y"]), "big"),
                                        ec.SECP256R1()).public_key()
    compressed = pub.public_bytes(Encoding.X962, PublicFormat.CompressedPoint)
    return receipts.signature_valid(compressed, message, signature)


@pytest.mark.parametrize("example", list(_examples()))
def test_example(example, request):
    name = request.node.callspec.id
    protected, payload, signature = _parts(example)
    external = bytes.fromhex(example["input"]["sign0"].get("external", ""))
    # RFC 9052 §4.4: an empty protected map enters Sig_structure as the empty string (sign-pass-01).
    # SSP/1 envelopes always protect alg, content type and kid, so ours takes the bytes as they are.
    tbs = cose.sig_structure(b"" if cbor2.loads(protected) == {} else protected, external, payload)
    if not example.get("fail"):
        # our Sig_structure is the example's ToBeSign, and its signature verifies
        assert tbs.hex().upper() == example["intermediates"]["ToBeSign_hex"]
        assert _verify(example, tbs, signature)
    elif "ChangeCBORTag" in example["input"]["failures"]:
        # the signature is intact; only the tag is wrong, and the envelope parser refuses it
        assert _verify(example, tbs, signature)
    else:
        # altered after signing: what the envelope says no longer verifies
        assert not _verify(example, tbs, signature)
    alg = ALGS[example["input"]["sign0"]["alg"]]
    with pytest.raises(DecodeError) as refused:
        cose.parse_sign1(bytes.fromhex(example["output"]["cbor"]), expect_alg=alg)
    assert refused.value.reason == PROFILE_REFUSAL[name]


@pytest.mark.parametrize("example", list(_examples()))
def test_example_with_the_kid_moved_out_is_still_refused(example):
    """With the unprotected header emptied, the envelope still lacks what SSP/1's protected header
    must hold (content type and a 16-byte kid), and is refused for that."""
    protected, payload, signature = _parts(example)
    env = cbor2.dumps(cbor2.CBORTag(18, [protected, {}, payload, signature]))
    with pytest.raises(DecodeError) as refused:
        cose.parse_sign1(env, expect_alg=ALGS[example["input"]["sign0"]["alg"]])
    assert refused.value.reason in ("bad_protected_header", "non_deterministic", "bad_alg")
