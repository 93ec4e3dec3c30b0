"""An in-memory link pair for tests and benchmarks: two endpoints, frames as bytes, and faults
(drop, duplicate, reorder, delay) drawn from a seeded random source. Time is simulated: the
caller passes `now`; nothing sleeps."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterable


@dataclass
class Faults:
    drop: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0  # chance a frame is delivered after frames sent later
    delay_ms: tuple[int, int] = (0, 0)  # uniform extra latency


@dataclass
class MemoryLink:
    """Frames in flight between endpoints 0 and 1."""

    faults: Faults = field(default_factory=Faults)
    seed: int = 0
    latency_ms: int = 1
    bytes_sent: int = 0
    frames_sent: int = 0
    _q: list[tuple[int, int, int, bytes]] = field(default_factory=list)  # (due, order, to, data)
    _n: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def send(self, frm: int, data: bytes, now: int) -> None:
        self.bytes_sent += len(data)
        self.frames_sent += 1
        f = self.faults
        if f.drop and self.rng.random() < f.drop:
            return
        copies = 2 if f.duplicate and self.rng.random() < f.duplicate else 1
        for _ in range(copies):
            due = now + self.latency_ms + (self.rng.randint(*f.delay_ms) if f.delay_ms[1] else 0)
            if f.reorder and self.rng.random() < f.reorder:
                due += self.rng.randint(1, 50)
            self._n += 1
            self._q.append((due, self._n, 1 - frm, data))

    def due(self, now: int) -> list[tuple[int, bytes]]:
        ready = sorted(x for x in self._q if x[0] <= now)
        self._q = [x for x in self._q if x[0] > now]
        return [(to, data) for _, _, to, data in ready]

    def next_due(self) -> int | None:
        return min((x[0] for x in self._q), default=None)

    def clear(self) -> None:
        self._q.clear()


class Pair:
    """Two sessions joined by a MemoryLink; `run` advances simulated time until quiet."""

    def __init__(self, a, b, link: MemoryLink | None = None, chain: bool = False) -> None:
        self.sessions = (a, b)
        self.link = link or MemoryLink()
        # The session's chain rule (`Session.chain`, as a serial line runs it): after an exchange
        # that moved events, the next one at once. Off by default: the benches and tests that
        # count exchanges started by `exchange` keep one cycle each.
        self.chain = chain

    def start(self, now: int) -> None:
        for s in self.sessions:
            s.start(now)
        self.flush(now)

    def flush(self, now: int) -> None:
        for i, s in enumerate(self.sessions):
            for data in s.data_to_send():
                self.link.send(i, data, now)

    def step(self, now: int) -> int:
        """Deliver what is due, fire timers that passed, move output to the link. Returns the
        number of frames delivered."""
        delivered = self.link.due(now)
        for to, data in delivered:
            self.sessions[to].receive(data, now)
        if self.chain:
            for s in self.sessions:
                s.chain(now)
        for s in self.sessions:
            t = s.timer()
            if t is not None and t <= now:
                s.handle_timer(now)
        self.flush(now)
        return len(delivered)

    def run(self, now: int, until: int, idle_stop: bool = True) -> int:
        """Advance time from `now` to at most `until`, jumping between events. Stops early once
        nothing is in flight and no exchange is pending (when idle_stop). Returns the time reached."""
        t = now
        while t <= until:
            self.step(t)
            nxt = [x for x in [self.link.next_due()] + [s.timer() for s in self.sessions] if x is not None]
            if idle_stop and self.link.next_due() is None and self.quiet():
                return t
            if not nxt:
                return t
            t = max(t + 1, min(nxt))
        return t

    def quiet(self) -> bool:
        return all(not s.busy and s.state == "ready" for s in self.sessions)

    def exchange(self, now: int, until: int | None = None) -> int:
        """One batch cycle started by endpoint 0, run to completion (or `until`)."""
        self.sessions[0].cycle(now)
        self.flush(now)
        return self.run(now, until if until is not None else now + 60_000)


def frames(link: MemoryLink) -> Iterable[bytes]:
    return [d for *_, d in link._q]
