"""Compaction of the persist-before-release journal (docs/keystore.md "Compaction"): which
entries a rewrite keeps, drops and replaces by FLOORs, and the atomic rewrite itself (new file,
fsync, rename, fsync of the directory). A crash at any step leaves the old or the new file, and
both answer alike for every identity the caller still needs. A mixin of `Journal`, whose state
and lock it works on."""
from __future__ import annotations

import fcntl
import itertools
import os
import threading
from typing import TYPE_CHECKING, Callable, Optional

from .errors import JournalError
from .identity import EventIdentity, decode_identity, encode_receipt_identity
from .journal_format import (BH, HDR, MAGIC, FileOps, STALE_SHARE, U32, Base, Loc, NothingToDrop, ReceiptsBelow, Recorded,
                             RewriteAll, encode_floor, encode_gap, encode_intent, encode_sealed, mapped,
                             receipts_to_drop, sealed_ad)
from .sealing import Sealer, key_id_of


class Compaction:
    """`Journal.compact` and its steps; the journal's file, index and lock are `Journal`'s."""

    if TYPE_CHECKING:   # Journal's state and helpers, declared for the type checker only
        path: str
        compactions: int
        _ops: FileOps
        _cond: threading.Condition
        _fd: int
        _tail: int
        _base: Optional[Base]
        _sealer: Optional[Sealer]
        _failed: Optional[BaseException]
        _flushing: bool
        _index: dict[bytes, Optional[Loc]]
        _key_of: dict[bytes, str]
        _max_hlc: dict[bytes, tuple[int, int]]
        _floor: dict[bytes, tuple[int, int]]
        _receipt_floor: dict[bytes, int]
        _gap: dict[bytes, tuple[tuple[int, int], tuple[int, int]]]
        _pending_effects: list[tuple[int, bytes, int, Optional[int], Optional[str]]]

        @property
        def tmp_path(self) -> str: ...
        def _check(self) -> None: ...
        def _fire(self, point: str) -> None: ...
        def _opened(self, ident: bytes, loc: tuple, data: bytes) -> bytes: ...

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
