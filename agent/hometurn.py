"""Waiting one's turn for a home (docs/operations.md "Operations: a running service other commands can talk to").

A home admits one writing process at a time: its signing journal's exclusive lock (one signer per
site, §13.5). A verb that finds the home held by a one-shot command (a `write`, a `sync --once`, a
`run` still starting or stopping) waits for it, for a bounded time (`SSP_AGENT_HOME_WAIT`
seconds, default 60), saying once for whom it waits; a home held by a `run` that serves its
control socket is not waited for (it holds the home until it is stopped): the caller forwards
the verb to it or refuses it (`HeldByService`). The wait polls the lock: flock(2) has no timeout.
"""
from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import Callable, TypeVar

from firmware_bridge.errors import JournalBusy

from . import control

WAIT_ENV = "SSP_AGENT_HOME_WAIT"
DEFAULT_WAIT_S = 60.0
POLL_S = 0.1
JOURNAL = "sign-journal"   # the file whose lock is the home's (firmware_bridge/journal.py)

N = TypeVar("N")


class HeldByService(Exception):
    """`ssp-agent run` holds the home and serves its control socket."""

    def __init__(self, home: Path, pid: int | None) -> None:
        super().__init__(f"{home} is held by `ssp-agent run` (pid {pid})")
        self.home, self.pid = home, pid


class StillHeld(Exception):
    """The home stayed held for the whole wait."""


class Stopped(Exception):
    """Told to stop (SIGTERM) while waiting."""


def budget() -> float:
    """Seconds to wait: `SSP_AGENT_HOME_WAIT`, else the default. ValueError for a bad value."""
    v = os.environ.get(WAIT_ENV, "").strip()
    if not v:
        return DEFAULT_WAIT_S
    try:
        s = float(v)
    except ValueError:
        s = -1.0
    if not 0 <= s <= 86400:
        raise ValueError(f"{WAIT_ENV} must be a number of seconds from 0 to 86400, got {v!r}")
    return s


def busy(home: Path) -> bool:
    """Whether some process holds the home's lock (a shared lock tried and dropped at once)."""
    try:
        fd = os.open(Path(home) / JOURNAL, os.O_RDONLY)
    except OSError:
        return False          # no journal: the open itself says what is wrong
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)          # drops the lock if it was taken


def holder(home: Path) -> tuple[int, str] | None:
    """The process holding the home's lock, from /proc/locks (Linux): its pid and command line."""
    try:
        st = os.stat(Path(home) / JOURNAL)
        text = Path("/proc/locks").read_text()
    except OSError:
        return None
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    best = None
    for line in text.splitlines():
        f = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"; a blocked waiter's line has "->" in f[1]
        if len(f) < 6 or f[1] != "FLOCK" or f[3] != "WRITE" or not f[4].isdecimal():
            continue
        if f[5] == dev:
            best = int(f[4])
            break
        if f[5].endswith(f":{st.st_ino}"):   # an overlay's st_dev is not its inode's device
            best = int(f[4])
    if not best:
        return None
    return best, _command(best)


def _command(pid: int) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in argv if a]
    # the verb, not the interpreter, the script or the home: "ssp-agent write", "ssp-agent run"
    i = 1
    while i < len(words):
        w = words[i]
        if w in ("--home", "-c", "-m"):
            i += 2
        elif w.startswith("-") or "/" in w or "\n" in w:
            i += 1
        else:
            return f"ssp-agent {w}"
    return " ".join(words)[:80]


def describe(who: tuple[int, str] | None) -> str:
    return f"pid {who[0]} ({who[1]})" if who else "another process"


def open_in_turn(home: Path, open_fn: Callable[[], N], *, wait_s: float,
                 should_stop: Callable[[], bool] | None = None, say: Callable[[str], None] | None = None) -> N:
    """`open_fn()` once no other process holds `home`, waiting up to `wait_s` for a one-shot
    holder. HeldByService at once when a running service holds it; StillHeld after the wait;
    Stopped when `should_stop()` turns true meanwhile."""
    deadline = None
    said = False
    while True:
        if not busy(home):
            try:
                return open_fn()
            except JournalBusy:
                pass          # taken between the look and the open: wait for that one too
        if control.listening(home):
            who = holder(home)
            raise HeldByService(home, who[0] if who else None)
        who = holder(home)
        now = time.monotonic()
        if deadline is None:
            deadline = now + wait_s
        if now >= deadline:
            raise StillHeld(f"{home} is still in use by {describe(who)} after waiting {wait_s:g} s: nothing was done; "
                            f"run this again once it is done (or set {WAIT_ENV}=SECONDS to wait longer)")
        if not said and say is not None:
            say(f"{home} is in use by {describe(who)}; waiting up to {wait_s:g} s for its turn")
            said = True
        if should_stop is not None and should_stop():
            raise Stopped(f"stopped while waiting for {home}, in use by {describe(who)}")
        time.sleep(POLL_S)
