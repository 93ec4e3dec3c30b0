"""Sequencing receipts: COSE_Sign1 ES256 exactly as docs/protocol.md §0 "Sequencing receipts" (SOVM §22.5).

    18([ protected   = bstr .cbor {1: -7, 3: "sovm/sequencing-receipt-v1", 4: kid (33 bytes)},
         unprotected = {},
         payload     = bstr .cbor {"group_id": bstr, "epoch": uint, "commit_hash": bstr32,
                                   "previous_receipt_hash": bstr32 / null},
         signature   = bstr .size 64 ])            ; P-256 r||s (IEEE P1363)

kid is the sequencer's 33-byte compressed SEC1 public key; external_aad is the empty byte
string; everything is deterministically encoded. Pure functions: the signature itself comes from
the keystore bridge (agent/sequencer/pipeline.py, resume.py), never from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import blake3

from agent.core import codec, cose
from firmware_bridge.verify import verify_p256

RECEIPT_CONTENT_TYPE = "sovm/sequencing-receipt-v1"
EXTERNAL_AAD = b""                          # docs/protocol.md §0: a sequencer serves groups, not one mesh
KID_LEN = 33
_FIELDS = frozenset({"group_id", "epoch", "commit_hash", "previous_receipt_hash"})


class ReceiptError(ValueError):
    """A receipt that does not parse or verify. ``reason`` is a stable code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True)
class Receipt:
    group_id: bytes
    epoch: int
    commit_hash: bytes
    previous_receipt_hash: Optional[bytes]
    kid: bytes                              # the signer's compressed P-256 key
    raw: bytes                              # the exact COSE_Sign1 bytes

    @property
    def receipt_hash(self) -> bytes:
        return receipt_hash(self.raw)


def commit_hash(mls_message: bytes) -> bytes:
    """BLAKE3 of the whole MLSMessage exactly as the member sent it (docs/protocol.md §0)."""
    return blake3.blake3(bytes(mls_message)).digest()


def receipt_hash(raw: bytes) -> bytes:
    """BLAKE3 of the exact receipt bytes: the next receipt's previous_receipt_hash."""
    return blake3.blake3(bytes(raw)).digest()


# The payload map's keys in deterministic order (RFC 8949 §4.2.1: bytewise on the encoded keys;
# all text keys, so shortest first), each with its encoded head: the payload is built directly on
# the hot path of every receipt (equal to codec.encode, tests/sequencer/test_receipts.py).
_K_EPOCH, _K_GROUP, _K_COMMIT, _K_PREV = (b"\x65epoch", b"\x68group_id", b"\x6bcommit_hash",
                                          b"\x75previous_receipt_hash")


def _uint(n: int) -> bytes:
    if n < 24:
        return bytes((n,))
    if n < 0x100:
        return bytes((0x18, n))
    if n < 0x10000:
        return b"\x19" + n.to_bytes(2, "big")
    if n < 0x100000000:
        return b"\x1a" + n.to_bytes(4, "big")
    return b"\x1b" + n.to_bytes(8, "big")


def payload_bytes(group_id: bytes, epoch: int, commit_hash_: bytes, previous: Optional[bytes]) -> bytes:
    """The deterministic CBOR of {"group_id", "epoch", "commit_hash", "previous_receipt_hash"}
    (docs/protocol.md §0)."""
    epoch = int(epoch)
    if not 0 <= epoch < 2**64:
        raise ValueError("epoch is a uint64")
    commit_hash_ = bytes(commit_hash_)
    return b"".join((_HEAD_EPOCH, _uint(epoch), _K_GROUP, cose.bstr(bytes(group_id)),
                     _K_COMMIT_32 + commit_hash_ if len(commit_hash_) == 32 else _K_COMMIT + cose.bstr(commit_hash_),
                     _K_PREV_NULL if previous is None else
                     _K_PREV_32 + previous if type(previous) is bytes and len(previous) == 32 else
                     _K_PREV + cose.bstr(bytes(previous))))


# the constant runs of every payload (a 32-byte hash's head is b"\x58\x20"), joined once
_HEAD_EPOCH = b"\xa4" + _K_EPOCH
_K_COMMIT_32, _K_PREV_32, _K_PREV_NULL = _K_COMMIT + b"\x58\x20", _K_PREV + b"\x58\x20", _K_PREV + b"\xf6"


def to_be_signed(kid: bytes, payload: bytes) -> tuple[bytes, bytes]:
    """(protected header bytes, Sig_structure) for a receipt payload under ``kid``."""
    if len(kid) != KID_LEN:
        raise ValueError("kid must be the 33-byte compressed SEC1 P-256 public key (docs/protocol.md §0)")
    protected = cose.protected_header(cose.ALG_ES256, RECEIPT_CONTENT_TYPE, kid)
    return protected, cose.sig_structure(protected, EXTERNAL_AAD, payload)


def protected_header(kid: bytes) -> bytes:
    if len(kid) != KID_LEN:
        raise ValueError("kid must be the 33-byte compressed SEC1 P-256 public key (docs/protocol.md §0)")
    return cose.protected_header(cose.ALG_ES256, RECEIPT_CONTENT_TYPE, bytes(kid))


class Signing:
    """The parts of every receipt under one protected header, computed once (the hot path of a
    group commit): ``parts(payload)`` gives the Sig_structure and the assembler the bridge calls
    with the 64-byte P1363 signature — the receipt's bytes are a prefix followed by it
    (equal to ``sig_structure`` and ``assemble``, tests/sequencer/test_receipts.py)."""

    __slots__ = ("_tbs_head", "_sign1_head")

    def __init__(self, protected: bytes) -> None:
        pb = cose.bstr(bytes(protected))
        self._tbs_head = cose.sig_structure(protected, EXTERNAL_AAD, b"")[:-1]   # less the empty payload's head
        self._sign1_head = cose.assemble_prefix(protected, b"")[:-3]            # less b"\x40" + b"\x58\x40"
        assert self._tbs_head.endswith(pb + cose.bstr(EXTERNAL_AAD)) and self._sign1_head.endswith(pb + b"\xa0")

    def parts(self, payload: bytes):
        pb = cose.bstr(payload)
        return self._tbs_head + pb, (self._sign1_head + pb + b"\x58\x40").__add__


def sig_structure(protected: bytes, payload: bytes) -> bytes:
    return cose.sig_structure(protected, EXTERNAL_AAD, payload)


def assemble(protected: bytes, payload: bytes, signature: bytes) -> bytes:
    return cose.assemble(protected, payload, signature)


def signature_valid(kid: bytes, message: bytes, signature: bytes) -> bool:
    """The one ES256 check every receipt goes through: a 33-byte compressed key (the only form
    registered and compared, §22.5), a 64-byte P1363 signature, r and s in [1, n-1]
    (firmware_bridge.verify_p256, pinned with Wycheproof)."""
    if not isinstance(kid, (bytes, bytearray)) or len(kid) != KID_LEN or kid[0] not in (2, 3):
        return False
    return verify_p256(bytes(kid), bytes(message), bytes(signature))


def _parse_signed(raw: bytes, content_type: str, *, commit_hash_may_be_null: bool) -> tuple:
    """The strict structural parse receipts and discontinuity statements share (same COSE_Sign1
    ES256 shape, same four payload fields; a statement may leave commit_hash null), signature not
    checked. Returns (group_id, epoch, commit_hash, previous_receipt_hash, kid). Raises ReceiptError."""
    try:
        s1 = cose.parse_sign1(bytes(raw), expect_alg=cose.ALG_ES256, kid_len=KID_LEN, sig_len=64)
        if s1.content_type != content_type:
            raise ReceiptError("bad_content_type", f"content type {s1.content_type!r}")
        p = codec.decode_strict(s1.payload_bytes)
    except codec.DecodeError as e:
        raise ReceiptError(e.reason, e.detail) from None
    except (TypeError, ValueError) as e:
        if isinstance(e, ReceiptError):
            raise
        raise ReceiptError("malformed", str(e)) from None
    if not isinstance(p, dict) or set(p) != _FIELDS:
        raise ReceiptError("bad_payload", "payload must hold exactly group_id, epoch, commit_hash, "
                                          "previous_receipt_hash")
    gid, epoch, ch, prev = p["group_id"], p["epoch"], p["commit_hash"], p["previous_receipt_hash"]
    if type(gid) is not bytes or not 1 <= len(gid) <= 255:
        raise ReceiptError("bad_payload", "group_id must be 1..255 bytes")
    if type(epoch) is not int or not 0 <= epoch < 2**64:
        raise ReceiptError("bad_payload", "epoch must be a uint64")
    if not (commit_hash_may_be_null and ch is None) and (type(ch) is not bytes or len(ch) != 32):
        raise ReceiptError("bad_payload", "commit_hash must be 32 bytes"
                           + (" or null" if commit_hash_may_be_null else ""))
    if prev is not None and (type(prev) is not bytes or len(prev) != 32):
        raise ReceiptError("bad_payload", "previous_receipt_hash must be 32 bytes or null")
    return gid, epoch, ch, prev, s1.kid


def parse_receipt(raw: bytes) -> Receipt:
    """Strict structural parse, signature not checked. Raises ReceiptError."""
    return Receipt(*_parse_signed(raw, RECEIPT_CONTENT_TYPE, commit_hash_may_be_null=False), bytes(raw))


def verify_receipt(raw: bytes, sequencer_key: Optional[bytes] = None) -> Receipt:
    """The receipt verification entry point: parse strictly, check the signature under its kid,
    and (when given) that the kid is the expected sequencer key, compared as 33 compressed
    bytes (§22.5). Raises ReceiptError."""
    return _signed_by(parse_receipt(raw), sequencer_key, "receipt")


def _signed_by(item, sequencer_key: Optional[bytes], what: str):
    """The one ES256 check of a parsed receipt or statement: its kid is ``sequencer_key`` when
    given, and the signature verifies under that kid. Returns the item. Raises ReceiptError."""
    if sequencer_key is not None and bytes(sequencer_key) != item.kid:
        raise ReceiptError("wrong_sequencer", f"signed by {item.kid.hex()}, expected {bytes(sequencer_key).hex()}")
    s1 = cose.parse_sign1(item.raw, expect_alg=cose.ALG_ES256, kid_len=KID_LEN, sig_len=64)
    if not signature_valid(item.kid, s1.sig_structure(EXTERNAL_AAD), s1.signature):
        raise ReceiptError("bad_signature", f"the ES256 signature does not verify under the {what}'s kid")
    return item


# -- discontinuity statements (§22.6 "epoch advanced, receipt absent", step 4) ----------------
#
#    18([ protected   = bstr .cbor {1: -7, 3: "sovm/sequencing-discontinuity-v1", 4: kid (33 bytes)},
#         unprotected = {},
#         payload     = bstr .cbor {"group_id": bstr, "epoch": uint,
#                                   "commit_hash": bstr32 / null   (the Commit accepted for the epoch, when known),
#                                   "previous_receipt_hash": bstr32 / null (the last receipt before the gap)},
#         signature   = bstr .size 64 ])
#
# §22.6 leaves the form of the discontinuity record to the control-plane profile; a signed one
# lets members relay it over the mesh (the same statement in front of every member, not a
# selective disclosure) and makes a statement contradicted by a member's receipt attributable
# to the sequencer that signed both. Its own content type: a statement is never a receipt.
DISCONTINUITY_CONTENT_TYPE = "sovm/sequencing-discontinuity-v1"


@dataclass(frozen=True)
class Statement:
    group_id: bytes
    epoch: int
    commit_hash: Optional[bytes]
    previous_receipt_hash: Optional[bytes]
    kid: bytes
    raw: bytes

    @property
    def payload_key(self) -> tuple:
        """What the statement says (two signings of it say the same)."""
        return (self.group_id, self.epoch, self.commit_hash, self.previous_receipt_hash, self.kid)


def statement_payload(group_id: bytes, epoch: int, commit_hash_: Optional[bytes], previous: Optional[bytes]) -> bytes:
    return codec.encode({"group_id": bytes(group_id), "epoch": int(epoch),
                         "commit_hash": None if commit_hash_ is None else bytes(commit_hash_),
                         "previous_receipt_hash": None if previous is None else bytes(previous)})


def statement_protected(kid: bytes) -> bytes:
    if len(kid) != KID_LEN:
        raise ValueError("kid must be the 33-byte compressed SEC1 P-256 public key (docs/protocol.md §0)")
    return cose.protected_header(cose.ALG_ES256, DISCONTINUITY_CONTENT_TYPE, bytes(kid))


def parse_statement(raw: bytes) -> Statement:
    """Strict structural parse of a discontinuity statement, signature not checked."""
    return Statement(*_parse_signed(raw, DISCONTINUITY_CONTENT_TYPE, commit_hash_may_be_null=True), bytes(raw))


def verify_statement(raw: bytes, sequencer_key: Optional[bytes] = None) -> Statement:
    """Parse strictly and check the ES256 signature under its kid (and that the kid is
    ``sequencer_key`` when given) through the one ES256 check. Raises ReceiptError."""
    return _signed_by(parse_statement(raw), sequencer_key, "statement")
