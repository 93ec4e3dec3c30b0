"""sd_notify(3) in a few lines: datagrams to $NOTIFY_SOCKET, no dependency.
`run` says READY=1 once it serves (the runner started, the control socket open), pings the
watchdog (WATCHDOG=1) from its loop every half of $WATCHDOG_USEC, and says STOPPING=1 on its
way out. Outside systemd ($NOTIFY_SOCKET unset) every call does nothing."""
from __future__ import annotations

import os
import socket
import time


def notify(state: str) -> bool:
    """Send one notification (e.g. "READY=1"); False when there is no socket or it failed."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":   # an abstract socket
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError:
        return False   # the service manager went away: nothing to tell


def watchdog_interval_s() -> float | None:
    """Seconds between pings (half the watchdog timeout), or None when no watchdog is set for us."""
    usec, pid = os.environ.get("WATCHDOG_USEC"), os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 2e6 if int(usec) > 0 else None
    except ValueError:
        return None


class Watchdog:
    """Call `ping()` from the loop as often as it likes; it sends WATCHDOG=1 at most once per interval."""

    def __init__(self) -> None:
        self.interval = watchdog_interval_s()
        self._last = None

    def next_due(self) -> float | None:
        """When `ping` next sends (monotonic), or None without a watchdog: the loop wakes for it."""
        if self.interval is None:
            return None
        return time.monotonic() if self._last is None else self._last + self.interval

    def ping(self) -> None:
        if self.interval is None:
            return
        now = time.monotonic()
        if self._last is None or now - self._last >= self.interval:
            notify("WATCHDOG=1")
            self._last = now
