"""`run`'s stop request (SIGTERM, SIGINT; docs/operations.md): one flag, set by the handler that
`ssp-agent run` installs first thing (agent/cli/__init__.py `main`), read by every stage of its start-up
(waiting for the home, connecting to the broker) and by its loop, which `wake` leaves at once.
So a stop at any moment ends `run` cleanly, with its summary, never by the signal."""
from __future__ import annotations

import signal
from typing import Callable

_STOP: dict = {"v": False, "wake": None}


def catch() -> None:
    """Install the handler (idempotent)."""
    def _stop(*_a):
        _STOP["v"] = True
        if _STOP["wake"] is not None:
            _STOP["wake"]()   # the loop sleeps until its next deadline: leave now, not then
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)


def requested() -> bool:
    return _STOP["v"]


def on_stop(wake: Callable[[], None] | None) -> None:
    """What the handler calls besides setting the flag (the loop's wake-up); None: nothing."""
    _STOP["wake"] = wake
