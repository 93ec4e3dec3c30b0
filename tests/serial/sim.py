"""A simulated serial line for the sans-I/O link: two SerialLinks, each direction through
LineFaults (tools/serial_relay.py), throttled to the line rate, in simulated time."""
from __future__ import annotations

from agent.transport.serial_link import LinkConfig, SerialLink
from serial_relay import LineFaults


class SimLine:
    def __init__(self, a: SerialLink, b: SerialLink, fab: LineFaults | None = None, fba: LineFaults | None = None,
                 baud: int = 115_200, latency_ms: int = 2) -> None:
        self.links = [a, b]
        self.faults = [fab or LineFaults(), fba or LineFaults(seed=1)]
        self.rate = baud / 10 / 1000  # bytes per ms
        self.latency = latency_ms
        self.q: list[list[tuple[float, bytes]]] = [[], []]
        self.free = [0.0, 0.0]
        self.received: list[list[bytes]] = [[], []]
        self.pulled = False
        self.take = [True, True]  # whether each end takes its messages (a busy node does not)
        self.line_bytes = [0, 0]

    def flush(self, now: int) -> None:
        for i, ln in enumerate(self.links):
            data = ln.data_to_send()
            if not data:
                continue
            self.line_bytes[i] += len(data)
            if self.pulled:
                continue
            out = self.faults[i].apply(data)
            for k in range(0, len(out), 64):  # bytes arrive as the line sends them, not all at the end
                piece = out[k:k + 64]
                self.free[i] = max(now, self.free[i]) + len(piece) / self.rate
                self.q[i].append((self.free[i] + self.latency, piece))

    def step(self, now: int) -> None:
        for i in (0, 1):
            due = [x for x in self.q[i] if x[0] <= now]
            self.q[i] = [x for x in self.q[i] if x[0] > now]
            for _, data in due:
                self.links[1 - i].receive_bytes(data, now)
        self.flush(now)
        for i, ln in enumerate(self.links):
            if self.take[i]:
                self.received[i] += ln.messages()
            t = ln.timer()
            if t is not None and t <= now:
                ln.handle_timer(now)
        self.flush(now)

    def next_time(self, now: int) -> int:
        ts = [int(x[0]) + 1 for q in self.q for x in q] + [t for t in (ln.timer() for ln in self.links) if t is not None]
        return max(now + 1, min(ts)) if ts else now + 1000

    def run(self, now: int, until: int, done=None) -> int:
        t = now
        while t < until:
            self.step(t)
            if done is not None and done():
                return t
            t = self.next_time(t)
        return t


def pair(seed: int = 0, fab: LineFaults | None = None, fba: LineFaults | None = None, **cfg) -> SimLine:
    c = LinkConfig(**cfg)
    return SimLine(SerialLink(c, 0x1000 + seed), SerialLink(c, 0x2000 + 7 * seed), fab, fba)


def up(line: SimLine, now: int = 0) -> int:
    for ln in line.links:
        ln.start(now)
    t = line.run(now, now + 60_000, lambda: all(ln.up for ln in line.links))
    assert all(ln.up for ln in line.links), [ln.state for ln in line.links]
    return t
