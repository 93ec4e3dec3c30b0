"""Reads of the event log's position (the `events` table's seq), for the loops that follow it.

`LogWatch` is the signal a running node gives its links when its log grew (docs/architecture.md
"The runtime loop"): every append in a `run` process happens on the loop thread (the links'
applies, forwarded `write`s; no other process can write while `run` holds the home: the signing
journal admits one bridge), so the loop asks once per turn, after the turn's work, and the
question costs a C attribute read (`Connection.total_changes`) unless this connection changed
something since the last look; only then is the top of the rowid tree looked up."""
from __future__ import annotations

import sqlite3


def top(conn: sqlite3.Connection) -> int:
    """The seq of the newest event in the log (0: empty): one look-up of the rowid tree."""
    return conn.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]


def newest_local(conn: sqlite3.Connection, after: int) -> int | None:
    """The seq of the newest event this node wrote itself (origin 'local') above `after`, or None:
    only the rows appended since `after` are examined (issue 12 item 6: a scan of the whole log
    made idle CPU grow with the store)."""
    return conn.execute("SELECT max(seq) FROM events WHERE seq > ? AND origin='local'", (after,)).fetchone()[0]


class LogWatch:
    """Whether the log grew since the last `grew()`; `top` is the seq it was last seen at."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn
        self._changes = conn.total_changes
        self.top = top(conn)

    def grew(self) -> bool:
        changes = self.conn.total_changes
        if changes == self._changes:
            return False   # this connection wrote nothing since: the log cannot have grown
        self._changes = changes
        t = top(self.conn)
        if t <= self.top:
            return False
        self.top = t
        return True
