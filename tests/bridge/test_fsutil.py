"""firmware_bridge.fsutil.atomic_write: a short write is a failure, never a truncated file.

`os.write` may write fewer bytes than asked (a full filesystem writes what fits and returns that
count; ENOSPC comes only on the next call). The old code wrote once, ignored the count, fsynced
and renamed: a truncated file in place of the old one, reported as success."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def _run_limited(path, data_len: int, limit: int):
    """atomic_write in a child whose file-size limit (RLIMIT_FSIZE) is `limit` bytes: the kernel
    writes up to the limit and returns a short count, then refuses with EFBIG (a real fault)."""
    code = textwrap.dedent(f"""
        import os, resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        fd = os.open({str(path) + '.probe'!r}, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        n = os.write(fd, b"p" * {data_len})   # show the fault is a short write, not an exception
        os.close(fd); os.unlink({str(path) + '.probe'!r})
        from firmware_bridge.fsutil import atomic_write
        try:
            atomic_write({str(path)!r}, b"n" * {data_len}, 0o644)
        except OSError as e:
            print("short", n, "raised", e.errno); sys.exit(0)
        print("short", n, "returned"); sys.exit(0)
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_a_short_write_raises_and_leaves_the_old_file(tmp_path):
    f = tmp_path / "out.bin"
    f.write_bytes(b"old")
    p = _run_limited(f, 100_000, 4096)
    assert p.returncode == 0, p.stderr
    words = p.stdout.split()
    assert words[:2] == ["short", "4096"]  # the kernel really wrote short
    assert words[2] == "raised", p.stdout  # ... and atomic_write did not pretend otherwise
    assert f.read_bytes() == b"old"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out.bin"]  # no temporary left behind


def test_a_whole_write_replaces(tmp_path):
    from firmware_bridge.fsutil import atomic_write
    f = tmp_path / "out.bin"
    f.write_bytes(b"old")
    atomic_write(str(f), b"x" * 300_000, 0o644)
    assert f.read_bytes() == b"x" * 300_000 and oct(f.stat().st_mode & 0o777) == "0o644"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out.bin"]
