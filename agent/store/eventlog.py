"""Reads of the event log's position (the `events` table's seq), for the loops that follow it.

`LogWatch` is the signal a running node gives its links when its log grew: every append in a
`run` process happens on the loop thread (the links' applies, forwarded `write`s; no other
process can write while `run` holds the home: the signing journal admits one bridge), so the
loop asks once per turn, after the turn's work, and the question costs a C attribute read
(`Connection.total_changes`) unless this connection changed something since the last look; only
then is the top of the rowid tree looked up."""
from __future__ import annotations

import sqlite3
from typing import Iterable


def top(conn: sqlite3.Connection) -> int:
    """The seq of the newest event in the log (0: empty): one look-up of the rowid tree."""
    return conn.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]


def newest_local(conn: sqlite3.Connection, after: int) -> int | None:
    """The seq of the newest event this node wrote itself (origin 'local') above `after`, or None:
    only the rows appended since `after` are examined (a scan of the whole log
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
def rows_after(conn: sqlite3.Connection, after: int, upto: int | None, limit: int, *,
               skip_tables: tuple[str, ...] = (), own: bytes | None = None) -> list[tuple]:
    """Up to `limit` log rows with seq > `after` (and <= `upto`), in append order, without their
    payload (most rows a selection examines are filtered; each payload is sealed at rest):
    (seq, site_id, qualified, hlc_p, hlc_l, None, origin). Rows of `skip_tables` not signed by
    `own` are passed over here, in SQL."""
    q = "SELECT seq, site_id, qualified, hlc_p, hlc_l, NULL, origin FROM events WHERE seq > ?"
    args: list = [after]
    if upto is not None:
        q += " AND seq <= ?"
        args.append(upto)
    if skip_tables:
        q += f" AND (qualified NOT IN ({','.join('?' * len(skip_tables))}) OR site_id = ?)"
        args += [*skip_tables, own]
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



# ---------------------------------------------------------------------- the apply path (agent/node.py, §12)
# Hot statements are module-level text, executed by the node itself: one statement per event, no
# extra Python call on the apply path.
INSERT_EVENT = ("INSERT OR IGNORE INTO events (event_id, site_id, hlc_p, hlc_l, qualified, row_key, operation, raw, origin)"
                " VALUES (?,?,?,?,?,?,?,?,?)")  # §12.4: idempotent, keyed on event_id
KNOWN_EVENT = ("SELECT EXISTS (SELECT 1 FROM events WHERE event_id=?1), "
               "EXISTS (SELECT 1 FROM held WHERE event_id=?1)")  # (in the log, held)
ROW_EVENTS = ("SELECT site_id, hlc_p, hlc_l, operation, unseal(event_id, raw) FROM events "
              "WHERE qualified=? AND row_key=?")  # every retained event of one row
HOLD_EVENT = ("INSERT OR IGNORE INTO held (event_id, site_id, qualified, hlc_p, hlc_l, raw, received_ms)"
              " VALUES (?,?,?,?,?,?,?)")  # an event for a table this node does not have yet (held)


def known_among(conn: sqlite3.Connection, eids: list[bytes]) -> set[bytes]:
    """The event_ids among `eids` that the log or the held table holds (one query per batch)."""
    if not eids:
        return set()
    marks = ",".join("?" for _ in eids)
    return {bytes(r[0]) for r in conn.execute(
        f"SELECT event_id FROM events WHERE event_id IN ({marks}) UNION ALL "
        f"SELECT event_id FROM held WHERE event_id IN ({marks})", eids + eids)}


def newest_of(conn: sqlite3.Connection, site: bytes) -> tuple[int, int] | None:
    """The HLC of `site`'s newest event in the retained log, or None."""
    r = conn.execute("SELECT hlc_p, hlc_l FROM events WHERE site_id=? ORDER BY hlc_p DESC, hlc_l DESC LIMIT 1",
                     (site,)).fetchone()
    return None if r is None else (r[0], r[1])


def signers(conn: sqlite3.Connection) -> list[bytes]:
    """Every site with an event in the retained log."""
    return [bytes(r[0]) for r in conn.execute("SELECT DISTINCT site_id FROM events")]


def events_of(conn: sqlite3.Connection, site: bytes) -> list[tuple[int, int, str, bytes]]:
    """(hlc_p, hlc_l, table, raw unsealed) of `site`'s retained events, oldest first."""
    return conn.execute("SELECT hlc_p, hlc_l, qualified, unseal(event_id, raw) FROM events WHERE site_id=? "
                        "ORDER BY hlc_p, hlc_l", (site,)).fetchall()


def entries(conn: sqlite3.Connection) -> Iterable[tuple]:
    """(event_id, site_id, hlc_p, hlc_l, table, row_key, operation) of the whole log, by seq."""
    return conn.execute("SELECT event_id, site_id, hlc_p, hlc_l, qualified, row_key, operation FROM events ORDER BY seq")


_BELOW = "qualified=? AND (hlc_p < ? OR (hlc_p = ? AND hlc_l < ?))"


def newest_below(conn: sqlite3.Connection, site: bytes, table: str, h: tuple[int, int]) -> tuple[int, int] | None:
    """The HLC of `site`'s newest event on `table` below the horizon `h`, or None."""
    r = conn.execute(f"SELECT hlc_p, hlc_l FROM events WHERE site_id=? AND {_BELOW} ORDER BY hlc_p DESC, hlc_l DESC "
                     "LIMIT 1", (site, table, h[0], h[0], h[1])).fetchone()
    return None if r is None else (r[0], r[1])


# `site`'s own events above what some peer acknowledged (`acked`; None: nothing) are not evictable.
_UNACKED = "site_id=? AND (hlc_p > ? OR (hlc_p = ? AND hlc_l > ?))"


def delete_below(conn: sqlite3.Connection, table: str, h: tuple[int, int], limit: int = -1,
                 keep: tuple[bytes, tuple[int, int] | None] | None = None) -> int:
    """Evict `table`'s events below the horizon `h` from the log, at most `limit` (-1: all);
    `keep` = (site, acked) spares that site's events above `acked`. Returns how many went."""
    where, args = _BELOW, [table, h[0], h[0], h[1]]
    if keep is not None:
        site, acked = keep
        a = acked if acked is not None else (-1, 0)
        where += f" AND NOT ({_UNACKED})"
        args += [site, a[0], a[0], a[1]]
    return conn.execute(f"DELETE FROM events WHERE seq IN (SELECT seq FROM events WHERE {where} LIMIT ?)",
                        (*args, limit)).rowcount


def newest_evictable_own(conn: sqlite3.Connection, site: bytes, table: str, h: tuple[int, int],
                         acked: tuple[int, int] | None) -> tuple[int, int] | None:
    """The newest of `site`'s own events on `table` that `delete_below(keep=(site, acked))` removes."""
    if acked is None:
        return None
    return newest_below(conn, site, table, min(h, (acked[0], acked[1] + 1)))


# ---------------------------------------------------------------------- held events
def held_tables(conn: sqlite3.Connection) -> list[str]:
    """The tables some held event waits for."""
    return [r[0] for r in conn.execute("SELECT DISTINCT qualified FROM held").fetchall()]


def take_held(conn: sqlite3.Connection, table: str) -> list[bytes]:
    """The events held for `table` (unsealed, in arrival order), removed from `held`."""
    rows = conn.execute("SELECT seq, unseal(event_id, raw) FROM held WHERE qualified=? ORDER BY seq", (table,)).fetchall()
    conn.execute("DELETE FROM held WHERE qualified=?", (table,))
    return [bytes(r[1]) for r in rows]
