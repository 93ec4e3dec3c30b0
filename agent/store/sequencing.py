"""Sequencing records a node holds (agent/core/seqrecords.py; docs/protocol.md §12): receipt heads
and discontinuity statements gossiped by members, and sequencer bindings issued by authorities. Stored without expiry, counted
in the record bound against their issuer (agent/store/sync_state.py `record_usage`), relayed to
every peer like the authority records."""
from __future__ import annotations

import sqlite3

from ..core.seqrecords import Binding, DiscontinuityRecord, ReceiptHead

DDL = """
CREATE TABLE IF NOT EXISTS sequencing_records (
  record_hash BLOB PRIMARY KEY, kind TEXT NOT NULL, issuer BLOB NOT NULL, group_id BLOB NOT NULL,
  receipt_hash BLOB, generation INTEGER, raw BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS sequencing_records_group ON sequencing_records (group_id, kind);
"""


def ensure_schema(conn: sqlite3.Connection) -> None:
    for stmt in DDL.split(";"):
        if stmt.strip():
            conn.execute(stmt)


def has_schema(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='sequencing_records'"
                        ).fetchone() is not None


def has(conn: sqlite3.Connection, record_hash: bytes) -> bool:
    return has_schema(conn) and conn.execute("SELECT 1 FROM sequencing_records WHERE record_hash=?",
                                             (record_hash,)).fetchone() is not None


def has_receipt(conn: sqlite3.Connection, receipt_hash: bytes, kind: str = "head") -> bool:
    """A head (or discontinuity) record for these exact receipt (statement) bytes is held (from
    anyone): no need to gossip it again."""
    return has_schema(conn) and conn.execute(
        "SELECT 1 FROM sequencing_records WHERE kind=? AND receipt_hash=? LIMIT 1", (kind, receipt_hash)).fetchone() is not None


def put_head(conn: sqlite3.Connection, h: ReceiptHead, receipt_hash: bytes) -> bool:
    cur = conn.execute("INSERT OR IGNORE INTO sequencing_records VALUES (?, 'head', ?, ?, ?, NULL, ?)",
                       (h.record_hash, h.issuer, h.group_id, receipt_hash, h.raw))
    return cur.rowcount == 1


def put_discontinuity(conn: sqlite3.Connection, d: DiscontinuityRecord, statement_hash: bytes) -> bool:
    cur = conn.execute("INSERT OR IGNORE INTO sequencing_records VALUES (?, 'discontinuity', ?, ?, ?, NULL, ?)",
                       (d.record_hash, d.issuer, d.group_id, statement_hash, d.raw))
    return cur.rowcount == 1


def put_binding(conn: sqlite3.Connection, b: Binding) -> bool:
    cur = conn.execute("INSERT OR IGNORE INTO sequencing_records VALUES (?, 'binding', ?, ?, NULL, ?, ?)",
                       (b.record_hash, b.issuer, b.group_id, b.generation, b.raw))
    return cur.rowcount == 1


def raws(conn: sqlite3.Connection, group_id: bytes, kind: str) -> list[bytes]:
    if not has_schema(conn):
        return []
    return [bytes(r) for (r,) in conn.execute(
        "SELECT raw FROM sequencing_records WHERE group_id=? AND kind=? ORDER BY record_hash", (group_id, kind))]


def groups(conn: sqlite3.Connection) -> list[bytes]:
    if not has_schema(conn):
        return []
    return [bytes(g) for (g,) in conn.execute("SELECT DISTINCT group_id FROM sequencing_records ORDER BY group_id")]


def records_ordered(conn: sqlite3.Connection) -> list[tuple[bytes, bytes]]:
    """(record_hash, raw) in the order bodies carry them: every group's bindings along their
    generations (a receipt arriving with the binding that resolves it is not held), then heads."""
    if not has_schema(conn):
        return []
    return [(bytes(h), bytes(raw)) for h, raw in conn.execute(
        "SELECT record_hash, raw FROM sequencing_records ORDER BY CASE kind WHEN 'binding' THEN 0 ELSE 1 END, "
        "group_id, generation, record_hash")]


def open_watch(path) -> sqlite3.Connection:
    """A read-only connection kept open only to ask ``data_version`` (agent/sequencing.py
    BindingStates): never in a transaction between calls, so it holds up neither the node's writer
    nor its checkpoints (unlike db.connect_readonly's full-disk fallback, exclusive mode)."""
    import urllib.parse
    return sqlite3.connect("file:" + urllib.parse.quote(str(path)) + "?mode=ro", uri=True,
                           isolation_level=None, check_same_thread=False)


def data_version(conn: sqlite3.Connection) -> int:
    """Changes whenever another connection (any process) committed to the file since this
    connection last asked (SQLite's PRAGMA data_version)."""
    return conn.execute("PRAGMA data_version").fetchone()[0]
