"""How a node's identity is bound to its hardware (issue 2 item 2; docs/operations.md).

A home directory copied to a second device would make two devices sign as one site_id,
and their HLCs would collide (§13.5 forbids reuse). At `init` the node records a hash of
the machine id; on every open a mismatch is refused until an operator states that the
original device is gone (`ssp-agent identity rebind`)."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

from firmware_bridge.fsutil import atomic_write

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
    """Where the clock ceiling is mirrored outside the home, so restoring the home from an
    older copy cannot roll the clock back (§13.5 clock durability)."""
    base = os.environ.get("SSP_AGENT_WITNESS_DIR")
    if base is None:
        state = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
        base = os.path.join(state, "ssp-agent", "clock-witness")
    return Path(base) / site_id.hex()


def read_witness(site_id: bytes) -> int:
    try:
        return int(witness_path(site_id).read_text().strip() or 0)
    except (OSError, ValueError):
        return 0


def write_witness(site_id: bytes, ceiling_ms: int) -> None:
    p = witness_path(site_id)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(str(p), str(ceiling_ms).encode(), 0o644)
    except OSError:
        # The witness is a second line of defence; the store's own ceiling is authoritative.
        pass
