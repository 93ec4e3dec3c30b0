"""How a node's identity is bound to its hardware (docs/operations.md).

A home directory copied to a second device would make two devices sign as one site_id,
and their HLCs would collide (§13.5 forbids reuse). At `init` the node records a hash of
the machine id; on every open a mismatch is refused until an operator states that the
original device is gone (`ssp-agent identity rebind`)."""
from __future__ import annotations

import hashlib
import logging
import os
import struct
import zlib
from pathlib import Path

from firmware_bridge.fsutil import fsync_dir

log = logging.getLogger("ssp_agent")

_MACHINE_ID_FILES = ("/etc/machine-id", "/var/lib/dbus/machine-id")


def machine_fingerprint() -> str:
    override = os.environ.get("SSP_AGENT_MACHINE_ID")  # tests simulate a second device
    raw = override
    if raw is None:
        for f in _MACHINE_ID_FILES:
            try:
                raw = Path(f).read_text().strip()
                if raw:
                    break
            except OSError:
                continue
    if not raw:
        import socket
        raw = "hostname:" + socket.gethostname()
    return hashlib.sha256(b"ssp-agent-machine\0" + raw.encode()).hexdigest()[:32]


def witness_path(site_id: bytes) -> Path:
    """Where the clock witness lives, outside the home, so restoring the home from an older
    copy cannot roll the clock back (§13.5 clock durability; docs/apply.md)."""
    base = os.environ.get("SSP_AGENT_WITNESS_DIR")
    if base is None:
        state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        base = os.path.join(state, "ssp-agent", "clock-witness")
    return Path(base) / site_id.hex()


def claim_home(site_id: bytes, home: Path) -> str | None:
    """Which home this site_id lives in, recorded beside its clock witness (outside the home): a
    `cp -a` copy of a live home must not sign as the original (HLC reuse, §13.5), while a home that
    moved must keep working. Returns the other home's path when it still holds this site's store
    (this one is a copy); otherwise records `home` as the site's home and returns None."""
    here = os.path.realpath(home)
    path = witness_path(site_id).with_suffix(".home")
    try:
        other = path.read_text().strip()
    except OSError:
        other = ""
    if other and other != here and _holds_site(Path(other), site_id):
        try:
            if os.path.samefile(other, here):  # the same directory by another path (bind mount)
                return None
        except OSError:
            pass
        return other
    if other != here:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".home.tmp")
            tmp.write_text(here + "\n")
            os.replace(tmp, path)
        except OSError as e:  # the claim is a guard, not a dependency: never stop a node for it
            log.warning("cannot record the home of site %s in %s: %s", site_id.hex(), path, e)
    return None


def _holds_site(home: Path, site_id: bytes) -> bool:
    from .store.reports import site_of_store
    return site_of_store(home / "store.sqlite") == site_id


# Two slots of (physical_ms, logical, counter, crc32): a torn write can spoil only the slot
# being written, and the other still holds the value written before the previous release.
_SLOT = struct.Struct("<QIQI")


class ClockWitness:
    """The highest HLC this site may have released, kept outside its home and made durable
    (fdatasync) before every release (docs/apply.md "The clock and identity (§13.5)"). `None` from `read`
    means no witness survives (first start, or the witness directory was lost)."""

    def __init__(self, site_id: bytes) -> None:
        self.path = witness_path(site_id)
        self._fd: int | None = None
        self._counter = 0
        self.value: tuple[int, int] | None = None
        self.failed = False
        self.legacy = False  # the earlier format: a ceiling, not the highest released HLC
        self._afd: int | None = None
        self._acount = 0

    def read(self) -> tuple[int, int] | None:
        try:
            data = self.path.read_bytes()
        except OSError:
            return None
        best = None
        if len(data) < _SLOT.size:  # the earlier format: a physical-ms ceiling as text
            try:
                best = (int(data.decode().strip()), 2**32 - 1)  # bounds every (ceiling, logical)
                self.legacy = True
            except ValueError:
                best = None
        else:
            for i in range(2):
                chunk = data[i * _SLOT.size:(i + 1) * _SLOT.size]
                if len(chunk) != _SLOT.size:
                    continue
                p, l, n, crc = _SLOT.unpack(chunk)
                if zlib.crc32(chunk[:-4]) != crc:
                    continue
                self._counter = max(self._counter, n)
                best = (p, l) if best is None or (p, l) > best else best
        self.value = best
        return best

    def advance(self, hlc: tuple[int, int]) -> bool:
        """Record `hlc` durably unless the witness already covers it. Returns False (and the
        caller falls back to the in-home ceiling) when the witness cannot be written."""
        if self.value is not None and hlc <= self.value:
            return True
        try:
            if self._fd is None:
                fresh = not self.path.exists()
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._fd = os.open(str(self.path), os.O_RDWR | os.O_CREAT, 0o644)
                if fresh:
                    os.fsync(self._fd)
                    fsync_dir(str(self.path.parent))
            self._counter += 1
            body = struct.pack("<QIQ", hlc[0], hlc[1], self._counter)
            os.pwrite(self._fd, body + struct.pack("<I", zlib.crc32(body)), (self._counter % 2) * _SLOT.size)
            os.fdatasync(self._fd)
        except OSError as e:
            if not self.failed:
                log.warning("clock witness %s cannot be written (%s); relying on the in-home ceiling", self.path, e)
            self.failed = True
            return False
        self.value = hlc
        return True

    # The count of events the home has applied, mirrored beside the witness after each batch
    # (no fsync: it only has to outlive the process, and it is read against the store's own count,
    # which commits first). A store behind it lost applied events: a restored home (docs/apply.md).
    def applied_path(self) -> Path:
        return self.path.with_name(self.path.name + ".applied")

    def read_applied(self) -> int | None:
        try:
            data = self.applied_path().read_bytes()
        except OSError:
            return None
        best = None
        for i in range(2):
            chunk = data[i * 16:(i + 1) * 16]
            if len(chunk) == 16:
                n, c, crc = struct.unpack("<QII", chunk)
                if zlib.crc32(chunk[:12]) == crc:
                    best = n if best is None else max(best, n)
        return best

    def note_applied(self, n: int) -> None:
        try:
            if self._afd is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._afd = os.open(str(self.applied_path()), os.O_RDWR | os.O_CREAT, 0o644)
            self._acount += 1
            body = struct.pack("<QI", n, self._acount & 0xFFFFFFFF)
            os.pwrite(self._afd, body + struct.pack("<I", zlib.crc32(body)), (self._acount % 2) * 16)
        except OSError:
            pass  # a second line of defence: restore detection only

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._afd is not None:
            os.close(self._afd)
            self._afd = None
