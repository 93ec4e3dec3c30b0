"""The software keystore's P-256 signing process (docs/keystore.md "Pipelined release and pipelined P-256 signing").

`cryptography`'s P-256 ``sign`` holds the GIL, so a second thread never signs beside the first;
a second *process* does. The software keystore starts one of these per P-256 key for pipelined
batches (the sequencer's group commit) and hands it the Sig_structures while its own process
journals, writes SQLite and releases the previous batch. The bridge's order is unchanged: every
intent is durable before its batch is sent here, every output durable before it is returned
(docs/keystore.md "The order of steps").

It reads the key file itself (the same checks as the keystore); the secret never crosses the
pipe. Signatures are RFC 6979 deterministic, so a signature made here is byte for byte the one the
keystore's own process would make: when this process dies the keystore signs the batch itself and
no identity ever gets a second, different signature.

Protocol on stdin/stdout (big-endian): ready = b"R" once the key opened; request = u32 count, then
count × (u32 length, bytes); answer = b"\\x00" and count × 64-byte raw r||s, or b"\\x01", u32 length
and the failure's type name. End of stdin: exit (the keystore's process closed it, or died).
"""
from __future__ import annotations

import struct
import sys

from .fsutil import write_all
from .pipes import ReadAhead

MAX_COUNT = 1 << 20      # a request larger than this is not from our keystore: stop
MAX_DATA = 1 << 20


def main(argv: list[str]) -> int:
    directory, name = argv
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    from .ec import der_to_raw
    from .software import KeyDir
    key = KeyDir(directory).get(name).p256
    if key is None:
        raise SystemExit(f"key {name!r} is not a P-256 key")
    sign = key.sign
    alg = ec.ECDSA(hashes.SHA256(), deterministic_signing=True)
    wfd = sys.stdout.fileno()
    requests = ReadAhead(sys.stdin.fileno())
    take, u32 = requests.take, struct.Struct(">I").unpack
    write_all(wfd, b"R")
    while True:
        try:
            (count,) = u32(take(4))
            if count > MAX_COUNT:
                return 2
            datas = []
            for _ in range(count):
                (n,) = u32(take(4))
                if n > MAX_DATA:
                    return 2
                datas.append(take(n))
        except EOFError:
            return 0
        try:
            out = b"\x00" + b"".join([der_to_raw(sign(d, alg)) for d in datas])
        except Exception as exc:   # reported; the keystore's process signs it and reports the error
            msg = type(exc).__name__.encode()
            out = b"\x01" + struct.pack(">I", len(msg)) + msg
        write_all(wfd, out)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
