"""Small durability helpers (fsync of a directory, atomic file replacement)."""
from __future__ import annotations

import errno
import os


def fsync_dir(path: str) -> None:
    """fsync a directory so a created/renamed entry in it is durable (POSIX)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` or raise OSError. ``os.write`` may write fewer bytes than
    asked (a full filesystem writes what fits and returns that count; the error comes only on the
    next call), so one call whose count is ignored can leave a truncated file behind."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        if n <= 0:  # never seen from a regular file, but a loop must not spin on it
            raise OSError(errno.ENOSPC, "short write: nothing written")
        view = view[n:]


def atomic_write(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` so that after a crash either the old or the new content is
    there, and raise OSError (leaving the old content and no temporary file) if it cannot be
    written whole: a short write, ENOSPC or a failed fsync is a failure, never a truncated file."""
    tmp = f"{path}.tmp.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))
