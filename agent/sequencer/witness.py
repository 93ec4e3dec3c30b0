"""The sequencer's receipt witness: outside its home, the last receipt it released for each group
(SOVM §22.5 cl. 2, §22.6 "a restore from backup"; docs/sequencer.md "Threat model").

Everything the home holds about what it signed (`sequencer.db`, the signing journal) rolls back
with a restore of the whole home (a VM snapshot, a backup). The witness does not: it lives beside
the node's clock witness (``SSP_AGENT_WITNESS_DIR``, agent/identity.py), one file per receipt key,
and a receipt is appended to it and made durable (fdatasync) before it is released. On open the
sequencer compares it with its state (resume.py ``Settler.resume``): a group whose state is at
or below an epoch the witness holds a receipt for is behind what it released, and jumps past it,
never signing that pair again.

The file is a sequence of records ``len (u16) | receipt | crc32 (u32)``; a torn tail (a crash
during an append) fails its CRC and is ignored (it was never released). Rewritten, one record a
group, once it holds far more records than groups.
"""
from __future__ import annotations

import logging
import os
import struct
import zlib
from pathlib import Path
from typing import Optional

from firmware_bridge.fsutil import fsync_dir

from agent.sequencer.receipts import ReceiptError, parse_receipt

log = logging.getLogger("ssp_agent.sequencer")

_LEN = struct.Struct("<H")
_CRC = struct.Struct("<I")
COMPACT_RECORDS = 4096          # appended since the last rewrite, beyond twice the groups


def witness_path(public_key: bytes) -> Path:
    """Beside the node's clock witness, outside any home (agent/identity.py ``witness_path``)."""
    base = os.environ.get("SSP_AGENT_WITNESS_DIR")
    if base is None:
        state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        base = os.path.join(state, "ssp-agent", "clock-witness")
    return Path(base) / f"sequencer-{public_key.hex()}"


class ReceiptWitness:
    """group_id -> (epoch, receipt bytes) of the highest receipt released, kept outside the home."""

    def __init__(self, public_key: bytes) -> None:
        self.path = witness_path(public_key)
        self.top: dict[bytes, tuple[int, bytes]] = {}
        self._fd: Optional[int] = None
        self._appended = 0
        self.failed = False
        self._read()

    def _read(self) -> None:
        try:
            data = self.path.read_bytes()
        except OSError:
            return
        at, n = 0, 0
        while at + _LEN.size <= len(data):
            (size,) = _LEN.unpack_from(data, at)
            end = at + _LEN.size + size
            if end + _CRC.size > len(data) or zlib.crc32(data[at:end]) != _CRC.unpack_from(data, end)[0]:
                break           # a torn append: never released
            self._keep(data[at + _LEN.size:end])
            at, n = end + _CRC.size, n + 1
        self._appended = n

    def _keep(self, raw: bytes) -> None:
        try:
            r = parse_receipt(raw)
        except ReceiptError:
            return
        old = self.top.get(r.group_id)
        if old is None or r.epoch > old[0]:
            self.top[r.group_id] = (r.epoch, raw)

    def note(self, raws: list[bytes]) -> bool:
        """Append ``raws`` and make them durable before they are released. False (logged once)
        when the witness cannot be written: the home's own records are then all there is."""
        if not raws:
            return True
        body = b"".join(_LEN.pack(len(r)) + r + _CRC.pack(zlib.crc32(_LEN.pack(len(r)) + r)) for r in raws)
        try:
            if self._fd is None:
                fresh = not self.path.exists()
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(str(self.path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                if fresh:
                    os.fsync(self._fd)
                    fsync_dir(str(self.path.parent))
            os.write(self._fd, body)
            os.fdatasync(self._fd)
        except OSError as e:
            if not self.failed:
                log.warning("receipt witness %s cannot be written (%s); a restored home cannot be detected", self.path, e)
            self.failed = True
            return False
        for r in raws:
            self._keep(r)
        self._appended += len(raws)
        if self._appended > COMPACT_RECORDS + 2 * len(self.top):
            self._rewrite()
        return True

    def _rewrite(self) -> None:
        """One record a group, replacing the file atomically (the old one stands until the rename)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        body = b"".join(_LEN.pack(len(r)) + r + _CRC.pack(zlib.crc32(_LEN.pack(len(r)) + r))
                        for _g, (_e, r) in sorted(self.top.items()))
        try:
            fd = os.open(str(tmp), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, body)
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, self.path)
            fsync_dir(str(self.path.parent))
        except OSError as e:
            log.warning("receipt witness %s cannot be rewritten (%s); appending on", self.path, e)
            return
        self.close()
        self._appended = len(self.top)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
