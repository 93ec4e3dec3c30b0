"""The persist-before-release journal: an append-only, CRC-framed, fsynced log (SOVM §22.5).

The file format is firmware_bridge/journal_format.py's (docs/keystore.md "Journal format").

A record is durable once the fsync that follows its write has returned.  Writers append through
``commit``; concurrent callers share one write+fsync (leader/follower group commit): the first
waiter becomes the leader, writes everything queued so far with one write() and one fsync(),
and wakes the followers whose records that fsync covered.

Recovery: a torn tail (an incomplete or CRC-failing record at the end) can only hold bytes that
were never covered by a completed fsync, hence never acted upon (no signature was made after an
intent that was not durable, no bytes released before their record was durable); it is
truncated.  A bad record with valid records after it is not a torn tail (later writes completed
after it, so it was durable once): the journal raises ``JournalCorrupt`` and changes nothing.  After an fsync failure the journal is poisoned and refuses all further work
("fsyncgate": the page cache state after a failed fsync is unknown).  An append that write()
refuses for want of space (ENOSPC, EDQUOT) is different: no fsync covered its bytes, so they are
cut off (ftruncate to the last durable tail), that batch's callers fail, and the journal goes on.

Compaction (``compact``) rewrites the file atomically (new file, fsync, rename, fsync of the
directory): events are kept only when their output is not yet recorded elsewhere by the caller (or
their signing is in flight); receipts in full, unless the caller says below which epoch a group's
receipts are recorded elsewhere (the sequencer: its receipts table), and then each group's last
released receipt below that epoch stays in full, with the gap intents after it; everything else is
replaced by one FLOOR record per site and per group.  A compaction of receipts alone keeps what
the last compaction wrote byte for byte and rewrites only what was appended since (the entries it
leaves behind, of groups that moved on, are bounded by STALE_SHARE).  A crash at any point leaves
either the old or the new file, and both answer every question the same way for every identity the
caller still needs.
"""
from __future__ import annotations

import errno
import fcntl
import itertools
import os
import struct
import sys
import threading
from typing import Any, Callable, Iterable, Optional, cast

from .errors import JournalBusy, JournalError
from .identity import DiscontinuityIdentity, EventIdentity, ReceiptIdentity, decode_identity, encode_receipt_identity
from .sealing import Sealer, key_id_of

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

class Journal:
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

    # -- compaction ---------------------------------------------------------------------------
    def compact_events(self, recorded: Callable[[EventIdentity], bool],
                       in_flight: Callable[[], set] = set) -> dict[str, int]:
        """``compact`` of the events only: every receipt is kept in full."""
        return self.compact(recorded, in_flight)

    def compact(self, recorded: Optional[Callable[[EventIdentity], bool]] = None,
                in_flight: Callable[[], set] = set,
                receipts_below: Optional[Callable[[bytes], Optional[int]]] = None) -> dict[str, int]:
        """Rewrite the journal without what the caller has durably recorded elsewhere.

        Events (``recorded`` given): kept, every event whose output is released and not
        ``recorded``, and every event intent in ``in_flight()`` (being signed now: its output is
        about to be persisted).  Dropped: released events for which ``recorded(identity)`` is
        true, and event intents without output (unknown outcomes, already spent).  Added: one
        FLOOR per site at the highest event HLC ever intended, so every dropped identity stays
        spent.  Without ``recorded`` every event is kept.

        Receipts (``receipts_below`` given; without it every receipt is kept in full):
        ``receipts_below(group_id)`` is the epoch below which the caller holds every receipt of the
        group durably, or the stated gap of an epoch that has none (the sequencer: its committed
        ``current_epoch``, §22.5 cl. 3), or None.  Kept in full: the group's last released receipt
        below it (its chain head) and every identity after it (the intents of the gaps since),
        so that a state restored from an older copy adopts the head byte for byte and a gap's
        statement names it; a group without a released receipt there keeps everything.  Dropped:
        every receipt identity below the one kept, released or intended, not ``in_flight()``.
        Added: one FLOOR per group at the epoch below the one kept, so every dropped identity stays spent
        (``state`` says "spent": never signed again, §22.5 cl. 1-2).  Receipts alone (``recorded``
        None): usually only what was appended since the last compaction is looked at and
        rewritten, after that compaction's file kept byte for byte (``_rewrite_tail``: the entries
        it leaves behind read released, not spent); the whole file otherwise (``_tail_after``).
        The returned counts say which (``"full"``).

        The new file is written beside the journal, fsynced, renamed over it, and the directory
        fsynced; commits wait meanwhile (they queue and share the next fsync afterwards).  A
        crash before the rename leaves the old journal (the stale file is deleted on open); after
        it, the new one.  ``recorded`` is called without the journal lock held."""
        with self._cond:
            self._check()
            while self._flushing or self._pending_effects:   # queued commits go first
                self._cond.wait()
                self._check()
            self._flushing = True          # no leader may append while we rewrite
            # no commit changes the index while this holds the writer role (``_flushing``): the
            # identities are copied, their locations read as needed (a copy of every item costs)
            index = self._index
            idents = list(index)
            key_of = self._key_of
            floors = dict(self._max_hlc)
            receipt_floors = dict(self._receipt_floor)
            old_fd, old_size = self._fd, self._tail
            base = self._base
        new_fd = -1
        renamed = False
        try:
            busy = in_flight()
            tail = self._tail_after(base, idents, old_size, recorded, receipts_below, receipt_floors)
            with mapped(old_fd, old_size, self.path) as view:
                dropped = stale = 0
                if tail is not None:
                    assert base is not None and receipts_below is not None  # _tail_after: a tail has both
                    try:
                        parts, new_index, new_keys, intents, receipts_dropped, stale = self._rewrite_tail(
                            view, old_size, base, tail, index, key_of, busy, receipts_below, receipt_floors)
                    except RewriteAll:
                        tail = None
                if tail is None:
                    out, new_index, new_keys, intents, dropped, receipts_dropped = self._rewrite_all(
                        view, old_size, idents, index, key_of, busy, recorded, receipts_below, floors, receipt_floors)
                    half = len(out) // 2
                    parts = (bytes(out[:half]), bytes(out[half:]))
            size = len(parts[0]) + len(parts[1])
            tmp = self.tmp_path
            new_fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND, 0o600)
            fcntl.flock(new_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held across the rename
            self._ops.write(new_fd, parts[0])
            self._fire("compact_torn_write")
            self._ops.write(new_fd, parts[1])
            self._fire("compact_before_fsync")
            self._ops.fsync(new_fd)
            self._fire("compact_before_rename")
            self._ops.replace(tmp, self.path)
            renamed = True
            self._fire("compact_after_rename")
            self._ops.fsync_dir(os.path.dirname(self.path))
            self._fire("compact_after_dirsync")
        except NothingToDrop:
            with self._cond:
                self._flushing = False
                self._cond.notify_all()
            return {"events_dropped": 0, "receipts_dropped": 0, "entries_kept": len(idents),
                    "bytes_before": old_size, "bytes_after": old_size, "full": False}
        except BaseException as exc:
            with self._cond:
                if renamed:
                    # the name may point at either file: stop, the next open decides
                    self._failed = exc
                self._flushing = False
                self._cond.notify_all()
            if new_fd >= 0:
                os.close(new_fd)
            if not renamed:
                try:
                    os.unlink(self.tmp_path)
                except OSError:
                    pass
            if isinstance(exc, JournalError):
                raise
            raise JournalError(f"journal compaction failed ({exc!r}); " +
                               ("restart the agent" if renamed else "the journal is unchanged")) from exc
        with self._cond:
            self._fd = new_fd
            os.close(old_fd)
            self._index = new_index
            self._key_of = new_keys
            self._floor = floors if recorded is not None else self._floor
            self._receipt_floor = receipt_floors
            self._tail = size
            self._base = Base(size, len(new_index), stale, len(new_keys), tuple(intents))
            self.compactions += 1
            self._flushing = False
            self._cond.notify_all()
        return {"events_dropped": dropped, "receipts_dropped": receipts_dropped, "entries_kept": len(new_index),
                "bytes_before": old_size, "bytes_after": size, "full": tail is None}

    @staticmethod
    def _tail_after(base: Optional[Base], idents: list, size: int, recorded: Optional[Recorded],
                    receipts_below: Optional[ReceiptsBelow], floors: dict[bytes, int]) -> Optional[list]:
        """The identities added since the last compaction, when only they are to be rewritten:
        receipts only (no events to weigh), the base written by a compaction since this open (so
        with every output under this journal's data key, where it has one: a full rewrite seals
        them again), and not already past STALE_SHARE of its entries left behind, counting one more
        for each group with receipts since that an earlier compaction kept an entry of (a quick
        estimate: ``_rewrite_tail`` counts them exactly before writing). None: rewrite everything."""
        if recorded is not None or receipts_below is None or base is None or base.end > size \
                or base.count > len(idents):
            return None
        tail = idents[base.count:]
        moving = {i[3:-8] for i in tail if i[0] == 0x52}
        return tail if base.stale + sum(g in floors for g in moving) <= STALE_SHARE * base.count else None

    def _rewrite_all(self, view: memoryview, old_size: int, idents: list, index: dict, key_of: dict, busy: set,
                     recorded: Optional[Recorded], receipts_below: Optional[ReceiptsBelow], floors: dict,
                     receipt_floors: dict) -> tuple:
        """The whole file anew: MAGIC, the floors, every kept identity (``compact``). Also returns
        the identities it wrote with an intent and no output (the new base's)."""
        out = bytearray(MAGIC)
        new_index: dict[bytes, Optional[Loc]] = {}
        new_keys: dict[bytes, str] = {}
        if recorded is not None:
            for site, hlc in sorted(floors.items()):
                out += encode_floor(EventIdentity(site, *hlc).encode())
        for site, (low, top) in sorted(self._gap.items()):
            # after the FLOOR it sits below: the identities it dropped inside the gap are below `low`
            out += encode_gap(EventIdentity(site, *low).encode(), top)
        drop_receipts: set = set()
        if receipts_below is not None:
            drop_receipts = receipts_to_drop(idents, index, busy, receipts_below, receipt_floors)
            if recorded is None and not drop_receipts:
                raise NothingToDrop   # receipts only, and none to drop: no rewrite
        for gid, epoch in sorted(receipt_floors.items()):
            out += encode_floor(encode_receipt_identity(gid, epoch))
        dropped = 0
        entries = []
        for ident in idents:
            if ident in drop_receipts:
                continue
            loc = index[ident]
            if recorded is not None and ident[:1] == b"E":
                # a b"E" identity decodes to an EventIdentity
                keep = (ident in busy) if loc is None else not recorded(decode_identity(ident))  # type: ignore[arg-type]
                if not keep:
                    dropped += 1
                    continue
            entries.append((ident, loc))
        intents = self._write_entries(view, old_size, out, 0, entries, key_of, new_index, new_keys, True)
        return out, new_index, new_keys, intents, dropped, len(drop_receipts)

    def _rewrite_tail(self, view: memoryview, old_size: int, base: Base, tail: list, index: dict, key_of: dict,
                      busy: set, receipts_below: ReceiptsBelow, receipt_floors: dict) -> tuple:
        """The base byte for byte, then the floors that rose and what is kept of the identities
        added since (``compact``): its cost follows what came since the last compaction, not every
        group ever signed for. The base's entries of groups that moved on stay in the file and the
        index (released, at or below the new floor: never signed again either way) until a full
        rewrite, which STALE_SHARE bounds. Also returns the new base's identities with an intent
        and no output, and how many entries it has left behind."""
        # the floors of the groups with receipts dropped, from nothing: only those are looked at
        # (not every group's: a sequencer may have served many more than move now)
        raised: dict[bytes, int] = {}
        drop = receipts_to_drop(tail, index, busy, receipts_below, raised)
        if not drop:
            raise RewriteAll        # what is droppable (if anything) is in the base
        # the base's entries each group whose floor rises now leaves behind: those between its old
        # floor and its new one (identities of a group compare as their epochs: identity.py).
        # Counted before anything is written or changed: past STALE_SHARE of what the new file
        # holds, the whole file is rewritten instead (_tail_after's one a group is an estimate: a
        # group whose last compaction kept several entries leaves them all)
        risen = []                                   # (group, new floor, its identity), in group order
        rose: dict[bytes, tuple[bytes, bytes]] = {}  # identity prefix -> (old floor's identity, new)
        for gid, epoch in sorted(raised.items()):
            old = receipt_floors.get(gid)
            if old is None or old < epoch:
                ident = encode_receipt_identity(gid, epoch)
                risen.append((gid, epoch, ident))
                rose[ident[:-8]] = (b"" if old is None else encode_receipt_identity(gid, old), ident)
        stale = base.stale + sum(1 for i in itertools.islice(index, base.count)
                                 if (r := rose.get(i[:-8])) is not None and r[0] < i <= r[1])
        kept = [(i, index[i]) for i in tail if i not in drop]
        if stale > STALE_SHARE * (base.count + len(kept)):
            raise RewriteAll
        # the base as it is, then what is new in a buffer of its own (appending to one of the
        # base's megabytes costs a reallocation each time)
        head, out = bytes(view[:base.end]), bytearray()
        for gid, epoch, ident in risen:
            receipt_floors[gid] = epoch
            out += encode_floor(ident)
        # the base's entries as they are (the dicts' first entries, in file order), then the kept
        # ones since, appended by _write_entries: the dropped are never copied to be deleted
        new_index = dict(itertools.islice(index.items(), base.count))
        new_keys = dict(itertools.islice(key_of.items(), base.keys))
        # the base's intents whose outputs came since: their intent records are in the base
        late = [(i, index[i]) for i in base.intents if index.get(i) is not None]
        self._write_entries(view, old_size, out, base.end, late, key_of, new_index, new_keys, False)
        intents = [i for i in base.intents if index.get(i) is None]
        intents += self._write_entries(view, old_size, out, base.end, kept, key_of, new_index, new_keys, True)
        return (head, bytes(out)), new_index, new_keys, intents, len(drop), stale

    def _write_entries(self, view: memoryview, old_size: int, out: bytearray, origin: int, entries: list, key_of: dict,
                       new_index: dict, new_keys: dict, with_intent: bool) -> list:
        """Append each (identity, location) entry's intent record (``with_intent``) and its output
        record to ``out`` (which starts at offset ``origin`` of the new file), setting its new
        location; returns the identities written with no output. The old file is read in place: a
        kept output's record is copied byte for byte (what encode_output would write again: the
        same type, identity and bytes), not re-read and re-encoded (~2 µs an entry)."""
        sealer = self._sealer
        intent_only = []
        for ident, loc in entries:
            if with_intent:
                key = new_keys[ident] = key_of.get(ident, "")
                out += encode_intent(ident, key)
            if loc is None:
                new_index[ident] = None
                intent_only.append(ident)
                continue
            at, size = loc[0], loc[1]
            if at + size > old_size:
                raise JournalError(f"journal {self.path}: short read during compaction")
            if sealer is not None and (len(loc) == 2 or key_id_of(view[at:at + size]) != sealer.current):
                # a clear output of an older journal, or one sealed under a retiring data key
                cose = sealer.seal(sealed_ad(ident), self._opened(ident, loc, bytes(view[at:at + size])))
                rec = encode_sealed(ident, cose)
                new_index[ident] = (origin + len(out) + len(rec) - len(cose), len(cose), 1)
                out += rec
                continue
            # the record: its header, type and identity, the output's length, the output
            start = at - (HDR.size + BH.size + len(ident) + U32.size)
            new_index[ident] = (origin + len(out) + at - start, size) + loc[2:]
            out += view[start:at + size]
        return intent_only

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
