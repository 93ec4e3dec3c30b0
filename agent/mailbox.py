"""Mailbox files (cli-contract.md `mailbox`): one sync body per file, store-and-forward.

Export selects from the durable per-peer cursor of the `mailbox` path, filtered by policy and
self-echo, and advances it only once the file is durably written. Import parses the whole body
strictly before anything touches the store (§32.2), then verifies and stores its control
records, then applies its events through the node's one apply path. A file carries no answer
and no authenticated stream, so mailbox bodies never move applied watermarks (docs/protocol.md).
"""
from __future__ import annotations

import os
from pathlib import Path

from .core.messages import MAX_MESSAGE_BYTES, ProtocolError


def read_file(path: Path) -> bytes:
    """A mailbox file's bytes, refused (ProtocolError `too_large`) before reading when it is
    larger than any message may be, so a hostile file cannot make the import read gigabytes.
    Parsing is `import_body`'s (the sync body boundary, agent/core/messages.py `parse_body`)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size > MAX_MESSAGE_BYTES:
            raise ProtocolError("too_large", f"{size} bytes > {MAX_MESSAGE_BYTES}")
        return f.read(MAX_MESSAGE_BYTES + 1)


def import_body(node, data: bytes, now: int | None = None) -> dict:
    """Raises ProtocolError before anything is written (cli-contract.md: a refused body changes
    nothing): the strict parse runs before the driver is made, because making it creates the
    sync tables and the default policy rows of a home that has none yet."""
    from .core.messages import parse_body
    from .sync import SyncDriver
    body = parse_body(data)
    return SyncDriver(node).import_mailbox(data, now, body=body)


def export_body(node, peer: bytes, out: Path) -> dict:
    from .sync import SyncDriver
    return SyncDriver(node).export_mailbox(peer, Path(out))
