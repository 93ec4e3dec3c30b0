"""The plaintext framing of an RFC 9420 MLSMessage, read blind (SOVM §22.5, docs/protocol.md §0).

The sequencer reads only what RFC 9420 §6 leaves unencrypted: version, wire_format, group_id,
epoch and content_type. It never decrypts anything and never decides whether a Commit is
semantically valid (§22.8): that is every member's job.

Strict, so that one byte string has one reading on every sequencer: big-endian integers, §2.1.2
length prefixes in their shortest form only, and a message parsed or (a PublicMessage carrying a
Commit) walked by lengths alone to its end, with nothing after it; walking is not reading, no
field of the Commit is interpreted. Every failure is a ``FramingError`` with a stable ``reason``
code; no other exception escapes ``parse_mls_message`` for any input bytes."""
from __future__ import annotations

from dataclasses import dataclass

from agent.core.frozen import fast_init

MLS10 = 1                                   # ProtocolVersion mls10 (RFC 9420 §6)
WIRE_PUBLIC, WIRE_PRIVATE, WIRE_WELCOME, WIRE_GROUP_INFO, WIRE_KEY_PACKAGE = 1, 2, 3, 4, 5
CT_APPLICATION, CT_PROPOSAL, CT_COMMIT = 1, 2, 3
SENDER_MEMBER, SENDER_EXTERNAL, SENDER_NEW_MEMBER_PROPOSAL, SENDER_NEW_MEMBER_COMMIT = 1, 2, 3, 4
MAX_GROUP_ID = 255                          # firmware_bridge ReceiptIdentity: group_id is 1..255 bytes
# The largest MLSMessage a sequencer reads (RFC 9420 sets none; a Commit's UpdatePath for a group of
# thousands is a few KiB): what every boundary refuses above it, and what the sequencer's and its
# members' MQTT clients announce room for (docs/sequencer.md "Size limits").
MAX_MESSAGE_BYTES = 1 << 20
_U64 = (1 << 64) - 1

WIRE_FORMAT_NAMES = {WIRE_PUBLIC: "mls_public_message", WIRE_PRIVATE: "mls_private_message",
                     WIRE_WELCOME: "mls_welcome", WIRE_GROUP_INFO: "mls_group_info",
                     WIRE_KEY_PACKAGE: "mls_key_package"}
CONTENT_TYPE_NAMES = {CT_APPLICATION: "application", CT_PROPOSAL: "proposal", CT_COMMIT: "commit"}


class FramingError(ValueError):
    """Bytes that are not a well-formed MLSMessage handshake framing. ``reason`` is a stable code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


@fast_init
@dataclass(frozen=True)
class Framing:
    """What the sequencer may know about an MLSMessage (RFC 9420 §6, plaintext only)."""

    version: int
    wire_format: int
    group_id: bytes
    epoch: int
    content_type: int

    @property
    def is_commit(self) -> bool:
        return self.content_type == CT_COMMIT


class _Reader:
    __slots__ = ("buf", "pos")

    def __init__(self, buf: bytes) -> None:
        self.buf = buf
        self.pos = 0

    def take(self, n: int, what: str) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise FramingError("truncated", f"{what}: need {n} bytes at offset {self.pos}, "
                                            f"{len(self.buf) - self.pos} left")
        out = self.buf[self.pos:end]
        self.pos = end
        return out

    def uint(self, n: int, what: str) -> int:
        end = self.pos + n
        if end > len(self.buf):
            self.take(n, what)                  # raises the truncation error
        v = int.from_bytes(self.buf[self.pos:end], "big")
        self.pos = end
        return v

    def varint(self, what: str) -> int:
        """RFC 9420 §2.1.2: 2-bit prefix gives 1/2/4 bytes; 0b11 invalid; shortest form only."""
        if self.pos >= len(self.buf):
            self.take(1, what)                  # raises the truncation error
        first = self.buf[self.pos]
        self.pos += 1
        prefix = first >> 6
        if prefix == 3:
            raise FramingError("bad_vector_length", f"{what}: length prefix 0b11 is invalid (RFC 9420 §2.1.2)")
        n = 1 << prefix
        value = first & 0x3F
        if n > 1:
            value = (value << (8 * (n - 1))) | self.uint(n - 1, what)
            if value < (0x40 if n == 2 else 0x4000):
                raise FramingError("non_minimal_length",
                                   f"{what}: length {value} not in its shortest form (RFC 9420 §2.1.2)")
        return value

    def vector(self, what: str) -> bytes:
        return self.take(self.varint(what), what)

    def skip_vector(self, what: str) -> None:
        """A vector walked by its length, not read (nor copied: a Commit's body may be large)."""
        n = self.varint(what)
        end = self.pos + n
        if end > len(self.buf):
            self.take(n, what)                  # raises the truncation error
        self.pos = end

    def at_end(self) -> bool:
        return self.pos == len(self.buf)


def parse_mls_message(data: bytes) -> Framing:
    """Strictly parse the framing of one MLSMessage; raises ``FramingError`` (only)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise FramingError("not_bytes", "an MLSMessage is a byte string")
    if len(data) > MAX_MESSAGE_BYTES:
        raise FramingError("too_large", f"{len(data)} bytes (at most {MAX_MESSAGE_BYTES})")
    data = bytes(data)
    got = _private_fast(data)
    if got is not None:
        return got
    r = _Reader(data)
    version = r.uint(2, "version")
    if version != MLS10:
        raise FramingError("unsupported_version", f"version {version}, expected mls10 (1)")
    wire_format = r.uint(2, "wire_format")
    if wire_format == WIRE_PRIVATE:
        return _private_message(r, version)
    if wire_format == WIRE_PUBLIC:
        return _public_message(r, version)
    if wire_format in WIRE_FORMAT_NAMES:
        raise FramingError("not_handshake", f"wire_format {WIRE_FORMAT_NAMES[wire_format]} carries no "
                                            "group_id/epoch/content_type framing to sequence")
    raise FramingError("unknown_wire_format", f"wire_format {wire_format}")


def _vector_end(d: bytes, p: int) -> int:
    """The end of the §2.1.2 vector at ``p``, or -1 for anything irregular (invalid or
    non-minimal prefix, truncated): the strict reader then says what is wrong."""
    n = len(d)
    if p >= n:
        return -1
    first = d[p]
    prefix = first >> 6
    if prefix == 0:
        end = p + 1 + first
    elif prefix == 1:
        if p + 2 > n:
            return -1
        v = ((first & 0x3F) << 8) | d[p + 1]
        if v < 0x40:
            return -1
        end = p + 2 + v
    elif prefix == 2:
        if p + 4 > n:
            return -1
        v = int.from_bytes(d[p:p + 4], "big") & 0x3FFFFFFF
        if v < 0x4000:
            return -1
        end = p + 4 + v
    else:
        return -1
    return end if end <= n else -1


def _private_fast(d: bytes):
    """A well-formed PrivateMessage (the sequencer's hot path: one per Commit), read by offsets
    under exactly the rules of ``_private_message``; None for anything else, which the strict
    reader then parses or refuses with its reason (equal results: tests/sequencer/test_framing.py)."""
    if len(d) < 5 or d[0] != 0 or d[1] != MLS10 or d[2] != 0 or d[3] != WIRE_PRIVATE:
        return None
    first = d[4]
    if first < 0x40:                            # group_id<V> is 1..255 bytes: a 1- or 2-byte length
        p, glen = 5, first
    elif first == 0x40 and len(d) > 5 and d[5] >= 0x40:
        p, glen = 6, d[5]
    else:
        return None
    if glen == 0:
        return None
    e = p + glen
    if e + 9 > len(d):
        return None
    ct = d[e + 8]
    if ct not in CONTENT_TYPE_NAMES:
        return None
    q = _vector_end(d, e + 9)                   # authenticated_data
    if q < 0:
        return None
    q = _vector_end(d, q)                       # encrypted_sender_data
    if q < 0:
        return None
    if _vector_end(d, q) != len(d):             # ciphertext, and nothing after it
        return None
    return Framing(MLS10, WIRE_PRIVATE, d[p:e], int.from_bytes(d[e:e + 8], "big"), ct)


def _group_id(r: _Reader) -> bytes:
    gid = r.vector("group_id")
    if not 1 <= len(gid) <= MAX_GROUP_ID:
        # §22.5: group identifiers are random opaque routing values; an empty one routes nowhere
        raise FramingError("bad_group_id", f"group_id of {len(gid)} bytes (1..{MAX_GROUP_ID} accepted)")
    return gid


def _content_type(r: _Reader) -> int:
    ct = r.uint(1, "content_type")
    if ct not in CONTENT_TYPE_NAMES:
        raise FramingError("bad_content_type", f"content_type {ct} (1 application, 2 proposal, 3 commit)")
    return ct


def _private_message(r: _Reader, version: int) -> Framing:
    # RFC 9420 §6.3: group_id<V>, uint64 epoch, content_type, authenticated_data<V>,
    # encrypted_sender_data<V>, ciphertext<V>.
    gid = _group_id(r)
    epoch = r.uint(8, "epoch")
    ct = _content_type(r)
    r.skip_vector("authenticated_data")
    r.skip_vector("encrypted_sender_data")
    r.skip_vector("ciphertext")
    if not r.at_end():
        raise FramingError("trailing_bytes", f"{len(r.buf) - r.pos} bytes after the PrivateMessage")
    return Framing(version, WIRE_PRIVATE, gid, epoch, ct)


def _public_message(r: _Reader, version: int) -> Framing:
    # RFC 9420 §6.2 / §6: FramedContent = group_id<V>, uint64 epoch, Sender, authenticated_data<V>,
    # content_type, body; then FramedContentAuthData; then membership_tag for a member sender.
    gid = _group_id(r)
    epoch = r.uint(8, "epoch")
    sender_type = r.uint(1, "sender_type")
    if sender_type in (SENDER_MEMBER, SENDER_EXTERNAL):
        r.uint(4, "sender index")
    elif sender_type not in (SENDER_NEW_MEMBER_PROPOSAL, SENDER_NEW_MEMBER_COMMIT):
        raise FramingError("bad_sender_type", f"sender_type {sender_type}")
    r.skip_vector("authenticated_data")
    ct = _content_type(r)
    framing = Framing(version, WIRE_PUBLIC, gid, epoch, ct)
    if ct != CT_COMMIT:
        return framing
    _walk_commit(r)
    r.skip_vector("signature")                   # FramedContentAuthData.signature
    r.skip_vector("confirmation_tag")            # present for content_type commit
    if sender_type == SENDER_MEMBER:
        r.skip_vector("membership_tag")
    if not r.at_end():
        raise FramingError("trailing_bytes", f"{len(r.buf) - r.pos} bytes after the PublicMessage")
    return framing


def _walk_commit(r: _Reader) -> None:
    # Commit = ProposalOrRef proposals<V>; optional<UpdatePath> path (RFC 9420 §12.4)
    r.skip_vector("commit proposals")
    present = r.uint(1, "commit path presence")
    if present == 0:
        return
    if present != 1:
        raise FramingError("bad_optional", f"optional<UpdatePath> presence byte {present}")
    _walk_leaf_node(r)
    r.skip_vector("update path nodes")


def _walk_leaf_node(r: _Reader) -> None:
    # LeafNode (RFC 9420 §7.2)
    r.skip_vector("encryption_key")
    r.skip_vector("signature_key")
    ctype = r.uint(2, "credential_type")
    if ctype == 1:
        r.skip_vector("basic credential identity")
    elif ctype == 2:
        r.skip_vector("x509 certificates")
    else:
        # an unregistered credential type has no length we could walk by
        raise FramingError("unknown_credential_type", f"credential_type {ctype} in the UpdatePath leaf")
    for what in ("capabilities versions", "capabilities cipher_suites", "capabilities extensions",
                 "capabilities proposals", "capabilities credentials"):
        r.skip_vector(what)
    source = r.uint(1, "leaf_node_source")
    if source == 1:
        r.take(16, "lifetime")
    elif source == 3:
        r.skip_vector("parent_hash")
    elif source != 2:
        raise FramingError("bad_leaf_node_source", f"leaf_node_source {source}")
    r.skip_vector("leaf extensions")
    r.skip_vector("leaf signature")


# -- encoders: used by tests and tools to build framings (not by the sequencer's read path) -------
def encode_vector(data: bytes) -> bytes:
    n = len(data)
    if n < 0x40:
        head = bytes((n,))
    elif n < 0x4000:
        head = (n | 0x4000).to_bytes(2, "big")
    elif n < 0x40000000:
        head = (n | 0x80000000).to_bytes(4, "big")
    else:
        raise ValueError("vector longer than 2^30-1 bytes")
    return head + data


def encode_private_message(group_id: bytes, epoch: int, content_type: int = CT_COMMIT, *,
                           authenticated_data: bytes = b"", encrypted_sender_data: bytes = b"\x00" * 16,
                           ciphertext: bytes = b"\x00" * 32) -> bytes:
    """An MLSMessage(PrivateMessage) with the given plaintext framing and opaque (test) body."""
    if not 0 <= epoch <= _U64:
        raise ValueError("epoch is a uint64")
    return b"".join((MLS10.to_bytes(2, "big"), WIRE_PRIVATE.to_bytes(2, "big"), encode_vector(group_id),
                     epoch.to_bytes(8, "big"), bytes((content_type,)), encode_vector(authenticated_data),
                     encode_vector(encrypted_sender_data), encode_vector(ciphertext)))
