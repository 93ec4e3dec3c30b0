"""How many rows of one kind a link surfaces (docs/apply.md "Bounds"), pure: every surfaced row
is a transaction (an fsync), and a hostile sender provokes refusals at will, so each link (the
MQTT runner's refusals and broker losses, a serial port's losses) admits them through this."""
from __future__ import annotations

from typing import Any


class SurfaceBudget:
    """A flood bound on surfaced rows (docs/apply.md "Bounds"): at most
    `per_window` per key (source, reason) in each `window` (in the caller's time unit); each
    surfaced row is a transaction of its own (an fsync), and a hostile sender can provoke
    refusals at will. The rest are counted and told in one row when the key's next window starts
    (`admit`) or the caller stops (`drain`)."""

    def __init__(self, per_window: int, window: float) -> None:
        self.per_window, self.window = per_window, window
        self.windows: dict[Any, list] = {}  # key -> [window start, surfaced, not surfaced]

    def admit(self, key: Any, now: float) -> tuple[bool, int]:
        """(surface this one, refusals not surfaced in the key's window that just ended: 0 or
        the count to tell in one row now)."""
        w = self.windows.get(key)
        told = 0
        if w is None or now - w[0] >= self.window:
            if w is not None:
                told = w[2]
            w = self.windows[key] = [now, 0, 0]
        if w[1] >= self.per_window:
            w[2] += 1
            return False, told
        w[1] += 1
        return True, told

    def drain(self) -> list[tuple[Any, int]]:
        out = [(k, w[2]) for k, w in self.windows.items() if w[2]]
        self.windows.clear()
        return out


def not_surfaced(count: int, window_s: float, what: str = "") -> str:
    """The one row that tells what a SurfaceBudget's window did not surface (every link's);
    ``what``: the rows' kind ("refusals"), when the row's own kind does not say it."""
    return f"{count} more {what + ' ' if what else ''}not surfaced within {window_s:g} s (flood bound)"
