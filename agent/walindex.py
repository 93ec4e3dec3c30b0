"""The WAL index allocated for real, for every SQLite file a process of this package maps (the
node's store, the sequencer's files): docs/reliability.md "Full disk".

SQLite's unix VFS grows the WAL index (FILE-shm) by writing one byte per 4 KiB page into a sparse
file, then maps it. On a filesystem whose blocks are smaller than a page (ext4 with 1 KiB blocks,
mke2fs's default below 512 MiB) the rest of each page has no block yet; touching it on a nearly
full disk kills the process with SIGBUS. So the index file's blocks are allocated (fallocate)
before SQLite maps it; where they cannot be, the caller keeps the index in heap memory (exclusive
locking mode, `open_connection`) and maps nothing. No SQL here: the node (agent/store) and the
sequencer, which never imports the node, both use it."""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import sqlite3
import struct
from pathlib import Path

WAL_INDEX_BYTES = 512 << 10   # 32 KiB per 4 096 WAL frames: a WAL of about 256 MiB
_SHM_DMS = 128                # the unix VFS's "dead man switch" byte: every -shm user holds a read lock on it
_F_OFD_SETLK = 37             # Linux: a lock of this file description, seen by this process's own POSIX locks
_FALLOC_KEEP_SIZE = 1
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)


_libc = None


def _libc_handle():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _fallocate(fd: int, keep_size: bool, offset: int, length: int) -> None:
    r = _libc_handle().fallocate(ctypes.c_int(fd), ctypes.c_int(_FALLOC_KEEP_SIZE if keep_size else 0),
                       ctypes.c_longlong(offset), ctypes.c_longlong(length))
    if r != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def allocate_wal_index(store: Path, size: int = WAL_INDEX_BYTES) -> bool:
    """Give the store's WAL index file real blocks for its first `size` bytes (and for all it
    holds), before SQLite maps it: False only when the filesystem has no room for them (else
    SQLite goes on as it would: a filesystem without fallocate, a file this user cannot write).
    Done in a forked child: closing any descriptor of the file drops every POSIX lock this process
    holds on it, SQLite's included (a connection already open here would lose its hold on the index)."""
    _libc_handle()
    pid = os.fork()
    if pid == 0:   # the child: system calls only, then _exit (no cleanup of the parent's state)
        code = 0
        try:
            code = 0 if _allocate(str(store), size) else 1
        except BaseException:   # noqa: BLE001 - the parent goes on as SQLite would
            code = 0
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) != 1


def _allocate(store: str, size: int) -> bool:
    """allocate_wal_index's work. When no process has the index open, SQLite's first opener
    truncates it to 3 bytes (freeing blocks past them): then it is emptied here and the blocks are
    allocated past its end (FALLOC_FL_KEEP_SIZE), which a growing truncate keeps. When others
    have it open it is only filled in (no size or byte changes)."""
    shm = store + "-shm"
    try:
        mode = os.stat(store).st_mode & 0o666
        fd = os.open(shm, os.O_RDWR | os.O_CREAT, mode)
    except OSError as e:
        return e.errno not in _NO_ROOM
    unused = False
    try:
        try:   # a write lock on the switch byte: granted only if no connection uses the index
            fcntl.fcntl(fd, _F_OFD_SETLK, struct.pack("hhqqi", fcntl.F_WRLCK, os.SEEK_SET, _SHM_DMS, 1, 0))
            unused = True
        except OSError:
            pass
        if unused:
            os.ftruncate(fd, 0)
        cur = os.fstat(fd).st_size
        if cur:
            _fallocate(fd, False, 0, cur)              # the holes SQLite's one-byte writes left
        if size > cur:
            _fallocate(fd, True, cur, size - cur)      # what it grows into, allocated ahead
        return True
    except OSError as e:
        if unused:   # give back what a partial allocation took (a truncate frees blocks past the end)
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass
        return e.errno not in _NO_ROOM
    finally:
        os.close(fd)



def open_connection(path: Path, *, readonly: bool = False) -> sqlite3.Connection:
    """A connection to the SQLite file `path` whose WAL index cannot kill it: shared and mapped
    when its blocks are allocated, else kept in heap memory (exclusive locking mode, set before
    WAL is first used: this connection then holds the file alone until it closes). `readonly`:
    opened read-only when shared, `query_only` when exclusive (a read-only connection cannot take
    the exclusive lock on a WAL file)."""
    if allocate_wal_index(path):
        if readonly:
            return sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
        return sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    conn = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA locking_mode=EXCLUSIVE")
    if readonly:
        conn.execute("PRAGMA query_only=1")
    return conn
