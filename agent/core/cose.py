"""COSE_Sign1 (RFC 9052 §4.2) exactly as docs/protocol.md §0 "Change events": tag 18, empty unprotected
map, Sig_structure = ["Signature1", protected, external_aad = mesh_id, payload]."""
from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from typing import Any, NamedTuple

import cbor2
import nacl.bindings
import nacl.exceptions

from .classify import classified
from .codec import DecodeError, decode_strict, encode

COSE_SIGN1_TAG = 18
ALG_EDDSA = -8
ALG_ES256 = -7
HDR_ALG, HDR_CTYPE, HDR_KID = 1, 3, 4


class Sign1(NamedTuple):
    """A strictly parsed COSE_Sign1 whose signature is not yet verified (immutable; a NamedTuple:
    one is made per received event, and a frozen dataclass's constructor costs several times more)."""

    protected_bytes: bytes
    alg: int
    content_type: str
    kid: bytes
    payload_bytes: bytes
    signature: bytes

    def sig_structure(self, external_aad: bytes) -> bytes:
        return sig_structure(self.protected_bytes, external_aad, self.payload_bytes)


@lru_cache(maxsize=64)
def protected_header(alg: int, content_type: str, kid: bytes) -> bytes:
    return encode({HDR_ALG: alg, HDR_CTYPE: content_type, HDR_KID: kid})


def bstr(data: bytes) -> bytes:
    """A deterministic CBOR byte string: major type 2, shortest length form (RFC 8949 §4.2.1)."""
    n = len(data)
    if n < 24:
        head = bytes((0x40 | n,))
    elif n < 0x100:
        head = bytes((0x58, n))
    elif n < 0x10000:
        head = b"\x59" + n.to_bytes(2, "big")
    elif n < 0x100000000:
        head = b"\x5a" + n.to_bytes(4, "big")
    else:
        head = b"\x5b" + n.to_bytes(8, "big")
    return head + data


# array(4) + text(10) "Signature1" / tag 18 + array(4): fixed heads of the two hot-path encodings
_SIG_STRUCTURE_HEAD = b"\x84\x6aSignature1"
_SIGN1_HEAD = b"\xd2\x84"


def sig_structure(protected_bytes: bytes, external_aad: bytes, payload_bytes: bytes) -> bytes:
    """The deterministic encoding of ["Signature1", protected, external_aad, payload], built
    directly (it is on every signature and every verification; equal to `encode`, tested)."""
    return b"".join((_SIG_STRUCTURE_HEAD, bstr(protected_bytes), bstr(external_aad), bstr(payload_bytes)))


def assemble(protected_bytes: bytes, payload_bytes: bytes, signature: bytes) -> bytes:
    """The exact encoded COSE_Sign1 bytes for a signature (deterministic): tag 18,
    [protected, {}, payload, signature], built directly (equal to `encode`, tested)."""
    return b"".join((_SIGN1_HEAD, bstr(protected_bytes), b"\xa0", bstr(payload_bytes), bstr(signature)))


def assemble_prefix(protected_bytes: bytes, payload_bytes: bytes) -> bytes:
    """`assemble(protected, payload, signature)` without its last 64 bytes, for a 64-byte
    signature (Ed25519, ES256): the COSE_Sign1 is this prefix followed by the signature."""
    return b"".join((_SIGN1_HEAD, bstr(protected_bytes), b"\xa0", bstr(payload_bytes), b"\x58\x40"))


def _bstr_at(data: bytes, i: int) -> tuple[int, int] | None:
    """(start, end) of the byte string whose head is at `i`, or None when there is none there."""
    n = len(data)
    if i >= n or not 0x40 <= data[i] <= 0x5B:
        return None
    ai = data[i] - 0x40
    if ai < 24:
        start, ln = i + 1, ai
    else:
        w = 1 << (ai - 24)
        start = i + 1 + w
        if start > n:
            return None
        ln = int.from_bytes(data[i + 1:start], "big")
    end = start + ln
    return None if end > n else (start, end)


def _split_sign1(data: bytes) -> tuple[bytes, bytes, bytes] | None:
    """The hot path of every received event: (protected, payload, signature) when `data` has
    exactly the envelope's shape (tag 18, array of 4, a byte string, the empty map, two byte
    strings, nothing after), read from the heads without building a CBOR value. None for
    anything else: the generic strict decode then names what is wrong."""
    if data[:2] != _SIGN1_HEAD:
        return None
    p = _bstr_at(data, 2)
    if p is None or p[1] >= len(data) or data[p[1]] != 0xA0:
        return None
    y = _bstr_at(data, p[1] + 1)
    if y is None:
        return None
    s = _bstr_at(data, y[1])
    if s is None or s[1] != len(data):
        return None
    return data[p[0]:p[1]], data[y[0]:y[1]], data[s[0]:s[1]]


def _split_generic(data: bytes) -> tuple[bytes, bytes, bytes]:
    obj = decode_strict(data, allowed_tags=frozenset({COSE_SIGN1_TAG}), shape_checked=True, deterministic=False)
    if type(obj) is not cbor2.CBORTag:
        raise DecodeError("untagged_cose", "COSE_Sign1 must carry CBOR tag 18")
    if obj.tag != COSE_SIGN1_TAG:
        raise DecodeError("unexpected_tag", f"tag {obj.tag}, expected 18")
    v = obj.value
    if not isinstance(v, (list, tuple)) or len(v) != 4:
        raise DecodeError("bad_cose_shape", "COSE_Sign1 must be an array of 4")
    protected, unprotected, payload, signature = v
    if not isinstance(unprotected, Mapping):
        raise DecodeError("bad_cose_shape", "unprotected header must be a map")
    if type(protected) is not bytes or type(payload) is not bytes or type(signature) is not bytes:
        raise DecodeError("bad_cose_shape", "protected, payload and signature must be byte strings")
    if len(unprotected) != 0:
        raise DecodeError("unprotected_not_empty", "the unprotected header must be the empty map")
    return protected, payload, signature


@lru_cache(maxsize=1024)
def _header(protected: bytes) -> tuple[Any, str, Any]:
    """(alg, content type, kid) of a protected header (a site signs all its events under one:
    cached). Raises DecodeError, which is not cached."""
    hdr = decode_strict(protected, shape_checked=True, deterministic=False)
    if type(hdr) is not dict or set(hdr) != {HDR_ALG, HDR_CTYPE, HDR_KID}:
        raise DecodeError("bad_protected_header", "protected header must hold exactly alg, content type and kid")
    alg, ctype, kid = hdr[HDR_ALG], hdr[HDR_CTYPE], hdr[HDR_KID]
    if type(ctype) is not str:
        raise DecodeError("bad_protected_header", "content type must be text")
    return alg, ctype, kid


@classified(DecodeError)
def parse_sign1(data: bytes, expect_alg: int = ALG_EDDSA, kid_len: int = 16, sig_len: int = 64) -> Sign1:
    """The envelope boundary of every event and record: strict structural parse; raises
    DecodeError with a stable reason code (and nothing else)."""
    if not isinstance(data, (bytes, bytearray)):
        raise DecodeError("not_bytes")
    data = bytes(data)
    # Determinism of the envelope and the protected header is checked below by rebuilding their
    # exact deterministic bytes (`assemble`, `protected_header`): cheaper than a generic re-encode.
    parts = _split_sign1(data) or _split_generic(data)
    protected, payload, signature = parts
    if len(signature) != sig_len:
        raise DecodeError("bad_signature_length", f"signature must be {sig_len} bytes")
    if assemble(protected, payload, signature) != data:
        raise DecodeError("non_deterministic", "bytes are not the deterministic encoding of their value")
    alg, ctype, kid = _header(protected)
    if type(alg) is not int or alg != expect_alg:
        raise DecodeError("bad_alg", f"alg {alg!r}, expected {expect_alg}")
    if type(kid) is not bytes or len(kid) != kid_len:
        raise DecodeError("bad_kid", f"kid must be {kid_len} bytes")
    if protected != protected_header(alg, ctype, kid):   # every member checked: safe to re-encode
        raise DecodeError("non_deterministic", "bytes are not the deterministic encoding of their value")
    return Sign1(protected, alg, ctype, kid, payload, signature)


def content_type(raw: Any) -> str | None:
    """The protected content type of a well-formed COSE_Sign1 (events and every record kind
    share the envelope), or None for anything that does not parse."""
    if not isinstance(raw, (bytes, bytearray)):
        return None
    try:
        return parse_sign1(bytes(raw)).content_type
    except (DecodeError, TypeError, ValueError):
        return None


def verify_ed25519(public_key: bytes, message: bytes, signature: bytes) -> bool:
    """libsodium crypto_sign_verify_detached semantics (docs/protocol.md §13: one accept set)."""
    if len(public_key) != 32 or len(signature) != 64:
        return False
    try:
        nacl.bindings.crypto_sign_open(signature + message, public_key)
        return True
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError, ValueError, TypeError):
        return False


def decode_payload(sign1: Sign1) -> Any:
    return decode_strict(sign1.payload_bytes)
