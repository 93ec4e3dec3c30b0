"""The tables of the durable delivery state (sync_state.py) and the default policy rows. All of it
is created on first use, so homes made before these tables existed gain them without a
migration step."""
from __future__ import annotations

import json
import sqlite3

from ..core.schema import SYNCABLE
from .db import transaction


_DDL = """
CREATE TABLE IF NOT EXISTS sync_cursors (
  peer BLOB NOT NULL, path TEXT NOT NULL, live INTEGER NOT NULL DEFAULT 0,
  bf_next INTEGER NOT NULL DEFAULT 0, bf_end INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (peer, path)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS sync_streams (
  sender BLOB NOT NULL, path TEXT NOT NULL, completed INTEGER NOT NULL,
  PRIMARY KEY (sender, path)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS sync_stream_gaps (
  sender BLOB NOT NULL, qualified TEXT NOT NULL, PRIMARY KEY (sender, qualified)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS peer_watermarks (
  peer BLOB NOT NULL, site_id BLOB NOT NULL, qualified TEXT NOT NULL,
  hlc_p INTEGER NOT NULL, hlc_l INTEGER NOT NULL, PRIMARY KEY (peer, site_id, qualified)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS policy_rows (
  peer TEXT NOT NULL, schema_name TEXT NOT NULL, table_name TEXT NOT NULL, layer TEXT NOT NULL,
  role TEXT NOT NULL DEFAULT '', effect TEXT NOT NULL,
  PRIMARY KEY (peer, schema_name, table_name, layer, role)) WITHOUT ROWID;
-- Widening backfill (scope §2): one durable job per (peer, table), walking rows in row_key order
-- from resume_after_row_key (NULL: genesis). Rehydration requests seen from peers, per subject.
CREATE TABLE IF NOT EXISTS backfill_jobs (
  peer BLOB NOT NULL, qualified TEXT NOT NULL, resume_after_row_key BLOB,
  rows_sent INTEGER NOT NULL DEFAULT 0, events_sent INTEGER NOT NULL DEFAULT 0,
  created_ms INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (peer, qualified)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rehydrate_records (
  record_hash BLOB PRIMARY KEY, subject BLOB NOT NULL, generation INTEGER NOT NULL,
  previous BLOB, requested_at INTEGER NOT NULL, raw BLOB NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rehydrate_served (
  subject BLOB PRIMARY KEY, generation INTEGER NOT NULL, upto_seq INTEGER NOT NULL,
  reset_ms INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS control_records (
  record_hash BLOB PRIMARY KEY, kind TEXT NOT NULL, issuer BLOB NOT NULL, subject BLOB NOT NULL,
  generation INTEGER NOT NULL, previous BLOB, value TEXT NOT NULL, raw BLOB NOT NULL) WITHOUT ROWID;
-- Control records (any kind) this node knows a peer holds on a path: answered for, written to a
-- mailbox file, or received from that peer. Bodies carry only the others (docs/protocol.md §5).
-- Sender side: events a peer rejected on a path (skew, held limit). The
-- cursor moves past them so one event cannot pin the stream behind it, and each is re-offered
-- until the peer takes it (§13.6: rejecting leaves the event in the set the sender re-offers).
CREATE TABLE IF NOT EXISTS reoffer (
  peer BLOB NOT NULL, path TEXT NOT NULL, seq INTEGER NOT NULL, site_id BLOB NOT NULL,
  attempts INTEGER NOT NULL, due_ms INTEGER NOT NULL, PRIMARY KEY (peer, path, seq)) WITHOUT ROWID;
-- Past REOFFER_PER_SIGNER entries of one signer, a rescan marker instead: that signer's events
-- from from_seq up to the cursor are walked again (re-offered) when due, so overflow is
-- re-offered later, never lost, and costs one row.
CREATE TABLE IF NOT EXISTS reoffer_rescan (
  peer BLOB NOT NULL, path TEXT NOT NULL, site_id BLOB NOT NULL, from_seq INTEGER NOT NULL,
  attempts INTEGER NOT NULL, due_ms INTEGER NOT NULL, PRIMARY KEY (peer, path, site_id)) WITHOUT ROWID;
-- Receiver side: events this node rejected (not retained, §13.6), remembered only so that no
-- watermark is inferred across them until they apply (§14.2), bounded per signer.
CREATE TABLE IF NOT EXISTS rejected_pins (
  site_id BLOB NOT NULL, qualified TEXT NOT NULL, hlc_p INTEGER NOT NULL, hlc_l INTEGER NOT NULL,
  event_id BLOB NOT NULL, PRIMARY KEY (site_id, event_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS records_delivered (
  peer BLOB NOT NULL, path TEXT NOT NULL, record_hash BLOB NOT NULL,
  PRIMARY KEY (peer, path, record_hash)) WITHOUT ROWID;
-- Bodies sent and not yet answered, per path, by the key the answer names (MQTT: correlation
-- data, or for a mailbox file its BLAKE3), with the selection token the answer confirms. Durable, so an
-- answer taken by a later process (a device that woke again) still moves the cursor (§14.1).
CREATE TABLE IF NOT EXISTS sent_bodies (
  id INTEGER PRIMARY KEY AUTOINCREMENT, path TEXT NOT NULL, sent_key BLOB NOT NULL, peer BLOB NOT NULL,
  kind TEXT NOT NULL, token TEXT NOT NULL, sent_ms INTEGER NOT NULL, UNIQUE (path, sent_key));
-- The mailbox path's answers (agent/mailbox.py, docs/protocol.md §6). Owed: the files imported
-- from a peer (BLAKE3 of the file, events processed before the first rejected one), newest kept.
-- Acks: the answer records this node signed (held, so the signing journal can drop them).
CREATE TABLE IF NOT EXISTS mailbox_owed (
  peer BLOB NOT NULL, body_hash BLOB NOT NULL, processed INTEGER NOT NULL, received_ms INTEGER NOT NULL,
  PRIMARY KEY (peer, body_hash)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS mailbox_acks (
  record_hash BLOB PRIMARY KEY, peer BLOB NOT NULL, answers TEXT NOT NULL, issued_ms INTEGER NOT NULL,
  raw BLOB NOT NULL) WITHOUT ROWID;
-- Relay: other nodes' answer records addressed to a third node (a ring of files), the newest per
-- (subject, issuer), carried in every file to their subject.
CREATE TABLE IF NOT EXISTS mailbox_relay (
  subject BLOB NOT NULL, issuer BLOB NOT NULL, issued_at INTEGER NOT NULL, raw BLOB NOT NULL,
  PRIMARY KEY (subject, issuer)) WITHOUT ROWID;
"""


def has_schema(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE name='control_records'").fetchone() is not None


_LATER_TABLES = ('rehydrate_served', 'records_delivered', 'sent_bodies', 'mailbox_owed', 'mailbox_acks', 'mailbox_relay',
                 'reoffer', 'reoffer_rescan', 'rejected_pins')


def _has_lifecycle_tables(conn: sqlite3.Connection) -> bool:
    return conn.execute(f"SELECT count(*) FROM sqlite_master WHERE name IN {_LATER_TABLES}"
                        ).fetchone()[0] == len(_LATER_TABLES)


def schema_ready(conn: sqlite3.Connection) -> bool:
    """The tables and the default policy rows are there: a read view can list them as they are."""
    return bool(has_schema(conn) and _has_lifecycle_tables(conn) and
                conn.execute("SELECT 1 FROM meta WHERE key='policy_defaults'").fetchone())


def ensure_schema(conn: sqlite3.Connection) -> None:
    """Create the tables (idempotent) and, once per home, the default policy rows: a `system`
    layer allow for every peer and every schema holding a syncable table (`peer * SCHEMA.*`), so a
    fresh mesh syncs. Operators narrow it with higher layers (docs/protocol.md)."""
    if schema_ready(conn):
        return
    with transaction(conn):   # rolls back only an open transaction: a full disk's error survives
        create_schema(conn)


def create_schema(conn: sqlite3.Connection, *, policy_defaults: bool = True) -> None:
    """The tables and the default policy rows, inside the caller's transaction (ensure_schema,
    and the store migration that introduced them: agent/store/migrations.py). The defaults are
    computed from the tables the store holds, so a store being created (no tables yet) leaves
    them to the first ensure_schema after `init` has made its tables."""
    for stmt in _DDL.strip().split(";"):
        if stmt.strip():
            conn.execute(stmt)
    if policy_defaults and conn.execute("SELECT 1 FROM meta WHERE key='policy_defaults'").fetchone() is None:
        schemas = sorted({s for s, c in conn.execute("SELECT schema_name, category FROM tables") if c == SYNCABLE})
        for s in schemas:
            conn.execute("INSERT OR IGNORE INTO policy_rows VALUES ('*', ?, '*', 'system', '', 'allow')", (s,))
        conn.execute("INSERT OR REPLACE INTO meta VALUES ('policy_defaults', ?)", (json.dumps(schemas),))


# Truncation records (the serving side of rehydration, agent/rehydrate.py, docs/protocol.md §8).
TRUNCATION_DDL = ("CREATE TABLE IF NOT EXISTS truncation_records ("
                  " record_hash BLOB PRIMARY KEY, issuer BLOB NOT NULL, subject BLOB NOT NULL, qualified TEXT NOT NULL,"
                  " horizon_p INTEGER NOT NULL, horizon_l INTEGER NOT NULL, n_rows INTEGER NOT NULL,"
                  " issued_at INTEGER NOT NULL, raw BLOB NOT NULL) WITHOUT ROWID")
