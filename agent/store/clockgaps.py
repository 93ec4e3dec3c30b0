"""What the store keeps of HLC ranges this site never issued (docs/apply.md "Clocks without an
RTC"), and the withdrawal of own events no one received: meta `clock_holes` (the ranges a clock
jump left, widest kept), `clock_gap` (the range the clock issues in after a wrong clock: low, top
and the highest value issued above it) and `clock_reissue` (a withdrawal begun: the originals'
event ids and where their re-issues start), each written in the caller's transaction."""
from __future__ import annotations

import json
import sqlite3

from .db import del_meta, get_meta, set_meta
from .eventlog import ROW_EVENTS

Hlc = tuple[int, int]
HOLES_KEPT = 8   # the widest ranges are kept: a wrong boot's is years wide, an idle night's hours


def holes(conn: sqlite3.Connection) -> list[tuple[Hlc, Hlc]]:
    raw = get_meta(conn, "clock_holes")
    return [((h[0], h[1]), (h[2], h[3])) for h in json.loads(raw)] if raw else []


def add_hole(conn: sqlite3.Connection, below: Hlc, above: Hlc) -> None:
    """Record that nothing strictly between `below` and `above` was issued (a clock jump)."""
    kept = holes(conn) + [(below, above)]
    kept.sort(key=lambda h: h[1][0] - h[0][0], reverse=True)
    kept = sorted(kept[:HOLES_KEPT])
    set_meta(conn, "clock_holes", json.dumps([[*b, *a] for b, a in kept]))


def clear_holes(conn: sqlite3.Connection) -> None:
    del_meta(conn, "clock_holes")


def gap(conn: sqlite3.Connection) -> tuple[Hlc, Hlc, Hlc] | None:
    """(low, top, spent) of the gap the clock issues in, or None."""
    raw = get_meta(conn, "clock_gap")
    if not raw:
        return None
    g = json.loads(raw)
    return (g["low"][0], g["low"][1]), (g["top"][0], g["top"][1]), (g["spent"][0], g["spent"][1])


def set_gap(conn: sqlite3.Connection, low: Hlc, top: Hlc, spent: Hlc) -> None:
    set_meta(conn, "clock_gap", json.dumps({"low": list(low), "top": list(top), "spent": list(spent)}))


def pending(conn: sqlite3.Connection) -> tuple[list[bytes], Hlc] | None:
    """(the withdrawn originals' event ids in HLC order, the HLC their re-issues start above)."""
    raw = get_meta(conn, "clock_reissue")
    if not raw:
        return None
    p = json.loads(raw)
    return [bytes.fromhex(i) for i in p["ids"]], (p["low"][0], p["low"][1])


def set_pending(conn: sqlite3.Connection, ids: list[bytes], low: Hlc) -> None:
    set_meta(conn, "clock_reissue", json.dumps({"ids": [i.hex() for i in ids], "low": list(low)}))


def clear_pending(conn: sqlite3.Connection) -> None:
    del_meta(conn, "clock_reissue")


def own_above(conn: sqlite3.Connection, site: bytes, after: Hlc) -> list[tuple[bytes, int, int, bytes]]:
    """(event_id, hlc_p, hlc_l, raw unsealed) of `site`'s retained events above `after`, by HLC."""
    return [(bytes(e), p, l, bytes(r)) for e, p, l, r in conn.execute(
        "SELECT event_id, hlc_p, hlc_l, unseal(event_id, raw) FROM events WHERE site_id=? AND "
        "(hlc_p > ? OR (hlc_p = ? AND hlc_l > ?)) ORDER BY hlc_p, hlc_l", (site, after[0], after[0], after[1]))]


def newest_own_below(conn: sqlite3.Connection, site: bytes, top: Hlc) -> Hlc | None:
    r = conn.execute("SELECT hlc_p, hlc_l FROM events WHERE site_id=? AND (hlc_p < ? OR (hlc_p = ? AND hlc_l < ?)) "
                     "ORDER BY hlc_p DESC, hlc_l DESC LIMIT 1", (site, top[0], top[0], top[1])).fetchone()
    return None if r is None else (r[0], r[1])


def withdraw(conn: sqlite3.Connection, event_ids: list[bytes]) -> int:
    """Delete own events no peer received from the log, with their pending re-offers (no peer took
    them); returns how many went. Inside the caller's transaction."""
    marks = ",".join("?" * len(event_ids))
    seqs = [r[0] for r in conn.execute(f"SELECT seq FROM events WHERE event_id IN ({marks})", event_ids)]
    if seqs and conn.execute("SELECT 1 FROM sqlite_master WHERE name='reoffer'").fetchone() is not None:
        conn.executemany("DELETE FROM reoffer WHERE seq=?", [(s,) for s in seqs])
    return conn.execute(f"DELETE FROM events WHERE event_id IN ({marks})", event_ids).rowcount


def row_events(conn: sqlite3.Connection, table: str, rk: bytes) -> list[tuple[bytes, int, int, str, bytes]]:
    """(site_id, hlc_p, hlc_l, operation, raw unsealed) of every retained event of one row."""
    return [(bytes(s), p, l, op, bytes(r)) for s, p, l, op, r in conn.execute(ROW_EVENTS, (table, rk)).fetchall()]
