"""Signature verification entry points with one accept set each.

- Ed25519: libsodium ``crypto_sign_verify_detached`` semantics through PyNaCl (docs/protocol.md §13,
  "One accept set for signatures").
- P-256 receipts (ES256, docs/protocol.md §0 "Sequencing receipts"): IEEE P1363 raw r||s, exactly 64 bytes, r and s in
  [1, n-1]; public key as SEC1 compressed (33) or uncompressed (65) bytes.  Pinned by the
  Wycheproof ecdsa_secp256r1_sha256_p1363 vectors in tests/bridge.
"""
from __future__ import annotations

from functools import lru_cache
from typing import TYPE_CHECKING, Callable

import nacl.exceptions
import nacl.signing

# cryptography is imported on the first P-256 verification only: a node that signs and verifies
# Ed25519 events never loads it (the start-up of `write` and `sync --once`).
if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric import ec

P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


def verify_ed25519(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """True iff libsodium accepts ``signature`` over ``message`` under the 32-byte key."""
    if len(public_key) != 32 or len(signature) != 64:
        return False
    try:
        nacl.signing.VerifyKey(bytes(public_key)).verify(bytes(message), bytes(signature))
        return True
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, nacl.exceptions.TypeError,
            ValueError, TypeError):
        return False


def verify_p256(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """True iff ``signature`` (64-byte r||s) is a valid ECDSA P-256/SHA-256 signature of ``message``."""
    if len(signature) != 64 or len(public_key) not in (33, 65):
        return False
    r = int.from_bytes(signature[:32], "big")
    s = int.from_bytes(signature[32:], "big")
    if not (1 <= r < P256_ORDER and 1 <= s < P256_ORDER):
        return False
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature
    try:
        key = _p256_key(bytes(public_key))
        key.verify(encode_dss_signature(r, s), bytes(message), ec.ECDSA(hashes.SHA256()))
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


def verify_p256_digest(public_key: bytes, digest: bytes, signature: bytes) -> bool:
    """``verify_p256`` over the message's SHA-256 digest (32 bytes) instead of the message: the
    same checks in the same order, so for ``digest == sha256(message)`` the same answer (the
    verifier process, verify_worker.py, gets digests: a PKCS#11 token signs the digest anyway)."""
    if len(signature) != 64 or len(public_key) not in (33, 65) or len(digest) != 32:
        return False
    r = int.from_bytes(signature[:32], "big")
    s = int.from_bytes(signature[32:], "big")
    if not (1 <= r < P256_ORDER and 1 <= s < P256_ORDER):
        return False
    invalid, encode, alg = _prehashed()
    try:
        key = _p256_key(bytes(public_key))
        key.verify(encode(r, s), bytes(digest), alg)
        return True
    except (invalid, ValueError, TypeError):
        return False


@lru_cache(maxsize=1)
def _prehashed() -> tuple[type[Exception], Callable[[int, int], bytes], ec.ECDSA]:
    """What verify_p256_digest needs from cryptography, imported once (it runs in a loop)."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.utils import Prehashed, encode_dss_signature
    return InvalidSignature, encode_dss_signature, ec.ECDSA(Prehashed(hashes.SHA256()))


@lru_cache(maxsize=256)
def _p256_key(public_key: bytes) -> ec.EllipticCurvePublicKey:
    """Decoding a point costs about a third of a verification; a sequencer's or a member's checks
    are under a handful of keys. A point that does not decode raises (never cached)."""
    from cryptography.hazmat.primitives.asymmetric import ec
    return ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), public_key)
