"""The hot-path COSE encodings built byte by byte (agent/core/cose.py) must equal the deterministic
CBOR encoding of the same structures (wire-profile.md §2), at every length boundary."""
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


def test_assembled_event_parses_back():
    prot = cose.protected_header(cose.ALG_EDDSA, "sovm/ssp-event-v1", bytes(16))
    assert cose.protected_header(cose.ALG_EDDSA, "sovm/ssp-event-v1", bytes(16)) is prot  # cached
    raw = cose.assemble(prot, b"\xa0", bytes(64))
    s1 = cose.parse_sign1(raw)
    assert (s1.protected_bytes, s1.payload_bytes, s1.signature) == (prot, b"\xa0", bytes(64))
