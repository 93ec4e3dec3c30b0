"""The persist-before-release journal: an append-only, CRC-framed, fsynced log (SOVM §22.5).

File layout (all integers big-endian), documented in docs/keystore.md "Journal format":

    header  = b"SSPJRNL1"
    record  = body_len (u32) | crc32(body) (u32) | body
    body    = type (u8) | ident_len (u16) | ident (identity.encode()) | rest
      type 1 INTENT:   rest = key_name_len (u8) | key_name (utf-8)
      type 2 RELEASED: rest = cose_len (u32) | exact COSE_Sign1 bytes

A record is durable once the fsync that follows its write has returned.  Writers append through
``commit``; concurrent callers share one write+fsync (leader/follower group commit): the first
waiter becomes the leader, writes everything queued so far with one write() and one fsync(),
and wakes the followers whose records that fsync covered.

Recovery: a torn tail (an incomplete or CRC-failing record at the end) can only hold bytes that
were never covered by a completed fsync, hence never acted upon (no signature was made after an
intent that was not durable, no bytes released before their record was durable); it is
truncated.  After an fsync failure the journal is poisoned and refuses all further work
("fsyncgate": the page cache state after a failed fsync is unknown).
"""
from __future__ import annotations

import fcntl
import os
import struct
import threading
import zlib
from typing import Callable, Iterable, Optional

from .errors import JournalError
from .fsutil import fsync_dir
from .identity import EventIdentity, ReceiptIdentity, decode_identity

MAGIC = b"SSPJRNL1"
INTENT = 1
RELEASED = 2
_HDR = struct.Struct(">II")
MAX_RECORD = 1 << 24

Hook = Callable[[str], None]


class FileOps:
    """The system calls the journal makes; a seam for lost-fsync and torn-write tests."""

    def write(self, fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]

    def fsync(self, fd: int) -> None:
        os.fsync(fd)

    def fsync_dir(self, path: str) -> None:
        fsync_dir(path)


def encode_intent(ident: bytes, key_name: str) -> bytes:
    kn = key_name.encode()
    body = bytes([INTENT]) + struct.pack(">H", len(ident)) + ident + bytes([len(kn)]) + kn
    return _HDR.pack(len(body), zlib.crc32(body)) + body


def encode_released(ident: bytes, cose: bytes) -> bytes:
    body = bytes([RELEASED]) + struct.pack(">H", len(ident)) + ident + struct.pack(">I", len(cose)) + cose
    return _HDR.pack(len(body), zlib.crc32(body)) + body


def _parse_body(body: bytes) -> tuple[int, bytes, int, int]:
    """-> (type, ident, payload offset within body, payload length)."""
    rtype = body[0]
    (ilen,) = struct.unpack_from(">H", body, 1)
    ident = bytes(body[3:3 + ilen])
    pos = 3 + ilen
    if rtype == INTENT:
        klen = body[pos]
        if pos + 1 + klen != len(body):
            raise ValueError("intent length mismatch")
        return rtype, ident, pos + 1, klen
    if rtype == RELEASED:
        (clen,) = struct.unpack_from(">I", body, pos)
        if pos + 4 + clen != len(body):
            raise ValueError("released length mismatch")
        return rtype, ident, pos + 4, clen
    raise ValueError("unknown record type")


class Journal:
    """Durable intents and released bytes, indexed in memory by identity encoding."""

    def __init__(self, path: str, *, ops: Optional[FileOps] = None, hook: Optional[Hook] = None) -> None:
        self.path = os.path.abspath(path)
        self._ops = ops or FileOps()
        self._hook = hook
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # ident -> None (intent only) or (offset, length) of the released COSE bytes
        self._index: dict[bytes, Optional[tuple[int, int]]] = {}
        self._max_hlc: dict[bytes, tuple[int, int]] = {}
        self._max_epoch: dict[bytes, int] = {}
        self._pending = bytearray()
        self._pending_effects: list[tuple[bytes, Optional[tuple[int, int]]]] = []
        self._seq = 0          # last sequence number handed out
        self._durable = 0      # last sequence number covered by a completed fsync
        self._flushing = False
        self._failed: Optional[BaseException] = None
        self.truncated_bytes = 0
        self.fsyncs = 0
        self._fd = self._open()

    # -- opening and recovery -------------------------------------------------------------
    def _open(self) -> int:
        directory = os.path.dirname(self.path)
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as exc:
            raise JournalError(f"cannot open journal {self.path}: {exc.strerror}; check the path and "
                               "that the directory is writable") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise JournalError(f"journal {self.path} is in use by another process; only one bridge may "
                               "own a journal (stop the other agent first)") from None
        size = os.fstat(fd).st_size
        if size < len(MAGIC):
            # new (or torn-at-creation) file: write the header, fsync it and its directory
            os.ftruncate(fd, 0)
            self._ops.write(fd, MAGIC)
            self._ops.fsync(fd)
            self._ops.fsync_dir(directory)
            self._tail = len(MAGIC)
            return fd
        data = os.pread(fd, size, 0)
        if data[:len(MAGIC)] != MAGIC:
            os.close(fd)
            raise JournalError(f"{self.path} is not a signing journal (bad magic); refusing to touch it")
        pos = len(MAGIC)
        while pos < size:
            if pos + _HDR.size > size:
                break
            blen, crc = _HDR.unpack_from(data, pos)
            start = pos + _HDR.size
            if blen == 0 or blen > MAX_RECORD or start + blen > size:
                break
            body = data[start:start + blen]
            if zlib.crc32(body) != crc:
                break
            try:
                rtype, ident, off, ln = _parse_body(body)
                self._apply(rtype, ident, (start + off, ln) if rtype == RELEASED else None)
            except (ValueError, IndexError, struct.error):
                break
            pos = start + blen
        if pos < size:
            # torn tail: never covered by a completed fsync, so never acted upon (module docstring)
            self.truncated_bytes = size - pos
            os.ftruncate(fd, pos)
            self._ops.fsync(fd)
        self._tail = pos
        return fd

    def _apply(self, rtype: int, ident: bytes, loc: Optional[tuple[int, int]]) -> None:
        if rtype == INTENT:
            self._index.setdefault(ident, None)
            identity = decode_identity(ident)
            if isinstance(identity, EventIdentity):
                cur = self._max_hlc.get(identity.site_id)
                if cur is None or identity.hlc > cur:
                    self._max_hlc[identity.site_id] = identity.hlc
            elif isinstance(identity, ReceiptIdentity):
                cur_e = self._max_epoch.get(identity.group_id)
                if cur_e is None or identity.epoch > cur_e:
                    self._max_epoch[identity.group_id] = identity.epoch
        else:
            if self._index.get(ident) is not None:
                raise ValueError("second released record for one identity")
            self._index[ident] = loc

    # -- group commit -----------------------------------------------------------------------
    def commit(self, records: Iterable[tuple[int, bytes, object]]) -> None:
        """Durably append records [(type, ident, key_name | cose)]; return once fsynced."""
        with self._cond:
            self._check()
            for rtype, ident, arg in records:
                if rtype == INTENT:
                    rec = encode_intent(ident, arg)  # type: ignore[arg-type]
                    loc = None
                else:
                    rec = encode_released(ident, arg)  # type: ignore[arg-type]
                    loc = (self._tail + len(rec) - len(arg), len(arg))  # type: ignore[arg-type]
                self._tail += len(rec)   # logical end: durable + in flight + queued
                self._pending += rec
                self._pending_effects.append((bytes([rtype]) + ident, loc))
            self._seq += 1
            my_seq = self._seq
            while True:
                self._check()
                if self._durable >= my_seq:
                    return
                if not self._flushing:
                    break
                self._cond.wait()
            # become the leader for everything queued so far
            self._flushing = True
            buf = bytes(self._pending)
            effects = self._pending_effects
            upto = self._seq
            self._pending = bytearray()
            self._pending_effects = []
        try:
            self._write(buf)
            if self._hook:
                self._hook("journal_before_fsync")
            self._ops.fsync(self._fd)
        except BaseException as exc:
            with self._cond:
                self._failed = exc
                self._flushing = False
                self._cond.notify_all()
            raise JournalError(f"journal write/fsync failed ({exc!r}); the bridge has stopped releasing. "
                               "Check the disk, then restart the agent: anything not durable was not released") from exc
        with self._cond:
            self.fsyncs += 1
            try:
                for tagged, loc in effects:
                    self._apply(tagged[0], tagged[1:], loc)
            except (ValueError, IndexError) as exc:  # the index disagrees with the file: stop
                self._failed = exc
                raise JournalError(f"journal index inconsistent ({exc}); restart the agent") from exc
            finally:
                self._durable = upto
                self._flushing = False
                self._cond.notify_all()

    def _write(self, buf: bytes) -> None:
        if self._hook and len(buf) > 1:
            half = len(buf) // 2
            self._ops.write(self._fd, buf[:half])
            self._hook("journal_torn_write")  # test seam: SIGKILL here leaves a torn tail
            self._ops.write(self._fd, buf[half:])
        else:
            self._ops.write(self._fd, buf)

    def _check(self) -> None:
        if self._failed is not None:
            raise JournalError(f"journal {self.path} is poisoned by an earlier write/fsync failure "
                               f"({self._failed!r}); restart the agent after checking the disk")
        if self._fd < 0:
            raise JournalError("journal is closed")

    # -- queries ------------------------------------------------------------------------------
    def state(self, ident: bytes) -> str:
        """"absent", "intent" (durable intent, no durable output) or "released"."""
        with self._lock:
            if ident not in self._index:
                return "absent"
            return "intent" if self._index[ident] is None else "released"

    def read_released(self, ident: bytes) -> Optional[bytes]:
        with self._lock:
            loc = self._index.get(ident)
            if loc is None:
                return None
            self._check()
            return os.pread(self._fd, loc[1], loc[0])

    def released_items(self) -> list[tuple[bytes, tuple[int, int]]]:
        """[(ident, (offset, length))] of every durable output, in journal (= persist) order."""
        with self._lock:
            items = [(i, loc) for i, loc in self._index.items() if loc is not None]
        return sorted(items, key=lambda x: x[1][0])

    def read_at(self, loc: tuple[int, int]) -> bytes:
        with self._lock:
            self._check()
            return os.pread(self._fd, loc[1], loc[0])

    def max_event_hlc(self, site_id: bytes) -> Optional[tuple[int, int]]:
        with self._lock:
            return self._max_hlc.get(site_id)

    def max_receipt_epoch(self, group_id: bytes) -> Optional[int]:
        with self._lock:
            return self._max_epoch.get(group_id)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)  # closing drops the flock
                self._fd = -1
