"""RowStore.rows_with_clock_of (the rows a trust change must rebuild, trust.reconcile_trust)
bound one SQL variable per site and clock column: a node whose first trust record listed every
signer of its log as shrunk (6 000 sites) with a table of 40 value columns asked SQLite for 252 000
variables, past the limit of Debian's build (250 000; SQLite's own: 32 766), and the trust rebuild
failed (OperationalError "too many SQL variables"). Now each site is one numbered variable
whatever the columns, in chunks within the connection's limit. The test lowers that limit to 1 000
(Connection.setlimit) so the same shape fails the old query with 2 000 sites."""
from __future__ import annotations

import os
import sqlite3

from agent.core.schema import table_def_from
from agent.store import rows


def _store(n_cols: int):
    conn = sqlite3.connect(":memory:")
    conn.execute("ATTACH ':memory:' AS app")
    spec = {"schema": "app", "name": "wide", "key": ["id"],
            "columns": {"id": "text", **{f"v{i}": "real" for i in range(n_cols)}}}
    t = table_def_from(spec)
    rows.create_table(conn, t)
    return conn, t


def test_many_sites_on_a_wide_table_find_exactly_their_rows(monkeypatch):
    conn, t = _store(40)
    conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 1000)    # two chunks of 1 000 sites
    sites = [os.urandom(16) for _ in range(2_000)]
    mine, other = sites[1_234], os.urandom(16)
    base = rows.q(rows.base_name(t))
    conn.execute(f"INSERT INTO {base} (id, _ex, _ex_c, _rk) VALUES ('a', 1, ?, ?)", (b"\0" * 12 + mine, b"ka"))
    conn.execute(f"INSERT INTO {base} (id, _ex, {rows.q('_c_v39')}, _rk) VALUES ('b', 1, ?, ?)",
                 (b"\0" * 12 + mine, b"kb"))
    conn.execute(f"INSERT INTO {base} (id, _ex, _ex_c, _rk) VALUES ('c', 1, ?, ?)", (b"\0" * 12 + other, b"kc"))
    got = rows.RowStore(conn, t).rows_with_clock_of(sites)
    assert sorted((bytes(rk), key["id"]) for rk, key in got) == [(b"ka", "a"), (b"kb", "b")]
