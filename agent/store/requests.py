"""The applications' write requests answered (docs/client.md "Protocol"): a request id with the
event ids its write signed and a digest of the rows and columns it wrote, so that a client's retry after a lost
answer is answered with those events instead of signing them again (exactly once). Kept in the
store, so a retry across a restart of `run` is recognized; the newest KEEP are kept."""
from __future__ import annotations

import json
import sqlite3

DDL = "CREATE TABLE IF NOT EXISTS client_requests (n INTEGER PRIMARY KEY, rid TEXT NOT NULL UNIQUE, " \
      "digest BLOB NOT NULL, event_ids TEXT NOT NULL)"
KEEP = 4096   # requests remembered: a retry comes seconds after its attempt, not thousands of writes later
PRUNE_EVERY = 256


def create_schema(conn: sqlite3.Connection) -> None:
    conn.execute(DDL)


def answered(conn: sqlite3.Connection, rid: str) -> tuple[bytes, list[str]] | None:
    """(digest, event ids hex) of request `rid`, None when it was never answered (or forgotten)."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='client_requests'").fetchone() is None:
        return None
    r = conn.execute("SELECT digest, event_ids FROM client_requests WHERE rid = ?", (rid,)).fetchone()
    return None if r is None else (bytes(r[0]), json.loads(r[1]))


def note(conn: sqlite3.Connection, rid: str, digest: bytes, event_ids: list[str]) -> None:
    """Request `rid` signed `event_ids`, in a transaction of its own committed without waiting
    for the disk (synchronous=NORMAL, for this commit only): it survives the process at once
    and a power cut from the next commit on, which syncs the WAL it is in; a write's answer
    does not wait for a second sync."""
    from .db import transaction
    level = int(conn.execute("PRAGMA synchronous").fetchone()[0])
    conn.execute("PRAGMA synchronous=NORMAL")
    try:
        with transaction(conn):
            create_schema(conn)
            n = conn.execute("INSERT INTO client_requests (rid, digest, event_ids) VALUES (?, ?, ?)",
                             (rid, digest, json.dumps(event_ids))).lastrowid
            if n % PRUNE_EVERY == 0:
                conn.execute("DELETE FROM client_requests WHERE n <= ?", (n - KEEP,))
    finally:
        conn.execute(f"PRAGMA synchronous={level}")
