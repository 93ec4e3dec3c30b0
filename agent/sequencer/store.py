"""The sequencer's own SQLite state (SOVM §22.5 cl. 3, §22.6): WAL, synchronous=FULL. Its tables and
versions are layout.py's ``STATE``: a writing open runs the forward-only steps, a read-only one
never does, and a file from a newer release is refused before anything is written.

`pending` holds the Commit accepted for (group_id, epoch) whose receipt is being signed, written
before the bridge records its signing intent (§22.6: "finds stored MLS bytes"); `discontinuities`
are stated, never inferred; `statements` keep the exact bytes of this sequencer's signed
discontinuity statements.

§22.5 clause 3: ``current_epoch`` only ever moves in the transaction that inserts the receipt for
the epoch it leaves (``commit_receipt``, ``commit_step``), records that epoch's discontinuity
(``commit_discontinuity``), settles a resume (``commit_settled``) or skips epochs the journal holds
as spent past its compaction floor (``skip_compacted``); there is no other UPDATE of it. So no
committed state has an epoch ahead of a durable receipt or a stated gap."""
from __future__ import annotations

import functools
import json
import sqlite3
from pathlib import Path
from typing import Iterator, Optional

from agent.sequencer import layout
from agent.sequencer.core import GroupState, Head


# The state file's WAL is checkpointed once it holds this many pages (SQLite's default: 1 000).
# Each Commit writes its group's own page of the receipts index, so a batch of 256 groups dirties
# ~256 index pages; a longer WAL rewrites a page several times before a checkpoint copies it once.
# With 300 receipts a group (1 024 groups) the COMMIT took 14.3-16.3 us of CPU a Commit at 1 000,
# 9.6-11.0 at 4 000 (8.2-10.3 at 8 000); with a short history no change (2.8-3.1). The WAL file
# reaches about this many pages (16 MiB) and is reused: home.DISK_RESERVE_BYTES keeps room for it.
STATE_WAL_CHECKPOINT_PAGES = 4000
STATE_PAGE_BYTES = 4096     # SQLite's default page size, which this file keeps


class Store:
    def __init__(self, path: Path, *, readonly: bool = False) -> None:
        """``readonly``: a reader beside a running `sequencer run` (WAL: it sees committed state)."""
        self.path = Path(path)
        # The writer holds the home's flock (home.py), so it may cache every group's state: the
        # cache changes only after the transaction that changed the rows committed.
        self._cache: Optional[dict[bytes, Optional[GroupState]]] = None if readonly else {}
        self._dirty: dict[bytes, Optional[GroupState]] = {}
        # a file from a newer release is refused before anything is written; a reader never migrates
        self.conn = layout.open_file(self.path, layout.STATE, readonly=readonly)
        if not readonly:
            self.conn.execute(f"PRAGMA wal_autocheckpoint={STATE_WAL_CHECKPOINT_PAGES}")

    def close(self) -> None:
        self.conn.close()

    def layout_version(self) -> int:
        """The file's layout version (layout.py), for `sequencer status`."""
        return layout.version(self.conn, layout.STATE)

    # -- meta ------------------------------------------------------------------------------
    def set_meta(self, key: str, value: object) -> None:
        self.conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, json.dumps(value)))

    def get_meta(self, key: str) -> object:
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else json.loads(row[0])

    # -- reads -----------------------------------------------------------------------------
    def group(self, group_id: bytes) -> Optional[GroupState]:
        if self._cache is not None and group_id in self._cache:
            return self._cache[group_id]
        got = self._read_group(group_id)
        if self._cache is not None and got is not None:
            self._cache[group_id] = got
        return got

    def _read_group(self, group_id: bytes) -> Optional[GroupState]:
        row = self.conn.execute("SELECT current_epoch, head_epoch, head_hash, origin, failed_closed, migrated "
                                "FROM groups WHERE group_id = ?", (group_id,)).fetchone()
        if row is None:
            return None
        gaps = tuple(e for (e,) in self.conn.execute(
            "SELECT epoch FROM discontinuities WHERE group_id = ? ORDER BY epoch", (group_id,)))
        head = None if row[1] is None else Head(row[1], bytes(row[2]))
        return GroupState(group_id, row[0], head, row[3], gaps, bool(row[4]), bool(row[5]))

    def iter_groups(self) -> Iterator[GroupState]:
        """Every group's state in group_id order, read in one pass with its gaps (a merge of two
        sorted reads) and not cached: `sequencer status` of 100 000 groups holds one at a time."""
        gaps = self.conn.execute("SELECT group_id, epoch FROM discontinuities ORDER BY group_id, epoch")
        gap = gaps.fetchone()
        for gid, current, head_epoch, head_hash, origin, failed, migrated in self.conn.execute(
                "SELECT group_id, current_epoch, head_epoch, head_hash, origin, failed_closed, migrated "
                "FROM groups ORDER BY group_id"):
            gid, mine = bytes(gid), []
            while gap is not None and bytes(gap[0]) <= gid:
                if bytes(gap[0]) == gid:
                    mine.append(gap[1])
                gap = gaps.fetchone()
            head = None if head_epoch is None else Head(head_epoch, bytes(head_hash))
            yield GroupState(gid, current, head, origin, tuple(mine), bool(failed), bool(migrated))

    def group_count(self) -> int:
        return self.conn.execute("SELECT count(*) FROM groups").fetchone()[0]

    def current_epochs(self) -> list[tuple[bytes, int]]:
        return [(bytes(g), e) for g, e in self.conn.execute("SELECT group_id, current_epoch FROM groups")]

    def group_ids(self) -> list[bytes]:
        return [bytes(g) for (g,) in self.conn.execute("SELECT group_id FROM groups ORDER BY group_id")]

    def receipt(self, group_id: bytes, epoch: int) -> Optional[bytes]:
        row = self.conn.execute("SELECT receipt FROM receipts WHERE group_id = ? AND epoch = ?",
                                (group_id, epoch)).fetchone()
        return None if row is None else bytes(row[0])

    def commit_message(self, group_id: bytes, epoch: int) -> Optional[bytes]:
        """The canonical Commit for (group, epoch), with or without a receipt (§22.6)."""
        for table in ("receipts", "discontinuities"):
            row = self.conn.execute(f"SELECT message FROM {table} WHERE group_id = ? AND epoch = ?",
                                    (group_id, epoch)).fetchone()
            if row is not None and row[0] is not None:
                return bytes(row[0])
        return None

    def is_discontinuity(self, group_id: bytes, epoch: int) -> bool:
        return self.conn.execute("SELECT 1 FROM discontinuities WHERE group_id = ? AND epoch = ?",
                                 (group_id, epoch)).fetchone() is not None

    def discontinuities(self) -> list[tuple[bytes, int, Optional[bytes]]]:
        return [(bytes(g), e, None if m is None else bytes(m)) for g, e, m in self.conn.execute(
            "SELECT group_id, epoch, message FROM discontinuities ORDER BY group_id, epoch")]

    def discontinuities_since(self, rowid: int) -> list[tuple[int, bytes, int, Optional[bytes], bool]]:
        """(rowid, group, epoch, Commit, signable) of the gaps recorded after ``rowid``, in the order
        recorded (rows are never deleted, so rowids only grow): what `sequencer run` has not looked
        at yet. ``signable``: this sequencer signs its statement (not one recovered or handed over,
        whose gaps were another sequencer's to state; as ``unsigned_gaps``)."""
        return [(r, bytes(g), e, None if m is None else bytes(m), bool(s)) for r, g, e, m, s in self.conn.execute(
            "SELECT rowid, group_id, epoch, message, cause != 'recovered' FROM discontinuities WHERE rowid > ? "
            "ORDER BY rowid", (rowid,))]

    def statement(self, group_id: bytes, epoch: int) -> Optional[bytes]:
        try:
            row = self.conn.execute("SELECT statement FROM statements WHERE group_id = ? AND epoch = ?",
                                    (group_id, epoch)).fetchone()
        except sqlite3.OperationalError:      # a home from before statements, read-only
            return None
        return None if row is None else bytes(row[0])

    def statements(self) -> dict[tuple[bytes, int], bytes]:
        try:
            return {(bytes(g), e): bytes(r) for g, e, r in self.conn.execute(
                "SELECT group_id, epoch, statement FROM statements")}
        except sqlite3.OperationalError:
            return {}

    def unsigned_gaps(self, after: Optional[tuple[bytes, int]] = None,
                      limit: int = -1) -> list[tuple[bytes, int, Optional[bytes], Optional[bytes]]]:
        """This sequencer's recorded gaps without a signed statement yet: (group, epoch, commit
        hash, the last receipt's hash before the gap), in (group, epoch) order, those after
        ``after`` only, at most ``limit`` (a batch of statements: one page of the primary key).
        Gaps that came with a recovery or a hand-off were another sequencer's to state (bound at
        their generation, §22.6)."""
        lo = after if after is not None else (b"", -1)
        rows = self.conn.execute(
            "SELECT d.group_id, d.epoch, d.commit_hash, (SELECT r.receipt_hash FROM receipts r WHERE "
            "r.group_id = d.group_id AND r.epoch < d.epoch ORDER BY r.epoch DESC LIMIT 1) FROM discontinuities d "
            "WHERE (d.group_id, d.epoch) > (?, ?) AND d.cause != 'recovered' AND NOT EXISTS (SELECT 1 FROM "
            "statements s WHERE s.group_id = d.group_id AND s.epoch = d.epoch) ORDER BY d.group_id, d.epoch "
            "LIMIT ?", (lo[0], lo[1], limit)).fetchall()
        return [(bytes(g), e, None if h is None else bytes(h), None if p is None else bytes(p)) for g, e, h, p in rows]

    def put_statement(self, group_id: bytes, epoch: int, raw: bytes) -> None:
        self.put_statements([(group_id, epoch, raw)])

    def put_statements(self, rows: list[tuple[bytes, int, bytes]]) -> None:
        """A batch of signed statements (the bridge persisted them first), one transaction."""
        with self._tx():
            self.conn.executemany("INSERT OR IGNORE INTO statements VALUES (?, ?, ?)", rows)

    def pending_row(self, group_id: bytes, epoch: int) -> Optional[tuple[bytes, bytes]]:
        """(commit hash, message) of the pending acceptance for (group, epoch), or None."""
        row = self.conn.execute("SELECT commit_hash, message FROM pending WHERE group_id = ? AND epoch = ?",
                                (group_id, epoch)).fetchone()
        return None if row is None else (bytes(row[0]), bytes(row[1]))

    def pending(self) -> list[tuple[bytes, int, bytes, bytes, bool]]:
        return [(bytes(g), e, bytes(h), bytes(m), bool(b)) for g, e, h, m, b in self.conn.execute(
            "SELECT group_id, epoch, commit_hash, message, bootstrap FROM pending ORDER BY group_id, epoch")]

    def events(self) -> list[dict]:
        return [{"seq": s, "kind": k, **json.loads(d)} for s, k, d in
                self.conn.execute("SELECT seq, kind, detail FROM events ORDER BY seq")]

    # -- the writes: each one transaction --------------------------------------------------
    def register(self, state: GroupState) -> None:
        with self._tx():
            self.conn.execute("INSERT INTO groups (group_id, current_epoch, origin) VALUES (?, ?, ?)",
                              (state.group_id, state.current_epoch, state.origin))
            self._dirty[state.group_id] = state

    def put_pending(self, group_id: bytes, epoch: int, commit_hash: bytes, message: bytes, bootstrap: bool) -> None:
        self.commit_step([], [(group_id, epoch, commit_hash, message, bootstrap)])

    def _put_pending_rows(self, rows: list[tuple[bytes, int, bytes, bytes, bool]]) -> None:
        flat: list = []
        for g, e, h, m, b in rows:
            flat += (g, e, h, m, int(b))
        _insert_values(self.conn, "INSERT INTO pending VALUES", 5, flat)

    def drop_pending(self, group_id: bytes, epoch: int) -> None:
        with self._tx():
            self.conn.execute("DELETE FROM pending WHERE group_id = ? AND epoch = ?", (group_id, epoch))

    def commit_receipt(self, new: GroupState, epoch: int, commit_hash: bytes, receipt: bytes,
                       receipt_hash: bytes, message: Optional[bytes]) -> None:
        """§22.5 cl. 3: the receipt bytes and the epoch advance in one atomic commitment."""
        with self._tx():
            self.conn.execute("INSERT INTO receipts VALUES (?, ?, ?, ?, ?, ?)",
                              (new.group_id, epoch, commit_hash, receipt, receipt_hash, message))
            self._put_group(new, epoch)

    def commit_step(self, rows: list[tuple[GroupState, int, bytes, bytes, bytes, Optional[bytes]]],
                    pending: list[tuple[bytes, int, bytes, bytes, bool]],
                    rows_pending: Optional[tuple[int, int]] = None) -> Optional[tuple[int, int]]:
        """One step of the pipelined group commit (docs/sequencer.md), one transaction: the
        receipts of the batch whose outputs the journal just persisted, with their epoch advances
        (§22.5 cl. 3, as ``commit_receipt``), and the pending rows of the next batch, durable before
        the journal records its intents. The batches hold distinct groups.
        ``rows_pending``: the pending rows of ``rows``, as the rowid range an earlier step returned
        (one range delete instead of a look-up per row); None: looked up one by one. Returns the
        rowid range of ``pending``'s rows (inserted together in one transaction, so consecutive), or None."""
        with self._tx():
            if rows:
                receipts, groups, dirty = [], [], self._dirty
                for new, epoch, ch, raw, rh, m in rows:
                    receipts += (new.group_id, epoch, ch, raw, rh, m)
                    groups += _group_row(new)
                    dirty[new.group_id] = new
                _insert_values(self.conn, "INSERT INTO receipts VALUES", 6, receipts)
                _insert_values(self.conn, _UPSERT_GROUP_HEAD, 6, groups, _UPSERT_GROUP_TAIL)
                if rows_pending is not None:
                    cur = self.conn.execute("DELETE FROM pending WHERE rowid BETWEEN ? AND ?", rows_pending)
                    if cur.rowcount != len(rows):   # never expected: the range was not this batch's
                        raise sqlite3.IntegrityError(f"pending rows {rows_pending} are not the batch's {len(rows)}")
                else:
                    self.conn.executemany("DELETE FROM pending WHERE group_id = ? AND epoch = ?",
                                          [(new.group_id, epoch) for new, epoch, *_rest in rows])
            if not pending:
                return None
            self._put_pending_rows(pending)
            hi = self.conn.execute("SELECT max(rowid) FROM pending").fetchone()[0]
            return (hi - len(pending) + 1, hi)

    def commit_discontinuity(self, new: GroupState, epoch: int, commit_hash: Optional[bytes],
                             message: Optional[bytes], cause: str) -> None:
        """§22.6: the stated gap and the epoch advance in one atomic commitment."""
        with self._tx():
            self.conn.execute("INSERT INTO discontinuities VALUES (?, ?, ?, ?, ?)",
                              (new.group_id, epoch, commit_hash, message, cause))
            self._put_group(new, epoch)
            self._event("discontinuity", {"group": new.group_id.hex(), "epoch": epoch, "cause": cause})

    def commit_settled(self, states: list[GroupState],
                       receipts: list[tuple[bytes, int, bytes, bytes, bytes, Optional[bytes]]],
                       gaps: list[tuple[bytes, int, Optional[bytes], Optional[bytes], str]],
                       events: list[tuple[str, dict]], pending_done: list[tuple[bytes, int]],
                       all_pending: bool = False) -> None:
        """§22.6 step 1 (resume), one transaction for a batch of epochs settled against the
        journal, of one group or several: the receipts adopted from the journal (group, epoch,
        commit hash, exact bytes, hash, Commit), the gaps stated (group, epoch, commit hash,
        Commit, cause), each group's state after them (``states``: its epoch just above the last
        of its epochs here, so never ahead of a durable receipt or stated gap, §22.5 cl. 3), the
        events, and the pending rows these epochs settle (``all_pending``: every pending row left,
        once every epoch the journal knows is settled: the rest was never signed)."""
        with self._tx():
            self.conn.executemany("INSERT INTO receipts VALUES (?, ?, ?, ?, ?, ?)", receipts)
            self.conn.executemany("INSERT INTO discontinuities VALUES (?, ?, ?, ?, ?)", gaps)
            self.conn.executemany(_UPSERT_GROUP, [_group_row(new) for new in states])
            for new in states:
                self._dirty[new.group_id] = new
            for kind, detail in events:
                self._event(kind, detail)
            if all_pending:
                self.conn.execute("DELETE FROM pending")
            else:
                self.conn.executemany("DELETE FROM pending WHERE group_id = ? AND epoch = ?", pending_done)

    def skip_compacted(self, new: GroupState, stated: list[tuple[int, Optional[bytes], bytes]], detail: dict) -> None:
        """§22.6 step 1, a state restored past the signing journal's compaction floor, one
        transaction a group: the epoch moves to the floor + 1 (every epoch up to the floor is spent
        in the journal and its receipt was recorded in a copy that is gone), the gaps whose signed
        statements the journal kept come back with those bytes (epoch, commit hash, statement),
        the group's pending rows up to the floor go (long settled), and the event says which
        epochs this sequencer can no longer serve (``receipts_lost``)."""
        gid = new.group_id
        with self._tx():
            self._put_stated(gid, stated)
            self.conn.execute(_UPSERT_GROUP, _group_row(new))
            self.conn.execute("DELETE FROM pending WHERE group_id = ? AND epoch < ?", (gid, new.current_epoch))
            self._dirty[gid] = None                      # re-read after commit (its gaps)
            self._event("receipts_lost", detail)

    def skip_witnessed(self, new: GroupState, commit_hash: bytes, receipt: bytes, lost_from: Optional[int],
                       detail: dict) -> None:
        """§22.5 cl. 2 after a restore of the whole home, one transaction a group: the receipt the
        witness outside the home holds (``new.head``) is taken back byte for byte and the epoch
        moves past it; the epochs from ``lost_from`` below it were released by a copy that is gone:
        no gap is stated for them (a member may hold their receipts: they are asked back,
        ``receipts_lost``), and a gap this open recorded there without a signed statement goes."""
        gid, w = new.group_id, new.head.epoch
        with self._tx():
            if lost_from is not None:
                self.conn.execute("DELETE FROM discontinuities WHERE group_id = ? AND epoch BETWEEN ? AND ? AND NOT "
                                  "EXISTS (SELECT 1 FROM statements s WHERE s.group_id = discontinuities.group_id "
                                  "AND s.epoch = discontinuities.epoch)", (gid, lost_from, w))
            self.conn.execute("INSERT OR REPLACE INTO receipts VALUES (?, ?, ?, ?, ?, NULL)",
                              (gid, w, commit_hash, receipt, new.head.receipt_hash))
            self.conn.execute(_UPSERT_GROUP, _group_row(new))
            self.conn.execute("DELETE FROM pending WHERE group_id = ? AND epoch <= ?", (gid, w))
            self._dirty[gid] = None                      # re-read after commit (its gaps)
            self._event("receipts_lost" if lost_from is not None and lost_from < w else "witness_ahead", detail)

    def lost_stretches(self, group_id: Optional[bytes] = None) -> dict[bytes, list[tuple[int, int]]]:
        """The epochs a resume named lost (events ``receipts_lost``: a state restored past the
        journal's compaction floor), group -> [(first, last)]; first 0 where the copy never knew
        the group. ``group_id``: that group's only."""
        out: dict[bytes, list[tuple[int, int]]] = {}
        for (detail,) in self.conn.execute("SELECT detail FROM events WHERE kind = 'receipts_lost' ORDER BY seq"):
            d = json.loads(detail)
            if d.get("to") is not None and (group_id is None or d.get("group") == group_id.hex()):
                out.setdefault(bytes.fromhex(d["group"]), []).append((d.get("from") or 0, int(d["to"])))
        return out

    def missing_between(self, group_id: bytes, first: int, last: int) -> int:
        """Epochs of ``group_id`` from ``first`` to ``last`` with neither a receipt nor a gap."""
        (n,) = self.conn.execute(
            "SELECT (SELECT count(*) FROM receipts WHERE group_id = ?1 AND epoch BETWEEN ?2 AND ?3) + "
            "(SELECT count(*) FROM discontinuities WHERE group_id = ?1 AND epoch BETWEEN ?2 AND ?3)",
            (group_id, first, last)).fetchone()
        return (last - first + 1) - n

    def missing_ranges(self, group_id: bytes, first: int, last: int, limit: int) -> list[tuple[int, int]]:
        """The runs of epochs from ``first`` to ``last`` with neither a receipt nor a gap, highest
        first, at most ``limit`` of them (what members are asked for, `lost`)."""
        return [(a, b) for a, b in self.conn.execute(
            "SELECT prev + 1, epoch - 1 FROM (SELECT epoch, lag(epoch, 1, ?2 - 1) OVER (ORDER BY epoch) AS prev FROM ("
            "SELECT epoch FROM receipts WHERE group_id = ?1 AND epoch BETWEEN ?2 AND ?3 UNION "
            "SELECT epoch FROM discontinuities WHERE group_id = ?1 AND epoch BETWEEN ?2 AND ?3 UNION SELECT ?3 + 1)) "
            "WHERE epoch - prev > 1 ORDER BY epoch DESC LIMIT ?4", (group_id, first, last, limit))]

    def held_between(self, group_id: bytes, first: int, last: int) -> tuple[dict[int, bytes], dict[int, bytes]]:
        """(epoch -> receipt, epoch -> gap statement) of ``group_id`` from ``first`` to ``last``."""
        rx = {e: bytes(r) for e, r in self.conn.execute(
            "SELECT epoch, receipt FROM receipts WHERE group_id = ? AND epoch BETWEEN ? AND ?", (group_id, first, last))}
        st = {e: bytes(r) for e, r in self.conn.execute(
            "SELECT epoch, statement FROM statements WHERE group_id = ? AND epoch BETWEEN ? AND ?", (group_id, first, last))}
        return rx, st

    def refill(self, group_id: bytes, rows: list[tuple[int, bytes, bytes, bytes]],
               stated: list[tuple[int, Optional[bytes], bytes]], detail: dict) -> None:
        """Lost receipts (epoch, commit hash, receipt, receipt hash) and gaps with their statements
        (epoch, commit hash, statement) taken back from members' evidence, one transaction; the
        epoch and the head do not move (they are above every lost stretch)."""
        with self._tx():
            self.conn.executemany("INSERT OR IGNORE INTO receipts VALUES (?, ?, ?, ?, ?, NULL)",
                                  [(group_id, e, ch, raw, rh) for e, ch, raw, rh in rows])
            self._put_stated(group_id, stated)
            self._dirty[group_id] = None                 # re-read after commit (its gaps)
            self._event("receipts_refilled", detail)

    def _put_stated(self, group_id: bytes, stated: list[tuple[int, Optional[bytes], bytes]]) -> None:
        """Gaps a restored state takes back with their signed statements (epoch, commit hash,
        statement bytes): the journal's (``skip_compacted``) or the members' (``refill``)."""
        self.conn.executemany("INSERT OR IGNORE INTO discontinuities VALUES (?, ?, ?, NULL, 'restored')",
                              [(group_id, e, ch) for e, ch, _raw in stated])
        self.conn.executemany("INSERT OR IGNORE INTO statements VALUES (?, ?, ?)",
                              [(group_id, e, raw) for e, _ch, raw in stated])

    def restore_group(self, state: GroupState, chain: list[tuple[int, bytes, bytes, bytes]],
                      gaps: list[int], detail: dict, kind: str = "recovered",
                      statements: Optional[dict[int, bytes]] = None) -> None:
        """§22.6 step 3: a group recovered from members' receipts, in one transaction: the verified
        chain (epoch, commit_hash, receipt, receipt_hash), its recorded gaps, the state."""
        with self._tx():
            for epoch, ch, raw, rh in chain:
                self.conn.execute("INSERT OR IGNORE INTO receipts VALUES (?, ?, ?, ?, ?, NULL)",
                                  (state.group_id, epoch, ch, raw, rh))
            for epoch in gaps:
                self.conn.execute("INSERT OR IGNORE INTO discontinuities VALUES (?, ?, NULL, NULL, 'recovered')",
                                  (state.group_id, epoch))
            for epoch, raw in (statements or {}).items():
                self.conn.execute("INSERT OR IGNORE INTO statements VALUES (?, ?, ?)", (state.group_id, epoch, raw))
            self.conn.execute("DELETE FROM retired WHERE group_id = ?", (state.group_id,))
            self.conn.execute("DELETE FROM held WHERE group_id = ?", (state.group_id,))
            self._put_group(state, -1)
            self._event(kind, detail)

    def retire(self, group_id: bytes, outcome: str, detail: dict) -> None:
        """§22.6: a group whose state this sequencer lost and whose recovery did not resume it
        (``outcome``): never bootstrapped nor registered again, with the event, in one transaction."""
        with self._tx():
            self.conn.execute("INSERT OR REPLACE INTO retired VALUES (?, ?)", (group_id, outcome))
            self._event("recovery_refused", detail)

    def retired(self, group_id: bytes) -> Optional[str]:
        """How the group's recovery ended, for a group retired here; None otherwise."""
        row = self.conn.execute("SELECT outcome FROM retired WHERE group_id = ?", (group_id,)).fetchone()
        return None if row is None else row[0]

    def hold(self, group_id: bytes, reason: str, detail: dict) -> None:
        """§22.5 cl. 2: members' evidence shows this state behind what was released: the group is
        not served until a recovery resumes it (``restore_group`` lifts the hold), with the event."""
        with self._tx():
            self.conn.execute("INSERT OR REPLACE INTO held VALUES (?, ?, ?)", (group_id, reason, json.dumps(detail)))
            self._event(reason, detail)

    def held(self) -> dict[bytes, dict]:
        """Every held group: group_id -> {"reason", **detail} (few: each is an operator's task)."""
        if self.layout_version() < 3:
            return {}           # a reader of a file no writer has migrated yet: nothing held
        return {g: {"reason": r, **json.loads(d)} for g, r, d in
                self.conn.execute("SELECT group_id, reason, detail FROM held ORDER BY group_id")}

    def fail_closed(self, group_id: bytes, current_epoch: int, detail: dict) -> None:
        """§22.6 step 4: equivocation evidence freezes the group for audit and migration."""
        with self._tx():
            self.conn.execute(
                "INSERT INTO groups (group_id, current_epoch, origin, failed_closed) VALUES (?, ?, 'recovered', 1) "
                "ON CONFLICT (group_id) DO UPDATE SET failed_closed = 1", (group_id, current_epoch))
            self._dirty[group_id] = None                 # re-read after commit
            self._event("equivocation", detail)

    def mark_migrated(self, group_id: bytes, detail: dict) -> None:
        """§22.6: after the hand-off this sequencer never serves the group again."""
        with self._tx():
            self.conn.execute("UPDATE groups SET migrated = 1 WHERE group_id = ?", (group_id,))
            self._dirty[group_id] = None
            self._event("migrated_out", detail)

    def record_event(self, kind: str, detail: dict, keep: Optional[int] = None) -> None:
        """One event; ``keep``: of this (routine) kind only the newest ``keep`` rows stay, in the
        same transaction (a kind a hostile client can make recur must not grow the file)."""
        with self._tx():
            self._event(kind, detail)
            if keep is not None:
                self.conn.execute("DELETE FROM events WHERE kind = ? AND seq <= (SELECT seq FROM events WHERE kind = ? "
                                  "ORDER BY seq DESC LIMIT 1 OFFSET ?)", (kind, kind, int(keep)))

    def _put_group(self, new: GroupState, epoch: int) -> None:
        self.conn.execute(_UPSERT_GROUP, _group_row(new))
        self.conn.execute("DELETE FROM pending WHERE group_id = ? AND epoch = ?", (new.group_id, epoch))
        self._dirty[new.group_id] = new

    def _event(self, kind: str, detail: dict) -> None:
        self.conn.execute("INSERT INTO events (kind, detail) VALUES (?, ?)", (kind, json.dumps(detail)))

    def _tx(self):
        return _Tx(self)


_UPSERT_GROUP_HEAD = "INSERT INTO groups (group_id, current_epoch, head_epoch, head_hash, origin, failed_closed) VALUES"
_UPSERT_GROUP_TAIL = (" ON CONFLICT (group_id) DO UPDATE SET current_epoch = excluded.current_epoch, "
                      "head_epoch = excluded.head_epoch, head_hash = excluded.head_hash")
_UPSERT_GROUP = _UPSERT_GROUP_HEAD + " (?, ?, ?, ?, ?, ?)" + _UPSERT_GROUP_TAIL

# Rows one multi-row INSERT takes at most (``_insert_values``).
_VALUES_ROWS = 64


@functools.lru_cache(maxsize=None)
def _values_sql(head: str, width: int, rows: int, tail: str) -> str:
    row = "(" + ", ".join("?" * width) + ")"
    return f"{head} {', '.join([row] * rows)}{tail}"


def _insert_values(conn: sqlite3.Connection, head: str, width: int, flat: list, tail: str = "") -> None:
    """``head`` VALUES (...), (...) ``tail`` over rows of ``width`` values given one after another
    in ``flat``: SQLite runs one statement for up to _VALUES_ROWS rows, where executemany runs
    it once a row (the group commit inserts a receipt, a group and a pending row per Commit: ~1 µs
    each saved). Row counts are powers of two, so few statement texts are prepared and cached."""
    n, i = len(flat) // width, 0
    while i < n:
        size = min(_VALUES_ROWS, 1 << ((n - i).bit_length() - 1))
        conn.execute(_values_sql(head, width, size, tail), flat[i * width:(i + size) * width])
        i += size


def _group_row(new: GroupState) -> tuple:
    head = new.head
    return (new.group_id, new.current_epoch, None if head is None else head.epoch,
            None if head is None else head.receipt_hash, new.origin, int(new.failed_closed))


def _rollback(conn: sqlite3.Connection) -> None:
    """ROLLBACK only an open transaction: SQLite rolls back by itself after some failures (a full
    disk, an I/O error), and a ROLLBACK then fails with "no transaction is active", replacing the
    error that says what happened (as agent/store/db.py `transaction`)."""
    if conn.in_transaction:
        conn.execute("ROLLBACK")


class _Tx:
    def __init__(self, store: Store) -> None:
        self.store = store

    def __enter__(self) -> None:
        self.store._dirty = {}
        self.store.conn.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        st = self.store
        if exc_type is not None:
            _rollback(st.conn)
            st._dirty = {}
            return
        try:
            st.conn.execute("COMMIT")
        except BaseException:
            _rollback(st.conn)
            st._dirty = {}
            raise
        if st._cache is not None:
            for gid, state in st._dirty.items():
                if state is None:
                    st._cache.pop(gid, None)
                else:
                    st._cache[gid] = state
        st._dirty = {}
