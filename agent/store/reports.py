"""What the node surfaces and reports (`ssp-agent events`, `check`, the metrics file): the
`surfaced` record, the §13.6 ignored-columns meter, the keyring's members, the oldest own event a
peer has not confirmed. (All SQL lives in agent/store/: tests/test_sql_in_store.py.)"""
from __future__ import annotations

import contextlib
import json
import sqlite3
from pathlib import Path


# ---------------------------------------------------------------------- the surfaced record
def surface(conn: sqlite3.Connection, now_ms: int, kind: str, reason: str, detail_json: str) -> None:
    """One row of `ssp-agent events` without a site or table, inside the caller's transaction."""
    conn.execute("INSERT INTO surfaced (at_ms, kind, reason, detail) VALUES (?,?,?,?)", (now_ms, kind, reason, detail_json))


def surface_once(conn: sqlite3.Connection, now_ms: int, kind: str, reason: str, site: bytes, table: str,
                 detail_json: str) -> None:
    """One row for (kind, reason, site, table), unless the record already holds one."""
    conn.execute(
        "INSERT INTO surfaced (at_ms, kind, reason, site_id, qualified, detail) SELECT ?,?,?,?,?,? WHERE NOT EXISTS"
        " (SELECT 1 FROM surfaced WHERE kind=? AND reason=? AND site_id=? AND qualified=?)",
        (now_ms, kind, reason, site, table, detail_json, kind, reason, site, table))


def surfaced_since(conn: sqlite3.Connection, since_ms: int) -> list[tuple[str, str, int]]:
    """(kind, reason, rows) surfaced at or after `since_ms`, most rows first."""
    return conn.execute("SELECT kind, reason, count(*) FROM surfaced WHERE at_ms >= ? GROUP BY kind, reason "
                        "ORDER BY 3 DESC", (since_ms,)).fetchall()


def surfaced_by_kind(conn: sqlite3.Connection) -> list[tuple[str, int]]:
    return conn.execute("SELECT kind, count(*) FROM surfaced GROUP BY kind ORDER BY kind").fetchall()


def ignored_columns(conn: sqlite3.Connection) -> list[tuple[str, str, int]]:
    """(table, column, events) of the §13.6 meter: payload columns this node's schema lacks."""
    return conn.execute(
        "SELECT qualified, column_name, sum(count) FROM ignored_columns GROUP BY 1, 2 ORDER BY 1, 2").fetchall()


# ---------------------------------------------------------------------- the keyring
def member_peers(conn: sqlite3.Connection, keyring: dict, self_site: bytes) -> list[bytes]:
    """The sites of the effective keyring (`keyring`: site -> (key, cutoff), provisioned keys and
    the vouched ones, sync_state.overlay_keyring) other than this node, not retired (no cutoff),
    in site order, that sync: a record key (`record_keys`) is no peer. A fleet's devices are
    vouched, not provisioned (docs/operations.md "Fleet rehearsal"): they count too."""
    keys = record_keys(conn)
    return sorted(s for s, (_pk, cutoff) in keyring.items() if s != self_site and cutoff is None and s not in keys)


def record_keys(conn: sqlite3.Connection) -> set[bytes]:
    """Mesh authorities whose key was provisioned as an authority's (the manifest's [[peers]] next
    to `authorities`, or `authority add`): a key that signs control records, never a node that
    syncs, so nobody offers it events or waits for its confirmations (docs/operations.md §0). An
    authority also added as a node (`peer add`, a vouch) stays a peer."""
    r = conn.execute("SELECT value FROM meta WHERE key='authorities'").fetchone()
    try:
        auths = {bytes.fromhex(a) for a in json.loads(r[0])} if r and r[0] else set()
    except (ValueError, TypeError):
        return set()
    if not auths:
        return set()
    return {bytes(s) for s, src in conn.execute("SELECT site_id, source FROM keyring WHERE source IN "
                                                "('manifest', 'authority')") if bytes(s) in auths}


def keyring_key(conn: sqlite3.Connection, site: bytes) -> bytes | None:
    """The public key the keyring holds for `site`, or None."""
    r = conn.execute("SELECT public_key FROM keyring WHERE site_id=?", (site,)).fetchone()
    return None if r is None else bytes(r[0])


def site_of_store(store: Path) -> bytes | None:
    """The site a store file belongs to, read through a read-only connection of its own; None if
    there is no store there or it cannot be read."""
    if not store.exists():
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"file:{store}?mode=ro", uri=True, timeout=5)) as c:
            row = c.execute("SELECT value FROM meta WHERE key='site_id'").fetchone()
    except sqlite3.Error:
        return None
    return None if row is None else bytes(row[0])


# ---------------------------------------------------------------------- confirmation of own events
def oldest_unconfirmed(conn: sqlite3.Connection, site: bytes, wms: dict) -> int | None:
    """The physical time of `site`'s oldest event above the watermark `wms` holds for its table
    ((site, table) -> (p, l); none: every event), over its tables; None when every one is covered."""
    oldest = None
    for q, in conn.execute("SELECT DISTINCT qualified FROM events WHERE site_id=?", (site,)).fetchall():
        wm = wms.get((site, q), (0, 0))
        r = conn.execute("SELECT min(hlc_p) FROM events WHERE site_id=? AND qualified=? AND "
                         "(hlc_p > ? OR (hlc_p = ? AND hlc_l > ?))", (site, q, wm[0], wm[0], wm[1])).fetchone()[0]
        if r is not None and (oldest is None or r < oldest):
            oldest = r
    return oldest


# ---------------------------------------------------------------------- the apply path's surfaced rows
# Module-level text the node executes itself (a rejected or held event, a resurrection, the
# §13.6 ignored-columns meter): no extra Python call per event.
SURFACE_EVENT = ("INSERT INTO surfaced (at_ms, kind, reason, event_id, site_id, qualified, detail)"
                 " VALUES (?,?,?,?,?,?,?)")
COUNT_IGNORED_COLUMN = ("INSERT INTO ignored_columns VALUES (?,?,?,1,?,?) ON CONFLICT(site_id, qualified, column_name)"
                        " DO UPDATE SET count = count + 1, last_ms = excluded.last_ms")


def surface_table(conn: sqlite3.Connection, now_ms: int, kind: str, reason: str, table: str, detail_json: str) -> None:
    """One row of `ssp-agent events` about a table (no site), inside the caller's transaction."""
    conn.execute("INSERT INTO surfaced (at_ms, kind, reason, qualified, detail) VALUES (?,?,?,?,?)",
                 (now_ms, kind, reason, table, detail_json))


def surfaced_rows(conn: sqlite3.Connection, limit: int) -> list[tuple]:
    """The newest `limit` surfaced rows, newest first: (seq, at_ms, kind, reason, event_id, site_id,
    table, detail)."""
    return conn.execute("SELECT * FROM surfaced ORDER BY seq DESC LIMIT ?", (limit,)).fetchall()


def ignored_column_rows(conn: sqlite3.Connection) -> list[tuple]:
    """(site_id, table, column, count, first_ms, last_ms) of the §13.6 meter, ordered."""
    return conn.execute("SELECT * FROM ignored_columns ORDER BY 1,2,3").fetchall()
