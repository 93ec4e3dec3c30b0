"""Per-(peer, path) link state, sender side (SQLite): cursors (§14.1), the bodies sent and awaiting
an answer, what this node learned of each peer's body limit, and the widening backfill jobs
(scope §2)."""
from __future__ import annotations

import json
import sqlite3
from typing import Iterable

from ..core.scope import WILDCARD
from ..core.schema import SYNCABLE
from .db import transaction
from .sync_schema import has_schema


# ---------------------------------------------------------------- cursors
def cursor(conn: sqlite3.Connection, peer: bytes, path: str) -> tuple[int, int, int]:
    """(live, bf_next, bf_end); a peer never sent to starts at genesis (§14.1)."""
    r = conn.execute("SELECT live, bf_next, bf_end FROM sync_cursors WHERE peer=? AND path=?", (peer, path)).fetchone()
    return (0, 0, 0) if r is None else (r[0], r[1], r[2])


def advance_cursor(conn: sqlite3.Connection, peer: bytes, path: str, live: int, bf_next: int | None = None) -> None:
    """Monotonic: a confirmation never moves a cursor back (two exchanges may overlap)."""
    cur = cursor(conn, peer, path)
    new_live = max(cur[0], live)
    new_bf = cur[1] if bf_next is None else max(cur[1], bf_next)
    conn.execute("INSERT OR REPLACE INTO sync_cursors VALUES (?,?,?,?,?)", (peer, path, new_live, new_bf, cur[2]))


# ---------------------------------------------------------------- bodies awaiting an answer
SENT_BODIES_KEPT = 64  # per (peer, path): older unanswered bodies are forgotten (their range is re-offered)


def put_sent_body(conn: sqlite3.Connection, path: str, key: bytes, peer: bytes, kind: str, token: str,
                  now_ms: int) -> None:
    """A body sent to `peer` on `path` whose answer will name `key`. Only the newest
    SENT_BODIES_KEPT per (peer, path) are kept: an answer to a forgotten one moves nothing, and the
    cursor it would have moved re-offers that range (at-least-once, §14.1)."""
    conn.execute("INSERT OR REPLACE INTO sent_bodies (path, sent_key, peer, kind, token, sent_ms) VALUES (?,?,?,?,?,?)",
                 (path, key, peer, kind, token, now_ms))
    conn.execute("DELETE FROM sent_bodies WHERE peer=? AND path=? AND id NOT IN (SELECT id FROM sent_bodies "
                 "WHERE peer=? AND path=? ORDER BY id DESC LIMIT ?)", (peer, path, peer, path, SENT_BODIES_KEPT))


def sent_body(conn: sqlite3.Connection, path: str, key: bytes) -> tuple[bytes, str, str] | None:
    """(peer, kind, token) of the unanswered body sent on `path` under `key`, or None."""
    if not has_schema(conn):
        return None
    r = conn.execute("SELECT peer, kind, token FROM sent_bodies WHERE path=? AND sent_key=?", (path, key)).fetchone()
    return None if r is None else (bytes(r[0]), r[1], r[2])


def forget_sent_body(conn: sqlite3.Connection, path: str, key: bytes) -> None:
    conn.execute("DELETE FROM sent_bodies WHERE path=? AND sent_key=?", (path, key))


# ---------------------------------------------------------------- per-peer link state (store layout v5)
# Quiet links: which of the bodies in sent_bodies still count as in flight to a
# peer (those after `gave_up_id`: waiting in the broker or at the peer), and what this node learned
# of the peer's body limit: the limit it advertised itself (presence, answers; transport metadata,
# docs/mqtt.md "Size limits") and the provisional reduction after `too_large` refusals (runner
# PeerLimit, as JSON), so neither is learned again after a restart or on the next wake.
PEER_LINKS_DDL = ("CREATE TABLE IF NOT EXISTS peer_links ("
                  " peer BLOB NOT NULL, path TEXT NOT NULL, gave_up_id INTEGER NOT NULL DEFAULT 0,"
                  " advertised INTEGER, limit_state TEXT, PRIMARY KEY (peer, path)) WITHOUT ROWID")


def _has_peer_links(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE name='peer_links'").fetchone() is not None


def peer_link(conn: sqlite3.Connection, peer: bytes, path: str) -> dict:
    """{gave_up_id, advertised, limit_state} of `peer` on `path` (defaults when nothing is known)."""
    r = conn.execute("SELECT gave_up_id, advertised, limit_state FROM peer_links WHERE peer=? AND path=?",
                     (peer, path)).fetchone() if _has_peer_links(conn) else None
    if r is None:
        return {"gave_up_id": 0, "advertised": None, "limit_state": None}
    return {"gave_up_id": r[0], "advertised": r[1], "limit_state": json.loads(r[2]) if r[2] else None}


def _put_link(conn: sqlite3.Connection, peer: bytes, path: str, column: str, value) -> None:
    conn.execute("INSERT INTO peer_links (peer, path) VALUES (?, ?) ON CONFLICT (peer, path) DO NOTHING", (peer, path))
    conn.execute(f"UPDATE peer_links SET {column}=? WHERE peer=? AND path=?", (value, peer, path))


def give_up_sent_bodies(conn: sqlite3.Connection, peer: bytes, path: str, upto_id: int | None = None) -> None:
    """The bodies sent to `peer` on `path` so far (or up to `upto_id`) no longer count as in flight
    (their ranges are offered again). Their rows stay: a late answer still moves the cursor."""
    top = conn.execute("SELECT coalesce(max(id), 0) FROM sent_bodies WHERE peer=? AND path=?", (peer, path)).fetchone()[0]
    if upto_id is not None:
        top = min(top, upto_id)
    if top > peer_link(conn, peer, path)["gave_up_id"]:
        _put_link(conn, peer, path, "gave_up_id", top)


def bodies_in_flight(conn: sqlite3.Connection, path: str, since_ms: int) -> list[tuple[int, bytes, bytes, str]]:
    """(id, key, peer, token) of the bodies sent on `path` since `since_ms`, not answered, not given up."""
    if not has_schema(conn):
        return []
    link = "LEFT JOIN peer_links l ON l.peer = s.peer AND l.path = s.path" if _has_peer_links(conn) else ""
    gave = "coalesce(l.gave_up_id, 0)" if link else "0"
    return [(i, bytes(k), bytes(p), t) for i, k, p, t in conn.execute(
        f"SELECT s.id, s.sent_key, s.peer, s.token FROM sent_bodies s {link} "
        f"WHERE s.path=? AND s.sent_ms >= ? AND s.id > {gave} ORDER BY s.id", (path, since_ms))]


def set_advertised_limit(conn: sqlite3.Connection, peer: bytes, path: str, limit: int | None) -> None:
    _put_link(conn, peer, path, "advertised", limit)


def set_limit_state(conn: sqlite3.Connection, peer: bytes, path: str, state: dict | None) -> None:
    _put_link(conn, peer, path, "limit_state", json.dumps(state, sort_keys=True) if state else None)


def schedule_backfill(conn: sqlite3.Connection, peer_text: str, tables: Iterable[str] | None = None,
                      peers: Iterable[bytes] = (), now_ms: int = 0) -> int:
    """Widening backfill (scope §2): enqueue one durable job per (peer, table) for the matching
    peers (those with a cursor, plus `peers`) and the given syncable tables (default: all). A job
    that already exists restarts from genesis (a second widening must not skip rows the first
    one had passed while they were still denied). Returns the number of jobs enqueued."""
    cand = {bytes(r[0]) for r in conn.execute("SELECT DISTINCT peer FROM sync_cursors")} | set(peers)
    if peer_text != WILDCARD:
        cand = {p for p in cand if p.hex() == peer_text}
    if tables is None:
        tables = [q for q, c in conn.execute("SELECT qualified, category FROM tables") if c == SYNCABLE]
    tables = sorted(set(tables))
    n = 0
    for p in sorted(cand):
        for q in tables:
            conn.execute("INSERT OR REPLACE INTO backfill_jobs VALUES (?,?,NULL,0,0,?)", (p, q, now_ms))
            n += 1
    return n


def backfill_jobs(conn: sqlite3.Connection, peer: bytes | None = None) -> list[dict]:
    q = "SELECT peer, qualified, resume_after_row_key, rows_sent, events_sent, created_ms FROM backfill_jobs"
    rows = conn.execute(q + (" WHERE peer=?" if peer is not None else "") + " ORDER BY peer, qualified",
                        (peer,) if peer is not None else ()).fetchall()
    return [{"peer": bytes(p), "table": t, "resume_after_row_key": None if r is None else bytes(r),
             "rows_sent": rs, "events_sent": es, "created_ms": c} for p, t, r, rs, es, c in rows]


def advance_backfill(conn: sqlite3.Connection, peer: bytes, table: str, expect_from: bytes | None,
                     resume_after: bytes | None, rows: int, events: int, done: bool) -> bool:
    """Commit backfill progress after a successful push. Only moves forward from the position the
    batch was selected from (a job restarted or dropped meanwhile is left alone). `done`: the walk
    reached the table's end; the job is finished."""
    r = conn.execute("SELECT resume_after_row_key FROM backfill_jobs WHERE peer=? AND qualified=?",
                     (peer, table)).fetchone()
    if r is None or (None if r[0] is None else bytes(r[0])) != expect_from:
        return False
    if done:
        conn.execute("DELETE FROM backfill_jobs WHERE peer=? AND qualified=?", (peer, table))
    elif resume_after is not None:
        conn.execute("UPDATE backfill_jobs SET resume_after_row_key=?, rows_sent=rows_sent+?, events_sent=events_sent+?"
                     " WHERE peer=? AND qualified=?", (resume_after, rows, events, peer, table))
    return True


def drop_backfill(conn: sqlite3.Connection, peer: bytes, table: str) -> None:
    conn.execute("DELETE FROM backfill_jobs WHERE peer=? AND qualified=?", (peer, table))


def peers_with_cursors(conn: sqlite3.Connection, path: str | None = None) -> list[bytes]:
    q = "SELECT DISTINCT peer FROM sync_cursors" + (" WHERE path=?" if path else "")
    return [bytes(r[0]) for r in conn.execute(q, (path,) if path else ())]


def adopt_meta_cursors(conn: sqlite3.Connection, path: str) -> None:
    """Homes from before the runner used the sync layer kept their MQTT cursors in `meta`
    (`cursor:<path>:<peer>`, same meaning: every seq <= c dealt with). Move them into the
    per-(peer, path) cursors (monotonic) once, so an upgrade does not re-offer everything."""
    rows = conn.execute("SELECT key, value FROM meta WHERE key LIKE ?", (f"cursor:{path}:%",)).fetchall()
    if not rows:
        return
    # db.transaction rolls back only an open transaction: after a COMMIT (or a statement) that
    # SQLite already rolled back, a ROLLBACK would replace the real error (a full disk).
    with transaction(conn):
        for key, value in rows:
            peer = key.rsplit(":", 1)[1]
            if len(peer) == 32:
                advance_cursor(conn, bytes.fromhex(peer), path, int(value))
            conn.execute("DELETE FROM meta WHERE key=?", (key,))
