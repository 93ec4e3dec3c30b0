"""Delivery progress (SQLite): per-(sender, path) stream positions and gaps, the node's own and its
peers' reported watermarks (§14.2), the pins of rejected events, the sender's re-offers of
rejected events, and how far a peer is behind. The node's own applied watermarks live in the
store's `watermarks` table (agent/store/db.py)."""
from __future__ import annotations

import sqlite3
from typing import Iterable

from .sync_schema import has_schema


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
