"""The member's Commit queue file, HOME/commit-queue.db: its storage adapter (every SQL statement of
the queue; client.py keeps the protocol and calls these methods). docs/sequencer.md "Member side:
the Commit queue".

SQLite, WAL, synchronous=FULL: an enqueued Commit or a kept receipt survives a power cut. The
layout is versioned (layout.py ``QUEUE``: the DDL of each version and why): every open runs the
forward-only steps, and a queue from a newer release is refused before anything is written.
Several processes may open one queue (`commits run` beside `commits queue|status`): every change
is one ``BEGIN IMMEDIATE`` transaction. What runs on every pump step reads what it needs, never
the history: settled Commits, heads and gossiped hashes are kept for good (the member's evidence,
§22.6), and the event log keeps a bounded tail of routine events."""
from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Iterable, Optional

from agent.sequencer import layout
from agent.sequencer.core import EPOCH_LIMIT
from agent.sequencer.receipts import receipt_hash

# The columns of a Commit, in the order client.Entry takes them
_COMMIT = "commit_hash, group_id, epoch, message, state, reason, receipt, submissions"

# The event log keeps the newest EVENTS_KEPT routine events (outcomes, hand-overs to gossip,
# held/settled receipts, bad answers: what they told stays in the tables: ``commits``, ``heads``,
# ``outbox``/``gossiped``, ``unsettled``), unless the queue's meta says otherwise (``events_kept``).
# KEPT_EVENTS are never pruned: the attribution records of receipts signed by a sequencer not
# bound at their generation (§22.6: "rejected and retained for attribution") and the recorded
# discontinuities (§22.6 step 4). The condition is the one of layout.py's partial index
# ``events_routine`` word for word (SQLite uses a partial index only for a query that states it).
EVENTS_KEPT = 1000
KEPT_EVENTS = ("receipt_attributed", "discontinuity")
_ROUTINE = "kind NOT IN ('receipt_attributed', 'discontinuity')"


# The receipts a member holds for group ?1 at epochs ?2..?3: its accepted Commits' and the heads
# it heard (held_of, held_in, top_held)
_HELD = ("SELECT epoch, receipt FROM commits WHERE group_id = ?1 AND epoch BETWEEN ?2 AND ?3 "
         "AND receipt IS NOT NULL AND state = 'accepted' "
         "UNION SELECT epoch, receipt FROM heads WHERE group_id = ?1 AND epoch BETWEEN ?2 AND ?3")
_ALL = EPOCH_LIMIT - 1


class QueueStore:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        # several processes may open one queue: each waits for the other's transaction
        self.conn = layout.open_file(self.path, layout.QUEUE, busy_timeout_ms=10_000)

    def close(self) -> None:
        self.conn.close()

    def _tx(self) -> "_Tx":
        return _Tx(self.conn)

    # -- meta ------------------------------------------------------------------------------
    def meta(self, key: str) -> Optional[str]:
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def init_meta(self, member_id: str, sequencer_key: Optional[str], events_kept: Optional[int] = None) -> None:
        """``member_id`` where the file has none yet (kept for ever after); ``sequencer_key`` and
        ``events_kept`` (the event log's retention) replace the ones kept, when given."""
        with self._tx():
            if self.meta("member_id") is None:
                self.conn.execute("INSERT INTO meta VALUES ('member_id', ?)", (member_id,))
            if sequencer_key is not None:
                self.conn.execute("INSERT OR REPLACE INTO meta VALUES ('sequencer_key', ?)", (sequencer_key,))
            if events_kept is not None:
                self.conn.execute("INSERT OR REPLACE INTO meta VALUES ('events_kept', ?)", (str(int(events_kept)),))

    # -- commits ---------------------------------------------------------------------------
    def add_queued(self, commit_hash: bytes, group_id: bytes, epoch: int, message: bytes) -> Optional[int]:
        """Queue a Commit, in one transaction with the checks: None when it is queued now or was
        already there (the same bytes: one entry); else the epoch of the Commit the group already
        has outstanding, and nothing is added (§22.7: one outstanding Commit per group)."""
        with self._tx():
            if self.conn.execute("SELECT 1 FROM commits WHERE commit_hash = ?", (commit_hash,)).fetchone():
                return None
            out = self.conn.execute("SELECT epoch FROM commits WHERE group_id = ? AND state = 'queued'",
                                    (group_id,)).fetchone()
            if out is not None:
                return int(out[0])
            seq = self.conn.execute("SELECT coalesce(max(queued_seq), 0) + 1 FROM commits").fetchone()[0]
            self.conn.execute("INSERT INTO commits (commit_hash, group_id, epoch, message, state, queued_seq) "
                              "VALUES (?, ?, ?, ?, 'queued', ?)", (commit_hash, group_id, epoch, message, seq))
            self.conn.execute("INSERT OR IGNORE INTO followed VALUES (?)", (group_id,))
        return None

    def commit(self, commit_hash: bytes) -> Optional[tuple]:
        return self.conn.execute(f"SELECT {_COMMIT} FROM commits WHERE commit_hash = ?", (commit_hash,)).fetchone()

    def outstanding(self) -> list[tuple]:
        return self.conn.execute(f"SELECT {_COMMIT} FROM commits WHERE state = 'queued' ORDER BY queued_seq").fetchall()

    def commits(self) -> list[tuple]:
        return self.conn.execute(f"SELECT {_COMMIT} FROM commits ORDER BY queued_seq").fetchall()

    def commits_tail(self, limit: Optional[int]) -> tuple[list[tuple], int]:
        """Every queued Commit and the ``limit`` most recent ones (None: all), in queue order;
        and how many were left out (``commits status``)."""
        if limit is None:
            return self.commits(), 0
        rows = self.conn.execute(
            f"SELECT {_COMMIT} FROM (SELECT {_COMMIT}, queued_seq FROM commits WHERE state = 'queued' "
            f"UNION SELECT * FROM (SELECT {_COMMIT}, queued_seq FROM commits ORDER BY queued_seq DESC LIMIT ?)) "
            "ORDER BY queued_seq", (int(limit),)).fetchall()
        total = self.conn.execute("SELECT count(*) FROM commits").fetchone()[0]
        return rows, total - len(rows)

    def receipts(self) -> list[bytes]:
        """The receipts of the Commits' outcomes, in queue order."""
        return [bytes(r) for (r,) in
                self.conn.execute("SELECT receipt FROM commits WHERE receipt IS NOT NULL ORDER BY queued_seq")]

    def note_submitted(self, commit_hash: bytes) -> None:
        with self._tx():
            self.conn.execute("UPDATE commits SET submissions = submissions + 1 WHERE commit_hash = ?",
                              (commit_hash,))

    def settle(self, commit_hash: bytes, state: str, reason: Optional[str], receipt: Optional[bytes]) -> bool:
        """Record an outcome for a queued Commit, with its event (only a queued one: an outcome is final)."""
        with self._tx():
            cur = self.conn.execute("UPDATE commits SET state = ?, reason = ?, receipt = ? "
                                    "WHERE commit_hash = ? AND state = 'queued'",
                                    (state, reason, receipt, commit_hash))
            if cur.rowcount:
                self._event(state, {"commit_hash": commit_hash.hex(), "reason": reason})
                if receipt is not None:
                    self._to_gossip(receipt)
        return bool(cur.rowcount)

    def note_reason(self, commit_hash: bytes, reason: str) -> None:
        with self._tx():
            self.conn.execute("UPDATE commits SET reason = ? WHERE commit_hash = ? AND state = 'queued'",
                              (reason, commit_hash))

    # -- what the broker publishes for the member's groups -----------------------------------
    def groups(self) -> list[bytes]:
        """Every group the member ever queued a Commit for."""
        return [bytes(g) for (g,) in self.conn.execute("SELECT group_id FROM followed ORDER BY group_id")]

    def keep_head(self, group_id: bytes, epoch: int, receipt: bytes) -> bool:
        with self._tx():
            cur = self.conn.execute("INSERT OR IGNORE INTO heads VALUES (?, ?, ?)", (group_id, epoch, receipt))
            if cur.rowcount:
                self._to_gossip(receipt)
        return bool(cur.rowcount)

    def keep_gap(self, group_id: bytes, epoch: int) -> bool:
        with self._tx():
            cur = self.conn.execute("INSERT OR IGNORE INTO gaps VALUES (?, ?)", (group_id, epoch))
        return bool(cur.rowcount)

    def keep_statement(self, group_id: bytes, epoch: int, statement: bytes) -> bool:
        with self._tx():
            cur = self.conn.execute("INSERT OR IGNORE INTO statements VALUES (?, ?, ?)", (group_id, epoch, statement))
            if cur.rowcount:
                self._to_gossip(statement)
        return bool(cur.rowcount)

    def statements(self) -> list[tuple[bytes, int, bytes]]:
        return [(bytes(g), e, bytes(r)) for g, e, r in
                self.conn.execute("SELECT group_id, epoch, statement FROM statements ORDER BY group_id, epoch")]

    def heads(self) -> list[tuple[bytes, int, bytes]]:
        return [(bytes(g), e, bytes(r)) for g, e, r in
                self.conn.execute("SELECT group_id, epoch, receipt FROM heads ORDER BY group_id, epoch")]

    def heads_tail(self, limit: Optional[int]) -> tuple[list[tuple[bytes, int, bytes]], int]:
        """Each group's ``limit`` most recent heads (None: all), in (group, epoch) order; and how
        many were left out (``commits status``)."""
        if limit is None:
            return self.heads(), 0
        rows = [(bytes(g), e, bytes(r)) for g, e, r in self.conn.execute(
            "SELECT group_id, epoch, receipt FROM (SELECT group_id, epoch, receipt, row_number() OVER "
            "(PARTITION BY group_id ORDER BY epoch DESC, receipt DESC) AS k FROM heads) WHERE k <= ? "
            "ORDER BY group_id, epoch, receipt", (int(limit),))]
        total = self.conn.execute("SELECT count(*) FROM heads").fetchone()[0]
        return rows, total - len(rows)

    def held_of(self, group_id: bytes) -> tuple[list[tuple[int, bytes]], list[int], list[bytes]]:
        """One group's receipts (its Commits' outcomes and the heads heard: (epoch, bytes), by
        epoch), recorded gaps and signed statements: the member's evidence (§22.6 step 1)."""
        rx = [(e, bytes(r)) for e, r in self.conn.execute(f"{_HELD} ORDER BY 1, 2", (group_id, 0, _ALL))]
        gaps = [e for (e,) in self.conn.execute("SELECT epoch FROM gaps WHERE group_id = ? ORDER BY epoch", (group_id,))]
        stated = [bytes(r) for (r,) in self.conn.execute(
            "SELECT statement FROM statements WHERE group_id = ? ORDER BY epoch", (group_id,))]
        return rx, gaps, stated

    def top_held(self, group_id: bytes) -> Optional[int]:
        """The highest epoch this member holds a receipt for in ``group_id`` (None: none)."""
        return self.conn.execute(f"SELECT max(epoch) FROM ({_HELD})", (group_id, 0, _ALL)).fetchone()[0]

    def held_in(self, group_id: bytes, first: int, last: int, limit: int) -> tuple[list[bytes], list[int], list[bytes]]:
        """``held_of`` for the epochs ``first``..``last`` only: up to ``limit`` receipts, highest
        epoch first, the gaps, and up to ``limit`` statements (what a member offers for a stretch
        the sequencer lost, §22.6 step 1)."""
        rx = [bytes(r) for _e, r in self.conn.execute(f"{_HELD} ORDER BY 1 DESC, 2 LIMIT ?4",
                                                       (group_id, first, last, limit))]
        gaps = [e for (e,) in self.conn.execute(
            "SELECT epoch FROM gaps WHERE group_id = ? AND epoch BETWEEN ? AND ? ORDER BY epoch", (group_id, first, last))]
        stated = [bytes(r) for (r,) in self.conn.execute(
            "SELECT statement FROM statements WHERE group_id = ? AND epoch BETWEEN ? AND ? ORDER BY epoch DESC LIMIT ?",
            (group_id, first, last, limit))]
        return rx, gaps, stated

    def gaps(self) -> list[tuple[bytes, int]]:
        return [(bytes(g), e) for g, e in self.conn.execute("SELECT group_id, epoch FROM gaps ORDER BY group_id, epoch")]

    # -- handed to the node's gossip --------------------------------------------------------
    def ungossiped(self) -> list[bytes]:
        """What was kept and not yet handed to the node's gossip, in the order it was kept (the
        outbox: its rows only, however much was gossiped before)."""
        return [bytes(r) for (r,) in self.conn.execute("SELECT raw FROM outbox ORDER BY seq")]

    def mark_gossiped(self, raws: Iterable[bytes]) -> None:
        """Handed over: recorded in ``gossiped`` (kept: heard again, it is not handed over again)
        and out of the outbox, in one transaction."""
        with self._tx():
            for raw in raws:
                h = receipt_hash(raw)
                self.conn.execute("INSERT OR IGNORE INTO gossiped VALUES (?)", (h,))
                self.conn.execute("DELETE FROM outbox WHERE hash = ?", (h,))

    def _to_gossip(self, raw: bytes) -> None:
        """Into the outbox, in the caller's transaction: once (a receipt that is a Commit's
        outcome and the group's head too), and not when it was handed over already."""
        h = receipt_hash(raw)
        self.conn.execute("INSERT OR IGNORE INTO outbox (hash, raw) SELECT ?, ? "
                          "WHERE NOT EXISTS (SELECT 1 FROM gossiped WHERE hash = ?)", (h, bytes(raw), h))

    # -- held and attributed receipts (§22.6) -------------------------------------------------
    def keep_unsettled(self, raw: bytes, group_id: bytes, epoch: int, verdict: str, signer: bytes,
                       decided_under: Optional[bytes] = None) -> bool:
        """Kept (or its verdict changed), with a ``receipt_<verdict>`` event; False when it was kept
        with this verdict already. ``decided_under``: the group's binding state read before the
        verdict was reached (None: unknown). Where the group's receipts were last looked at under
        another state (another process may have noted a newer one meanwhile), that is forgotten, so
        the next recheck looks at the group again; under the same state, nothing to look at again."""
        with self._tx():
            row = self.conn.execute("SELECT verdict FROM unsettled WHERE receipt = ?", (raw,)).fetchone()
            if row is not None and row[0] == verdict:
                return False
            self.conn.execute("INSERT OR REPLACE INTO unsettled VALUES (?, ?, ?, ?, ?)",
                              (raw, group_id, epoch, verdict, signer))
            self.conn.execute("INSERT INTO unsettled_groups VALUES (?1, NULL) ON CONFLICT (group_id) DO UPDATE "
                              "SET bindings = NULL WHERE ?2 IS NULL OR bindings IS NOT ?2", (group_id, decided_under))
            self._event("receipt_" + verdict, {"group": group_id.hex(), "epoch": epoch, "signer": signer.hex(),
                                               "receipt": raw.hex()})
        return True

    def unsettled(self) -> list[tuple[bytes, str]]:
        return [(bytes(r), v) for r, v in self.conn.execute("SELECT receipt, verdict FROM unsettled ORDER BY group_id, epoch")]

    def drop_unsettled(self, raw: bytes) -> None:
        with self._tx():
            row = self.conn.execute("DELETE FROM unsettled WHERE receipt = ? RETURNING group_id", (raw,)).fetchone()
            if row is not None:
                self.conn.execute("DELETE FROM unsettled_groups WHERE group_id = ? AND NOT EXISTS "
                                  "(SELECT 1 FROM unsettled WHERE group_id = ?)", (row[0], row[0]))

    def unsettled_groups(self) -> list[tuple[bytes, Optional[bytes]]]:
        """(group, the binding state its retained receipts were last looked at under, or None):
        one row a group, however many receipts it retains."""
        return [(bytes(g), None if b is None else bytes(b)) for g, b in
                self.conn.execute("SELECT group_id, bindings FROM unsettled_groups ORDER BY group_id")]

    def unsettled_of(self, group_id: bytes) -> list[tuple[bytes, str]]:
        return [(bytes(r), v) for r, v in self.conn.execute(
            "SELECT receipt, verdict FROM unsettled WHERE group_id = ? ORDER BY epoch, receipt", (group_id,))]

    def note_rechecked(self, group_id: bytes, seen: Optional[bytes], bindings: bytes) -> None:
        """The group's retained receipts were looked at under ``bindings``; noted only where the
        group's row still says ``seen`` (what the recheck read before looking): a receipt kept
        meanwhile under another state (another process) keeps the group to be looked at again. A
        group whose last receipt went meanwhile has no row to note it in."""
        with self._tx():
            self.conn.execute("UPDATE unsettled_groups SET bindings = ? WHERE group_id = ? AND bindings IS ?",
                              (bindings, group_id, seen))

    # -- events ------------------------------------------------------------------------------
    def events(self) -> list[dict]:
        return [{"seq": s, "kind": k, **json.loads(d)} for s, k, d in
                self.conn.execute("SELECT seq, kind, detail FROM events ORDER BY seq")]

    def events_tail(self, limit: Optional[int]) -> tuple[list[dict], int]:
        """The ``limit`` most recent events (None: all kept), oldest first; and how many kept
        events were left out (``commits status``)."""
        if limit is None:
            return self.events(), 0
        rows = self.conn.execute("SELECT seq, kind, detail FROM (SELECT seq, kind, detail FROM events "
                                 "ORDER BY seq DESC LIMIT ?) ORDER BY seq", (int(limit),)).fetchall()
        total = self.conn.execute("SELECT count(*) FROM events").fetchone()[0]
        return [{"seq": s, "kind": k, **json.loads(d)} for s, k, d in rows], total - len(rows)

    def events_kept(self) -> int:
        v = self.meta("events_kept")
        return EVENTS_KEPT if v is None else int(v)

    def record_event(self, kind: str, detail: dict) -> None:
        with self._tx():
            self._event(kind, detail)

    def _event(self, kind: str, detail: dict) -> None:
        self.conn.execute("INSERT INTO events (kind, detail) VALUES (?, ?)", (kind, json.dumps(detail)))
        if kind not in KEPT_EVENTS:
            # the newest ``events_kept`` routine events stay: the walk is of those index entries
            # (events_routine), never of the whole log nor of the evidence kept beside it
            self.conn.execute(f"DELETE FROM events WHERE seq IN (SELECT seq FROM events WHERE {_ROUTINE} "
                              "ORDER BY seq DESC LIMIT -1 OFFSET ?)", (self.events_kept(),))


class _Tx:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> None:
        self.conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        # ROLLBACK only an open transaction: after a failure SQLite already rolled back (a full
        # disk, an I/O error, also at COMMIT) it would replace the real error (as agent/store/db.py).
        if exc_type is None:
            try:
                self.conn.execute("COMMIT")
                return
            except BaseException:
                if self.conn.in_transaction:
                    self.conn.execute("ROLLBACK")
                raise
        if self.conn.in_transaction:
            self.conn.execute("ROLLBACK")
