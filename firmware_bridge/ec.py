"""P-256 helpers shared by the backends: point compression and signature re-encoding.

docs/protocol.md §0 "Sequencing receipts" / SOVM §22.5: the sequencer key is registered and compared only as the
33-byte compressed SEC1 point; receipt signatures are COSE ES256, i.e. raw r||s (64 bytes).
"""
from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from .verify import P256_ORDER  # noqa: F401 - one definition (verify.py imports no cryptography)


def compress_point(point: bytes) -> bytes:
    """Any SEC1 encoding of a P-256 point (33 or 65 bytes) -> 33-byte compressed form."""
    key = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), point)
    return key.public_bytes(Encoding.X962, PublicFormat.CompressedPoint)


def public_key_compressed(key: ec.EllipticCurvePublicKey) -> bytes:
    return key.public_bytes(Encoding.X962, PublicFormat.CompressedPoint)


def der_to_raw(der: bytes) -> bytes:
    """DER ECDSA-Sig-Value -> raw r||s, 32 bytes each (COSE ES256, RFC 9053 §2.1)."""
    r, s = decode_dss_signature(der)
    return r.to_bytes(32, "big") + s.to_bytes(32, "big")


def raw_to_der(raw: bytes) -> bytes:
    if len(raw) != 64:
        raise ValueError("raw P-256 signature must be 64 bytes")
    return encode_dss_signature(int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big"))
