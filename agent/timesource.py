"""The time the loops are given: one `Clock` passed into the MQTT runner, the serial ports, the
runtime and the broker launcher, so transports and drivers read no clock of their own (as the
serial link and aioquic take `now`), and a test can drive them with its own.

Two clocks, for two jobs: the monotonic one for timers and deadlines (a clock step must not end a
link or give up on a peer), the wall one in milliseconds for what is stored or compared across
nodes (HLCs, the skew bound, sent_bodies, learned body limits: agent/clockstate.py's)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from .clockstate import now_ms


@dataclass(frozen=True)
class Clock:
    mono: Callable[[], float]  # monotonic seconds
    wall_ms: Callable[[], int]  # wall-clock milliseconds
    sleep: Callable[[float], None]  # wait this many seconds (a loop with nothing to poll)

    def mono_ms(self) -> int:
        return int(self.mono() * 1000)


SYSTEM = Clock(time.monotonic, now_ms, time.sleep)
