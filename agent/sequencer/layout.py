"""Versioned layouts of the sequencer package's own SQLite files (docs/sequencer.md "State"): STATE
(HOME/sequencer.db, store.py) and QUEUE (HOME/commit-queue.db, queue_store.py), each with its own
version line in `PRAGMA user_version`. What each version added is said beside its step below.

As for the node's store (agent/store/migrations.py, which this package may not import):
migrations run forward only, on a writing open, each in its own transaction with the version it
reaches, so a crash or a full disk leaves the file at the previous version. A file newer than this
agent is refused (LayoutError, CLI exit 1) before anything is written; a read-only open never
migrates and refuses a newer file all the same.

Version 1 is what the release before versioning wrote (user_version 0): its step is `IF NOT
EXISTS` throughout, so on such a file it changes only the header (and completes a file whose
creation was cut short), then checks every table has exactly the version-1 columns, so a file from
a development build is refused rather than labelled version 1. To change a layout: append a step
to its list; never edit a released one (step 1 must stay idempotent on the released DDL)."""
from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Callable

from agent.sqlbind import bind_plainly
from agent.sqlscript import statements
from agent.walindex import open_connection

bind_plainly()   # blobs, NULLs and booleans bound without the module's adaptation look-up

Step = Callable[[sqlite3.Connection], None]


class LayoutError(Exception):
    """A file this agent must not open or change: written by a newer release, or not a layout it
    knows. A local fault (CLI exit 1), not a refusal of the request."""


class Layout:
    """One file's version line: ``steps`` are (version reached, what it does, step), in order."""

    def __init__(self, what: str, marker: str, steps: list[tuple[int, str, Step]]) -> None:
        self.what = what            # how the messages name the file
        self.marker = marker        # a table every released layout has: present with user_version 0 → version 1
        self.steps = steps

    @property
    def latest(self) -> int:
        return self.steps[-1][0]


def _table_shapes(conn: sqlite3.Connection, tables: list[str]) -> dict[str, list]:
    """Each table's columns (name, type, not null, default, key position) and index names."""
    return {t: [tuple(r[1:]) for r in conn.execute(f"PRAGMA table_info({t})")] +
            sorted(r[1] for r in conn.execute(f"PRAGMA index_list({t})")) for t in tables}


def _base(ddl: str) -> Step:
    """Step 1: the released layout, created where absent, then checked column for column."""
    def step(conn: sqlite3.Connection) -> None:
        for stmt in statements(ddl):
            conn.execute(stmt)
        ref = sqlite3.connect(":memory:")
        try:
            for stmt in statements(ddl):
                ref.execute(stmt)
            tables = [t for (t,) in ref.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                                "AND name NOT LIKE 'sqlite_%' ORDER BY name")]
            want = _table_shapes(ref, tables)
        finally:
            ref.close()
        got = _table_shapes(conn, tables)
        odd = sorted(t for t in tables if got[t] != want[t])
        if odd:
            raise LayoutError(f"its tables {', '.join(odd)} are not the version-1 layout (a development build "
                              "wrote it?); nothing was changed")
    return step


# -- STATE: HOME/sequencer.db (store.py) ----------------------------------------------------------
# Version 1, exactly as the release before versioning wrote it (store.py SCHEMA). Never edit.
STATE_V1 = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
  group_id BLOB PRIMARY KEY, current_epoch INTEGER NOT NULL, head_epoch INTEGER, head_hash BLOB,
  origin TEXT NOT NULL, failed_closed INTEGER NOT NULL DEFAULT 0, migrated INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS pending (
  group_id BLOB NOT NULL, epoch INTEGER NOT NULL, commit_hash BLOB NOT NULL, message BLOB NOT NULL,
  bootstrap INTEGER NOT NULL, PRIMARY KEY (group_id, epoch));
CREATE TABLE IF NOT EXISTS receipts (
  group_id BLOB NOT NULL, epoch INTEGER NOT NULL, commit_hash BLOB NOT NULL, receipt BLOB NOT NULL,
  receipt_hash BLOB NOT NULL, message BLOB, PRIMARY KEY (group_id, epoch));
CREATE TABLE IF NOT EXISTS discontinuities (
  group_id BLOB NOT NULL, epoch INTEGER NOT NULL, commit_hash BLOB, message BLOB, cause TEXT NOT NULL,
  PRIMARY KEY (group_id, epoch));
CREATE TABLE IF NOT EXISTS statements (
  group_id BLOB NOT NULL, epoch INTEGER NOT NULL, statement BLOB NOT NULL, PRIMARY KEY (group_id, epoch));
CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, detail TEXT NOT NULL);
"""

# Version 2: the groups this sequencer has a record of and no state for (§22.6: a recovery that
# ended in genesis reset or did not converge). Such a group is never bootstrapped by a Commit nor
# registered again; only a recovery that converges brings it back (§22.10: a reset uses a new group_id).
STATE_V2 = """
CREATE TABLE retired (group_id BLOB PRIMARY KEY, outcome TEXT NOT NULL);
"""


def _state_v2(conn: sqlite3.Connection) -> None:
    for stmt in statements(STATE_V2):
        conn.execute(stmt)


# Version 3: the groups held after a resume because members' evidence (a receipt head the broker
# retains, a Commit framed ahead) shows this state is behind what was released (§22.5 cl. 2): not
# served until `sequencer recover` resumes them from members' receipts (docs/sequencer.md).
STATE_V3 = """
CREATE TABLE held (group_id BLOB PRIMARY KEY, reason TEXT NOT NULL, detail TEXT NOT NULL);
"""


def _state_v3(conn: sqlite3.Connection) -> None:
    for stmt in statements(STATE_V3):
        conn.execute(stmt)


STATE = Layout("sequencer state", "groups", [
    (1, "the released layout (groups, pending, receipts, discontinuities, statements, events)", _base(STATE_V1)),
    (2, "the retired groups (a recovery that did not resume them)", _state_v2),
    (3, "the held groups (members' evidence shows the state behind what was released)", _state_v3),
])


# -- QUEUE: HOME/commit-queue.db (queue_store.py) ---------------------------------------------------
# Version 1, exactly as the release before versioning wrote it (client.py SCHEMA). Never edit.
QUEUE_V1 = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS commits (
  commit_hash BLOB PRIMARY KEY, group_id BLOB NOT NULL, epoch INTEGER NOT NULL, message BLOB NOT NULL,
  state TEXT NOT NULL, reason TEXT, receipt BLOB, queued_seq INTEGER NOT NULL, submissions INTEGER NOT NULL DEFAULT 0);
CREATE UNIQUE INDEX IF NOT EXISTS one_outstanding ON commits (group_id) WHERE state = 'queued';
CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, detail TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS heads (
  group_id BLOB NOT NULL, epoch INTEGER NOT NULL, receipt BLOB NOT NULL, PRIMARY KEY (group_id, epoch, receipt));
CREATE TABLE IF NOT EXISTS gaps (group_id BLOB NOT NULL, epoch INTEGER NOT NULL, PRIMARY KEY (group_id, epoch));
CREATE TABLE IF NOT EXISTS statements (
  group_id BLOB NOT NULL, epoch INTEGER NOT NULL, statement BLOB NOT NULL, PRIMARY KEY (group_id, epoch, statement));
CREATE TABLE IF NOT EXISTS gossiped (hash BLOB PRIMARY KEY);
CREATE TABLE IF NOT EXISTS unsettled (
  receipt BLOB PRIMARY KEY, group_id BLOB NOT NULL, epoch INTEGER NOT NULL, verdict TEXT NOT NULL, signer BLOB NOT NULL);
"""

# Version 2: what runs on every pump step reads what it needs, not the history (settled Commits,
# heads and gossiped hashes are kept for good: the member's evidence, §22.6). Added:
#   commits_in_order  the queue order: enqueue's max(queued_seq) is one seek, `entries` needs no sort
#   queued_in_order   the queued Commits only, in queue order (partial): `outstanding` reads those
#                     rows and sorts nothing (with commits_in_order alone SQLite would walk every
#                     Commit in order to find the queued ones)
#   followed          one row per group the member ever queued a Commit for (was SELECT DISTINCT
#                     over every Commit on every pump step)
#   outbox            what is kept and not yet handed to the node's gossip, in the order it was kept
#                     (was: every Commit, head, statement and gossiped hash read after every step);
#                     a row goes when its hash goes into `gossiped`; `seq` is a rowid, so a row
#                     kept later always gets a larger one (numbers are reused only once it is empty)
QUEUE_V2 = """
CREATE INDEX commits_in_order ON commits (queued_seq);
CREATE INDEX queued_in_order ON commits (queued_seq) WHERE state = 'queued';
CREATE TABLE followed (group_id BLOB PRIMARY KEY);
INSERT INTO followed SELECT DISTINCT group_id FROM commits;
CREATE TABLE outbox (seq INTEGER PRIMARY KEY, hash BLOB NOT NULL UNIQUE, raw BLOB NOT NULL);
"""


def _queue_v2(conn: sqlite3.Connection) -> None:
    from agent.sequencer.receipts import receipt_hash     # BLAKE3, the key `gossiped` is kept by
    for stmt in statements(QUEUE_V2):
        conn.execute(stmt)
    # the outbox starts with what version 1 would have handed over next, in its order: the
    # Commits' receipts in queue order, the heads, the statements; less what was handed over
    held = [r for (r,) in conn.execute("SELECT receipt FROM commits WHERE receipt IS NOT NULL ORDER BY queued_seq")]
    held += [r for (r,) in conn.execute("SELECT receipt FROM heads ORDER BY group_id, epoch")]
    held += [r for (r,) in conn.execute("SELECT statement FROM statements ORDER BY group_id, epoch")]
    for raw in held:
        h = receipt_hash(bytes(raw))
        conn.execute("INSERT OR IGNORE INTO outbox (hash, raw) SELECT ?, ? "
                     "WHERE NOT EXISTS (SELECT 1 FROM gossiped WHERE hash = ?)", (h, bytes(raw), h))


# Version 3: what a member does every 2 s, and what its event log keeps, no longer grow with
# its history (a 512 MB device with an SD card, running for months).
#   unsettled_by_group  a group's retained receipts, read only when its binding records changed
#   unsettled_groups    one row per group with receipts in `unsettled` (its rows gone, the row
#                       goes): `bindings` is the state of the member node's binding records for the
#                       group under which its receipts were last looked at (NULL: never), so the
#                       recheck reads a row a group, and a group's receipts only when that changed
#                       (§22.6: only a binding decides a held or attributed receipt again)
#   events_routine      the events that may be pruned, in order: every kind but the attribution
#                       records (`receipt_attributed`, §22.6 "retained for attribution") and the
#                       recorded discontinuities (§22.6 step 4); keeping the newest N of them is one
#                       walk of N index entries, never of the evidence kept beside them
QUEUE_V3 = """
CREATE INDEX unsettled_by_group ON unsettled (group_id, epoch);
CREATE TABLE unsettled_groups (group_id BLOB PRIMARY KEY, bindings BLOB);
INSERT INTO unsettled_groups SELECT DISTINCT group_id, NULL FROM unsettled;
CREATE INDEX events_routine ON events (seq) WHERE kind NOT IN ('receipt_attributed', 'discontinuity');
"""


def _queue_v3(conn: sqlite3.Connection) -> None:
    for stmt in statements(QUEUE_V3):
        conn.execute(stmt)


QUEUE = Layout("Commit queue", "commits", [
    (1, "the released layout (commits, heads, gaps, statements, gossiped, unsettled, events)", _base(QUEUE_V1)),
    (2, "the queue order indexed, the followed groups, the gossip outbox", _queue_v2),
    (3, "the retained receipts by group with the bindings they were checked under, the prunable events", _queue_v3),
])


# -- the runner -------------------------------------------------------------------------------------
def _stamped(conn: sqlite3.Connection) -> int:
    return conn.execute("PRAGMA user_version").fetchone()[0]


def version(conn: sqlite3.Connection, layout: Layout) -> int:
    """The layout version of the file behind ``conn`` (reads only)."""
    v = _stamped(conn)
    if v:
        return v
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (layout.marker,)).fetchone():
        return 1       # the release before versioning left user_version at 0
    return 0


def refuse_newer(conn: sqlite3.Connection, layout: Layout, path: Path) -> int:
    """The file's version, or LayoutError when a newer release wrote it (read and writing opens).
    Call it before anything that may write (even `PRAGMA journal_mode=WAL` writes the header)."""
    v = version(conn, layout)
    if v > layout.latest:
        raise LayoutError(
            f"{layout.what} {path} has layout version {v}, newer than this agent understands ({layout.latest}): "
            "it was written by a newer ssp-agent. Nothing was changed. Install that release or a later one "
            "(`ssp-agent --version` shows this one); the file is never migrated backwards")
    return v


def open_file(path: Path, layout: Layout, *, readonly: bool = False,
              busy_timeout_ms: int = 0) -> sqlite3.Connection:
    """A connection to ``path`` at ``layout``'s latest version (WAL, synchronous=FULL): the layout
    version is checked first, so a file from a newer release is refused (LayoutError) before
    anything is written (even journal_mode=WAL writes the header); then the forward-only steps
    run. ``readonly``: never written, never migrated (a reader sees committed state)."""
    # The WAL index allocated before SQLite maps it, or kept in heap memory: on a nearly full
    # filesystem with 1 KiB blocks a mapped sparse index kills the process by SIGBUS.
    conn = open_connection(path, readonly=readonly)
    try:
        if busy_timeout_ms:
            conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        refuse_newer(conn, layout, path)
        if not readonly:
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            migrate(conn, layout, path)
    except BaseException:
        conn.close()
        raise
    return conn


def migrate(conn: sqlite3.Connection, layout: Layout, path: Path) -> list[int]:
    """Bring the file to ``layout.latest`` (a writing open; ``conn`` in autocommit mode). Returns
    the versions applied (empty: current). A file of the release before versioning gets step 1
    (which changes nothing on it but the version in the header)."""
    applied = []
    for v, _what, step in layout.steps:
        refuse_newer(conn, layout, path)
        if _stamped(conn) >= v:
            continue
        conn.execute("BEGIN IMMEDIATE")
        try:
            # Again under the write lock: another opener (the queue has several) may have
            # migrated meanwhile, or a newer release may have.
            refuse_newer(conn, layout, path)
            if _stamped(conn) >= v:
                conn.execute("COMMIT")
                continue
            try:
                step(conn)
            except LayoutError as e:
                raise LayoutError(f"{layout.what} {path}: {e}") from None
            conn.execute(f"PRAGMA user_version = {int(v)}")
            conn.execute("COMMIT")
        except BaseException:
            # ROLLBACK only an open transaction: after a full disk or an I/O error SQLite already
            # rolled back, and a ROLLBACK would replace the error that says what happened.
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        applied.append(v)
    return applied
