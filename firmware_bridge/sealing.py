"""At-rest sealing of stored signed outputs (docs/reliability.md "At rest").

A *data key* (32 random bytes, XChaCha20-Poly1305) seals each stored copy of a signed event: in
the agent's event log and held table, and in this package's signing journal. The data key is
never stored in clear: it is kept *wrapped* (sealed) by a key that lives inside the keystore
(``Keystore.seal`` / ``unseal``; PKCS#11: a non-extractable AES key used with CKM_AES_GCM; the
serial device: its SEAL/UNSEAL commands; the software keystore: a key file beside the signing
key, which protects nothing against a stolen card). Opening the stored bytes therefore needs
the keystore.

Never derive the data key from a signature: every signature the bridge makes is persisted in
clear in the journal (persist-before-release) and sent to peers.

Sealed blob (what a column or journal record holds):

    0x01 | key_id (u16, big-endian) | nonce (24 bytes, random) | ciphertext || tag (16 bytes)

The associated data binds each blob to where it belongs (the caller's ``ad``: the agent uses the
event_id, the journal the identity encoding), so a blob moved to another row or record does not
open. The first byte tells a sealed blob from a clear COSE_Sign1 (which starts with 0xD2, tag 18).
"""
from __future__ import annotations

import os
import struct
from typing import Mapping

import nacl.bindings
import nacl.exceptions

from .errors import KeystoreError

VERSION = 0x01
KEY_BYTES = 32
NONCE_BYTES = 24
TAG_BYTES = 16
HEADER = struct.Struct(">BH")
OVERHEAD = HEADER.size + NONCE_BYTES + TAG_BYTES   # 43 bytes per sealed blob
SEAL_KEY = "store-seal"   # the keystore's wrapping key for data keys (a name in its key namespace)

_encrypt = nacl.bindings.crypto_aead_xchacha20poly1305_ietf_encrypt
_decrypt = nacl.bindings.crypto_aead_xchacha20poly1305_ietf_decrypt
try:
    # libsodium through PyNaCl's own cffi handle: the bindings above check and copy their
    # arguments in Python, which costs more than the cipher on a 300-byte event (every log read
    # opens one: bench/bench_atrest.py). Same library, same calls; the bindings stay the fallback.
    from nacl._sodium import ffi as _ffi, lib as _lib
except ImportError:  # pragma: no cover - a PyNaCl without it
    _ffi = _lib = None


class SealError(KeystoreError):
    """A sealed blob does not open: damaged, moved to another row/record, or sealed under a data
    key this store does not hold (a replaced keystore)."""


def new_data_key() -> bytes:
    return os.urandom(KEY_BYTES)


def is_sealed(blob: bytes) -> bool:
    return len(blob) >= OVERHEAD and blob[0] == VERSION


def key_id_of(blob: bytes | memoryview) -> int:
    return HEADER.unpack_from(blob, 0)[1]


class Sealer:
    """Seals and opens blobs under a set of data keys {key_id: key}; new blobs under ``current``.
    Holds keys in memory only; thread-safe (no mutable state after construction)."""

    __slots__ = ("_keys", "current", "_head")

    def __init__(self, keys: Mapping[int, bytes], current: int) -> None:
        if current not in keys:
            raise ValueError("the current data key must be among the keys")
        for k in keys.values():
            if len(k) != KEY_BYTES:
                raise ValueError("a data key is 32 bytes")
        self._keys = dict(keys)
        self.current = current
        self._head = HEADER.pack(VERSION, current)

    @property
    def key_ids(self) -> frozenset[int]:
        return frozenset(self._keys)

    def only_current(self) -> "Sealer":
        """The same sealer without the older keys (after a re-seal job has passed every row)."""
        return Sealer({self.current: self._keys[self.current]}, self.current)

    def seal(self, ad: bytes, plaintext: bytes) -> bytes:
        key = self._keys[self.current]
        if _lib is None:
            nonce = os.urandom(NONCE_BYTES)
            return self._head + nonce + _encrypt(plaintext, ad, nonce, key)
        # Built in one bytearray (header, random nonce, then the cipher writes ciphertext and tag
        # in place): on every applied event and journal output, so no cffi allocation per call.
        h = HEADER.size
        start = h + NONCE_BYTES
        buf = bytearray(start + len(plaintext) + TAG_BYTES)
        buf[0:h] = self._head
        buf[h:start] = os.urandom(NONCE_BYTES)
        c = _ffi.from_buffer(buf)
        if _lib.crypto_aead_xchacha20poly1305_ietf_encrypt(c + start, _ffi.NULL, plaintext, len(plaintext), ad, len(ad),
                                                           _ffi.NULL, c + h, key) != 0:
            raise SealError("sealing failed")
        return bytes(buf)

    def seal_many(self, ads: list[bytes], plaintexts: list[bytes]) -> list[bytes]:
        """`seal` of each (ad, plaintext) pair: a group commit's outputs, the nonces of the batch
        drawn from the system's random source in one call (each still 24 random bytes of its own)."""
        if _lib is None or not plaintexts:
            return [self.seal(a, p) for a, p in zip(ads, plaintexts)]
        key, head, h = self._keys[self.current], self._head, HEADER.size
        nonces = os.urandom(NONCE_BYTES * len(plaintexts))
        encrypt, from_buffer, null = _lib.crypto_aead_xchacha20poly1305_ietf_encrypt, _ffi.from_buffer, _ffi.NULL
        start = h + NONCE_BYTES
        out = []
        for i, (ad, pt) in enumerate(zip(ads, plaintexts)):
            buf = bytearray(start + len(pt) + TAG_BYTES)
            buf[0:h] = head
            buf[h:start] = nonces[i * NONCE_BYTES:(i + 1) * NONCE_BYTES]
            c = from_buffer(buf)
            if encrypt(c + start, null, pt, len(pt), ad, len(ad), null, c + h, key) != 0:
                raise SealError("sealing failed")
            out.append(bytes(buf))
        return out

    def open(self, ad: bytes, blob: bytes) -> bytes:
        if not is_sealed(blob):
            raise SealError("not a sealed blob (unknown format byte or too short)")
        key = self._keys.get(key_id_of(blob))
        if key is None:
            raise SealError(f"sealed under data key {key_id_of(blob)}, which this store does not hold")
        h = HEADER.size
        if _lib is None:
            try:
                return _decrypt(bytes(blob[h + NONCE_BYTES:]), ad, bytes(blob[h:h + NONCE_BYTES]), key)
            except nacl.exceptions.CryptoError:
                raise SealError("sealed blob does not open (damaged, or moved from another row)") from None
        src = _ffi.from_buffer(blob)
        clen = len(blob) - h - NONCE_BYTES
        out = _ffi.new("unsigned char[]", clen - TAG_BYTES)
        mlen = _ffi.new("unsigned long long *")
        if _lib.crypto_aead_xchacha20poly1305_ietf_decrypt(out, mlen, _ffi.NULL, src + h + NONCE_BYTES, clen, ad,
                                                           len(ad), src + h, key) != 0:
            raise SealError("sealed blob does not open (damaged, or moved from another row)")
        return _ffi.buffer(out, mlen[0])[:]
