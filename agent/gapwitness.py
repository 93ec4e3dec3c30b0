"""The highest HLC this site released inside its clock gap, kept beside the clock witness outside
the home and made durable before anything signed with it leaves (docs/apply.md "Clocks without an
RTC"). The clock witness holds the highest HLC ever released, which lies above the gap, so a home
restored from an older copy could not tell what the gap already issued; this file can. Two
CRC-checked slots written in turn (the newer counter wins), as the clock witness does."""
from __future__ import annotations

import logging
import os
import struct
import zlib
from pathlib import Path

from firmware_bridge.fsutil import fsync_dir

from .identity import witness_path

log = logging.getLogger("ssp_agent")
_SLOT = struct.Struct("<QIQIQI")   # top physical, logical; highest physical, logical; counter; crc32

Hlc = tuple[int, int]


def path(site_id: bytes) -> Path:
    w = witness_path(site_id)
    return w.with_name(w.name + ".gap")


def _slots(site_id: bytes) -> list[tuple[int, Hlc, Hlc]]:
    try:
        data = path(site_id).read_bytes()
    except OSError:
        return []
    out = []
    for i in range(2):
        chunk = data[i * _SLOT.size:(i + 1) * _SLOT.size]
        if len(chunk) == _SLOT.size:
            tp, tl, hp, hl, n, crc = _SLOT.unpack(chunk)
            if zlib.crc32(chunk[:-4]) == crc:
                out.append((n, (tp, tl), (hp, hl)))
    return out


def read(site_id: bytes) -> tuple[Hlc, Hlc] | None:
    """(the gap's top, the highest HLC released below it) of the newest slot, or None."""
    slots = _slots(site_id)
    if not slots:
        return None
    _n, top, hi = max(slots)
    return top, hi


def advance(site_id: bytes, top: Hlc, hlc: Hlc) -> bool:
    """Record `hlc` released inside the gap below `top`, durably, unless already covered. False
    (warned) when the file cannot be written: the in-home ceiling still bounds the gap."""
    slots = _slots(site_id)
    n, cur_top, cur = max(slots) if slots else (0, None, None)
    if cur_top == top and cur is not None and hlc <= cur:
        return True
    p = path(site_id)
    try:
        fresh = not p.exists()
        p.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(str(p), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            body = _SLOT.pack(top[0], top[1], hlc[0], hlc[1], n + 1, 0)[:-4]
            os.pwrite(fd, body + struct.pack("<I", zlib.crc32(body)), ((n + 1) % 2) * _SLOT.size)
            os.fdatasync(fd)
        finally:
            os.close(fd)
        if fresh:
            fsync_dir(str(p.parent))
    except OSError as e:
        log.warning("clock gap witness %s cannot be written (%s); relying on the in-home ceiling", p, e)
        return False
    return True
