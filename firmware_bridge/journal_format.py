"""The signing journal's file format (SOVM §22.5): its records, how they are framed and read back,
and the compaction bookkeeping that works on records alone (firmware_bridge/journal.py writes).

File layout (all integers big-endian), documented in docs/keystore.md "Journal format":

    header  = b"SSPJRNL1"
    record  = body_len (u32) | crc32(body) (u32) | body
    body    = type (u8) | ident_len (u16) | ident (identity.encode()) | rest
      type 1 INTENT:   rest = key_name_len (u8) | key_name (utf-8)
      type 2 RELEASED: rest = cose_len (u32) | exact COSE_Sign1 bytes
      type 3 FLOOR:    rest = (empty); ident is an event identity (site_id, HLC): every event
                       identity of that site at or below that HLC that the journal does not hold
                       is spent; or a receipt identity (group_id, epoch): every receipt identity of
                       that group at or below that epoch that the journal does not hold is spent
                       (written by compaction, see ``compact``)
      type 4 SEALED:   as RELEASED, the bytes sealed (sealing.py, associated data
                       b"ssp-journal\0" | ident): written by a journal given a sealer, so the
                       card holds no signed event in clear (docs/reliability.md "At rest")
      type 5 GAP:      rest = top HLC (u64 physical, u32 logical); ident is an event identity
                       (site_id, low): no identity of that site strictly between low and top was
                       ever intended but those this journal holds, whatever a FLOOR says; the
                       clock issues there after a wrong clock (``open_gap``); a compaction
                       rewrites it with low raised to the highest identity intended inside
"""
from __future__ import annotations

import contextlib
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from .errors import JournalCorrupt, JournalError
from .fsutil import fsync_dir
from .identity import EventIdentity

MAGIC = b"SSPJRNL1"
INTENT = 1
RELEASED = 2
FLOOR = 3
SEALED = 4     # a RELEASED record whose output is sealed at rest (sealing.py)
GAP = 5        # a never-issued HLC range of one site below its FLOOR (``open_gap``)
RELEASED_TYPES = (RELEASED, SEALED)
# where an output is in the file: (offset, length), with a third member (1) when it is sealed
Loc = tuple[int, ...]
Recorded = Callable[[EventIdentity], bool]           # ``compact``'s ``recorded``
ReceiptsBelow = Callable[[bytes], Optional[int]]     # ``compact``'s ``receipts_below``
HDR = struct.Struct(">II")
BH = struct.Struct(">BH")
U32 = struct.Struct(">I")
HLC = struct.Struct(">QI")
U64 = struct.Struct(">Q")
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

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst)


def encode_intent(ident: bytes, key_name: str) -> bytes:
    kn = key_name.encode()
    body = b"".join((BH.pack(INTENT, len(ident)), ident, bytes((len(kn),)), kn))
    return HDR.pack(len(body), zlib.crc32(body)) + body


def encode_output(rtype: int, ident: bytes, data: bytes) -> bytes:
    """A RELEASED (clear COSE bytes) or SEALED (their sealed form) record."""
    body = b"".join((BH.pack(rtype, len(ident)), ident, U32.pack(len(data)), data))
    return HDR.pack(len(body), zlib.crc32(body)) + body


def encode_released(ident: bytes, cose: bytes) -> bytes:
    return encode_output(RELEASED, ident, cose)


def encode_sealed(ident: bytes, sealed: bytes) -> bytes:
    return encode_output(SEALED, ident, sealed)


def sealed_ad(ident: bytes) -> bytes:
    """What a sealed journal output is bound to: its identity (a record moved elsewhere does not open)."""
    return b"ssp-journal\0" + ident


def encode_floor(ident: bytes) -> bytes:
    body = bytes([FLOOR]) + struct.pack(">H", len(ident)) + ident
    return HDR.pack(len(body), zlib.crc32(body)) + body


def encode_gap(ident: bytes, top: tuple[int, int]) -> bytes:
    body = bytes([GAP]) + struct.pack(">H", len(ident)) + ident + HLC.pack(*top)
    return HDR.pack(len(body), zlib.crc32(body)) + body


def parse_body(body: bytes) -> tuple[int, bytes, int, int]:
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
    if rtype in RELEASED_TYPES:
        (clen,) = struct.unpack_from(">I", body, pos)
        if pos + 4 + clen != len(body):
            raise ValueError("released length mismatch")
        return rtype, ident, pos + 4, clen
    if rtype == FLOOR:
        if pos != len(body) or not ((ilen == 29 and ident[:1] == b"E") or receipt_parts(ident) is not None):
            raise ValueError("floor record malformed")
        return rtype, ident, pos, 0
    if rtype == GAP:
        if ilen != 29 or ident[:1] != b"E" or pos + HLC.size != len(body):
            raise ValueError("gap record malformed")
        return rtype, ident, pos, HLC.size
    raise ValueError("unknown record type")


def record_at(data: bytes, pos: int, size: int) -> Optional[tuple[int, bytes, int, int, int]]:
    """The complete, CRC-valid, well-formed record at ``pos``: (type, ident, payload offset within
    its body, payload length, end offset); None if the bytes there are not one."""
    if pos + HDR.size > size:
        return None
    blen, crc = HDR.unpack_from(data, pos)
    start = pos + HDR.size
    if blen == 0 or blen > MAX_RECORD or start + blen > size:
        return None
    body = data[start:start + blen]
    if zlib.crc32(body) != crc:
        return None
    try:
        rtype, ident, off, ln = parse_body(body)
    except (ValueError, IndexError, struct.error):
        return None
    return rtype, ident, off, ln, start + blen


def valid_records_after(data: bytes, bad: int, size: int) -> Optional[tuple[int, int, int]]:
    """Is the region from ``bad`` to the end a torn tail? A torn tail is a prefix of writes no
    fsync completed: an incomplete or damaged last record, possibly zeroed or garbage to the end,
    with nothing valid after it. Look for a valid record starting at any later byte (a CRC-32 match
    on garbage is a 2^-32 chance per offset, and a length must also fit); from the first found,
    count the chain of valid records that follows it. None: nothing valid follows (a torn tail);
    else (offset of the first valid record, records in its chain, released outputs among them)."""
    for q in range(bad + 1, size - HDR.size):
        got = record_at(data, q, size)
        if got is None:
            continue
        records = released = 0
        pos = q
        while got is not None:
            records += 1
            released += got[0] in RELEASED_TYPES
            pos = got[4]
            got = record_at(data, pos, size)
        return q, records, released
    return None


def receipt_parts(ident: bytes) -> Optional[tuple[bytes, int]]:
    """(group_id, epoch) of a receipt identity's encoding (identity.py), read in place; None for
    anything else."""
    if len(ident) < 12 or ident[:1] != b"R" or struct.unpack_from(">H", ident, 1)[0] != len(ident) - 11:
        return None
    return ident[3:-8], U64.unpack_from(ident, len(ident) - 8)[0]


@contextlib.contextmanager
def mapped(fd: int, size: int, path: str) -> Iterator[memoryview]:
    """The first ``size`` bytes of ``fd`` (the journal at ``path``) as a memoryview, mapped
    read-only (the page cache, not a copy on the heap: a journal is megabytes); read into memory
    where the file cannot be mapped (a file shorter than ``size`` cannot: JournalError)."""
    try:
        mapped = mmap.mmap(fd, size, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        data = os.pread(fd, size, 0)
        if len(data) != size:
            raise JournalError(f"journal {path}: short read during compaction") from None
        yield memoryview(data)
        return
    view = memoryview(mapped)
    try:
        yield view
    finally:
        view.release()
        mapped.close()


# A receipts-only compaction keeps the file the last one wrote (its "base") byte for byte and
# rewrites only what came after it, unless more than this share of the new file's entries would
# then be left behind (entries of groups that moved on since, at or below their new floor): then it
# rewrites everything (``compact``; docs/keystore.md "Compaction")
STALE_SHARE = 0.5


@dataclass(frozen=True)
class Base:
    """The file as the last compaction left it: its first ``end`` bytes, which stay as they are
    until the next compaction (commits only append), and the first ``count`` identities of the
    index (a dict: commits add identities after them, in file order, and never remove one)."""

    end: int
    count: int
    stale: int                      # entries left behind by the compactions since the last full one
    keys: int                       # the first ``keys`` entries of the key-name dict are the base's
    intents: tuple                  # base identities with an intent and no output yet


class NothingToDrop(Exception):
    """``compact`` of receipts found none to drop: the journal is left as it is."""


class RewriteAll(Exception):
    """A compaction of what came since is not the one to make (nothing to drop since the base,
    or it would leave more than STALE_SHARE behind): the whole file is rewritten instead."""


def receipts_to_drop(idents: list, index: dict, busy: set, receipts_below: Callable[[bytes], Optional[int]],
                      floors: dict[bytes, int]) -> set:
    """The receipt identities ``compact`` drops (see there): below the group's last released
    receipt at or below the epoch before the caller's recorded one (so that receipt stays, with
    the intents of the gaps after it: a state restored from an older copy adopts it as its head,
    and the gaps' statements name it), not in flight; a group with no released receipt there
    keeps everything. ``floors`` (group -> epoch) is raised to the epoch below the entry kept (a
    group's epochs advance one at a time, each intended once, in order: §22.5). Comprehensions,
    not a loop: this runs over every receipt signed since the last compaction."""
    # b"R": only well-formed ones are indexed (_apply); each with its group's prefix, sliced once
    receipts = [(i, i[:-8]) for i in idents if i[0] == 0x52]
    # a group's identities share the prefix "R" | len | group_id and end in the big-endian epoch,
    # so "epoch at or below E" is "identity at or below the group's identity at E", compared as bytes
    threshold: dict[bytes, bytes] = {}
    for prefix in {p for _i, p in receipts}:
        below = receipts_below(prefix[3:])
        if below is not None and below >= 1:
            threshold[prefix] = prefix + U64.pack(below - 1)
    get = threshold.get
    # each group's last released receipt at or below its threshold: the last one in the index's
    # order wins, which is its epochs' order (a group's epochs are intended one at a time, in
    # order: §22.5); were it not, a lower receipt would be kept and everything above it with it
    keep = {p: i for i, p in receipts if i <= get(p, b"") and index[i] is not None}
    kept = keep.get
    drop = {i for i, p in receipts if i < kept(p, b"")} - busy
    for prefix in {i[:-8] for i in drop}:
        # at least the highest dropped; an epoch below the kept one that was never intended (a
        # group adopted or recovered above it) reads spent too: it is never to be signed
        floors[prefix[3:]] = max(floors.get(prefix[3:], -1), U64.unpack(keep[prefix][-8:])[0] - 1)
    return drop


@dataclass(frozen=True)
class ReceiptGroup:
    """What the journal knows of one group's receipts (``Journal.receipt_groups``): ``floor``, the
    compaction floor (every identity at or below it the journal does not hold is spent) or None;
    ``lowest``/``top``, the lowest and highest epoch it holds an identity for (None: none held);
    ``statements``, epoch -> the attempts of discontinuity statements it holds."""

    floor: Optional[int]
    lowest: Optional[int]
    top: Optional[int]
    statements: dict[int, tuple[int, ...]]


def corrupt_error(path: str, pos: int, after: tuple[int, int, int]) -> JournalCorrupt:
    first, records, released = after
    return JournalCorrupt(
        f"signing journal {path} is damaged at byte {pos}: {first - pos} byte(s) there do not form a "
        f"record, yet {records} valid record(s) follow ({released} released output(s) among them), so this "
        "is not a torn tail but damage to durable data (disk fault or tampering). Nothing was changed. Stop "
        "the agent, keep a copy of the file and check the medium; then restore the journal from a backup, "
        "or move it aside to start without it (the clock resumes above the store's durable ceiling, but "
        "released outputs the store lacks are then lost)", pos, records, released)


def inspect(path: str) -> dict[str, int]:
    """Read a journal without opening it for writing, taking its lock or repairing anything (for
    read-only views such as ``ssp-agent status``, which must work on a full disk and beside a
    running agent): {"bytes", "records", "released", "torn_tail_bytes"}. Raises JournalCorrupt
    for damage in the middle (as opening would), JournalError for a file that is not a journal."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return {"bytes": 0, "records": 0, "released": 0, "torn_tail_bytes": 0}
    except OSError as exc:
        raise JournalError(f"cannot read journal {path}: {exc.strerror}") from None
    size = len(data)
    if size < len(MAGIC):
        return {"bytes": size, "records": 0, "released": 0, "torn_tail_bytes": size}
    if data[:len(MAGIC)] != MAGIC:
        raise JournalError(f"{path} is not a signing journal (bad magic); refusing to touch it")
    pos, records, released = len(MAGIC), 0, 0
    while pos < size:
        got = record_at(data, pos, size)
        if got is None:
            break
        records += 1
        released += got[0] in RELEASED_TYPES
        pos = got[4]
    if pos < size:
        after = valid_records_after(data, pos, size)
        if after is not None:
            raise corrupt_error(os.path.abspath(path), pos, after)
    return {"bytes": size, "records": records, "released": released, "torn_tail_bytes": size - pos}


