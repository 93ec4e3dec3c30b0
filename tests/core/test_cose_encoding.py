"""The hot-path COSE encodings built byte by byte (agent/core/cose.py) must equal the deterministic
CBOR encoding of the same structures (docs/protocol.md §0), at every length boundary."""
import cbor2
from hypothesis import given, settings, strategies as st

from agent.core import cose
from agent.core.codec import encode

BOUNDARY_LENGTHS = [0, 1, 23, 24, 255, 256, 65535, 65536]
lengths = st.one_of(st.sampled_from(BOUNDARY_LENGTHS), st.integers(0, 600))


@settings(max_examples=150, deadline=None)
@given(p=lengths, a=lengths, y=lengths, s=st.sampled_from([0, 64, 24, 300]), seed=st.integers(0, 255))
def test_sig_structure_and_assemble_equal_the_deterministic_encoding(p, a, y, s, seed):
    prot, aad, pay, sig = (bytes([(seed + k) % 256]) * n for k, n in enumerate((p, a, y, s)))
    assert cose.sig_structure(prot, aad, pay) == encode(["Signature1", prot, aad, pay])
    assert cose.sig_structure(prot, aad, pay) == cbor2.dumps(["Signature1", prot, aad, pay], canonical=True)
    assert cose.assemble(prot, pay, sig) == encode(cbor2.CBORTag(18, [prot, {}, pay, sig]))
    sig64 = bytes([seed]) * 64   # Node.write_many assembles its events as prefix + signature
    assert cose.assemble_prefix(prot, pay) + sig64 == cose.assemble(prot, pay, sig64)


def test_assembled_event_parses_back():
    prot = cose.protected_header(cose.ALG_EDDSA, "sovm/ssp-event-v1", bytes(16))
    assert cose.protected_header(cose.ALG_EDDSA, "sovm/ssp-event-v1", bytes(16)) is prot  # cached
    raw = cose.assemble(prot, b"\xa0", bytes(64))
    s1 = cose.parse_sign1(raw)
    assert (s1.protected_bytes, s1.payload_bytes, s1.signature) == (prot, b"\xa0", bytes(64))


def test_parse_refuses_every_non_deterministic_form_of_envelope_and_header():
    """parse_sign1 checks determinism by rebuilding the exact bytes: a long-form length anywhere in
    the envelope, or header keys out of order, is `non_deterministic`; a bignum alg is `bad_alg`."""
    import pytest
    from agent.core.codec import DecodeError
    p = cose.protected_header(cose.ALG_EDDSA, "x", bytes(16))
    good = b"\xd2\x84\x58\x18" + p + b"\xa0\x41\xa0\x58\x40" + bytes(64)
    assert cose.parse_sign1(good).payload_bytes == b"\xa0"
    bad = {
        "long payload length": b"\xd2\x84\x58\x18" + p + b"\xa0\x58\x01\xa0\x58\x40" + bytes(64),
        "long protected length": b"\xd2\x84\x59\x00\x18" + p + b"\xa0\x41\xa0\x58\x40" + bytes(64),
        "long signature length": b"\xd2\x84\x58\x18" + p + b"\xa0\x41\xa0\x59\x00\x40" + bytes(64),
        "long array length": b"\xd2\x98\x04\x58\x18" + p + b"\xa0\x41\xa0\x58\x40" + bytes(64),
        "header keys out of order": cose.assemble(b"\xa3\x03\x61x\x01\x27\x04\x50" + bytes(16), b"\xa0", bytes(64)),
        "header alg long form": cose.assemble(b"\xa3\x01\x38\x07\x03\x61x\x04\x50" + bytes(16), b"\xa0", bytes(64)),
    }
    for name, raw in bad.items():
        with pytest.raises(DecodeError) as e:
            cose.parse_sign1(raw)
        assert e.value.args[0].startswith("non_deterministic") or "non_deterministic" in str(e.value), name
    big = cose.assemble(cbor2.dumps({1: 2**70, 3: "x", 4: bytes(16)}, canonical=True), b"\xa0", bytes(64))
    # a bignum alg is a tag (2) inside the header: the decoder refuses it before building anything
    with pytest.raises(DecodeError, match="unexpected_tag"):
        cose.parse_sign1(big)
