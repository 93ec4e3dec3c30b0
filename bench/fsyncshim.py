"""Build and use bench/fsync_shim.c (benches only): count a process's fsync/fdatasync calls and
delay each to simulate a slow flush. ``build(dir)`` returns the .so path, or None without a C
compiler (the benches then say what they could not measure)."""
from __future__ import annotations

import os
import shutil
import subprocess

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fsync_shim.c")


def build(directory: str) -> str | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    out = os.path.join(directory, "fsync_shim.so")
    r = subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", out, SRC, "-ldl"], capture_output=True, text=True)
    return out if r.returncode == 0 else None


def env(shim: str, *, delay_us: int = 0, count_file: str | None = None, base: dict | None = None) -> dict:
    e = dict(os.environ if base is None else base)
    e["LD_PRELOAD"] = shim
    if delay_us:
        e["SSP_FSYNC_DELAY_US"] = str(delay_us)
    if count_file:
        e["SSP_FSYNC_COUNT_FILE"] = count_file
    return e


def read_counts(count_file: str) -> list[tuple[int, int, int]]:
    """[(pid, fsyncs, fdatasyncs)] of every process that exited with the shim loaded."""
    try:
        with open(count_file) as f:
            return [tuple(int(x) for x in line.split()) for line in f if line.strip()]  # type: ignore[misc]
    except FileNotFoundError:
        return []
