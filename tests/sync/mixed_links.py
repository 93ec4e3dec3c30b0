"""Exchanges between two nodes over the links the mesh state machine mixes: the shipped session
(agent/core/session.py through SyncDriver) over the in-memory link, and the same session through
SerialEndpoint over the serial link state machine (agent/transport/serial_link.py, sans I/O)
with a lossy byte pipe between the ends (tools/serial_relay.py LineFaults: bit errors, dropped,
doubled, reordered and truncated frames), all in simulated time."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))  # serial_relay

from serial_relay import LineFaults  # noqa: E402

from agent.sync import SyncDriver  # noqa: E402
from agent.transport.serial import SerialEndpoint, SessionSettings  # noqa: E402
from agent.transport.serial_link import LinkConfig, SerialLink  # noqa: E402


class SerialLine:
    """Two SerialEndpoints joined by a byte pipe at `baud` (a byte takes 10 bit times), each way
    through its own LineFaults; one tick is 1 ms. A cable plugged in for one exchange: new link
    incarnations each time (new nonces), as when a technician plugs a laptop in."""

    def __init__(self, drivers, faults, base: int, nonce: int, baud: int = 115_200, batch_limit: int = 50,
                 cycle_ms: int = 2_000) -> None:
        self.base, self.t = base, 0
        self.q: list[list[tuple[float, bytes]]] = [[], []]
        self.free = [0.0, 0.0]
        self.rate = baud / 10 / 1000
        self.faults = faults
        self.eps = [SerialEndpoint(d, SerialLink(LinkConfig(baud=baud, dead_ms=4_000, keepalive_ms=500),
                                                 (nonce + 7919 * i) & 0xFFFFFFFF or 1), self._writer(i),
                                   SessionSettings(secure=True, cycle_ms=cycle_ms, answer_timeout_ms=20_000,
                                                   batch_limit=batch_limit))
                    for i, d in enumerate(drivers)]
        for ep in self.eps:
            ep.start(0)

    def _writer(self, i):
        def write(data: bytes) -> None:
            out = self.faults[i].apply(data)
            for k in range(0, len(out), 64):
                piece = out[k:k + 64]
                self.free[i] = max(self.t, self.free[i]) + len(piece) / self.rate
                self.q[i].append((self.free[i] + 2, piece))
        return write

    def run(self, until: int, done=lambda: False) -> bool:
        while self.t < until:
            t = self.t
            for i in (0, 1):
                due = [x for x in self.q[i] if x[0] <= t]
                self.q[i] = [x for x in self.q[i] if x[0] > t]
                for _, d in due:
                    self.eps[1 - i].receive_bytes(d, t, self.base + t)
            for ep in self.eps:
                ep.handle_timer(t, self.base + t)
            if done():
                return True
            nxt = [int(x[0]) + 1 for q in self.q for x in q] + \
                [x for x in (ep.timer(t, self.base + t) for ep in self.eps) if x is not None]
            self.t = max(t + 1, min(nxt)) if nxt else t + 100
        return False

    def exchanged(self) -> bool:
        """Both ends completed an exchange (one carries both directions) and the link is idle."""
        return all(ep.completed >= 1 and not ep.busy() for ep in self.eps)


def serial_exchange(na, nb, now: int, limit: int, seed: int, cut_ms: int | None, **faults) -> int:
    """One exchange over a cable between `na` and `nb` starting at wall time `now`: cut after
    `cut_ms` of simulated time in whatever state it is (None: until both ends completed one
    exchange on a clean line). Fresh drivers: SerialEndpoint counts outcomes on its driver, and
    a plugged cable is a new process's link anyway. Returns the wall time reached."""
    line = SerialLine([SyncDriver(na, batch_limit=limit), SyncDriver(nb, batch_limit=limit)],
                      [LineFaults(seed=seed, **faults), LineFaults(seed=seed + 1, **faults)], now, seed * 2 + 1,
                      batch_limit=limit)
    if cut_ms is None:
        assert line.run(600_000, line.exchanged), "no exchange over a clean serial line in 600 s"
    else:
        line.run(cut_ms)
    return now + line.t + 1


def mqtt_exchange(broker, na, nb, limit: int, cut_ms: int | None) -> None:
    """`na` and `nb` each offer the other a window of bodies through a real mosquitto, both
    runners (agent/runner.py, the MQTT path) answering; after `cut_ms` of wall time both
    processes stop in whatever state they are (bodies and answers left in the broker reach a
    later runner of that node, §14.1), or (None) once each has its bodies answered. Wall time:
    the runner reads the real clock and runs the paho network thread."""
    import time

    from agent.runner import RunConfig, Runner
    from agent.transport.mqtt import MqttSettings
    settings = MqttSettings.from_url(broker.url, backoff_min_s=0.05, backoff_max_s=0.5)
    runners = []
    try:
        for n in (na, nb):
            r = Runner(n, settings, RunConfig(cadence_s=3600, answer_timeout_s=3.0, realtime=False, secure=True,
                                              max_events=limit))
            runners.append(r)
            assert r.start(10), r.link.last_error
        ra, rb = runners
        ra.offer(nb.site_id)
        rb.offer(na.site_id)
        deadline = time.monotonic() + (cut_ms / 1000 if cut_ms is not None else 20)
        while time.monotonic() < deadline:
            for r in runners:
                r.step(0.005)
            if cut_ms is None and not ra.in_flight(nb.site_id) and not rb.in_flight(na.site_id):
                return
        assert cut_ms is not None, "an exchange over MQTT did not complete in 20 s"
    finally:
        for r in runners:
            r.close()
