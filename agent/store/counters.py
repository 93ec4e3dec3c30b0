"""Durable counters for the metrics: what the apply path decided, per origin and
outcome (applied, duplicate, dropped, rejected, held), and how `sync --once` runs ended. Kept in
the store, so they count across processes (a timer's `sync --once` and `run` alike) and restarts;
Prometheus treats them as counters (they only grow; a new home starts at zero)."""
from __future__ import annotations

import sqlite3
from collections import Counter

DDL = ("CREATE TABLE IF NOT EXISTS counters (name TEXT NOT NULL, label TEXT NOT NULL, n INTEGER NOT NULL, "
       "PRIMARY KEY (name, label)) WITHOUT ROWID")


def bump(conn: sqlite3.Connection, name: str, counts: dict[str, int]) -> None:
    """Add `counts` (label -> n) inside the caller's transaction."""
    conn.executemany("INSERT INTO counters VALUES (?, ?, ?) ON CONFLICT (name, label) DO UPDATE SET n = n + excluded.n",
                     [(name, label, n) for label, n in counts.items() if n])


def bump_outcomes(conn: sqlite3.Connection, origin: str, statuses) -> None:
    bump(conn, "events", {f"{origin}:{s}": n for s, n in Counter(statuses).items()})


def read(conn: sqlite3.Connection, name: str) -> dict[str, int]:
    """label -> n; empty for a store older than the table (a read view of an older layout)."""
    try:
        return {label: n for label, n in conn.execute("SELECT label, n FROM counters WHERE name=?", (name,))}
    except sqlite3.OperationalError:
        return {}
