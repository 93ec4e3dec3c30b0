"""The pipes to a keystore's worker process (the software keystore's P-256 signing process,
sign_worker.py; the PKCS#11 worker, pkcs11_worker.py), at the file-descriptor level.

Several requests may be outstanding at a worker (pipelined signing, docs/keystore.md). The
worker blocks writing a reply when its stdout is full and then reads no request, so a writer that
blocked on a full stdin as well would wait for ever: ``write_draining`` writes a request without
blocking and reads the worker's replies into a buffer meanwhile; ``read_buffered`` takes from
that buffer before reading the pipe. ``ReadAhead`` is a worker's side of its request pipe.
"""
from __future__ import annotations

import math
import os
import select
import struct
import time
from typing import Optional


def read_exact(fd: int, n: int) -> bytes:
    """Exactly ``n`` bytes from ``fd`` (blocking); EOFError at end of file."""
    parts = []
    while n:
        b = os.read(fd, n)
        if not b:
            raise EOFError
        parts.append(b)
        n -= len(b)
    return b"".join(parts)


def read_buffered(fd: int, inbuf: bytearray, n: int) -> bytes:
    """Exactly ``n`` bytes: what ``inbuf`` holds first (consumed), then read from ``fd``."""
    if len(inbuf) >= n:
        out = bytes(inbuf[:n])
        del inbuf[:n]
        return out
    head = bytes(inbuf)
    inbuf.clear()
    return head + read_exact(fd, n - len(head))


class ReadAhead:
    """A worker's request pipe read in chunks of up to READ_CHUNK (the software keystore's signing
    process, sign_worker.py): a batch of 256 Sig_structures is one or two reads, where reading
    each length and each structure by itself made two system calls a signature (~1 µs of that
    process's ~27: alone it signed 36-37k/s, now 37.5-39k/s). What a read brings beyond the
    current request stays for the next one. Blocking: for a worker that reads only this pipe."""

    READ_CHUNK = 1 << 16

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""
        self.pos = 0

    def take(self, n: int) -> bytes:
        """Exactly ``n`` bytes; EOFError if the pipe ends first."""
        end = self.pos + n
        if end > len(self.buf):
            parts = [self.buf[self.pos:]]
            have = len(parts[0])
            while have < n:
                chunk = os.read(self.fd, max(self.READ_CHUNK, n - have))
                if not chunk:
                    raise EOFError
                parts.append(chunk)
                have += len(chunk)
            self.buf, self.pos, end = b"".join(parts), 0, n
        out = self.buf[self.pos:end]
        self.pos = end
        return out


def write_draining(wfd: int, rfd: int, data: bytes, inbuf: bytearray, timeout_ms: Optional[int] = None) -> None:
    """Write all of ``data`` to the non-blocking ``wfd``; while it is full, read what the worker
    wrote on ``rfd`` into ``inbuf``. EOFError when the worker's stdout ends, OSError when it
    breaks, TimeoutError (an OSError) when nothing moves for ``timeout_ms`` (None: wait as long
    as it takes)."""
    view = memoryview(data)
    poller = None
    while view:
        try:
            view = view[os.write(wfd, view):]
            continue
        except BlockingIOError:
            pass
        if poller is None:   # poll, not select: no FD_SETSIZE limit in a busy process
            poller = select.poll()
            poller.register(rfd, select.POLLIN)
            poller.register(wfd, select.POLLOUT)
        events = poller.poll(timeout_ms)
        if not events:
            raise TimeoutError("the worker process stopped reading")
        if any(fd == rfd for fd, _ in events):   # POLLIN or POLLHUP: read (EOF is seen here)
            got = os.read(rfd, 1 << 16)
            if not got:
                raise EOFError
            inbuf += got


def read_before(fd: int, poller: "select.poll", deadline: float) -> bytes:
    """What ``fd`` holds now (one read), waiting at most until ``deadline`` (time.monotonic());
    ``poller`` watches ``fd``. TimeoutError when nothing came in time, EOFError at end of file."""
    left = deadline - time.monotonic()
    if left <= 0 or not poller.poll(math.ceil(left * 1000)):
        raise TimeoutError
    got = os.read(fd, 1 << 16)
    if not got:
        raise EOFError
    return got


def encode_request(datas: list[bytes]) -> bytes:
    """A request to the signing process (sign_worker.py): u32 count, then count × (u32 length,
    bytes), big-endian. Here, not in sign_worker.py, which imports the keystore that sends it."""
    pack = struct.Struct(">I").pack
    return b"".join([pack(len(datas))] + [p for d in datas for p in (pack(len(d)), d)])
