"""The PKCS#11 keystore's verifier process (docs/keystore.md "Verified in a verifier process").

Every signature a token returns is verified before the bridge may persist it (a faulty token's
signature is never released). An ES256 verification costs about as much as a SoftHSM2 signature,
and `cryptography` holds the GIL while it verifies, so in the keystore's own process it would
serialise with the sequencer's work; here it runs beside both the token worker and that process.

Its inputs: the **public keys**, from the keystore's process on stdin (the keys the bridge knows:
``Pkcs11Keystore.public_key(name)``), and the **copies**, from the token worker
(pkcs11_worker.py) on the pipe whose descriptor is argv[1]: for every ``sign_many`` chunk the
keystore asked it to copy, the key name, the SHA-256 digest of the data and the signature of each
item. It verifies each pair with ``verify.verify_p256_digest`` (``verify_p256``'s accept set, over
the digest) and answers on stdout, per copy: its sequence number, how many pairs it got, how many
verified before the first that did not, and the SHA-256 of the copy's body; when one did not
verify, it also writes the copy's batch number to the worker's cancel pipe (argv[2]), so the
worker does not sign that batch's chunks still queued. The keystore's process
recomputes that body from its own data (its digests, the signatures it read from the worker) and
takes the verdict only when the hashes match: what was verified is exactly what it will return.

Protocol (big-endian):

  stdin    key   = u8 name_len | name | u8 key_len | key (SEC1, 33 or 65 bytes)
  copies   copy  = u32 len | u64 seq | u64 batch | body  (len counts seq, batch and body);
                   body = (u8 name_len | name | digest (32) | u16 sig_len | sig)*
  stdout   answer = u64 seq | u32 count | u32 verified | sha256(body)   (48 bytes)
  cancel   u64 batch, when a signature of that batch did not verify (non-blocking; best effort)

No PKCS#11 library is loaded here. End of stdin (the keystore's process closed it, or died) or of
the copies (the worker died, or stopped copying mid-copy): exit.
"""
from __future__ import annotations

import hashlib
import os
import select
import struct
import sys
from typing import Iterable

from .fsutil import write_all
from .pipes import read_exact
from .verify import verify_p256_digest

MAX_BODY = 1 << 24   # a copy larger than this is not from our worker: stop
ANSWER = struct.Struct(">QII")


def encode_key(name: str, key: bytes) -> bytes:
    n = name.encode()
    return bytes([len(n)]) + n + bytes([len(key)]) + key


def encode_items(items: Iterable[tuple[bytes, bytes, bytes]]) -> bytes:
    """The body of a copy from (name bytes, digest, signature) triples (the worker sends it; the
    keystore's process hashes the same body to bind a verdict to its own data)."""
    pack = struct.Struct(">H").pack
    return b"".join([p for name, digest, sig in items for p in (bytes([len(name)]), name, digest, pack(len(sig)), sig)])


def decode_items(body: bytes) -> list[tuple[bytes, bytes, bytes]]:
    out, pos, end = [], 0, len(body)
    while pos < end:
        n = body[pos]
        name = body[pos + 1:pos + 1 + n]
        digest = body[pos + 1 + n:pos + 33 + n]
        (slen,) = struct.unpack_from(">H", body, pos + 33 + n)
        sig = body[pos + 35 + n:pos + 35 + n + slen]
        pos += 35 + n + slen
        if pos > end:
            raise ValueError("truncated copy")
        out.append((name, digest, sig))
    return out


class Keys:
    """The public keys the keystore's process registered, read from stdin as they come."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = bytearray()
        self.keys: dict[bytes, bytes] = {}

    def read(self) -> None:
        """Read what stdin holds (blocking for some), registering every complete key; EOFError at
        its end (the keystore's process is gone)."""
        got = os.read(self.fd, 1 << 16)
        if not got:
            raise EOFError
        self.buf += got
        buf = self.buf
        while buf:
            n = buf[0]
            if len(buf) < 2 + n or len(buf) < 2 + n + buf[1 + n]:
                break
            klen = buf[1 + n]
            self.keys[bytes(buf[1:1 + n])] = bytes(buf[2 + n:2 + n + klen])
            del buf[:2 + n + klen]

    def get(self, name: bytes) -> bytes:
        """The key registered under ``name``; the keystore's process sends it before it asks the
        worker for a copy that names it, so wait for it on stdin."""
        while name not in self.keys:
            self.read()
        return self.keys[name]


def main(argv: list[str]) -> int:
    copies = int(argv[0])
    cancel = int(argv[1]) if len(argv) > 1 else None
    if cancel is not None:
        os.set_blocking(cancel, False)
    keys = Keys(sys.stdin.fileno())
    out = sys.stdout.fileno()
    poller = select.poll()
    poller.register(keys.fd, select.POLLIN)
    poller.register(copies, select.POLLIN)
    while True:
        try:
            for fd, _ in poller.poll():
                if fd == keys.fd:      # a key, or the end of the keystore's process (POLLHUP)
                    keys.read()
                    continue
                (n,) = struct.unpack(">I", read_exact(copies, 4))
                if n < 16 or n > MAX_BODY:
                    return 2
                seq, batch = struct.unpack(">QQ", read_exact(copies, 16))
                body = read_exact(copies, n - 16)
                items = decode_items(body)
                ok = 0
                for name, digest, sig in items:
                    if not verify_p256_digest(keys.get(name), digest, sig):
                        break
                    ok += 1
                if ok < len(items) and batch and cancel is not None:
                    try:   # the worker skips the batch's chunks still queued (a full pipe: it signs them)
                        os.write(cancel, struct.pack(">Q", batch))
                    except OSError:
                        pass
                write_all(out, ANSWER.pack(seq, len(items), ok) + hashlib.sha256(body).digest())
        except (EOFError, BrokenPipeError, ValueError):
            return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
