"""The persist-before-release journal: an append-only, CRC-framed, fsynced log (SOVM §22.5), in
firmware_bridge/journal_format.py's format (docs/keystore.md "Journal format").

A record is durable once the fsync after its write returned. Concurrent ``commit`` callers share one
write+fsync (leader/follower group commit). Recovery truncates a torn tail (bytes no completed fsync
covered, so never acted upon); a bad record with valid records after it was durable once, so the
journal raises ``JournalCorrupt`` and changes nothing. After an fsync failure the journal is
poisoned ("fsyncgate": the page cache is unknown); an append refused for want of space (ENOSPC,
EDQUOT) is cut off at the last durable tail, that batch's callers fail, and the journal goes on.
Compaction is firmware_bridge/journal_compact.py's."""
from __future__ import annotations

import errno
import fcntl
import os
import struct
import sys
import threading
from typing import Any, Iterable, Optional, cast

from .errors import JournalBusy, JournalError
from .identity import DiscontinuityIdentity, EventIdentity, ReceiptIdentity, decode_identity
from .sealing import Sealer
from .journal_compact import Compaction

from .journal_format import (  # noqa: F401 - the format's names are the journal's API too
    MAGIC,
    INTENT,
    RELEASED,
    FLOOR,
    SEALED,
    GAP,
    RELEASED_TYPES,
    Loc,
    Recorded,
    ReceiptsBelow,
    HDR,
    BH,
    U32,
    HLC,
    U64,
    MAX_RECORD,
    Hook,
    FileOps,
    encode_intent,
    encode_output,
    encode_released,
    encode_sealed,
    sealed_ad,
    encode_floor,
    encode_gap,
    parse_body,
    record_at,
    valid_records_after,
    receipt_parts,
    mapped,
    STALE_SHARE,
    Base,
    NothingToDrop,
    RewriteAll,
    receipts_to_drop,
    ReceiptGroup,
    corrupt_error,
    inspect,
)

class Journal(Compaction):
    """Durable intents and released bytes, indexed in memory by identity encoding."""

    def __init__(self, path: str, *, ops: Optional[FileOps] = None, hook: Optional[Hook] = None,
                 sealer: Optional[Sealer] = None) -> None:
        """``sealer`` (sealing.Sealer): outputs are written sealed (type SEALED) and opened on
        read; without it, clear (RELEASED), and a SEALED record cannot be read (JournalError)."""
        self.path = os.path.abspath(path)
        self._sealer = sealer
        self._ops = ops or FileOps()
        self._hook = hook
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        # ident -> None (intent only) or (offset, length) of the released COSE bytes, or
        # (offset, length, 1) of their sealed form
        self._index: dict[bytes, Optional[Loc]] = {}
        self._max_hlc: dict[bytes, tuple[int, int]] = {}
        self._max_epoch: dict[bytes, int] = {}
        self._floor: dict[bytes, tuple[int, int]] = {}   # site_id -> HLC floor (FLOOR records)
        self._receipt_floor: dict[bytes, int] = {}       # group_id -> epoch floor (FLOOR records)
        # site_id -> (low, top) of its GAP record, low raised by every intent inside (``open_gap``)
        self._gap: dict[bytes, tuple[tuple[int, int], tuple[int, int]]] = {}
        self._key_of: dict[bytes, str] = {}   # ident -> key name of its intent (interned)
        self._pending = bytearray()
        # (tagged ident, record length, payload length or None, key name or None) of queued records
        self._pending_effects: list[tuple[int, bytes, int, Optional[int], Optional[str]]] = []
        self._seq = 0          # last sequence number handed out
        self._durable = 0      # last sequence number covered by a completed fsync
        self._flushing = False  # a leader (or a compaction) owns the file
        self._failed: Optional[BaseException] = None
        self._taken = 0        # last sequence number a leader took into a batch
        self._refused: list[tuple[int, int]] = []  # (after, upto] sequence ranges refused for want of space
        self.truncated_bytes = 0
        self.fsyncs = 0
        self.compactions = 0
        # what the last compaction wrote (None: none since this open): a receipts-only compaction
        # keeps it byte for byte and rewrites only what was appended after it (``compact``)
        self._base: Optional[Base] = None
        self._fd = self._open()

    @property
    def tmp_path(self) -> str:
        return self.path + ".compact"

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
            raise JournalBusy(f"journal {self.path} is in use by another process; only one bridge may "
                               "own a journal (stop the other agent first)") from None
        try:
            # a compaction that crashed before its rename: the old file is the journal
            os.unlink(self.tmp_path)
        except FileNotFoundError:
            pass
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
            got = record_at(data, pos, size)
            if got is None:
                break
            rtype, ident, off, ln, end = got
            try:
                if rtype == GAP:
                    self._apply_gap(ident, HLC.unpack_from(data, pos + HDR.size + off))
                else:
                    self._apply(rtype, ident, (pos + HDR.size + off, ln) if rtype == RELEASED else
                                (pos + HDR.size + off, ln, 1) if rtype == SEALED else None,
                                data[pos + HDR.size + off:pos + HDR.size + off + ln].decode()
                                if rtype == INTENT else None)
            except (ValueError, IndexError, struct.error, UnicodeDecodeError):
                break
            pos = end
        if pos < size:
            after = valid_records_after(data, pos, size)
            if after is not None:
                # Valid records follow the bad one: the bad bytes were followed by later, complete
                # writes, so they are not a torn tail but damage to durable data. Truncating would
                # silently drop every later record (released outputs among them): refuse, and
                # change nothing.
                os.close(fd)
                raise corrupt_error(self.path, pos, after)
            # torn tail: never covered by a completed fsync, so never acted upon (module docstring)
            self.truncated_bytes = size - pos
            os.ftruncate(fd, pos)
            self._ops.fsync(fd)
        self._tail = pos
        return fd

    def _apply(self, rtype: int, ident: bytes, loc: Optional[Loc], key: Optional[str] = None) -> None:
        if rtype == INTENT:
            self._index.setdefault(ident, None)
            self._key_of.setdefault(ident, sys.intern(key or ""))
            if len(ident) == 29 and ident[0] == 0x45:   # b"E": an event (identity.py), the hot path
                site, hlc = ident[1:17], HLC.unpack_from(ident, 17)
                cur = self._max_hlc.get(site)
                if cur is None or hlc > cur:
                    self._max_hlc[site] = hlc
                gap = self._gap.get(site) if self._gap else None
                if gap is not None and gap[0] < hlc < gap[1]:
                    self._gap[site] = (hlc, gap[1])   # the gap's low end rises with what is issued in it
                return
            if ident[0] == 0x52 and ident[1] == 0 and ident[2] and len(ident) == 11 + ident[2]:
                # b"R" | u16 len (1..255) | group_id | u64 epoch (identity.py): a receipt, the
                # sequencer's hot path, read in place; anything else is decoded (and refused) in full
                gid, epoch = ident[3:-8], U64.unpack_from(ident, len(ident) - 8)[0]
            else:
                identity = decode_identity(ident)
                if not isinstance(identity, ReceiptIdentity):
                    return
                gid, epoch = identity.group_id, identity.epoch
            cur_e = self._max_epoch.get(gid)
            if cur_e is None or epoch > cur_e:
                self._max_epoch[gid] = epoch
        elif rtype == FLOOR:
            identity = decode_identity(ident)
            if isinstance(identity, ReceiptIdentity):
                for etable in (self._receipt_floor, self._max_epoch):
                    cur_e = etable.get(identity.group_id)
                    if cur_e is None or identity.epoch > cur_e:
                        etable[identity.group_id] = identity.epoch
                return
            if not isinstance(identity, EventIdentity):
                raise ValueError("a FLOOR record names an event or a receipt identity")
            for table in (self._floor, self._max_hlc):
                cur = table.get(identity.site_id)
                if cur is None or identity.hlc > cur:
                    table[identity.site_id] = identity.hlc
        else:
            if self._index.get(ident) is not None:
                raise ValueError("second released record for one identity")
            self._index[ident] = loc

    def _apply_gap(self, ident: bytes, top: tuple[int, int]) -> None:
        """A GAP record: the site's gap is (low, top), low raised above any intent the index holds
        inside it (a GAP written by ``open_gap`` has none; one a compaction wrote, none either)."""
        site, low = ident[1:17], HLC.unpack_from(ident, 17)
        top = (top[0], top[1])
        inside = [h for i in self._index if len(i) == 29 and i[0] == 0x45 and i[1:17] == site
                  and low < (h := HLC.unpack_from(i, 17)) < top]
        self._gap[site] = (max(inside, default=low), top)

    def _apply_flushed(self, effects: list, pos: int) -> None:
        """``_apply`` each record of a batch just made durable, written from offset ``pos`` on
        ((type, ident, record length, payload length or None, key name or None) each)."""
        index, apply = self._index, self._apply
        for rtype, ident, rlen, plen, key in effects:
            if rtype == RELEASED:      # _apply's, inline: one per signature, the hot path
                if index.get(ident) is not None:
                    raise ValueError("second released record for one identity")
                index[ident] = (pos + rlen - plen, plen)
            elif rtype == GAP:
                self._apply_gap(ident, key)
            else:
                apply(rtype, ident, None if plen is None else (pos + rlen - plen, plen, 1), key)
            pos += rlen

    # -- group commit -----------------------------------------------------------------------
    def commit(self, records: Iterable[tuple[int, bytes, Any]]) -> None:
        """Durably append records [(type, ident, key_name | cose)]; return once fsynced."""
        records = list(records)
        if self._sealer is not None:
            # Sealed before the lock is taken (pure, and the costliest part of a release's records:
            # other threads' commits need not wait for it), the batch's outputs in one call.
            released = [(k, r[1], r[2]) for k, r in enumerate(records) if r[0] == RELEASED]
            if released:
                blobs = self._sealer.seal_many([sealed_ad(i) for _, i, _ in released], [o for _, _, o in released])
                for (k, ident, _), blob in zip(released, blobs):
                    records[k] = (SEALED, ident, blob)
        recs: list[bytes] = []
        effs: list[tuple[int, bytes, int, Optional[int], Optional[str]]] = []
        for rtype, ident, arg in records:
            if rtype == INTENT:
                rec = encode_intent(ident, arg)
                effs.append((rtype, ident, len(rec), None, arg))
            elif rtype == GAP:
                rec = encode_gap(ident, arg)
                effs.append((rtype, ident, len(rec), None, arg))
            else:
                rec = encode_output(rtype, ident, arg)
                effs.append((rtype, ident, len(rec), len(arg), None))
            recs.append(rec)
        with self._cond:
            self._check()
            self._pending += b"".join(recs)
            self._pending_effects.extend(effs)
            self._seq += 1
            my_seq = self._seq
            while True:
                self._check()
                if any(lo < my_seq <= hi for lo, hi in self._refused):
                    raise JournalError(f"journal {self.path}: no space for the records; nothing was released")
                if self._durable >= my_seq:
                    return
                if not self._flushing:
                    break
                self._cond.wait()
            # become the leader for everything queued so far
            self._flushing = True
            buf = bytes(self._pending)
            pending = self._pending_effects
            upto = self._seq
            taken, self._taken = self._taken, upto   # this batch: the commits (taken, upto]
            self._pending = bytearray()
            self._pending_effects = []
            # offsets are fixed against the file the leader is about to append to (a compaction
            # between queueing and flushing changes the file; none runs while the leader owns it)
            start = self._tail
        try:
            try:
                self._write(buf)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT) and self._cut_back(self._tail):
                    # No space for this batch (write() refused, no fsync failed): its partial bytes
                    # are cut off, its callers fail, the journal goes on (`run`
                    # signs again once eviction or the operator freed space).
                    with self._cond:
                        self._refused.append((taken, upto))
                        del self._refused[:-16]
                        self._flushing = False
                        self._cond.notify_all()
                    raise JournalError(f"journal {self.path}: no space for the records ({exc.strerror}); "
                                       "nothing was released") from exc
                raise
            if self._hook:
                self._hook("journal_before_fsync")
            self._ops.fsync(self._fd)
        except JournalError:
            raise
        except BaseException as exc:
            with self._cond:
                self._failed = exc
                self._flushing = False
                self._cond.notify_all()
            raise JournalError(f"journal write/fsync failed ({exc!r}); the bridge has stopped releasing. "
                               "Check the disk, then restart the agent: anything not durable was not released") from exc
        with self._cond:
            self.fsyncs += 1
            self._tail = start + len(buf)
            try:
                self._apply_flushed(pending, start)
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

    def _cut_back(self, tail: int) -> bool:
        """Cut a refused append's partial bytes off (the file is O_APPEND: the next append goes
        after `tail` again). False if that fails too: then the journal is poisoned."""
        try:
            os.ftruncate(self._fd, tail)
            return True
        except OSError:
            return False

    def _check(self) -> None:
        if self._failed is not None:
            raise JournalError(f"journal {self.path} is poisoned by an earlier write/fsync failure "
                               f"({self._failed!r}); restart the agent after checking the disk")
        if self._fd < 0:
            raise JournalError("journal is closed")

    def _fire(self, point: str) -> None:
        if self._hook:
            self._hook(point)

    # -- queries ------------------------------------------------------------------------------
    def _state_locked(self, ident: bytes) -> str:
        if ident in self._index:
            return "intent" if self._index[ident] is None else "released"
        if ident[:1] == b"E" and len(ident) == 29:
            floor = self._floor.get(ident[1:17])
            if floor is not None and (hlc := struct.unpack(">QI", ident[17:29])) <= floor:
                gap = self._gap.get(ident[1:17])
                return "absent" if gap is not None and gap[0] < hlc < gap[1] else "spent"
        elif ident[:1] == b"R" and self._receipt_floor:
            parts = receipt_parts(ident)
            if parts is not None and parts[1] <= self._receipt_floor.get(parts[0], -1):
                return "spent"
        return "absent"

    def state(self, ident: bytes) -> str:
        """"absent", "intent" (durable intent, no durable output), "released", or "spent" (an
        event or receipt identity at or below its site's or group's compaction floor that the
        journal no longer holds: recorded by the caller, or an unknown outcome; never to be
        signed)."""
        with self._lock:
            return self._state_locked(ident)

    def states(self, idents: list[bytes]) -> list[str]:
        """`state` of each identity, under one acquisition of the lock (a group commit's look-up)."""
        with self._lock:
            return [self._state_locked(i) for i in idents]

    def read_released(self, ident: bytes) -> Optional[bytes]:
        with self._lock:
            loc = self._index.get(ident)
            if loc is None:
                return None
            self._check()
            data = os.pread(self._fd, loc[1], loc[0])
        return self._opened(ident, loc, data)

    def _opened(self, ident: bytes, loc: tuple, data: bytes) -> bytes:
        if len(loc) == 2:
            return data
        if self._sealer is None:
            raise JournalError(f"journal {self.path} holds sealed outputs and was opened without the data key; "
                               "open it through the agent's node (its keystore unseals the key)")
        from .sealing import SealError
        try:
            return self._sealer.open(sealed_ad(ident), data)
        except SealError as exc:
            raise JournalError(f"journal {self.path}: a sealed output does not open ({exc}); the journal "
                               "belongs to another keystore or was damaged") from None

    @property
    def sealed(self) -> bool:
        return self._sealer is not None

    def released_items(self) -> list[tuple[bytes, Loc]]:
        """[(ident, (offset, length))] of every durable output, in journal (= persist) order.
        Offsets are only valid until the next compaction: read through ``read_released``."""
        with self._lock:
            items = [(i, loc) for i, loc in self._index.items() if loc is not None]
        return sorted(items, key=lambda x: x[1][0])

    def read_at(self, loc: Loc) -> bytes:
        """The stored bytes at ``loc`` (sealed ones as stored: read through ``read_released``)."""
        with self._lock:
            self._check()
            return os.pread(self._fd, loc[1], loc[0])

    def max_event_hlc(self, site_id: bytes) -> Optional[tuple[int, int]]:
        with self._lock:
            return self._max_hlc.get(site_id)

    def event_gap(self, site_id: bytes) -> Optional[tuple[tuple[int, int], tuple[int, int]]]:
        """(low, top) of the site's gap (``open_gap``): no identity above low and below top was
        ever intended; low is the highest intended inside since the gap was recorded. None: none."""
        with self._lock:
            return self._gap.get(site_id)

    def open_gap(self, site_id: bytes, low: tuple[int, int], top: tuple[int, int]) -> None:
        """Durably record that no event identity of ``site_id`` strictly between ``low`` and
        ``top`` was ever intended, so they are signable although a FLOOR covers them (a clock that
        ran ahead and was corrected issues there: docs/apply.md "Clocks without an RTC"). The
        caller vouches for what the journal forgot (below a FLOOR); the journal refuses a range
        holding an identity it knows, or a range below the one recorded (it only moves up)."""
        low, top = (low[0], low[1]), (top[0], top[1])
        if not low < top:
            raise ValueError("a gap needs low < top")
        ident = EventIdentity(site_id, *low).encode()
        with self._lock:
            cur = self._gap.get(site_id)
            if cur is not None and low < cur[0]:
                raise JournalError(f"journal {self.path}: a gap at or above {cur[0]} is recorded; it never moves down")
            held = [i for i in self._index if len(i) == 29 and i[0] == 0x45 and i[1:17] == site_id
                    and low < HLC.unpack_from(i, 17) < top]
            if held:
                h = HLC.unpack_from(held[0], 17)
                raise JournalError(f"journal {self.path}: {h[0]}.{h[1]} was intended inside the gap "
                                   f"{low[0]}.{low[1]} .. {top[0]}.{top[1]}; refusing it")
        self.commit([(GAP, ident, top)])

    def max_receipt_epoch(self, group_id: bytes) -> Optional[int]:
        with self._lock:
            return self._max_epoch.get(group_id)

    def receipt_groups(self) -> dict[bytes, ReceiptGroup]:
        """Every group the journal knows receipts, floors or statements of (a resume's question,
        §22.6 step 1: which groups a restored state lacks or is behind). One pass over the index."""
        with self._lock:
            idents = list(self._index)
            floors = dict(self._receipt_floor)
        held: dict[bytes, list] = {}
        stated: dict[bytes, dict[int, list]] = {}
        for i in idents:
            if i[0] == 0x52:
                parts = receipt_parts(i)
                if parts is not None:
                    held.setdefault(parts[0], []).append(parts[1])
            elif i[0] == 0x44:          # b"D": a discontinuity statement (identity.py)
                d = cast(DiscontinuityIdentity, decode_identity(i))  # what a b"D" identity decodes to
                stated.setdefault(d.group_id, {}).setdefault(d.epoch, []).append(d.attempt)
        out = {}
        for gid in set(held) | set(stated) | set(floors):
            epochs = held.get(gid)
            out[gid] = ReceiptGroup(floors.get(gid), min(epochs) if epochs else None, max(epochs) if epochs else None,
                                    {e: tuple(sorted(a)) for e, a in stated.get(gid, {}).items()})
        return out

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"bytes": self._tail, "entries": len(self._index), "fsyncs": self.fsyncs,
                    "compactions": self.compactions}

    def close(self) -> None:
        with self._cond:
            while self._flushing:   # let a running flush or compaction finish with its fd
                self._cond.wait()
            if self._fd >= 0:
                os.close(self._fd)  # closing drops the flock
                self._fd = -1
