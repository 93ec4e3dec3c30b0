"""Versioned store layout: the schema version is `PRAGMA user_version` (the SQLite file header, read
without touching any table). Migrations run forward only, on a writing open, each in its own
transaction together with the version it reaches, so a crash or a full disk leaves the store at
the previous version, never between two. A store newer than this agent is refused (StoreError,
exit 1): an older agent cannot know what the newer layout means. What each version added is said
beside its step below.

To change the layout: append a step (version LATEST + 1). Never edit a released step. The
ensure_* functions stay idempotent and keep working on their own (they are also called where the
tables are first used), but a home reaches a version only through this list."""
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Callable

from agent.sqlscript import statements  # noqa: F401 - also this module's name for it

from . import atrest, counters, db, feed, requests, sequencing, sync_state


def _v1_base(conn: sqlite3.Connection) -> None:
    for stmt in statements(db.DDL):
        conn.execute(stmt)


def _v2_bounds_sync_state(conn: sqlite3.Connection) -> None:
    conn.execute(db.BOUNDS_DDL) if conn.execute(
        "SELECT 1 FROM sqlite_master WHERE type='trigger' AND name='surfaced_bound'").fetchone() is None else None
    db.create_held_counts(conn)
    # An existing home gets its default policy now; a store being created gets it once `init`
    # has made the manifest's tables (the first ensure_schema), as before.
    sync_state.create_schema(conn, policy_defaults=db.get_meta(conn, "site_id") is not None)
    conn.execute(sync_state.TRUNCATION_DDL)


def _v3_counters(conn: sqlite3.Connection) -> None:
    conn.execute(counters.DDL)


def _v4_sequencing(conn: sqlite3.Connection) -> None:
    sequencing.ensure_schema(conn)


def _v5_peer_links(conn: sqlite3.Connection) -> None:
    conn.execute(sync_state.PEER_LINKS_DDL)


def _v6_atrest(conn: sqlite3.Connection) -> None:
    atrest.create_schema(conn)


def _v7_log_count(conn: sqlite3.Connection) -> None:
    db.create_log_count(conn)


def _v8_feed(conn: sqlite3.Connection) -> None:
    feed.create_schema(conn)


def _v9_feed_started(conn: sqlite3.Connection) -> None:
    feed.note_started(conn)
    requests.create_schema(conn)


# (version reached, what it does): applied in order, each in one transaction. Version 0 is an empty
# file; 1 is the first release's layout (schema_version=1 in meta, user_version never set); 6 gives a
# store that holds events a re-seal job (meta atrest_job), run by the next writing open with the keystore.
MIGRATIONS: list[tuple[int, str, Callable[[sqlite3.Connection], None]]] = [
    (1, "base layout", _v1_base),
    (2, "surfaced bound, held counts, sync state, truncation records", _v2_bounds_sync_state),
    (3, "counters for the metrics", _v3_counters),
    (4, "sequencing records (receipt heads, sequencer bindings)", _v4_sequencing),
    (5, "per-peer link state: bodies in flight, learned body limits", _v5_peer_links),
    (6, "at-rest sealing of the event log", _v6_atrest),
    (7, "the log's event count", _v7_log_count),
    (8, "the applications' change feed", _v8_feed),
    (9, "the feed's start on a home that held rows before it (a watcher from 0 re-reads); the "
        "applications' write request ids (a retry is not a second event)", _v9_feed_started),
]
LATEST = MIGRATIONS[-1][0]


def store_version(conn: sqlite3.Connection) -> int:
    """The layout version of the store behind `conn` (reads only)."""
    v = conn.execute("PRAGMA user_version").fetchone()[0]
    if v:
        return v
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='meta'").fetchone() is None:
        return 0
    return 1   # the first release wrote meta schema_version=1 and left user_version at 0


def refuse_newer(conn: sqlite3.Connection, path: Path) -> int:
    """The store's version, or StoreError when a newer agent wrote it (read and writing opens)."""
    v = store_version(conn)
    if v > LATEST:
        raise db.StoreError(
            f"store {path} has layout version {v}, newer than this agent understands ({LATEST}): it was written by "
            "a newer ssp-agent. Nothing was changed. Install that release or a later one (`ssp-agent --version` "
            "shows this one); a store is never migrated backwards")
    return v


def migrate(conn: sqlite3.Connection, path: Path) -> list[int]:
    """Bring the store to LATEST (a writing open). Returns the versions applied (empty: current)."""
    applied = []
    for version, _name, step in MIGRATIONS:
        if refuse_newer(conn, path) >= version:
            continue
        with db.transaction(conn):
            # Re-read under the write lock: another process may have migrated meanwhile.
            if store_version(conn) >= version:
                continue
            step(conn)
            conn.execute(f"PRAGMA user_version = {int(version)}")
            db.set_meta(conn, "schema_version", version)
        applied.append(version)
    return applied


def create(conn: sqlite3.Connection) -> None:
    """A new store: auto_vacuum must be chosen before the first table exists (eviction reclaims
    space); the layout is made by the migrations from version 0. Here, not in db.py: this module
    builds on db, never the other way round (no import circle)."""
    conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
    migrate(conn, Path(conn.execute("PRAGMA database_list").fetchone()[2]))
