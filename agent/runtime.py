"""`ssp-agent run`'s one loop, for every transport (docs/serial.md "A gateway", docs/mqtt.md).

One thread owns the node (one writer, docs/operations.md) and drives, in one loop:
- the MQTT Runner (agent/runner.py) when a broker is configured, through its public
  `step(timeout)` / `summary()`;
- any number of serial ports (agent/transport/serial.py `SerialPort`), each with its own link
  and session, each reopened on its own when its adapter goes away;
- between the steps: the verbs other commands forward through the control socket
  (agent/control.py), the systemd watchdog, the metrics file, the profile's eviction job and
  (without MQTT) the clock evidence (agent/jobs.py; the runner's step keeps its own clock check);
- realtime (§33): after a local write every link is told at once; when the node serves more
  than one link (a gateway), events that arrived over one link are pushed on the others at once
  (each push selects from that peer's cursor; self-echo is filtered there), instead of waiting
  for their next batch cycle.

Waiting. With MQTT alone the loop blocks in the runner's queue (`step(TICK_S)`), as `run` always
did. With serial ports, one poll() waits on every open port's descriptor and a wake-up pipe
that the MQTT network thread and the control socket's threads write to when something arrives
for the loop; its timeout is the nearest port timer (a retransmission, a keep-alive, a port to
reopen), at most TICK_S, the pace of the runner's own timers (cycles, expiry, coalesced pushes).
Nothing in a turn blocks: a port that went away is retried on its timer, never by sleeping, so
a pulled cable on one port does not hold up the others.
"""
from __future__ import annotations

import os
import select
import time
from collections import Counter
from typing import Any, Callable

from . import jobs, sdnotify
from .control import ControlServer
from .metrics import write_metrics_file
from .store import eventlog

TICK_S = 0.05  # longest wait of one turn: the runner's timers are looked at this often
_EVERY_LINK = object()
CLOCK_S = 60.0  # clock evidence (docs/apply.md "Clocks without an RTC")


class Runtime:
    def __init__(self, node, *, runner=None, ports: list | tuple = (), broker_url: str | None = None,
                 forward: Callable[..., tuple[int, str, str]] | None = None,
                 eviction_interval_s: float | None = None, metrics_file: str | None = None,
                 metrics_interval_s: float = 15.0) -> None:
        if runner is None and not ports:
            raise ValueError("a runtime needs a broker or at least one serial port")
        self.node, self.runner, self.ports = node, runner, list(ports)
        self.broker_url = broker_url
        self.forward = forward
        self.eviction_interval_s = eviction_interval_s
        self.metrics_file, self.metrics_interval_s = metrics_file, metrics_interval_s
        # With a runner its counters are the process's (summary, metrics): evictions go there too.
        self.stats: Counter = runner.stats if runner is not None else Counter()
        self.last_eviction: dict | None = None
        self._relay = len(self.ports) + (runner is not None) > 1
        self._seen_top = self._top() if self._relay else 0
        self._next_evict = 0.0   # the first turn evicts, as the runner always did
        self._next_clock = 0.0
        self._next_metrics = 0.0
        self._next_runner = 0.0
        self._wake_r = self._wake_w = None
        if self.ports:
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
            if runner is not None:
                runner.link.wake = self.wake

    # ------------------------------------------------------------------ what the loop reports
    def summary(self) -> dict[str, Any]:
        """`run`'s summary: the runner's (MQTT alone) or the endpoint's (one serial port) as it
        always was; a gateway's has one per link."""
        ev = {"evictions": self.stats.get("evictions", 0)}
        if self.runner is not None:
            mq = self.runner.summary()
            mq["config"]["eviction_interval_s"] = self.eviction_interval_s  # the runtime runs the job
            if not self.ports:
                return mq
        if self.runner is None and len(self.ports) == 1:
            return {**self.ports[0].endpoint.summary(), **ev}
        return {"mqtt": mq if self.runner is not None else None,
                "serial": {p.port: p.endpoint.summary() for p in self.ports}, **ev}

    def status_extra(self) -> dict[str, Any]:
        """What `status` adds while `run` holds the home."""
        if self.runner is not None and not self.ports:
            return {"pid": os.getpid(), "broker": self.broker_url, **self.runner.summary()}
        if self.runner is None and len(self.ports) == 1:
            return {"pid": os.getpid(), "serial": self.ports[0].port, **self.summary()}
        return {"pid": os.getpid(), "broker": self.broker_url, **self.summary()}

    def describe(self) -> str:
        links = [f"over {p.port}" for p in self.ports]
        if self.runner is not None:
            links.append(f"through {self.broker_url}")
        return "syncing " + " and ".join(links)

    # ------------------------------------------------------------------ the loop
    def run(self, should_stop: Callable[[], bool]) -> dict[str, Any]:
        server = ControlServer(self.node.home, self._execute, wake=self.wake if self.ports else None)
        watchdog = sdnotify.Watchdog()
        # Type=notify: ready once the control socket serves and the links are started (an MQTT
        # broker that is down is retried by its link: the service is up either way).
        sdnotify.notify(f"READY=1\nSTATUS={self.describe()}\nMAINPID={os.getpid()}")
        try:
            while not should_stop():
                watchdog.ping()   # from the loop itself: a loop stuck in a step is what the watchdog sees
                self.turn()
                server.serve()
                self._jobs()
        finally:
            sdnotify.notify("STOPPING=1")
            server.close()
            write_metrics_file(self.node, self.metrics_file, self._run_stats())
            self._close_wake()
        return self.summary()

    def turn(self) -> None:
        """Wait for the first thing due (at most TICK_S), then step every link that has work."""
        r = self.runner
        if not self.ports:
            r.step(TICK_S)   # MQTT alone: nothing else to wait on
            return
        now = time.monotonic()
        wait = min(p.wait_s(TICK_S) for p in self.ports)
        if r is not None:
            wait = min(wait, max(0.0, self._next_runner - now))
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        fds: dict[int, Any] = {}
        for p in self.ports:
            fd = p.fileno()
            if fd is not None:
                fds[fd] = p
                poller.register(fd, select.POLLIN | (select.POLLOUT if p.wants_write else 0))
        try:
            ready = dict(poller.poll(wait * 1000))
        except InterruptedError:
            ready = {}
        woken = self._wake_r in ready and self._drain_wake()
        if r is not None and (woken or time.monotonic() >= self._next_runner):
            self._next_runner = time.monotonic() + TICK_S
            r.step(0)
            if self._relay:
                self._relayed(None)
        for p in self.ports:
            fd = p.fileno()
            ev = ready.get(fd, 0) if fd is not None and fds.get(fd) is p else 0
            # POLLHUP / POLLERR / POLLNVAL: reading tells the port what happened (end of file, EIO)
            got = p.service(bool(ev & (select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLNVAL)),
                            bool(ev & select.POLLOUT))
            if got and self._relay:
                self._relayed(p)

    # ------------------------------------------------------------------ realtime across links
    def _top(self) -> int:
        return eventlog.top(self.node.conn)

    def _relayed(self, source) -> None:
        """Events arrived over `source` (a port, or None: MQTT): push them on the other links now."""
        top = self._top()
        if top <= self._seen_top:
            return
        self._seen_top = top
        self._tell(exclude=source)

    def _tell(self, exclude: Any = _EVERY_LINK) -> None:
        """Tell every link but `exclude` (a port, or None for MQTT) that there is something to push."""
        from .transport.serial import _mono, _wall
        if self.runner is not None and exclude is not None:
            self.runner.notify_produced()
        mono, wall = _mono(), _wall()
        for p in self.ports:
            if p is not exclude:
                p.endpoint.local_events(mono, wall)

    def local_write(self) -> None:
        """The node wrote (a forwarded `write`): every realtime peer gets it at once (§33)."""
        self._tell()
        if self._relay:
            self._seen_top = self._top()

    def _execute(self, argv: list[str]) -> tuple[int, str, str]:
        res = self.forward(argv, self.node, self.status_extra)
        if res[0] == 0 and "write" in argv:
            self.local_write()
        return res

    # ------------------------------------------------------------------ between the steps
    def _jobs(self) -> None:
        now = time.monotonic()
        if self.eviction_interval_s and now >= self._next_evict:
            self._next_evict = now + self.eviction_interval_s
            rep = jobs.evict(self.node, self.stats)
            if rep is not None:
                self.last_eviction = rep
        if self.runner is None and now >= self._next_clock:
            self._next_clock = now + CLOCK_S
            jobs.note_clock(self.node)
        if self.metrics_file and now >= self._next_metrics:
            write_metrics_file(self.node, self.metrics_file, self._run_stats())
            self._next_metrics = now + self.metrics_interval_s

    def _run_stats(self) -> Counter | None:
        return self.stats if self.runner is not None else None

    # ------------------------------------------------------------------ the wake-up pipe
    def wake(self) -> None:
        """Any thread: something arrived for the loop (an MQTT message, a control request)."""
        if self._wake_w is None:
            return
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # full: the loop is woken already; closed: the loop is gone

    def _drain_wake(self) -> bool:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass
        return True

    def _close_wake(self) -> None:
        if self.runner is not None:
            self.runner.link.wake = lambda: None
        for fd in (self._wake_r, self._wake_w):
            if fd is not None:
                os.close(fd)
        self._wake_r = self._wake_w = None
