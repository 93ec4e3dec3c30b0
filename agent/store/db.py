"""The node's SQLite store: one file, WAL, synchronous=FULL on the connection that records
anything released to the outside (signed events, the HLC ceiling, cursor advances).
The database is the only source of truth; every cache is rebuilt from it on open."""
from __future__ import annotations

import errno
import os
import sqlite3
import threading
import urllib.parse
from pathlib import Path

from agent.sqlbind import bind_plainly
from agent.walindex import allocate_wal_index

bind_plainly()   # blobs, NULLs and booleans bound without the module's adaptation look-up

SCHEMA_VERSION = 1   # the first release's layout; the current one is migrations.LATEST

DDL = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS tables (
  qualified TEXT PRIMARY KEY, schema_name TEXT NOT NULL, table_name TEXT NOT NULL,
  category TEXT NOT NULL, key_json TEXT NOT NULL, columns_json TEXT NOT NULL,
  retention TEXT,  -- eviction class; NULL: this table is never evicted (scope §3)
  horizon_p INTEGER NOT NULL DEFAULT 0, horizon_l INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS keyring (
  site_id BLOB PRIMARY KEY, public_key BLOB NOT NULL,
  retired_p INTEGER, retired_l INTEGER, source TEXT NOT NULL) WITHOUT ROWID;
-- The retained event log in local append order (seq): what cursors walk (docs/protocol.md §2).
CREATE TABLE IF NOT EXISTS events (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, event_id BLOB NOT NULL UNIQUE, site_id BLOB NOT NULL,
  hlc_p INTEGER NOT NULL, hlc_l INTEGER NOT NULL, qualified TEXT NOT NULL, row_key BLOB NOT NULL,
  operation TEXT NOT NULL, raw BLOB NOT NULL, origin TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS events_row ON events (qualified, row_key, hlc_p, hlc_l);
CREATE INDEX IF NOT EXISTS events_group ON events (site_id, qualified, hlc_p, hlc_l);
-- Events whose destination table is missing (§13.6 row 1): held, retried when it appears.
CREATE TABLE IF NOT EXISTS held (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, event_id BLOB NOT NULL UNIQUE, site_id BLOB NOT NULL,
  qualified TEXT NOT NULL, hlc_p INTEGER NOT NULL, hlc_l INTEGER NOT NULL, raw BLOB NOT NULL,
  received_ms INTEGER NOT NULL);
CREATE INDEX IF NOT EXISTS held_table ON held (qualified);
-- What the spec says to surface, kept for the operator (`ssp-agent events`).
CREATE TABLE IF NOT EXISTS surfaced (
  seq INTEGER PRIMARY KEY AUTOINCREMENT, at_ms INTEGER NOT NULL, kind TEXT NOT NULL,
  reason TEXT NOT NULL, event_id BLOB, site_id BLOB, qualified TEXT, detail TEXT);
-- §13.6: events whose payload columns were ignored, metered per (site, table, column).
CREATE TABLE IF NOT EXISTS ignored_columns (
  site_id BLOB NOT NULL, qualified TEXT NOT NULL, column_name TEXT NOT NULL,
  count INTEGER NOT NULL, first_ms INTEGER NOT NULL, last_ms INTEGER NOT NULL,
  PRIMARY KEY (site_id, qualified, column_name)) WITHOUT ROWID;
-- §14.2 applied watermarks, per (site_id, schema, table).
CREATE TABLE IF NOT EXISTS watermarks (
  site_id BLOB NOT NULL, qualified TEXT NOT NULL, hlc_p INTEGER NOT NULL, hlc_l INTEGER NOT NULL,
  PRIMARY KEY (site_id, qualified)) WITHOUT ROWID;
"""


# ---------------------------------------------------------------- bounds on what peers can make us store
# The surfaced record (`ssp-agent events`) keeps the newest `surfaced_limit` rows (meta; set from the
# profile at init). The bound is a trigger, so every process and every insert path honours it (the
# apply path, record and rehydration handling, the disk-budget check...), and every row it evicts
# is counted in meta `surfaced_evicted` (shown by `status`): never silently.
SURFACED_LIMIT = 100_000
BOUNDS_DDL = f"""
CREATE TRIGGER IF NOT EXISTS surfaced_bound AFTER INSERT ON surfaced
WHEN NEW.seq > coalesce((SELECT value FROM meta WHERE key='surfaced_limit'), {SURFACED_LIMIT})
BEGIN
  INSERT INTO meta (key, value) VALUES ('surfaced_evicted', (SELECT count(*) FROM surfaced WHERE seq <=
      NEW.seq - coalesce((SELECT value FROM meta WHERE key='surfaced_limit'), {SURFACED_LIMIT})))
    ON CONFLICT (key) DO UPDATE SET value = value + excluded.value;
  DELETE FROM surfaced WHERE seq <= NEW.seq - coalesce((SELECT value FROM meta WHERE key='surfaced_limit'),
                                                       {SURFACED_LIMIT});
END
"""


def ensure_bounds(conn: sqlite3.Connection) -> None:
    """Install the store-enforced bounds in a home made before they existed (a writing open)."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE type='trigger' AND name='surfaced_bound'").fetchone() is None:
        conn.execute(BOUNDS_DDL)


def surfaced_bounds(conn: sqlite3.Connection) -> dict:
    """What `status` shows: rows kept, the bound, and how many rows the bound has evicted."""
    return {"rows": conn.execute("SELECT count(*) FROM surfaced").fetchone()[0],
            "limit": int(get_meta(conn, "surfaced_limit", SURFACED_LIMIT)),
            "evicted": int(get_meta(conn, "surfaced_evicted", 0))}


# Held events counted per signer and in total (site_id X'') by triggers, so the bound of
# apply.hold costs one look-up whatever the store holds.
_HELD_COUNTS = (
    "CREATE TABLE IF NOT EXISTS held_counts (site_id BLOB PRIMARY KEY, n INTEGER NOT NULL) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS held_site ON held (site_id)",
    "CREATE TRIGGER IF NOT EXISTS held_count_ins AFTER INSERT ON held BEGIN "
    "INSERT INTO held_counts VALUES (NEW.site_id, 1) ON CONFLICT(site_id) DO UPDATE SET n = n + 1; "
    "INSERT INTO held_counts VALUES (X'', 1) ON CONFLICT(site_id) DO UPDATE SET n = n + 1; END",
    "CREATE TRIGGER IF NOT EXISTS held_count_del AFTER DELETE ON held BEGIN "
    "UPDATE held_counts SET n = n - 1 WHERE site_id IN (OLD.site_id, X''); END",
)


def ensure_held_counts(conn: sqlite3.Connection) -> None:
    """Create the counters (homes made before them get them on open), counting what is held."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE name='held_count_del'").fetchone():
        return
    with transaction(conn):
        create_held_counts(conn)


def create_held_counts(conn: sqlite3.Connection) -> None:
    """The counters and their triggers, counting what is held (inside the caller's transaction)."""
    if conn.execute("SELECT 1 FROM sqlite_master WHERE name='held_count_del'").fetchone():
        return
    for stmt in _HELD_COUNTS:
        conn.execute(stmt)
    conn.execute("DELETE FROM held_counts")
    conn.execute("INSERT INTO held_counts SELECT site_id, count(*) FROM held GROUP BY site_id")
    conn.execute("INSERT INTO held_counts SELECT X'', count(*) FROM held")


def held_count(conn: sqlite3.Connection, site_id: bytes) -> tuple[int, int]:
    """(events held from `site_id`, events held in total)."""
    r = dict(conn.execute("SELECT site_id, n FROM held_counts WHERE site_id IN (?, X'')", (site_id,)).fetchall())
    return r.get(site_id, 0), r.get(b"", 0)


# The number of events in the log, kept by triggers: `status` and the metrics
# read one row instead of counting a log of a million events (166 ms). Triggers, so the count is
# exact through every path that adds or removes log rows (the apply path, eviction, rehydration,
# whatever comes later) in the same transaction; they cost one row update per event applied.
_LOG_COUNT = (
    "CREATE TABLE IF NOT EXISTS log_count (k INTEGER PRIMARY KEY CHECK (k = 0), n INTEGER NOT NULL)",
    "CREATE TRIGGER IF NOT EXISTS log_count_ins AFTER INSERT ON events BEGIN "
    "UPDATE log_count SET n = n + 1 WHERE k = 0; END",
    "CREATE TRIGGER IF NOT EXISTS log_count_del AFTER DELETE ON events BEGIN "
    "UPDATE log_count SET n = n - 1 WHERE k = 0; END",
)


def create_log_count(conn: sqlite3.Connection) -> None:
    """The count and its triggers, counting what the log holds (inside the caller's transaction)."""
    for stmt in _LOG_COUNT:
        conn.execute(stmt)
    conn.execute("INSERT OR REPLACE INTO log_count VALUES (0, (SELECT count(*) FROM events))")


def log_count(conn: sqlite3.Connection) -> int:
    """Events in the log: one row read; a read view of a store older than the count counts."""
    try:
        r = conn.execute("SELECT n FROM log_count WHERE k = 0").fetchone()
    except sqlite3.OperationalError:   # no such table: a layout before version 7, read as it is
        r = None
    return r[0] if r is not None else conn.execute("SELECT count(*) FROM events").fetchone()[0]


def held_total(conn: sqlite3.Connection) -> int:
    """Events held in total: the held counts' total row; a store older than them counts."""
    try:
        r = conn.execute("SELECT n FROM held_counts WHERE site_id = X''").fetchone()
    except sqlite3.OperationalError:
        return conn.execute("SELECT count(*) FROM held").fetchone()[0]
    return 0 if r is None else r[0]


class StoreError(RuntimeError):
    """A local storage fault (never a protocol error): the CLI prints its one-line message, which
    says what is wrong and what to do, and exits 1."""


# SQLite primary result codes (sqlite3.Error.sqlite_errorcode & 0xFF) that mean the medium or the
# file, not the program, is at fault; anything else is a bug and keeps its traceback.
_BUSY, _LOCKED, _READONLY, _IOERR, _CORRUPT, _FULL, _CANTOPEN, _NOTADB = 5, 6, 8, 10, 11, 13, 14, 26
LOW_SPACE_BYTES = 1 << 20   # below this much free space an I/O error is reported as a full disk


# The `unseal` SQL function (agent/store/atrest.py) cannot carry its exception through SQLite (the
# caller sees "user-defined function raised exception"): it leaves its message here for storage_fault.
_unseal_failure = threading.local()


def note_unseal_failure(msg: str) -> None:
    _unseal_failure.msg = msg


def no_inodes(path: Path) -> bool:
    """Has the filesystem holding `path` no inode left for an unprivileged file?"""
    try:
        st = os.statvfs(str(path))
    except OSError:
        return False
    return st.f_files > 0 and st.f_favail == 0


def free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(str(path))
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


# ---------------------------------------------------------------- the space kept for eviction
# Eviction and WAL truncation are how a device frees its own space, yet both write (the deletions
# go through the WAL, the journal is compacted on open): on a disk filled to the last block they
# failed like any write. The home keeps a reserve file, allocated while there is room; eviction
# (and nothing else) releases it when the disk is full, runs, and takes it back once there is room.
RESERVE_FILE = "store.reserve"
RESERVE_BYTES = 4 << 20


def ensure_reserve(home: Path, size: int = RESERVE_BYTES) -> bool:
    """Allocate the reserve unless it exists. Never fills a disk to do it: only with its size plus
    LOW_SPACE_BYTES free. Best effort (a guard, never a reason to stop): False if not there."""
    path = Path(home) / RESERVE_FILE
    try:
        if path.stat().st_size >= size:
            return True
    except OSError:
        pass
    free = free_bytes(Path(home))
    if free is None or free < size + LOW_SPACE_BYTES:
        return False
    tmp = path.with_name(RESERVE_FILE + ".tmp")
    try:
        fd = os.open(str(tmp), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)   # real blocks, not a sparse file
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                from firmware_bridge.fsutil import write_all
                write_all(fd, bytes(size))
        finally:
            os.close(fd)
        os.replace(tmp, path)
        return True
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False


def release_reserve(home: Path) -> int:
    """Give the reserve back to the filesystem (for eviction on a full disk): bytes freed."""
    path = Path(home) / RESERVE_FILE
    try:
        size = path.stat().st_size
        path.unlink()
    except OSError:
        return 0
    return size


def disk_full(exc: BaseException, store: Path) -> bool:
    """Is `exc`, or an exception it was raised from, the full-disk fault of `storage_fault`?"""
    while exc is not None:
        fault = storage_fault(exc, store)
        if fault is not None and str(fault).startswith("the filesystem holding"):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def storage_fault(exc: BaseException, store: Path) -> StoreError | None:
    """Classify an exception from the store or its filesystem (the one function the CLI boundary
    calls): a full disk, a damaged store, an unreadable or busy file become a StoreError whose
    one line says what is wrong and what to do; None for anything else (a bug: not hidden)."""
    home = store.parent
    free = free_bytes(home)
    node = store.name == "store.sqlite"       # else a sequencer's home (sequencer.db)
    if node:
        todo = ("Free space there, or run `ssp-agent evict --auto` (it uses the space the home reserves for it), then "
                "retry; read verbs (status, dump, log, events) still work")
    else:       # nothing in it to evict
        todo = "Free space there, then retry; read verbs (status, receipt) still work"
    full_msg = (f"the filesystem holding {home} is full ({free if free is not None else '?'} bytes free): nothing "
                f"was changed. {todo}")
    # No inode left (blocks may be free): a new file (the WAL, its index, a journal's
    # replacement) cannot be made, which SQLite reports as a file it cannot open.
    inodes_msg = (f"the filesystem holding {home} has no free inode left (too many files; blocks may be free): "
                  f"nothing was changed. Remove files there (df -i shows it), then retry; read verbs still work")
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return StoreError(inodes_msg if no_inodes(home) else full_msg)
    if isinstance(exc, OSError) and exc.errno in (errno.EIO, errno.EROFS):
        return StoreError(f"{exc.filename or home}: {exc.strerror}; the medium is failing or read-only: check it "
                          "(dmesg), keep a copy of the home, then retry")
    if isinstance(exc, sqlite3.OperationalError) and "user-defined function raised exception" in str(exc):
        msg = getattr(_unseal_failure, "msg", None)   # a sealed log value that did not open (atrest.py)
        _unseal_failure.msg = None
        if msg:
            return StoreError(msg)
    if not isinstance(exc, sqlite3.Error) or getattr(exc, "sqlite_errorcode", None) is None:
        return None
    code, name = exc.sqlite_errorcode & 0xFF, exc.sqlite_errorname
    if code == _FULL or (code == _IOERR and free is not None and free < LOW_SPACE_BYTES):
        return StoreError(full_msg)
    if code in (_CORRUPT, _NOTADB) and not node:
        return StoreError(f"store {store} is damaged ({exc}, {name}): nothing was changed. Stop `sequencer run` and "
                          f"keep a copy of the home; then restore {store.name} from a backup (its signing journal "
                          "settles the older state on the next start and never signs an epoch twice), or recover "
                          "the groups from members' evidence with `sequencer recover` (docs/sequencer.md)")
    if code in (_CORRUPT, _NOTADB):
        return StoreError(f"store {store} is damaged ({exc}, {name}): nothing was changed. Stop the agent and keep a "
                          "copy of the home; then restore store.sqlite from a backup (the clock witness keeps HLCs "
                          "unique), or initialise a new node and rehydrate it from a peer (docs/operations.md)")
    if code == _IOERR:
        return StoreError(f"store {store}: I/O error ({name}): the medium is failing; check it (dmesg), keep a copy "
                          "of the home, then retry")
    if code in (_BUSY, _LOCKED):
        return StoreError(f"store {store} is busy ({name}): another process holds it; retry when it is done")
    if code in (_READONLY, _CANTOPEN) and no_inodes(home):
        return StoreError(inodes_msg)
    if code in (_READONLY, _CANTOPEN):
        return StoreError(f"store {store} cannot be opened for writing ({exc}, {name}): check the permissions "
                          "and that the filesystem is mounted read-write")
    return None


def connect(path: Path) -> sqlite3.Connection:
    heap_index = not allocate_wal_index(path)
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    if heap_index:
        # No blocks for the WAL index (a full disk): keep it in heap memory, set before WAL is
        # first used. This connection then holds the store alone until it closes.
        conn.execute("PRAGMA locking_mode=EXCLUSIVE")
    # Before WAL: switching to WAL writes the file header, after which auto_vacuum no longer takes
    # and eviction's freed pages would never go back to the filesystem (an existing store is
    # converted by eviction: convert_to_incremental_vacuum).
    conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")  # this connection records released outputs
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute("PRAGMA busy_timeout=10000")
    return conn


def reclaim_free_pages(conn: sqlite3.Connection) -> bool:
    """Return the store's free pages to the filesystem (eviction, scope §3). A store created
    before auto_vacuum was chosen ahead of WAL has it off: the first reclaim converts it with one
    VACUUM (a one-off rewrite needing about the store's size free; on a full disk it is left for
    the next eviction, and the freed pages are still reused by later writes). Returns whether
    the store was converted."""
    converted = False
    if conn.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
        conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
        try:
            conn.execute("VACUUM")
            converted = True
        except sqlite3.OperationalError as e:
            if (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF != _FULL:
                raise
    # A step at a time, the WAL truncated after each: a step's WAL (the pages it moves) must fit
    # in the home's reserve on a full disk, whatever the number of free pages.
    # executescript steps the pragma to completion: the sqlite3 module's execute() stops after the
    # first step of a statement without result columns, and each step frees one page.
    free = conn.execute("PRAGMA freelist_count").fetchone()[0]
    while free:
        conn.executescript(f"PRAGMA incremental_vacuum({RECLAIM_STEP_PAGES});")
        checkpoint(conn)
        left = conn.execute("PRAGMA freelist_count").fetchone()[0]
        if left >= free:
            break
        free = left
    checkpoint(conn)
    return converted


RECLAIM_STEP_PAGES = 256


def checkpoint(conn: sqlite3.Connection) -> None:
    """Copy the WAL into the store and truncate it (its blocks back to the filesystem); a reader
    holding an old snapshot only makes it partial."""
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()


_SECURE_DELETE = {"on": "ON", "fast": "FAST", "off": "OFF"}   # names: "=2" reads as a boolean (on)


def scrub_superseded(conn: sqlite3.Connection, mode: str) -> None:
    """What the node's connection does with values it overwrites or deletes (the profile's
    `[store] secure_delete`; docs/reliability.md "Superseded values"). Set explicitly: the
    compile-time default differs between builds (SQLite's own is off; Debian's is on). Unless off,
    the WAL is also truncated when it restarts after a complete checkpoint (journal_size_limit 0),
    so the frames holding old page images do not outlive the checkpoints SQLite runs by itself."""
    conn.execute(f"PRAGMA secure_delete={_SECURE_DELETE[mode]}")
    conn.execute(f"PRAGMA journal_size_limit={-1 if mode == 'off' else 0}").fetchall()


def connect_readonly(path: Path) -> sqlite3.Connection:
    """A connection for the read verbs (status, dump, log, events) that writes nothing, so they
    work on a full disk. A read-only WAL reader still needs the -shm index file; on a full disk
    it cannot be created or sized (SQLITE_IOERR_SHMSIZE), or given real blocks (allocate_wal_index).
    Then read in exclusive locking mode,
    where SQLite keeps the WAL index in heap memory and needs no -shm at all (it still reads any
    committed frames from the -wal file); `query_only` keeps this connection from writing."""
    if allocate_wal_index(path):   # else a shared index could kill this reader (SIGBUS): see above
        uri = "file:" + urllib.parse.quote(str(path)) + "?mode=ro"
        conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
        try:
            conn.execute("PRAGMA busy_timeout=10000")
            conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
            return conn
        except sqlite3.OperationalError as e:
            conn.close()
            if (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF not in (_IOERR, _CANTOPEN, _FULL):
                raise
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    try:
        conn.execute("PRAGMA locking_mode=EXCLUSIVE")
        conn.execute("PRAGMA query_only=1")
        conn.execute("PRAGMA busy_timeout=10000")
        conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
        return conn
    except sqlite3.OperationalError as e:
        conn.close()
        wal = Path(str(path) + "-wal")
        if (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF != _CANTOPEN or wal.exists():
            raise
    # No -wal file can be made (no inode left) and none exists: the store file holds everything
    # committed and nothing has it open for writing (a writer keeps a -wal), so read it as it is.
    uri = "file:" + urllib.parse.quote(str(path)) + "?mode=ro&immutable=1"
    conn = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    conn.execute("SELECT count(*) FROM sqlite_master").fetchone()
    return conn


def get_meta(conn: sqlite3.Connection, key: str, default=None):
    row = conn.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
    return default if row is None else row[0]


def set_meta(conn: sqlite3.Connection, key: str, value) -> None:
    conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))


def del_meta(conn: sqlite3.Connection, key: str) -> None:
    conn.execute("DELETE FROM meta WHERE key=?", (key,))


class transaction:
    """BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any exception (every writer uses this one)."""

    def __init__(self, conn: sqlite3.Connection) -> None:
        self.conn = conn

    def __enter__(self) -> sqlite3.Connection:
        self.conn.execute("BEGIN IMMEDIATE")
        return self.conn

    def __exit__(self, et, e, tb) -> None:
        if et is not None:
            _rollback(self.conn)
            return
        try:
            self.conn.execute("COMMIT")
        except BaseException:
            # A COMMIT that fails (SQLITE_FULL, an I/O error) may or may not have been rolled back
            # by SQLite itself: never leave the connection inside the transaction.
            _rollback(self.conn)
            raise


def _rollback(conn: sqlite3.Connection) -> None:
    """ROLLBACK if a transaction is still open: SQLite rolls back by itself after some failures
    (a full disk, an I/O error), and a ROLLBACK then would fail with "no transaction is active"
    and replace the error that says what happened."""
    if conn.in_transaction:
        conn.execute("ROLLBACK")


def data_version(conn: sqlite3.Connection) -> int:
    """SQLite's `PRAGMA data_version`: it changes when another connection committed to the file
    since this connection last looked (its own commits do not change it)."""
    return conn.execute("PRAGMA data_version").fetchone()[0]


def store_pages_bytes(conn: sqlite3.Connection) -> int:
    """The main database file's size as SQLite counts it (page size times pages; the WAL apart)."""
    return conn.execute("PRAGMA page_size").fetchone()[0] * conn.execute("PRAGMA page_count").fetchone()[0]
