"""Durable delivery state (SQLite): per-(peer, path) cursors and backfill ranges, per-(sender,
path) stream positions, the peers' reported watermarks, the local policy store (never
replicated) and the control records this node holds. The node's own applied watermarks live
in the store's `watermarks` table (agent/store/db.py). All of it is created on first use, so
homes made before these tables existed gain them without a migration step."""
from __future__ import annotations

import json
import sqlite3
from typing import Iterable

from ..core.records import Record, Trust, resolve_trust
from ..core.scope import WILDCARD, PolicyRow
from ..core.schema import SYNCABLE
from .db import transaction

_DDL = """
CREATE TABLE IF NOT EXISTS sync_cursors (
  peer BLOB NOT NULL, path TEXT NOT NULL, live INTEGER NOT NULL DEFAULT 0,
  bf_next INTEGER NOT NULL DEFAULT 0, bf_end INTEGER NOT NULL DEFAULT 0,
  PRIMARY KEY (peer, path)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS sync_streams (
  sender BLOB NOT NULL, path TEXT NOT NULL, completed INTEGER NOT NULL,
  PRIMARY KEY (sender, path)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS sync_stream_gaps (
  sender BLOB NOT NULL, qualified TEXT NOT NULL, PRIMARY KEY (sender, qualified)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS peer_watermarks (
  peer BLOB NOT NULL, site_id BLOB NOT NULL, qualified TEXT NOT NULL,
  hlc_p INTEGER NOT NULL, hlc_l INTEGER NOT NULL, PRIMARY KEY (peer, site_id, qualified)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS policy_rows (
  peer TEXT NOT NULL, schema_name TEXT NOT NULL, table_name TEXT NOT NULL, layer TEXT NOT NULL,
  role TEXT NOT NULL DEFAULT '', effect TEXT NOT NULL,
  PRIMARY KEY (peer, schema_name, table_name, layer, role)) WITHOUT ROWID;
-- Widening backfill (scope §2): one durable job per (peer, table), walking rows in row_key order
-- from resume_after_row_key (NULL: genesis). Rehydration requests seen from peers, per subject.
CREATE TABLE IF NOT EXISTS backfill_jobs (
  peer BLOB NOT NULL, qualified TEXT NOT NULL, resume_after_row_key BLOB,
  rows_sent INTEGER NOT NULL DEFAULT 0, events_sent INTEGER NOT NULL DEFAULT 0,
  created_ms INTEGER NOT NULL DEFAULT 0, PRIMARY KEY (peer, qualified)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rehydrate_records (
  record_hash BLOB PRIMARY KEY, subject BLOB NOT NULL, generation INTEGER NOT NULL,
  previous BLOB, requested_at INTEGER NOT NULL, raw BLOB NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rehydrate_served (
  subject BLOB PRIMARY KEY, generation INTEGER NOT NULL, upto_seq INTEGER NOT NULL,
  reset_ms INTEGER NOT NULL) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS control_records (
  record_hash BLOB PRIMARY KEY, kind TEXT NOT NULL, issuer BLOB NOT NULL, subject BLOB NOT NULL,
  generation INTEGER NOT NULL, previous BLOB, value TEXT NOT NULL, raw BLOB NOT NULL) WITHOUT ROWID;
-- Control records (any kind) this node knows a peer holds on a path: answered for, written to a
-- mailbox file, or received from that peer. Bodies carry only the others (docs/protocol.md §5).
-- Sender side: events a peer rejected on a path (skew, held limit). The
-- cursor moves past them so one event cannot pin the stream behind it, and each is re-offered
-- until the peer takes it (§13.6: rejecting leaves the event in the set the sender re-offers).
CREATE TABLE IF NOT EXISTS reoffer (
  peer BLOB NOT NULL, path TEXT NOT NULL, seq INTEGER NOT NULL, site_id BLOB NOT NULL,
  attempts INTEGER NOT NULL, due_ms INTEGER NOT NULL, PRIMARY KEY (peer, path, seq)) WITHOUT ROWID;
-- Past REOFFER_PER_SIGNER entries of one signer, a rescan marker instead: that signer's events
-- from from_seq up to the cursor are walked again (re-offered) when due, so overflow is
-- re-offered later, never lost, and costs one row.
CREATE TABLE IF NOT EXISTS reoffer_rescan (
  peer BLOB NOT NULL, path TEXT NOT NULL, site_id BLOB NOT NULL, from_seq INTEGER NOT NULL,
  attempts INTEGER NOT NULL, due_ms INTEGER NOT NULL, PRIMARY KEY (peer, path, site_id)) WITHOUT ROWID;
-- Receiver side: events this node rejected (not retained, §13.6), remembered only so that no
-- watermark is inferred across them until they apply (§14.2), bounded per signer.
CREATE TABLE IF NOT EXISTS rejected_pins (
  site_id BLOB NOT NULL, qualified TEXT NOT NULL, hlc_p INTEGER NOT NULL, hlc_l INTEGER NOT NULL,
  event_id BLOB NOT NULL, PRIMARY KEY (site_id, event_id)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS records_delivered (
  peer BLOB NOT NULL, path TEXT NOT NULL, record_hash BLOB NOT NULL,
  PRIMARY KEY (peer, path, record_hash)) WITHOUT ROWID;
-- Bodies sent and not yet answered, per path, by the key the answer names (MQTT: correlation
-- data, or for a mailbox file its BLAKE3), with the selection token the answer confirms. Durable, so an
-- answer taken by a later process (a device that woke again) still moves the cursor (§14.1).
CREATE TABLE IF NOT EXISTS sent_bodies (
  id INTEGER PRIMARY KEY AUTOINCREMENT, path TEXT NOT NULL, sent_key BLOB NOT NULL, peer BLOB NOT NULL,
  kind TEXT NOT NULL, token TEXT NOT NULL, sent_ms INTEGER NOT NULL, UNIQUE (path, sent_key));
-- The mailbox path's answers (agent/mailbox.py, docs/protocol.md §6). Owed: the files imported
-- from a peer (BLAKE3 of the file, events processed before the first rejected one), newest kept.
-- Acks: the answer records this node signed (held, so the signing journal can drop them).
CREATE TABLE IF NOT EXISTS mailbox_owed (
  peer BLOB NOT NULL, body_hash BLOB NOT NULL, processed INTEGER NOT NULL, received_ms INTEGER NOT NULL,
  PRIMARY KEY (peer, body_hash)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS mailbox_acks (
  record_hash BLOB PRIMARY KEY, peer BLOB NOT NULL, answers TEXT NOT NULL, issued_ms INTEGER NOT NULL,
  raw BLOB NOT NULL) WITHOUT ROWID;
-- Relay: other nodes' answer records addressed to a third node (a ring of files), the newest per
-- (subject, issuer), carried in every file to their subject.
CREATE TABLE IF NOT EXISTS mailbox_relay (
  subject BLOB NOT NULL, issuer BLOB NOT NULL, issued_at INTEGER NOT NULL, raw BLOB NOT NULL,
  PRIMARY KEY (subject, issuer)) WITHOUT ROWID;
"""


def has_schema(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM sqlite_master WHERE name='control_records'").fetchone() is not None


_LATER_TABLES = ('rehydrate_served', 'records_delivered', 'sent_bodies', 'mailbox_owed', 'mailbox_acks', 'mailbox_relay',
                 'reoffer', 'reoffer_rescan', 'rejected_pins')


def _has_lifecycle_tables(conn: sqlite3.Connection) -> bool:
    return conn.execute(f"SELECT count(*) FROM sqlite_master WHERE name IN {_LATER_TABLES}"
                        ).fetchone()[0] == len(_LATER_TABLES)


def ensure_schema(conn: sqlite3.Connection) -> None:
    """Create the tables (idempotent) and, once per home, the default policy rows: a `system`
    layer allow for every peer and every schema holding a syncable table (`peer * SCHEMA.*`), so a
    fresh mesh syncs. Operators narrow it with higher layers (docs/protocol.md)."""
    if has_schema(conn) and _has_lifecycle_tables(conn) and \
            conn.execute("SELECT 1 FROM meta WHERE key='policy_defaults'").fetchone():
        return
    with transaction(conn):   # rolls back only an open transaction: a full disk's error survives
        create_schema(conn)


def create_schema(conn: sqlite3.Connection, *, policy_defaults: bool = True) -> None:
    """The tables and the default policy rows, inside the caller's transaction (ensure_schema,
    and the store migration that introduced them: agent/store/migrations.py). The defaults are
    computed from the tables the store holds, so a store being created (no tables yet) leaves
    them to the first ensure_schema after `init` has made its tables."""
    for stmt in _DDL.strip().split(";"):
        if stmt.strip():
            conn.execute(stmt)
    if policy_defaults and conn.execute("SELECT 1 FROM meta WHERE key='policy_defaults'").fetchone() is None:
        schemas = sorted({s for s, c in conn.execute("SELECT schema_name, category FROM tables") if c == SYNCABLE})
        for s in schemas:
            conn.execute("INSERT OR IGNORE INTO policy_rows VALUES ('*', ?, '*', 'system', '', 'allow')", (s,))
        conn.execute("INSERT OR REPLACE INTO meta VALUES ('policy_defaults', ?)", (json.dumps(schemas),))


# Truncation records (the serving side of rehydration, agent/rehydrate.py, docs/protocol.md §8).
TRUNCATION_DDL = ("CREATE TABLE IF NOT EXISTS truncation_records ("
                  " record_hash BLOB PRIMARY KEY, issuer BLOB NOT NULL, subject BLOB NOT NULL, qualified TEXT NOT NULL,"
                  " horizon_p INTEGER NOT NULL, horizon_l INTEGER NOT NULL, n_rows INTEGER NOT NULL,"
                  " issued_at INTEGER NOT NULL, raw BLOB NOT NULL) WITHOUT ROWID")


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


# ---------------------------------------------------------------- mailbox answers (agent/mailbox.py)
MAILBOX_ANSWERS_KEPT = 16  # answers owed per peer (an ack carries at most 16)
MAILBOX_ACKS_KEPT = 4  # signed answer records kept per peer (the newest is re-used while nothing changed)
MAILBOX_RELAY_PER_ISSUER = 64  # other nodes' answer records relayed: subjects kept per issuer


def owe_mailbox_answer(conn: sqlite3.Connection, peer: bytes, h: bytes, processed: int, now_ms: int) -> None:
    """This node imported file `h` from `peer` and processed its first `processed` events to a
    final state. A file imported again keeps the larger count; the newest files are kept."""
    r = conn.execute("SELECT processed FROM mailbox_owed WHERE peer=? AND body_hash=?", (peer, h)).fetchone()
    conn.execute("INSERT OR REPLACE INTO mailbox_owed VALUES (?,?,?,?)",
                 (peer, h, processed if r is None else max(r[0], processed), now_ms))
    conn.execute("DELETE FROM mailbox_owed WHERE peer=? AND body_hash NOT IN (SELECT body_hash FROM mailbox_owed "
                 "WHERE peer=? ORDER BY received_ms DESC, body_hash LIMIT ?)", (peer, peer, MAILBOX_ANSWERS_KEPT))


def owed_mailbox_answers(conn: sqlite3.Connection, peer: bytes) -> list[tuple[bytes, int]]:
    """(file hash, processed), oldest first."""
    return [(bytes(h), k) for h, k in conn.execute(
        "SELECT body_hash, processed FROM mailbox_owed WHERE peer=? ORDER BY received_ms, body_hash", (peer,))]


def _answers_json(answers: list[tuple[bytes, int]]) -> str:
    return json.dumps([[h.hex(), k] for h, k in answers])


def mailbox_ack_saying(conn: sqlite3.Connection, peer: bytes, answers: list[tuple[bytes, int]]) -> bytes | None:
    """A held answer record to `peer` that says exactly `answers` (re-used: no new signature)."""
    r = conn.execute("SELECT raw FROM mailbox_acks WHERE peer=? AND answers=? ORDER BY issued_ms DESC LIMIT 1",
                     (peer, _answers_json(answers))).fetchone()
    return None if r is None else bytes(r[0])


def put_mailbox_ack(conn: sqlite3.Connection, h: bytes, peer: bytes, answers: list[tuple[bytes, int]], raw: bytes,
                    issued_ms: int, prune: bool = True) -> None:
    """Keep an answer record this node signed. `prune`: drop the oldest beyond MAILBOX_ACKS_KEPT
    (off when recovery stores released ones: each must be held until the journal has dropped it,
    or the next open would store it again, docs/keystore.md)."""
    conn.execute("INSERT OR IGNORE INTO mailbox_acks VALUES (?,?,?,?,?)", (h, peer, _answers_json(answers), issued_ms,
                                                                             raw))
    if prune:
        conn.execute("DELETE FROM mailbox_acks WHERE peer=? AND record_hash NOT IN (SELECT record_hash FROM "
                     "mailbox_acks WHERE peer=? ORDER BY issued_ms DESC, record_hash LIMIT ?)",
                     (peer, peer, MAILBOX_ACKS_KEPT))


def relay_mailbox_ack(conn: sqlite3.Connection, subject: bytes, issuer: bytes, issued_at: int, raw: bytes) -> bool:
    """Keep `issuer`'s answer record to `subject` for the files to `subject`, if it is newer than
    the one held (an answer names the issuer's newest files from the subject)."""
    r = conn.execute("SELECT issued_at FROM mailbox_relay WHERE subject=? AND issuer=?", (subject, issuer)).fetchone()
    if r is not None and r[0] >= issued_at:
        return False
    conn.execute("INSERT OR REPLACE INTO mailbox_relay VALUES (?,?,?,?)", (subject, issuer, issued_at, raw))
    # Bounded per issuer: a signer naming fictional subjects cannot grow the store (or every file).
    conn.execute("DELETE FROM mailbox_relay WHERE issuer=? AND subject NOT IN (SELECT subject FROM mailbox_relay "
                 "WHERE issuer=? ORDER BY issued_at DESC, subject LIMIT ?)", (issuer, issuer, MAILBOX_RELAY_PER_ISSUER))
    return True


def relayed_mailbox_acks(conn: sqlite3.Connection, peer: bytes) -> list[bytes]:
    """The relayed answer records a file to `peer` carries: those addressed to `peer` first, then
    the others (they go on round the ring), never `peer`'s own."""
    return [bytes(r) for (r,) in conn.execute(
        "SELECT raw FROM mailbox_relay WHERE issuer != ? ORDER BY subject != ?, subject, issuer", (peer, peer))]


def mailbox_owed_peers(conn: sqlite3.Connection) -> list[bytes]:
    return [bytes(p) for (p,) in conn.execute("SELECT DISTINCT peer FROM mailbox_owed ORDER BY peer")]


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


# ---------------------------------------------------------------- streams (receiver side)
def stream_completed(conn: sqlite3.Connection, sender: bytes, path: str) -> int:
    r = conn.execute("SELECT completed FROM sync_streams WHERE sender=? AND path=?", (sender, path)).fetchone()
    return 0 if r is None else r[0]


def set_stream_completed(conn: sqlite3.Connection, sender: bytes, path: str, completed: int) -> None:
    conn.execute("INSERT OR REPLACE INTO sync_streams VALUES (?,?,?)", (sender, path, completed))


def stream_gaps(conn: sqlite3.Connection, sender: bytes) -> set[str]:
    return {q for (q,) in conn.execute("SELECT qualified FROM sync_stream_gaps WHERE sender=?", (sender,))}


def add_stream_gaps(conn: sqlite3.Connection, sender: bytes, tables: Iterable[str]) -> None:
    conn.executemany("INSERT OR IGNORE INTO sync_stream_gaps VALUES (?,?)", [(sender, t) for t in tables])


# ---------------------------------------------------------------- watermarks
def own_watermarks(conn: sqlite3.Connection) -> dict[tuple[bytes, str], tuple[int, int]]:
    return {(bytes(s), q): (p, l) for s, q, p, l in conn.execute("SELECT site_id, qualified, hlc_p, hlc_l FROM watermarks")}


def raise_watermarks(conn: sqlite3.Connection, updates: dict[tuple[bytes, str], tuple[int, int]]) -> None:
    for (s, q), (p, l) in updates.items():
        r = conn.execute("SELECT hlc_p, hlc_l FROM watermarks WHERE site_id=? AND qualified=?", (s, q)).fetchone()
        if r is None or (p, l) > (r[0], r[1]):  # monotonic (§14.2)
            conn.execute("INSERT OR REPLACE INTO watermarks VALUES (?,?,?,?)", (s, q, p, l))


def held_min(conn: sqlite3.Connection, site: bytes) -> dict[tuple[bytes, str], tuple[int, int]]:
    """Per group of `site`, the lowest HLC of an event this node holds or rejected and has not
    applied: no watermark may be inferred at or above it (§14.2)."""
    out: dict[tuple[bytes, str], tuple[int, int]] = {}
    for q, p, l in conn.execute("SELECT qualified, hlc_p, hlc_l FROM held WHERE site_id=? UNION ALL "
                                "SELECT qualified, hlc_p, hlc_l FROM rejected_pins WHERE site_id=?", (site, site)):
        if (site, q) not in out or (p, l) < out[(site, q)]:
            out[(site, q)] = (p, l)
    return out


PINS_PER_SIGNER = 10_000  # rejected-event pins kept per signer (docs/apply.md)


def pin_rejected(conn: sqlite3.Connection, pins: list[tuple[bytes, str, tuple[int, int], bytes]]) -> int:
    """Remember rejected events (site, table, hlc, event_id) so no watermark passes them. Past
    PINS_PER_SIGNER a signer's group is gapped for good instead (inference stops; nothing is
    claimed), so a flood costs the flooder's own watermarks and a bounded number of rows.
    Returns how many groups were gapped."""
    gapped = 0
    room: dict[bytes, int] = {}
    for site, q, hlc, eid in pins:
        if site not in room:
            room[site] = PINS_PER_SIGNER - conn.execute("SELECT count(*) FROM rejected_pins WHERE site_id=?",
                                                        (site,)).fetchone()[0]
        if room[site] <= 0:
            add_stream_gaps(conn, site, [q])
            gapped += 1
            continue
        room[site] -= conn.execute("INSERT OR IGNORE INTO rejected_pins VALUES (?,?,?,?,?)",
                                   (site, q, hlc[0], hlc[1], eid)).rowcount
    return gapped


def any_pins(conn: sqlite3.Connection) -> bool:
    return conn.execute("SELECT 1 FROM rejected_pins LIMIT 1").fetchone() is not None


def unpin(conn: sqlite3.Connection, events: Iterable[tuple[bytes, bytes]]) -> None:
    """Forget pins of events (site_id, event_id) that reached a final state here."""
    conn.executemany("DELETE FROM rejected_pins WHERE site_id=? AND event_id=?", list(events))


# ---------------------------------------------------------------- re-offers (sender side)
REOFFER_PER_SIGNER = 2_000  # entries per (peer, path, signer); past it, one rescan marker


def _backoff(now_ms: int, attempts: int) -> int:
    """The next try waits 2^attempts s (at most 10 min): an event that keeps being rejected
    costs the link a bounded share."""
    return now_ms + min(600_000, 1000 * 2 ** min(attempts, 10))


def reoffer_due(conn: sqlite3.Connection, peer: bytes, path: str, now_ms: int, limit: int, cursor: int
                ) -> tuple[list[tuple[int, bytes, str, bytes]], list[tuple[bytes, int]]]:
    """Re-offers due now: (seq, site_id, table, raw) of stored entries, least recently tried
    first, then of due rescans (that signer's events from its marker up to `cursor`), at most
    `limit` in all; and the rescans taken as (site_id, last seq taken or -1 when none is left).
    Entries whose event left the log (evicted) are dropped: the peer counts them applied below
    its horizon anyway."""
    rows = conn.execute("SELECT r.seq, e.site_id, e.qualified, unseal(e.event_id, e.raw) FROM reoffer r LEFT JOIN events e ON e.seq = r.seq"
                        " WHERE r.peer=? AND r.path=? AND r.due_ms <= ? ORDER BY r.due_ms, r.seq LIMIT ?",
                        (peer, path, now_ms, limit)).fetchall()
    gone = [(peer, path, seq) for seq, sid, _q, _raw in rows if sid is None]
    if gone:
        conn.executemany("DELETE FROM reoffer WHERE peer=? AND path=? AND seq=?", gone)
    out = [(seq, bytes(sid), q, bytes(raw)) for seq, sid, q, raw in rows if sid is not None]
    scans: list[tuple[bytes, int]] = []
    for site, from_seq in conn.execute("SELECT site_id, from_seq FROM reoffer_rescan WHERE peer=? AND path=? "
                                       "AND due_ms <= ? ORDER BY due_ms", (peer, path, now_ms)).fetchall():
        room = limit - len(out)
        if room <= 0:
            break
        got = conn.execute("SELECT seq, site_id, qualified, unseal(event_id, raw) FROM events WHERE site_id=? AND seq >= ? AND seq <= ?"
                           " ORDER BY seq LIMIT ?", (site, from_seq, cursor, room)).fetchall()
        out += [(q, bytes(sid), t, bytes(raw)) for q, sid, t, raw in got]
        scans.append((bytes(site), got[-1][0] if len(got) == room else -1))
    return out, scans


def reoffer_count(conn: sqlite3.Connection, peer: bytes, path: str) -> int:
    """Stored entries plus rescan markers for `peer` on `path`."""
    return conn.execute("SELECT (SELECT count(*) FROM reoffer WHERE peer=?1 AND path=?2) + "
                        "(SELECT count(*) FROM reoffer_rescan WHERE peer=?1 AND path=?2)", (peer, path)).fetchone()[0]


def reoffer_put(conn: sqlite3.Connection, peer: bytes, path: str, seqs: Iterable[int], now_ms: int) -> None:
    """Add or re-schedule rejected events (attempts grow, `_backoff`). A signer past
    REOFFER_PER_SIGNER entries gets a rescan marker at its lowest such seq instead."""
    for seq in seqs:
        r = conn.execute("SELECT attempts FROM reoffer WHERE peer=? AND path=? AND seq=?", (peer, path, seq)).fetchone()
        if r is not None:
            conn.execute("UPDATE reoffer SET attempts=?, due_ms=? WHERE peer=? AND path=? AND seq=?",
                         (r[0] + 1, _backoff(now_ms, r[0] + 1), peer, path, seq))
            continue
        site = conn.execute("SELECT site_id FROM events WHERE seq=?", (seq,)).fetchone()
        if site is None:
            continue
        site = bytes(site[0])
        n = conn.execute("SELECT count(*) FROM reoffer WHERE peer=? AND path=? AND site_id=?", (peer, path, site)).fetchone()[0]
        if n < REOFFER_PER_SIGNER:
            conn.execute("INSERT INTO reoffer VALUES (?,?,?,?,?,?)", (peer, path, seq, site, 1, _backoff(now_ms, 1)))
            continue
        m = conn.execute("SELECT from_seq, attempts FROM reoffer_rescan WHERE peer=? AND path=? AND site_id=?",
                         (peer, path, site)).fetchone()
        attempts = 1 if m is None else m[1] + 1
        conn.execute("INSERT OR REPLACE INTO reoffer_rescan VALUES (?,?,?,?,?,?)",
                     (peer, path, site, seq if m is None else min(m[0], seq), attempts, _backoff(now_ms, attempts)))


def rescan_done(conn: sqlite3.Connection, peer: bytes, path: str, site: bytes, upto: int, now_ms: int) -> None:
    """The peer answered a body carrying a rescan of `site` up to seq `upto` (-1: the walk reached
    the cursor): move the marker past it (its rejections were put back first, lowering it)."""
    m = conn.execute("SELECT from_seq, attempts FROM reoffer_rescan WHERE peer=? AND path=? AND site_id=?",
                     (peer, path, site)).fetchone()
    if m is None:
        return
    if upto < 0:
        conn.execute("DELETE FROM reoffer_rescan WHERE peer=? AND path=? AND site_id=?", (peer, path, site))
    else:
        conn.execute("UPDATE reoffer_rescan SET from_seq=max(from_seq, ?), due_ms=? WHERE peer=? AND path=? AND site_id=?",
                     (upto + 1, now_ms, peer, path, site))


def reoffer_done(conn: sqlite3.Connection, peer: bytes, path: str, seqs: Iterable[int]) -> None:
    conn.executemany("DELETE FROM reoffer WHERE peer=? AND path=? AND seq=?", [(peer, path, s) for s in seqs])


def peer_watermarks(conn: sqlite3.Connection, peer: bytes) -> dict[tuple[bytes, str], tuple[int, int]]:
    return {(bytes(s), q): (p, l) for s, q, p, l in
            conn.execute("SELECT site_id, qualified, hlc_p, hlc_l FROM peer_watermarks WHERE peer=?", (peer,))}


def acked_by_any(conn: sqlite3.Connection, site: bytes, table: str) -> tuple[int, int] | None:
    """The highest watermark any peer reported for `site`'s events on `table` (None: none did)."""
    if not has_schema(conn):
        return None
    r = conn.execute("SELECT hlc_p, hlc_l FROM peer_watermarks WHERE site_id=? AND qualified=? "
                     "ORDER BY hlc_p DESC, hlc_l DESC LIMIT 1", (site, table)).fetchone()
    return None if r is None else (r[0], r[1])


def peer_time_evidence(conn: sqlite3.Connection, site: bytes, others: Iterable[bytes],
                       tables: Iterable[str]) -> int | None:
    """The latest physical time the mesh vouches for: the newest HLC this node holds or applied
    from another site (`others`), or of its own that a peer acknowledged (a peer accepted it
    within its skew bound, §12 step 2). None when there is none."""
    found = [conn.execute("SELECT max(hlc_p) FROM watermarks WHERE site_id != ?", (site,)).fetchone()[0]]
    found += [conn.execute("SELECT max(hlc_p) FROM events WHERE site_id = ? AND qualified = ?", (s, q)).fetchone()[0]
              for s in others if s != site for q in tables]   # one index probe each (events_group)
    if has_schema(conn):
        found.append(conn.execute("SELECT max(hlc_p) FROM peer_watermarks WHERE site_id = ?", (site,)).fetchone()[0])
    return max((f for f in found if f is not None), default=None)


def set_peer_watermarks(conn: sqlite3.Connection, peer: bytes, wms: Iterable[tuple[bytes, str, tuple[int, int]]]) -> None:
    """The peer's latest report replaces the previous one (a peer restored from a backup reports
    less, and must be offered again what it lost)."""
    conn.execute("DELETE FROM peer_watermarks WHERE peer=?", (peer,))
    conn.executemany("INSERT OR REPLACE INTO peer_watermarks VALUES (?,?,?,?,?)",
                     [(peer, s, q, h[0], h[1]) for s, q, h in wms])


# ---------------------------------------------------------------- policy
def policy_rows(conn: sqlite3.Connection) -> list[PolicyRow]:
    return [PolicyRow(p, s, t, la, e, r) for p, s, t, la, r, e in
            conn.execute("SELECT peer, schema_name, table_name, layer, role, effect FROM policy_rows")]


def put_policy_row(conn: sqlite3.Connection, row: PolicyRow) -> None:
    conn.execute("INSERT OR REPLACE INTO policy_rows VALUES (?,?,?,?,?,?)",
                 (row.peer, row.schema, row.table, row.layer, row.role, row.effect))


def delete_policy_row(conn: sqlite3.Connection, row: PolicyRow) -> int:
    return conn.execute("DELETE FROM policy_rows WHERE peer=? AND schema_name=? AND table_name=? AND layer=? AND role=?",
                        (row.peer, row.schema, row.table, row.layer, row.role)).rowcount


# ---------------------------------------------------------------- control records
def _value_json(r: Record) -> str:
    if r.kind == "role":
        return json.dumps(r.value)
    if r.kind == "vouch":
        return json.dumps(r.value.hex())
    (p, l), succ = r.value
    return json.dumps([[p, l], succ.hex() if succ else None])


def _value_from(kind: str, text: str):
    v = json.loads(text)
    if kind == "role":
        return v
    if kind == "vouch":
        return bytes.fromhex(v)
    return ((v[0][0], v[0][1]), bytes.fromhex(v[1]) if v[1] else None)


# ---------------------------------------------------------------- the bound on stored records
# Control records (vouch, retire, role), rehydrate requests and truncation records are stored
# without expiry, and a chain head in force (the vouch admitting a signer, a retirement, a role)
# must never be evicted, nor the chain below it that peers need to resolve it (records_ordered).
# No eviction rule is safe for all of them, so the bound refuses instead (docs/apply.md "Bounds"):
# once the records held from other issuers reach `records_limit` records or `records_limit_bytes`
# raw bytes (meta; set from the profile at init), a new one from another issuer is not stored,
# the refusal is surfaced (`record_refused`, reason `record_limit`) and counted (meta
# `records_refused`). Records this node issued itself are always stored (their bytes already
# left through the signing journal). A dropped record stores only its surfaced row, which the
# surfaced bound (agent/store/db.py) covers.
RECORDS_LIMIT = 10_000
RECORDS_LIMIT_BYTES = 16 * 2**20
_RECORD_TABLES = (("control_records", "issuer"), ("rehydrate_records", "subject"), ("truncation_records", "issuer"),
                  ("sequencing_records", "issuer"))


def record_usage(conn: sqlite3.Connection, self_site: bytes) -> tuple[int, int]:
    """(records, raw bytes) held from issuers other than this node, over every record table."""
    have = {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    n = size = 0
    for table, issuer in _RECORD_TABLES:
        if table in have:
            c, b = conn.execute(f"SELECT count(*), coalesce(sum(length(raw)), 0) FROM {table} WHERE {issuer} != ?",
                                (self_site,)).fetchone()
            n, size = n + c, size + b
    return n, size


class RecordBudget:
    """Room for records from other issuers, read once from the store per batch of records (the
    caller's transaction) and counted down as it admits them."""

    def __init__(self, conn: sqlite3.Connection, self_site: bytes) -> None:
        self.conn, self.self_site = conn, self_site
        self.count, self.bytes = record_usage(conn, self_site)
        self.limit = int(conn.execute("SELECT coalesce((SELECT value FROM meta WHERE key='records_limit'), ?)",
                                      (RECORDS_LIMIT,)).fetchone()[0])
        self.limit_bytes = int(conn.execute(
            "SELECT coalesce((SELECT value FROM meta WHERE key='records_limit_bytes'), ?)",
            (RECORDS_LIMIT_BYTES,)).fetchone()[0])

    def admit(self, issuer: bytes, raw: bytes, record_type: str, record_hash: bytes, now: int) -> bool:
        """True: store it (and it is counted). False: refused over the bound, surfaced and counted."""
        if issuer == self.self_site:
            return True
        if self.count < self.limit and self.bytes + len(raw) <= self.limit_bytes:
            self.count += 1
            self.bytes += len(raw)
            return True
        self.conn.execute("INSERT INTO meta (key, value) VALUES ('records_refused', 1)"
                          " ON CONFLICT (key) DO UPDATE SET value = value + 1")
        self.conn.execute("INSERT INTO surfaced (at_ms, kind, reason, site_id, detail) VALUES (?,?,?,?,?)",
                          (now, "record_refused", "record_limit", issuer, json.dumps(
                              {"type": record_type, "record_hash": record_hash.hex(), "bytes": len(raw),
                               "held": self.count, "held_bytes": self.bytes, "limit": self.limit,
                               "limit_bytes": self.limit_bytes}, sort_keys=True)))
        return False


def record_bounds(conn: sqlite3.Connection, self_site: bytes) -> dict:
    """What `status` shows of the record bound."""
    n, size = record_usage(conn, self_site)
    meta = dict(conn.execute("SELECT key, value FROM meta WHERE key IN "
                             "('records_limit', 'records_limit_bytes', 'records_refused')").fetchall())
    return {"held": n, "held_bytes": size, "limit": int(meta.get("records_limit", RECORDS_LIMIT)),
            "limit_bytes": int(meta.get("records_limit_bytes", RECORDS_LIMIT_BYTES)),
            "refused": int(meta.get("records_refused", 0))}


def has_record(conn: sqlite3.Connection, h: bytes) -> bool:
    return conn.execute("SELECT 1 FROM control_records WHERE record_hash=?", (h,)).fetchone() is not None


def put_record(conn: sqlite3.Connection, r: Record) -> bool:
    cur = conn.execute("INSERT OR IGNORE INTO control_records VALUES (?,?,?,?,?,?,?,?)",
                       (r.record_hash, r.kind, r.issuer, r.subject, r.generation, r.previous, _value_json(r), r.raw))
    return cur.rowcount == 1


def records(conn: sqlite3.Connection) -> list[Record]:
    if not has_schema(conn):
        return []
    return [Record(bytes(h), bytes(raw), k, bytes(i), bytes(s), g, bytes(p) if p is not None else None, _value_from(k, v))
            for h, k, i, s, g, p, v, raw in conn.execute(
                "SELECT record_hash, kind, issuer, subject, generation, previous, value, raw FROM control_records"
                " ORDER BY record_hash")]


def record_raws(conn: sqlite3.Connection) -> list[bytes]:
    if not has_schema(conn):
        return []
    return [bytes(r[0]) for r in conn.execute("SELECT raw FROM control_records ORDER BY record_hash")]


def records_ordered(conn: sqlite3.Connection) -> list[tuple[bytes, bytes]]:
    """(record_hash, raw) of the authority records in the order bodies carry them: retire, then
    vouch, then role, each chain from its genesis. Retirements first: a retire may void what an
    authority issued, so a receiver that gets it before a successor's re-issued genesis never sees
    the two geneses as a fork (authority records are verified with provisioned keys only, so
    nothing here depends on a vouch)."""
    if not has_schema(conn):
        return []
    return [(bytes(h), bytes(raw)) for h, raw in conn.execute(
        "SELECT record_hash, raw FROM control_records ORDER BY CASE kind WHEN 'retire' THEN 0 WHEN 'vouch' THEN 1 "
        "ELSE 2 END, subject, generation, record_hash")]


def delivered_records(conn: sqlite3.Connection, peer: bytes, path: str) -> set[bytes]:
    """Hashes of the records `peer` is known to hold on `path`."""
    return {bytes(h) for (h,) in conn.execute("SELECT record_hash FROM records_delivered WHERE peer=? AND path=?",
                                               (peer, path))}


def mark_records_delivered(conn: sqlite3.Connection, peer: bytes, path: str, hashes: Iterable[bytes]) -> None:
    conn.executemany("INSERT OR IGNORE INTO records_delivered VALUES (?,?,?)",
                     [(peer, path, bytes(h)) for h in hashes])


def clear_all_records_delivered(conn: sqlite3.Connection) -> None:
    """Every peer, every path: a newly stored record may unlock what a peer dropped."""
    conn.execute("DELETE FROM records_delivered")


def clear_records_delivered(conn: sqlite3.Connection, peer: bytes) -> None:
    """Every path: the peer may have lost what it held (a verified rehydrate request)."""
    conn.execute("DELETE FROM records_delivered WHERE peer=?", (peer,))


def provisioned_keyring(conn: sqlite3.Connection) -> dict:
    """The keyring the node was given (manifest, `peer add`, `authority add`), without records."""
    return {bytes(sid): (bytes(pk), None if rp is None else (rp, rl))
            for sid, pk, rp, rl in conn.execute("SELECT site_id, public_key, retired_p, retired_l FROM keyring")}


def put_keyring(conn: sqlite3.Connection, site: bytes, public_key: bytes, retired_after: tuple[int, int] | None,
                source: str, *, replace: bool = True) -> None:
    """A provisioned keyring entry (`source`: self, manifest, operator, authority...); with
    `replace` False an existing entry for the site is an error (the node's own key at init)."""
    verb = "INSERT OR REPLACE" if replace else "INSERT"
    conn.execute(f"{verb} INTO keyring VALUES (?,?,?,?,?)",
                 (site, public_key, retired_after[0] if retired_after else None,
                  retired_after[1] if retired_after else None, source))


def keyring_source(conn: sqlite3.Connection, site: bytes) -> str | None:
    """Where `site`'s provisioned keyring entry came from, or None (none: vouched by a record, or unknown)."""
    r = conn.execute("SELECT source FROM keyring WHERE site_id=?", (site,)).fetchone()
    return None if r is None else r[0]


def drop_keyring(conn: sqlite3.Connection, site: bytes) -> None:
    conn.execute("DELETE FROM keyring WHERE site_id=?", (site,))


def keyring_sources(conn: sqlite3.Connection) -> dict[bytes, str]:
    return {bytes(s): src for s, src in conn.execute("SELECT site_id, source FROM keyring")}


_SIGNED_RECORD_TABLES = ("control_records", "rehydrate_records", "truncation_records", "mailbox_acks",
                         "sequencing_records")


def holds_signed_record(conn: sqlite3.Connection, h: bytes) -> bool:
    """A control record with this hash is in one of the store's record tables (those that exist)."""
    marks = ",".join("?" for _ in _SIGNED_RECORD_TABLES)
    tables = [t for (t,) in conn.execute(f"SELECT name FROM sqlite_master WHERE name IN ({marks})",
                                         _SIGNED_RECORD_TABLES).fetchall()]
    return any(conn.execute(f"SELECT 1 FROM {t} WHERE record_hash=?", (h,)).fetchone() for t in tables)


def authorities(conn: sqlite3.Connection) -> set[bytes]:
    r = conn.execute("SELECT value FROM meta WHERE key='authorities'").fetchone()
    return {bytes.fromhex(a) for a in json.loads(r[0] if r else "[]")}


def trust(conn: sqlite3.Connection, self_site: bytes | None = None) -> Trust:
    """The effective trust (core/records.resolve_trust) from the provisioned keyring, the
    authority list and every control record held."""
    if self_site is None:
        r = conn.execute("SELECT value FROM meta WHERE key='site_id'").fetchone()
        self_site = bytes(r[0]) if r else b""
    return resolve_trust(records(conn), provisioned_keyring(conn), authorities(conn), self_site)


def overlay_keyring(conn: sqlite3.Connection, keyring: dict, self_site: bytes) -> dict:
    """Replace the in-memory keyring the apply path reads with the effective one: provisioned keys
    and cutoffs, vouched keys, and cutoffs lowered by retire records (resolve_trust). Returns the
    chains, for callers that surface forks."""
    t = trust(conn, self_site)
    keyring.clear()
    keyring.update(t.keyring)
    return t.chains


def current_roles(conn: sqlite3.Connection) -> dict[bytes, object]:
    """subject -> role (str) or scope.FORKED, from the role records that count (a retired
    authority's do not)."""
    from ..core.scope import FORKED
    out: dict[bytes, object] = {}
    for (kind, subject), ch in trust(conn).chains.items():
        if kind != "role":
            continue
        if ch.forked:
            out[subject] = FORKED
        elif ch.head is not None:
            out[subject] = ch.head.value
    return out


# ---------------------------------------------------------------- rehydration (agent/rehydrate.py)
def rehydrate_upto(conn: sqlite3.Connection, subject: bytes) -> int:
    """While serving a rehydration of `subject`: the last log seq at the reset (0: not serving)."""
    r = conn.execute("SELECT upto_seq FROM rehydrate_served WHERE subject=?", (subject,)).fetchone()
    return 0 if r is None else r[0]


def rehydrate_generation(conn: sqlite3.Connection, subject: bytes) -> int | None:
    if not has_schema(conn):
        return None
    r = conn.execute("SELECT generation FROM rehydrate_served WHERE subject=?", (subject,)).fetchone()
    return None if r is None else r[0]


# ---------------------------------------------------------------------- how far behind (watermarks)
def group_counts(conn: sqlite3.Connection) -> list[tuple[bytes, str, int]]:
    """(site, table, events held) for every group: one pass over the log, shared by the peers of
    one `check` (the pass per peer made `check` cost peers x events)."""
    return [(bytes(s), q, n) for s, q, n in conn.execute(
        "SELECT site_id, qualified, count(*) FROM events GROUP BY site_id, qualified").fetchall()]


def peer_lag(conn: sqlite3.Connection, peer: bytes, counts: list[tuple[bytes, str, int]] | None = None) -> int:
    """How far `peer` is behind this node, from watermarks: the events this node holds (other
    than the peer's own) that the peer's last reported applied watermarks do not cover. Reports
    are stored only from authenticated links (`peer_watermarks`); with none, every such event
    counts. `counts`: `group_counts(conn)` when the caller asks for several peers. Only the
    events above a watermark are counted (a range of the events_group index): a peer that keeps
    up costs little whatever the log holds."""
    wms = peer_watermarks(conn, peer)
    total = 0
    for site, q, n in (group_counts(conn) if counts is None else counts):
        if site == peer:
            continue
        wm = wms.get((site, q))
        if wm is not None:
            n = conn.execute("SELECT count(*) FROM events WHERE site_id=? AND qualified=? AND (hlc_p, hlc_l) > (?, ?)",
                             (site, q, wm[0], wm[1])).fetchone()[0]
        total += n
    return total


def own_coverage(conn: sqlite3.Connection, self_site: bytes) -> dict[bytes, tuple[int, int]]:
    """Per origin site (other than this node): (events held here, of which covered by this node's
    own applied watermarks). The node's claim "I have everything of S up to h", per table."""
    wms = own_watermarks(conn)
    out: dict[bytes, tuple[int, int]] = {}
    for site, q, n in group_counts(conn):
        if site == self_site:
            continue
        wm = wms.get((site, q))
        c = 0 if wm is None else conn.execute(
            "SELECT count(*) FROM events WHERE site_id=? AND qualified=? AND (hlc_p < ? OR (hlc_p = ? AND hlc_l <= ?))",
            (site, q, wm[0], wm[0], wm[1])).fetchone()[0]
        h, cov = out.get(site, (0, 0))
        out[site] = (h + n, cov + c)
    return out


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
