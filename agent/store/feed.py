"""The change feed's store (docs/client.md): one row per change to a row or per signal about an
event, appended by the apply transaction itself, so a record exists exactly when its change
committed. `seq` is the durable cursor. Values are not kept here but read from the row when a
record is read (`resolved`). The newest `feed_retain` records are kept (meta, from the profile;
RETAIN without it); the highest seq ever pruned is in meta so that a cursor below it is told it
expired, never silently skipped.
Also the applications' reads of one row with each value's state (materialized, cleared by a
delete, never materialized), on any connection: the running agent's reader or a read-only open."""
from __future__ import annotations

import json
import sqlite3
import struct
from typing import Any

from .db import get_meta, set_meta

# `rk`: the row's address in its base table (agent/store/rows.py), where a reader finds the values
DDL = ("CREATE TABLE IF NOT EXISTS feed (seq INTEGER PRIMARY KEY AUTOINCREMENT, qualified TEXT, rk BLOB, "
       "record TEXT NOT NULL)")
RETAIN = 100_000   # records kept: at a few hundred bytes each, tens of MB at most
PRUNE_EVERY = 1024  # appends between two prunes (a DELETE of the oldest by primary key)
PRUNED = "feed_pruned_through"

_INSERT = "INSERT INTO feed (qualified, rk, record) VALUES (?, ?, ?)"


def create_schema(conn: sqlite3.Connection) -> None:
    conn.execute(DDL)


# A home that held rows before it had the feed (store version 7 and older): a watcher from cursor 0
# must re-read the tables rather than take an empty history for a complete one (docs/client.md)
STARTED = ('{"kind":"rebuild","cause":"feed_started","table":null,"message":"the feed starts here: rows '
           'written before it are in no record; re-read the tables"}')


def note_started(conn: sqlite3.Connection) -> bool:
    """In the migration after the feed's: the STARTED record, when the feed never held a record and
    the home holds rows or events already (a fresh home has nothing to re-read). Whether it did."""
    if conn.execute("SELECT 1 FROM sqlite_sequence WHERE name='feed'").fetchone() is not None:
        return False
    held = conn.execute("SELECT 1 FROM events LIMIT 1").fetchone() is not None or any(
        conn.execute(f"SELECT 1 FROM {_q(name)} LIMIT 1").fetchone() is not None
        for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table' AND name LIKE '\\_ssp\\_rows.%' "
                                    "ESCAPE '\\'").fetchall())
    if held:
        append(conn, None, None, STARTED)
    return held


def append(conn: sqlite3.Connection, qualified: str | None, rk: bytes | None, record: str) -> int:
    """Inside the apply transaction: one record; returns its cursor."""
    seq = conn.execute(_INSERT, (qualified, rk, record)).lastrowid
    if seq % PRUNE_EVERY == 0:
        retain = int(get_meta(conn, "feed_retain", RETAIN))   # a small card keeps fewer (the profile)
        if seq > retain:
            conn.execute("DELETE FROM feed WHERE seq <= ?", (seq - retain,))
            set_meta(conn, PRUNED, seq - retain)
    return seq


def reader(path) -> sqlite3.Connection:
    """A read-only connection beside the running agent, which allocated the WAL index already;
    never the exclusive-mode fallback of db.connect_readonly, which would lock out its writer."""
    import urllib.parse
    conn = sqlite3.connect("file:" + urllib.parse.quote(str(path)) + "?mode=ro", uri=True, isolation_level=None,
                           check_same_thread=False)
    conn.execute("PRAGMA busy_timeout=10000")
    return conn


def _has_feed(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='feed'").fetchone() is not None


def exists(conn: sqlite3.Connection) -> bool:
    """Whether this home has the feed: not one an older agent made and no writing open migrated."""
    return _has_feed(conn)


def bounds(conn: sqlite3.Connection) -> tuple[int, int]:
    """(highest pruned seq, head seq): a cursor below the first has lost records."""
    if not _has_feed(conn):
        return 0, 0
    head = conn.execute("SELECT seq FROM sqlite_sequence WHERE name='feed'").fetchone()
    return int(get_meta(conn, PRUNED, 0) or 0), int(head[0]) if head else 0


def pruned_through(conn: sqlite3.Connection) -> int:
    """The highest seq pruned (0: none): a cursor below it has lost records."""
    return int(get_meta(conn, PRUNED, 0) or 0)


def after(conn: sqlite3.Connection, cursor: int, tables: list[str] | None, limit: int) -> list[tuple]:
    """Up to `limit` records past `cursor` (seq, table, rk, record JSON), for `tables` only when
    given; a record about an event whose table is unknown (NULL) goes to every watcher."""
    if not _has_feed(conn):
        return []
    if not tables:
        return conn.execute("SELECT seq, qualified, rk, record FROM feed WHERE seq > ? ORDER BY seq LIMIT ?",
                            (cursor, limit)).fetchall()
    marks = ", ".join("?" * len(tables))
    return conn.execute(f"SELECT seq, qualified, rk, record FROM feed WHERE seq > ? AND (qualified IN ({marks}) "
                        "OR qualified IS NULL) ORDER BY seq LIMIT ?", (cursor, *tables, limit)).fetchall()


def seqs_after(conn: sqlite3.Connection, cursor: int, tables: list[str] | None, limit: int) -> list[int]:
    """The cursors `after` would return: a watcher served from lines already resolved reads no record."""
    if not tables:
        q = conn.execute("SELECT seq FROM feed WHERE seq > ? ORDER BY seq LIMIT ?", (cursor, limit))
    else:
        marks = ", ".join("?" * len(tables))
        q = conn.execute(f"SELECT seq FROM feed WHERE seq > ? AND (qualified IN ({marks}) OR qualified IS NULL) "
                         "ORDER BY seq LIMIT ?", (cursor, *tables, limit))
    return [r[0] for r in q]


def rows_at(conn: sqlite3.Connection, seqs: list[int]) -> list[tuple]:
    """The records at these cursors (as `after` gives them), in cursor order; a pruned one is left out."""
    marks = ", ".join("?" * len(seqs))
    return conn.execute(f"SELECT seq, qualified, rk, record FROM feed WHERE seq IN ({marks}) ORDER BY seq",
                        seqs).fetchall()


def _stamp(hlc: str, site: str) -> bytes:
    p, l = hlc.split(".")
    return struct.pack(">QI", int(p), int(l)) + bytes.fromhex(site)


def resolved(conn: sqlite3.Connection, rows: list[tuple]) -> list[dict]:
    """The records of `after` as the feed shows them, with their cursor and each written column's
    value. Values are not kept in the feed (docs/reliability.md "Superseded values": a value
    replaced is in no file of the home): read from the row, where the column still carries the
    clock the record names; else `superseded` (a later record carries what replaced it)."""
    shapes: dict = {}
    found: dict = {}   # (table, rk) -> the row's values and clocks: one query per table and batch
    for qualified in {q for _s, q, rk, _t in rows if rk is not None}:
        cols = table_columns(conn, qualified)
        vals = cols[1] if cols else []
        shown = ", ".join(["_rk"] + [_q(c) for c in vals] + [_q("_c_" + c) for c in vals])
        shapes[qualified] = ({c: i for i, c in enumerate(vals)}, len(vals))
        rks = list({rk for _s, q, rk, _t in rows if q == qualified and rk is not None})
        for i in range(0, len(rks), 500):
            part = rks[i:i + 500]
            for r in conn.execute(f"SELECT {shown} FROM {_q('_ssp_rows.' + qualified)} WHERE _rk IN "
                                  f"({', '.join('?' * len(part))})", part):
                found[(qualified, r[0])] = r[1:]
    out = []
    for seq, qualified, rk, text in rows:
        rec = json.loads(text)
        rec = {"cursor": seq, **rec}
        if rec.get("kind") == "change" and rk is not None:
            idx, n = shapes[qualified]
            row = found.get((qualified, rk))
            for c, w in rec["columns"].items():
                if w.get("state") == "unmaterialized":
                    w["value"] = None
                    continue
                i = idx.get(c)
                if row is not None and i is not None and row[n + i] == _stamp(w.get("hlc", rec["hlc"]),
                                                                              w.get("site", rec["site"])):
                    v = row[i]
                    w["value"] = {"$bytes": v.hex()} if isinstance(v, bytes) else v
                else:
                    w["superseded"] = True
        out.append(rec)
    return out


def data_version(conn: sqlite3.Connection) -> int:
    """Changes whenever another connection committed (a reader's cheap 'anything new?')."""
    return conn.execute("PRAGMA data_version").fetchone()[0]


# ---------------------------------------------------------------- an application's reads
def _q(ident: str) -> str:
    return '"' + ident.replace('"', '""') + '"'


def table_columns(conn: sqlite3.Connection, qualified: str) -> tuple[list[str], list[str]] | None:
    """(key columns, value columns) of a local table, None when there is no such table. From the
    base table itself (agent/store/rows.py): a value column C has a clock column _c_C."""
    names = [r[1] for r in conn.execute(f"PRAGMA table_info({_q('_ssp_rows.' + qualified)})")]
    if not names:
        return None
    clocks = {n[3:] for n in names if n.startswith("_c_")}
    values = [n for n in names if n in clocks]
    keys = [n for n in names if not n.startswith("_") and n not in clocks]
    return keys, values


def read_row(conn: sqlite3.Connection, qualified: str, key: dict[str, Any]) -> dict | None:
    """One row: {"exists", "values": {col: value}, "states": {col: state}}; state 'absent' for the
    row when it was never materialized here. None when the table does not exist."""
    cols = table_columns(conn, qualified)
    if cols is None:
        return None
    keys, values = cols
    if set(key) != set(keys):
        raise KeyError(f"{qualified}: the key columns are {keys}")
    shown = ", ".join([_q(c) for c in values] + [_q("_c_" + c) for c in values] + ["_ex", "_tomb_c"])
    where = " AND ".join(f"{_q(k)} IS ?" for k in keys)
    r = conn.execute(f"SELECT {shown} FROM {_q('_ssp_rows.' + qualified)} WHERE {where}",
                     tuple(key[k] for k in keys)).fetchone()
    n = len(values)
    if r is None:
        return {"state": "absent", "exists": False, "values": {c: None for c in values},
                "states": {c: "unmaterialized" for c in values}}
    exists = bool(r[2 * n])
    states = {}
    for i, c in enumerate(values):
        # §13.6: no clock, never materialized here (NULL is absence, not a value); a row that does
        # not exist had its values cleared by a delete (§13.3)
        states[c] = "unmaterialized" if r[n + i] is None else "materialized" if exists else "deleted"
    return {"state": "materialized" if exists else "deleted", "exists": exists,
            "values": {c: r[i] for i, c in enumerate(values)}, "states": states}
