"""Materialized rows (§13): one base table per local table holding the key columns, the
value columns, and the clocks the merge needs (existence, tombstone, one per column); and a
view named `schema.table` that shows the rows that exist.

A stamp is stored as one BLOB whose bytewise order is the §13.1 order:
physical_ms (8 bytes BE) || logical (4 bytes BE) || site_id (16 bytes)."""
from __future__ import annotations

import json
import sqlite3
import struct
from typing import Any, Iterable

from ..core.events import text_map
from ..core.merge import RowState, Stamp
from ..core.schema import TableDef

_ST = struct.Struct(">QI")


def pack_stamp(s: Stamp | None) -> bytes | None:
    return None if s is None else _ST.pack(s[0], s[1]) + s[2]


def unpack_stamp(b: bytes | None) -> Stamp | None:
    if b is None:
        return None
    p, l = _ST.unpack_from(b)
    return (p, l, bytes(b[12:]))


def q(ident: str) -> str:
    return '"' + ident.replace('"', '""') + '"'


def base_name(t: TableDef) -> str:
    return f"_ssp_rows.{t.qualified}"


def row_key_bytes(row_key: dict[str, Any]) -> bytes:
    """The canonical address of a row: deterministic CBOR of its key map (text keys and scalar
    values, checked by the EventPayload shape: the events encoder's map form, equal to
    `encode_trusted(row_key)`, tests/core/test_events_encoding.py)."""
    return text_map(row_key)


def create_table(conn: sqlite3.Connection, t: TableDef) -> None:
    # Columns carry no declared type: SQLite then never coerces (docs/protocol.md §0: no coercion).
    cols = [q(c) for c in t.key] + [q(c) for c in t.value_columns]
    cols += ["_ex INTEGER NOT NULL DEFAULT 0", "_ex_c BLOB", "_tomb_c BLOB", "_rk BLOB PRIMARY KEY"]
    cols += [q("_c_" + c) + " BLOB" for c in t.value_columns]
    conn.execute(f"CREATE TABLE {q(base_name(t))} ({', '.join(cols)}) WITHOUT ROWID")
    create_view(conn, t)


STATE_SUFFIX = "$state"  # manifest identifiers are [A-Za-z][A-Za-z0-9_]*: no collision possible


def create_view(conn: sqlite3.Connection, t: TableDef) -> None:
    """The user-facing view: the rows that exist, their key and value columns, and per value
    column C a companion "C$state" derived from C's column clock (§13.6: a column the local schema
    never materialized carries no clock, and must not be presented as a cleared value):
    'materialized' (a NULL value is a real, clocked null: cleared or written null) or
    'unmaterialized' (no event that counts ever set it here: NULL means absent, not cleared)."""
    conn.execute(f"DROP VIEW IF EXISTS {q(t.qualified)}")
    shown = [q(c) for c in list(t.key) + list(t.value_columns)]
    shown += [f"CASE WHEN {q('_c_' + c)} IS NULL THEN 'unmaterialized' ELSE 'materialized' END AS "
              f"{q(c + STATE_SUFFIX)}" for c in t.value_columns]
    conn.execute(f"CREATE VIEW {q(t.qualified)} AS SELECT {', '.join(shown)} FROM {q(base_name(t))} WHERE _ex = 1")


def stale_views(conn: sqlite3.Connection, tables: Iterable[TableDef]) -> list[TableDef]:
    """The tables whose view lacks the companion columns (views made by older versions) or is
    missing. sqlite_master is read once for every view: a query per table scanned it per table,
    quadratic in the tables on every writing open (probe r08: 7.8 s CPU at 8 000 tables)."""
    views = dict(conn.execute("SELECT name, sql FROM sqlite_master WHERE type='view'").fetchall())
    out = []
    for t in tables:
        sql = views.get(t.qualified)
        if sql is None or (t.value_columns and STATE_SUFFIX not in sql):
            out.append(t)
    return out


def add_column(conn: sqlite3.Connection, t: TableDef, column: str) -> None:
    conn.execute(f"ALTER TABLE {q(base_name(t))} ADD COLUMN {q(column)}")
    conn.execute(f"ALTER TABLE {q(base_name(t))} ADD COLUMN {q('_c_' + column)} BLOB")
    create_view(conn, t)


SITES_PER_QUERY = 10_000   # rows_with_clock_of: sites per statement (one variable each)


class RowStore:
    """Reads and writes one table's rows; SQL is built once per table and column set."""

    def __init__(self, conn: sqlite3.Connection, t: TableDef) -> None:
        self.conn, self.t = conn, t
        self.vcols = t.value_columns
        clock_cols = ", ".join(q("_c_" + c) for c in self.vcols)
        cols = f"_ex, _ex_c, _tomb_c{', ' + clock_cols if clock_cols else ''}"
        self._select = f"SELECT {cols} FROM {q(base_name(t))} WHERE _rk = ?"
        self._select_in = f"SELECT _rk, {cols} FROM {q(base_name(t))} WHERE _rk IN "   # + (?, ?, ...)
        self._upserts: dict[tuple[str, ...], str] = {}
        # Write-behind (`defer`/`flush`): a batch's rows held in memory between its writes, so a
        # row touched by many events of one batch is read once and written once (the
        # profile had a SELECT and an upsert per event). rk -> (row_key, state, column writes).
        self._pending: dict[bytes, tuple[dict[str, Any], RowState, dict[str, Any]]] | None = None
        # Rows read ahead by `prefetch` while deferred (rk -> state, None: no row), until written.
        self._read: dict[bytes, RowState | None] = {}
        # Rows as the last committed batch left them (a `run` applies a body of
        # 1 000 events per batch, and each body re-read the ~1 000 rows the one before wrote).
        # Kept only while nothing else can have changed them: `defer(version)` takes them when
        # the connection's `PRAGMA data_version` is the one they were kept under (no other
        # connection committed since), and every write of this table outside a deferred batch
        # drops them. `_written`: the states a deferred batch wrote; `_staged`: the states it
        # leaves, until the caller says its transaction committed (`committed`).
        self._version: int | None = None
        self._written: dict[bytes, RowState] | None = None
        self._staged: tuple[dict, int] | None = None
        self._kept: dict[bytes, RowState | None] = {}
        self._kept_version: int | None = None

    KEEP_ROWS = 2048   # at most this many rows kept between batches (memory)

    def defer(self, version: int | None = None) -> None:
        """Hold writes in memory until `flush` (inside the caller's transaction); `load` answers
        from them. Every reader of this table inside the batch goes through `load`. `version`:
        the connection's `PRAGMA data_version`, read inside the caller's transaction: the rows
        the last committed batch left are used if no other connection committed since."""
        if self._pending is None:
            self._pending = {}
            self._staged = None   # staged by a batch whose commit was never confirmed: dropped
            if version is not None and self._kept and version == self._kept_version:
                self._read = self._kept
            self._kept, self._kept_version = {}, None
            self._version, self._written = version, ({} if version is not None else None)

    def committed(self) -> None:
        """The caller's transaction committed: the rows its batch left are the table's rows."""
        if self._staged is not None:
            self._kept, self._kept_version = self._staged
            self._staged = None

    def _forget_kept(self) -> None:
        self._kept, self._kept_version, self._staged = {}, None, None

    def pending(self) -> int:
        return 0 if self._pending is None else len(self._pending)

    def flush(self, keep: bool = True) -> None:
        """Write the held rows, one prepared statement per column set (`executemany`). With
        `keep=False` deferral ends; `discard` drops them instead (the transaction rolls back)."""
        held, self._pending = self._pending, ({} if keep and self._pending is not None else None)
        written = self._written
        if written is not None and held:
            if len(written) + len(held) > self.KEEP_ROWS:
                written = self._written = None   # too many to keep: the next batch reads them
            else:
                written.update((rk, h[1]) for rk, h in held.items())
        if self._pending is None:
            read, self._read = self._read, {}
            if written is not None and self._version is not None and len(read) + len(written) <= self.KEEP_ROWS:
                # read and not written: unchanged, as stored; written: as this flush stores them
                self._staged = ({**read, **written}, self._version)
            self._written = self._version = None
        if not held:
            return
        groups: dict[tuple[str, ...], list[list[Any]]] = {}
        for rk, (row_key, state, writes) in held.items():
            cols = tuple(sorted(writes))
            groups.setdefault(cols, []).append(self._params(rk, row_key, state, cols, writes))
        for cols, params in groups.items():
            self.conn.executemany(self._upsert_sql(cols), params)

    def discard(self) -> None:
        self._pending = None
        self._read = {}
        self._written = self._version = None

    def prefetch(self, rks: Iterable[bytes]) -> None:
        """While deferred: read the rows at `rks` that are not held, in one query per 500 (a
        batch of local writes knows its rows before applying them), so `load` answers from memory."""
        if self._pending is None:
            return
        want = [rk for rk in dict.fromkeys(rks) if rk not in self._pending and rk not in self._read]
        for i in range(0, len(want), 500):
            chunk = want[i:i + 500]
            found = {bytes(r[0]): self._state(r[1:]) for r in self.conn.execute(
                self._select_in + f"({', '.join('?' * len(chunk))})", chunk)}
            for rk in chunk:
                self._read[rk] = found.get(rk)

    def load(self, rk: bytes) -> RowState | None:
        if self._pending is not None:
            held = self._pending.get(rk)
            if held is not None:
                return held[1]
            if rk in self._read:
                return self._read[rk]
        r = self.conn.execute(self._select, (rk,)).fetchone()
        return None if r is None else self._state(r)

    def _state(self, r) -> RowState:
        cells = {c: unpack_stamp(r[3 + i]) for i, c in enumerate(self.vcols) if r[3 + i] is not None}
        return RowState(bool(r[0]), unpack_stamp(r[1]), unpack_stamp(r[2]), cells)

    def _upsert_sql(self, cols: tuple[str, ...]) -> str:
        sql = self._upserts.get(cols)
        if sql is None:
            names = ["_rk", "_ex", "_ex_c", "_tomb_c"] + list(self.t.key)
            for c in cols:
                names += [c, "_c_" + c]
            placeholders = ", ".join("?" for _ in names)
            updates = ["_ex = excluded._ex", "_ex_c = excluded._ex_c", "_tomb_c = excluded._tomb_c"]
            for c in cols:
                updates += [f"{q(c)} = excluded.{q(c)}", f"{q('_c_' + c)} = excluded.{q('_c_' + c)}"]
            sql = (f"INSERT INTO {q(base_name(self.t))} ({', '.join(q(n) for n in names)}) VALUES ({placeholders}) "
                   f"ON CONFLICT(_rk) DO UPDATE SET {', '.join(updates)}")
            self._upserts[cols] = sql
        return sql

    def save(self, rk: bytes, row_key: dict[str, Any], state: RowState,
             writes: dict[str, tuple[Any, Stamp] | None]) -> None:
        """Write the row's clocks and the given column writes (None: drop the column's clock).
        Deferred: the row's newest clocks replace the held ones and its column writes add up
        (a later write of a column is the newer applied effect), so the flush writes the same row."""
        if self._pending is not None:
            self._read.pop(rk, None)   # the held row answers `load` from now on
            held = self._pending.get(rk)
            if held is None:
                self._pending[rk] = (row_key, state, dict(writes))
            else:
                held[2].update(writes)
                self._pending[rk] = (row_key, state, held[2])
            return
        self._forget_kept()   # written outside a deferred batch
        cols = tuple(sorted(writes))
        self.conn.execute(self._upsert_sql(cols), self._params(rk, row_key, state, cols, writes))

    def _params(self, rk: bytes, row_key: dict[str, Any], state: RowState, cols: tuple[str, ...],
                writes: dict[str, Any]) -> list[Any]:
        params: list[Any] = [rk, int(state.exists), pack_stamp(state.exist_clock), pack_stamp(state.tomb_clock)]
        params += [row_key[k] for k in self.t.key]
        for c in cols:
            w = writes[c]
            params += [None, None] if w is None else [w[0], pack_stamp(w[1])]
        return params

    def dump(self) -> list[dict[str, Any]]:
        """The rows that exist, sorted by key; `values` holds only columns with a clock
        (docs/cli.md `dump`: an unmaterialized column is absent, never a default)."""
        if self._pending:   # a reader of the table itself sees the held writes
            self.flush()
        sel = ", ".join([q(c) for c in self.t.key] + [q(c) for c in self.vcols] + [q("_c_" + c) for c in self.vcols])
        out = []
        nk, nv = len(self.t.key), len(self.vcols)
        for r in self.conn.execute(f"SELECT {sel} FROM {q(base_name(self.t))} WHERE _ex = 1"):
            key = {k: r[i] for i, k in enumerate(self.t.key)}
            values = {c: r[nk + i] for i, c in enumerate(self.vcols) if r[nk + nv + i] is not None}
            out.append({"key": key, "values": values})
        out.sort(key=lambda row: [_sort_key(row["key"][k]) for k in self.t.key])
        return out

    def delete(self, rk: bytes) -> None:
        """Forget a row that no counted event touches any more (it has no clock left)."""
        if self._pending:   # a reader of the table itself sees the held writes
            self.flush()
        self._read.pop(rk, None)
        if self._written is not None:
            self._written.pop(rk, None)
        self._forget_kept()
        self.conn.execute(f"DELETE FROM {q(base_name(self.t))} WHERE _rk = ?", (rk,))

    def rows_with_clock_of(self, sites: Iterable[bytes]) -> list[tuple[bytes, dict[str, Any]]]:
        """(rk, key) of the rows with any clock (existence, tombstone, a column) owned by an
        event of one of `sites` (a stamp ends with its site_id)."""
        if self._pending:   # a reader of the table itself sees the held writes
            self.flush()
        sites = [bytes(s) for s in sites]
        clocks = ["_ex_c", "_tomb_c"] + [q("_c_" + c) for c in self.vcols]
        cols = ", ".join(q(c) for c in self.t.key)
        found: dict[bytes, dict[str, Any]] = {}
        # Each site is one numbered variable (?1..?n) shared by every clock column's IN list, and
        # the sites go in chunks within the connection's variable limit (32 766 in SQLite's own
        # build, 250 000 in Debian's): sites x clocks passed it (6 000 sites, 40 value columns).
        per = max(1, min(SITES_PER_QUERY, self.conn.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)))
        for i in range(0, len(sites), per):
            chunk = sites[i:i + per]
            marks = ", ".join(f"?{k + 1}" for k in range(len(chunk)))
            where = " OR ".join(f"substr({c}, 13) IN ({marks})" for c in clocks)
            for r in self.conn.execute(f"SELECT _rk, {cols} FROM {q(base_name(self.t))} WHERE {where}", chunk):
                found[bytes(r[0])] = {k: r[1 + j] for j, k in enumerate(self.t.key)}
        return list(found.items())

    def all_row_keys(self) -> Iterable[tuple[bytes, dict[str, Any]]]:
        if self._pending:   # a reader of the table itself sees the held writes
            self.flush()
        cols = ", ".join(q(c) for c in self.t.key)
        for r in self.conn.execute(f"SELECT _rk, {cols} FROM {q(base_name(self.t))}").fetchall():
            yield r[0], {k: r[1 + i] for i, k in enumerate(self.t.key)}


def _sort_key(v: Any) -> tuple:
    # A total order across the scalar kinds a key may hold (type rank first, then value).
    if isinstance(v, int):
        return (0, v, b"")
    if isinstance(v, float):
        return (1, v, b"")
    if isinstance(v, str):
        return (2, 0, v.encode())
    return (3, 0, bytes(v))


def table_def_row(t: TableDef) -> tuple:
    return (t.qualified, t.schema, t.name, t.category, json.dumps(list(t.key)),
            json.dumps(t.columns, sort_keys=True), t.retention)


def clocks_after(conn: sqlite3.Connection, t: TableDef, after: bytes | None, limit: int) -> list[tuple]:
    """Up to `limit` rows of table `t` with row_key > `after` (None: from the first), in row_key
    order: (row_key, existence clock, tombstone clock, each value column's clock), packed stamps
    (`unpack_stamp`); what a widening backfill selects a row's covering events by (scope §2)."""
    clocks = ["_ex_c", "_tomb_c"] + [q("_c_" + c) for c in t.value_columns]
    sql = f"SELECT _rk, {', '.join(clocks)} FROM {q(base_name(t))}" + (" WHERE _rk > ?" if after is not None else "")
    return conn.execute(sql + " ORDER BY _rk LIMIT ?", ((after,) if after is not None else ()) + (limit,)).fetchall()


# ---------------------------------------------------------------------- the tables' own record (`tables`)
def table_rows(conn: sqlite3.Connection) -> list[tuple]:
    """(qualified, schema, name, category, key_json, columns_json, retention, horizon_p, horizon_l)
    of every table the node has."""
    return conn.execute("SELECT * FROM tables").fetchall()


def insert_table_row(conn: sqlite3.Connection, t: TableDef) -> None:
    conn.execute("INSERT INTO tables (qualified, schema_name, table_name, category, key_json, columns_json, retention)"
                 " VALUES (?,?,?,?,?,?,?)", table_def_row(t))


def set_columns(conn: sqlite3.Connection, table: str, columns_json: str) -> None:
    conn.execute("UPDATE tables SET columns_json=? WHERE qualified=?", (columns_json, table))


def set_horizon(conn: sqlite3.Connection, table: str, horizon: tuple[int, int]) -> None:
    conn.execute("UPDATE tables SET horizon_p=?, horizon_l=? WHERE qualified=?", (horizon[0], horizon[1], table))


def zero_horizons(conn: sqlite3.Connection) -> None:
    """Every horizon back to zero (rehydration, scope §3: the only way a horizon moves down)."""
    conn.execute("UPDATE tables SET horizon_p=0, horizon_l=0")
