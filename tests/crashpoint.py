"""Named crash points for producer subprocesses: SIGKILL this process the hit-th time a point is
reached, as named by an environment variable ("point:hit"); no variable, no kill."""
from __future__ import annotations

import os
import signal
from typing import Callable


def hook_from_env(var: str) -> Callable[[str], None]:
    point, _, hit = os.environ.get(var, "").partition(":")
    count = 0

    def hook(reached: str) -> None:
        nonlocal count
        if point and reached == point:
            count += 1
            if count == int(hit):
                os.kill(os.getpid(), signal.SIGKILL)
    return hook
