"""The store side of rehydration and truncation records (agent/rehydrate.py, docs/protocol.md §8; all SQL
lives in agent/store/, tests/test_sql_in_store.py): the rehydrate records
held (`rehydrate_records`), what this node served (`rehydrate_served`, the subject's cursors and
watermarks reset), the truncation records (`truncation_records`), the surfaced rows they cause,
and what `rehydrate --status` counts. Every function runs inside the caller's transaction (or
none, for reads)."""
from __future__ import annotations

import sqlite3
from typing import Iterator

from . import eventlog, sync_state


def has_table(conn: sqlite3.Connection, name: str) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE name=?", (name,)).fetchone() is not None


# ---------------------------------------------------------------------- rehydrate records
def latest_requests(conn: sqlite3.Connection) -> list[tuple[bytes, bytes]]:
    """(record_hash, raw) of the latest rehydrate record held per subject, by subject."""
    if not has_table(conn, "rehydrate_records"):
        return []
    return [(bytes(h), bytes(raw)) for h, raw in conn.execute(
        "SELECT record_hash, raw FROM rehydrate_records r WHERE generation = "
        "(SELECT max(generation) FROM rehydrate_records WHERE subject = r.subject) ORDER BY subject")]


def has_request(conn: sqlite3.Connection, h: bytes) -> bool:
    return conn.execute("SELECT 1 FROM rehydrate_records WHERE record_hash=?", (h,)).fetchone() is not None


def put_request(conn: sqlite3.Connection, r: dict) -> None:
    """A verified rehydrate record (`rehydrate.verify`'s dict); a known one is kept as it is."""
    conn.execute("INSERT OR IGNORE INTO rehydrate_records VALUES (?,?,?,?,?,?)",
                 (r["record_hash"], r["subject"], r["generation"], r["previous"], r["requested_at"], r["raw"]))


def last_request(conn: sqlite3.Connection, subject: bytes) -> tuple[int, bytes] | None:
    """(generation, record_hash) of `subject`'s newest rehydrate record held, or None."""
    r = conn.execute("SELECT generation, record_hash FROM rehydrate_records WHERE subject=? "
                     "ORDER BY generation DESC LIMIT 1", (subject,)).fetchone()
    return None if r is None else (r[0], bytes(r[1]))


def serve(conn: sqlite3.Connection, subject: bytes, generation: int, now_ms: int) -> int:
    """Act on `subject`'s rehydrate record of `generation` (once per generation): its cursors back
    to zero on every path, the watermarks it reported forgotten, the records delivered to it sent
    again (it may have lost them too), and the generation noted with the log's top at that moment
    (`upto`, what `rehydrate --status` counts down). Returns `upto`."""
    upto = eventlog.top(conn)
    conn.execute("UPDATE sync_cursors SET live=0, bf_next=0, bf_end=0 WHERE peer=?", (subject,))
    conn.execute("DELETE FROM peer_watermarks WHERE peer=?", (subject,))
    sync_state.clear_records_delivered(conn, subject)
    conn.execute("INSERT OR REPLACE INTO rehydrate_served VALUES (?,?,?,?)", (subject, generation, upto, now_ms))
    return upto


def forget_own_watermarks(conn: sqlite3.Connection) -> None:
    """This node's own watermarks, all of them (a rehydration lowers its horizons to zero: they
    were claims made below the old ones)."""
    conn.execute("DELETE FROM watermarks")


# ---------------------------------------------------------------------- `rehydrate --status`
def partial_rebuilds(conn: sqlite3.Connection) -> tuple[int, int]:
    """(every partial rebuild surfaced here, those a serving peer declared by its horizon)."""
    return (conn.execute("SELECT count(*) FROM surfaced WHERE kind='partial_rebuild'").fetchone()[0],
            conn.execute("SELECT count(*) FROM surfaced WHERE kind='partial_rebuild' "
                         "AND reason='serving_peer_horizon'").fetchone()[0])


def served(conn: sqlite3.Connection) -> list[tuple[bytes, int, int, int]]:
    """(subject, generation, upto_seq, reset_ms) of every subject this node served a rehydration."""
    return [(bytes(s), g, u, a) for s, g, u, a in
            conn.execute("SELECT subject, generation, upto_seq, reset_ms FROM rehydrate_served")]


def remaining_by_path(conn: sqlite3.Connection, subject: bytes, upto: int) -> dict[str, int]:
    """Per path with a cursor for `subject`: events up to `upto` (not its own) past that cursor."""
    return {path: conn.execute("SELECT count(*) FROM events WHERE seq > ? AND seq <= ? AND site_id != ?",
                               (live, upto, subject)).fetchone()[0]
            for path, live in conn.execute("SELECT path, live FROM sync_cursors WHERE peer=?", (subject,)).fetchall()}


def remaining(conn: sqlite3.Connection, subject: bytes, upto: int) -> int:
    """Events up to `upto` not of `subject` (no cursor yet: everything)."""
    return conn.execute("SELECT count(*) FROM events WHERE seq <= ? AND site_id != ?", (upto, subject)).fetchone()[0]


# ---------------------------------------------------------------------- truncation records
def row_clocks(conn: sqlite3.Connection, base: str, clocks: list[str]) -> Iterator[tuple]:
    """(_rk, *clocks) of every row of the (quoted) base table `base`, by row key."""
    return conn.execute(f"SELECT _rk, {', '.join(clocks)} FROM {base} ORDER BY _rk")


def has_event(conn: sqlite3.Connection, site: bytes, table: str, p: int, l: int) -> bool:
    """`site`'s event on `table` at HLC (p, l) is in the retained log."""
    return conn.execute("SELECT 1 FROM events WHERE site_id=? AND qualified=? AND hlc_p=? AND hlc_l=?",
                        (site, table, p, l)).fetchone() is not None


def has_truncation(conn: sqlite3.Connection, h: bytes) -> bool:
    return conn.execute("SELECT 1 FROM truncation_records WHERE record_hash=?", (h,)).fetchone() is not None


def put_truncation(conn: sqlite3.Connection, t) -> bool:
    """A verified truncation record (`core.records.verify_truncation`'s); True when it is new."""
    cur = conn.execute("INSERT OR IGNORE INTO truncation_records VALUES (?,?,?,?,?,?,?,?,?)",
                       (t.record_hash, t.issuer, t.subject, t.table, t.horizon[0], t.horizon[1], len(t.row_keys),
                        t.issued_at, t.raw))
    return cur.rowcount == 1


def truncations_for(conn: sqlite3.Connection, subject: bytes) -> list[tuple[bytes, bytes]]:
    """(record_hash, raw) of the truncation records addressed to `subject`, oldest first."""
    if not has_table(conn, "truncation_records"):
        return []
    return [(bytes(h), bytes(raw)) for h, raw in conn.execute(
        "SELECT record_hash, raw FROM truncation_records WHERE subject=? ORDER BY issued_at, record_hash", (subject,))]


def truncations_of(conn: sqlite3.Connection, site: bytes) -> list[tuple[bytes, bytes, str, int, int, bytes]]:
    """(issuer, subject, table, horizon_p, horizon_l, raw) of the records `site` issued or received."""
    if not has_table(conn, "truncation_records"):
        return []
    return [(bytes(i), bytes(s), q, p, l, bytes(raw)) for i, s, q, p, l, raw in conn.execute(
        "SELECT issuer, subject, qualified, horizon_p, horizon_l, raw FROM truncation_records "
        "WHERE subject=?1 OR issuer=?1", (site,))]


# ---------------------------------------------------------------------- surfaced rows
def surface_about(conn: sqlite3.Connection, now_ms: int, kind: str, reason: str, site: bytes, detail_json: str) -> None:
    """One row of `ssp-agent events` about a site (no table)."""
    conn.execute("INSERT INTO surfaced (at_ms, kind, reason, site_id, detail) VALUES (?,?,?,?,?)",
                 (now_ms, kind, reason, site, detail_json))


def surface_rows(conn: sqlite3.Connection, now_ms: int, kind: str, reason: str, site: bytes, table: str,
                 details_json: list[str]) -> None:
    """One row of `ssp-agent events` per detail, all about the same site and table."""
    conn.executemany("INSERT INTO surfaced (at_ms, kind, reason, site_id, qualified, detail) VALUES (?,?,?,?,?,?)",
                     [(now_ms, kind, reason, site, table, d) for d in details_json])
