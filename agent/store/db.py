"""The node's SQLite store: one file, WAL, synchronous=FULL on the connection that records
anything released to the outside (signed events, the HLC ceiling, cursor advances).
The database is the only source of truth; every cache is rebuilt from it on open."""
from __future__ import annotations

import sqlite3
from pathlib import Path

SCHEMA_VERSION = 1

_DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tables (
  qualified TEXT PRIMARY KEY, schema_name TEXT NOT NULL, table_name TEXT NOT NULL,
  category TEXT NOT NULL, key_json TEXT NOT NULL, columns_json TEXT NOT NULL,
  retention TEXT,  -- eviction class; NULL: this table is never evicted (scope §3)
  horizon_p INTEGER NOT NULL DEFAULT 0, horizon_l INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS keyring (
  site_id BLOB PRIMARY KEY, public_key BLOB NOT NULL,
  retired_p INTEGER, retired_l INTEGER, source TEXT NOT NULL) WITHOUT ROWID;
-- The retained event log in local append order (seq): what cursors walk (wire-profile §5).
CREATE TABLE IF NOT EXISTS events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, event_id BLOB NOT NULL UNIQUE, site_id BLOB NOT NULL,
  hlc_p INTEGER NOT NULL, hlc_l INTEGER NOT NULL, qualified TEXT NOT NULL, row_key BLOB NOT NULL,
  operation TEXT NOT NULL, raw BLOB NOT NULL, origin TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_row ON events (qualified, row_key, hlc_p, hlc_l);
CREATE INDEX IF NOT EXISTS events_group ON events (site_id, qualified, hlc_p, hlc_l);
-- Events whose destination table is missing (§13.6 row 1): held, retried when it appears.
CREATE TABLE IF NOT EXISTS held (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, event_id BLOB NOT NULL UNIQUE, site_id BLOB NOT NULL,
  qualified TEXT NOT NULL, hlc_p INTEGER NOT NULL, hlc_l INTEGER NOT NULL, raw BLOB NOT NULL,
  received_ms INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS held_table ON held (qualified);
-- What the spec says to surface, kept for the operator (`ssp-agent events`).
CREATE TABLE IF NOT EXISTS surfaced (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, at_ms INTEGER NOT NULL, kind TEXT NOT NULL,
  reason TEXT NOT NULL, event_id BLOB, site_id BLOB, qualified TEXT, detail TEXT);
-- §13.6: events whose payload columns were ignored, metered per (site, table, column).
CREATE TABLE IF NOT EXISTS ignored_columns (
  site_id BLOB NOT NULL, qualified TEXT NOT NULL, column_name TEXT NOT NULL,
  count INTEGER NOT NULL, first_ms INTEGER NOT NULL, last_ms INTEGER NOT NULL,
  PRIMARY KEY (site_id, qualified, column_name)) WITHOUT ROWID;
-- §14.2 applied watermarks, per (site_id, schema, table).
CREATE TABLE IF NOT EXISTS watermarks (
  site_id BLOB NOT NULL, qualified TEXT NOT NULL, hlc_p INTEGER NOT NULL, hlc_l INTEGER NOT NULL,
  PRIMARY KEY (site_id, qualified)) WITHOUT ROWID;
"""


class StoreError(RuntimeError):
    """A local storage fault (never a protocol error)."""


def connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")  # this connection records released outputs
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA busy_timeout=10000")
    return conn


def create(conn: sqlite3.Connection) -> None:
    # auto_vacuum must be chosen before the first table exists (eviction reclaims space).
    conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
    conn.executescript(_DDL)
    conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))


def get_meta(conn: sqlite3.Connection, key: str, default=None):
    row = conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
    return default if row is None else row[0]


def set_meta(conn: sqlite3.Connection, key: str, value) -> None:
    conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))


class transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any exception (every writer uses this one)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, et, e, tb) -> None:
        self.conn.execute("COMMIT" if et is None else "ROLLBACK")
