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


# ---------------------------------------------------------------------- what the sync layer reads
def rows_after(conn: sqlite3.Connection, after: int, upto: int | None, limit: int) -> list[tuple]:
    """Up to `limit` log rows with seq > `after` (and <= `upto`), in append order, without their
    payload (most rows a selection examines are filtered; each payload is sealed at rest):
    (seq, site_id, qualified, hlc_p, hlc_l, None, origin)."""
    q = "SELECT seq, site_id, qualified, hlc_p, hlc_l, NULL, origin FROM events WHERE seq > ?"
    args: list = [after]
    if upto is not None:
        q += " AND seq <= ?"
        args.append(upto)
    return conn.execute(q + " ORDER BY seq LIMIT ?", (*args, limit)).fetchall()


def open_seqs(conn: sqlite3.Connection, seqs: list[int]) -> dict[int, bytes]:
    """The signed bytes (unsealed) of the log rows `seqs`: seq -> bytes."""
    out: dict[int, bytes] = {}
    for i in range(0, len(seqs), 500):
        part = seqs[i:i + 500]
        q = f"SELECT seq, unseal(event_id, raw) FROM events WHERE seq IN ({','.join('?' * len(part))})"
        out.update((seq, bytes(raw)) for seq, raw in conn.execute(q, part))
    return out


def event_at(conn: sqlite3.Connection, site: bytes, table: str, p: int, l: int) -> tuple | None:
    """The log row of `site`'s event on `table` at HLC (p, l), its bytes unsealed:
    (seq, site_id, qualified, hlc_p, hlc_l, raw, origin), or None (evicted, never held)."""
    return conn.execute("SELECT seq, site_id, qualified, hlc_p, hlc_l, unseal(event_id, raw), origin FROM events"
                        " WHERE site_id=? AND qualified=? AND hlc_p=? AND hlc_l=?", (site, table, p, l)).fetchone()


def place_of(conn: sqlite3.Connection, event_id: bytes) -> tuple[str, int, int] | None:
    """(table, hlc_p, hlc_l) of a known event, in the log or held; None if neither has it."""
    r = conn.execute("SELECT qualified, hlc_p, hlc_l FROM events WHERE event_id=?", (event_id,)).fetchone()
    if r is None:
        r = conn.execute("SELECT qualified, hlc_p, hlc_l FROM held WHERE event_id=?", (event_id,)).fetchone()
    return r


def count_after(conn: sqlite3.Connection, after: int, not_site: bytes) -> int:
    """Events after seq `after` other than `not_site`'s own: what a peer's cursor has not covered."""
    return conn.execute("SELECT count(*) FROM events WHERE seq > ? AND site_id != ?", (after, not_site)).fetchone()[0]

