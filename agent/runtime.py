"""`ssp-agent run`'s one loop, for every transport (docs/serial.md "A gateway", docs/mqtt.md).

One thread owns the node (one writer, docs/operations.md) and drives the MQTT Runner when a broker
is configured, any number of serial ports (each reopened on its own when its adapter goes away),
and between the steps the forwarded verbs (agent/control.py), the systemd watchdog, the metrics
file, the eviction job and the clock evidence (agent/jobs.py). After a local write every link is
told at once, and on a gateway events that arrived over one link are pushed on the others (§33).

No polling: each turn sleeps in one poll() on every open port and a wake-up pipe until the
earliest deadline of every link and job (`next_due`); what arrives wakes it at once. After each
link's work the loop asks the store whether the log grew (`store.eventlog.LogWatch`); no other
process can append while `run` holds the home, so there is no fallback check of the file. Nothing
in a turn blocks: a port that went away is retried on its timer, so a pulled cable on one port
does not hold up the others."""
from __future__ import annotations

import os
import select
from collections import Counter
from typing import Any, Callable

from . import jobs, sdnotify
from .control import ControlServer
from .metrics import write_metrics_file
from .store import db, eventlog
from .timesource import SYSTEM, Clock

# Longest sleep of one turn. Nothing needs it (every timer is a deadline, everything that arrives
# wakes the loop): it bounds what a deadline forgotten in `next_due` could cost.
MAX_WAIT_S = 30.0
_EVERY_LINK = object()
LOW_DISK_EVICT_S = 60.0  # at most this often when the disk is nearly full
CLOCK_S = 60.0  # clock evidence (docs/apply.md "Clocks without an RTC")


class Runtime:
    def __init__(self, node, *, runner=None, ports: list | tuple = (), broker_url: str | None = None,
                 forward: Callable[..., tuple[int, str, str]] | None = None,
                 eviction_interval_s: float | None = None, metrics_file: str | None = None,
                 metrics_interval_s: float = 15.0, clock: Clock = SYSTEM) -> None:
        if runner is None and not ports:
            raise ValueError("a runtime needs a broker or at least one serial port")
        self.node, self.runner, self.ports = node, runner, list(ports)
        self.clock = clock  # the loop's deadlines (monotonic) and the ports' session time (wall)
        self.broker_url = broker_url
        self.forward = forward
        self.eviction_interval_s = eviction_interval_s
        self.metrics_file, self.metrics_interval_s = metrics_file, metrics_interval_s
        # With a runner its counters are the process's (summary, metrics): evictions go there too.
        self.stats: Counter = runner.stats if runner is not None else Counter()
        self.last_eviction: dict | None = None
        self.turns = 0   # the loop's wake-ups (`loop_turns` in the summary): an idle loop sleeps
        # "The log grew" (agent/store/eventlog.py): asked after each piece of a turn's work; every
        # append happens on this thread (no other process writes while `run` holds the home).
        self._log = eventlog.LogWatch(node.conn)
        self._server = self._watchdog = None
        self._next_evict = 0.0   # the first turn evicts, as the runner always did
        self._next_clock = 0.0
        self._next_metrics = 0.0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        if runner is not None:
            runner.link.wake = self.wake

    # ------------------------------------------------------------------ what the loop reports
    def summary(self) -> dict[str, Any]:
        """`run`'s summary: the runner's (MQTT alone) or the endpoint's (one serial port) as it
        always was; a gateway's has one per link."""
        ev = {"evictions": self.stats.get("evictions", 0), "loop_turns": self.turns}
        if self.runner is not None:
            mq = self.runner.summary()
            mq["config"]["eviction_interval_s"] = self.eviction_interval_s  # the runtime runs the job
            if not self.ports:
                return {**mq, "loop_turns": self.turns}
        if self.runner is None and len(self.ports) == 1:
            return {**self.ports[0].endpoint.summary(), **ev}
        return {"mqtt": mq if self.runner is not None else None,
                "serial": {p.port: p.endpoint.summary() for p in self.ports}, **ev}

    def status_extra(self) -> dict[str, Any]:
        """What `status` adds while `run` holds the home."""
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
        server = self._server = ControlServer(self.node.home, self._execute, wake=self.wake, node=self.node)
        watchdog = self._watchdog = sdnotify.Watchdog()
        # Type=notify: ready once the control socket serves and the links are started (an MQTT
        # broker that is down is retried by its link: the service is up either way).
        sdnotify.notify(f"READY=1\nSTATUS={self.describe()}\nMAINPID={os.getpid()}")
        try:
            while not should_stop():
                watchdog.ping()   # from the loop itself: a loop stuck in a step is what the watchdog sees
                self.turn()
                if server.serve() and self._log.grew():
                    self._tell()   # a forwarded write (or any verb that appended): every link, at once
                self._jobs()
        finally:
            sdnotify.notify("STOPPING=1")
            server.close()
            self._server = self._watchdog = None
            write_metrics_file(self.node, self.metrics_file, self._run_stats())
            self._close_wake()
        return self.summary()

    def next_due(self, now: float) -> float:
        """The earliest deadline of every link and job (monotonic): the runner's
        (`Runner.next_due`: cycles, coalesced pushes, answer timeouts), each port's timers, the
        loop's jobs (eviction, clock evidence, metrics file, the systemd watchdog)."""
        due = [now + MAX_WAIT_S]
        if self.runner is not None:
            due.append(self.runner.next_due(now))
        for p in self.ports:
            due.append(now + p.wait_s(MAX_WAIT_S))
        if self.eviction_interval_s:
            due.append(self._next_evict)
        if self.runner is None:
            due.append(self._next_clock)
        if self.metrics_file:
            due.append(self._next_metrics)
        if self._watchdog is not None:
            w = self._watchdog.next_due()
            if w is not None:
                due.append(w)
        if self._server is not None and not self._server.requests.empty():
            due.append(now)   # more requests than one serve() runs
        return min(due)

    def turn(self) -> None:
        """Sleep until the first thing is due or something arrives (an MQTT message or connection
        change, a control request: the wake-up pipe; bytes on a port: its descriptor), then step
        every link that has work."""
        self.turns += 1
        r = self.runner
        now = self.clock.mono()
        wait = max(0.0, self.next_due(now) - now)
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
        if r is not None and (woken or r.next_due(self.clock.mono()) <= self.clock.mono()):
            r.step(0)
            if self._log.grew():
                self._tell(exclude=None)   # events arrived over MQTT: on to the other links now
        for p in self.ports:
            fd = p.fileno()
            ev = ready.get(fd, 0) if fd is not None and fds.get(fd) is p else 0
            # POLLHUP / POLLERR / POLLNVAL: reading tells the port what happened (end of file, EIO)
            p.service(bool(ev & (select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLNVAL)),
                            bool(ev & select.POLLOUT))
            if self._log.grew():
                self._tell(exclude=p)   # events arrived over this port: on to the other links now

    # ------------------------------------------------------------------ realtime across links
    def _tell(self, exclude: Any = _EVERY_LINK) -> None:
        """Tell every link but `exclude` (a port, or None for MQTT) that there is something to push."""
        if self.runner is not None and exclude is not None:
            self.runner.notify_produced()
        mono, wall = self.clock.mono_ms(), self.clock.wall_ms()
        for p in self.ports:
            if p is not exclude:
                p.endpoint.local_events(mono, wall)

    def _execute(self, argv: list[str]) -> tuple[int, str, str]:
        return self.forward(argv, self.node, self.status_extra)

    # ------------------------------------------------------------------ between the steps
    def _jobs(self) -> None:
        now = self.clock.mono()
        if self.eviction_interval_s and (now >= self._next_evict or self._disk_low(now)):
            self._next_evict = now + self.eviction_interval_s
            self._last_low_evict = now
            rep = jobs.evict(self.node, self.stats)
            if rep is not None:
                self.last_eviction = rep
        if self.runner is None and now >= self._next_clock:
            self._next_clock = now + CLOCK_S
            jobs.note_clock(self.node)
        if self.metrics_file and now >= self._next_metrics:
            write_metrics_file(self.node, self.metrics_file, self._run_stats())
            self._next_metrics = now + self.metrics_interval_s

    _last_low_evict = 0.0

    def _disk_low(self, now: float) -> bool:
        """A disk nearly full (below db.LOW_SPACE_BYTES free) brings
        the eviction job forward, at most once a minute: a node whose disk fills frees its own
        space without waiting for the interval (docs/reliability.md "Full disk")."""
        if now < self._last_low_evict + LOW_DISK_EVICT_S:
            return False
        free = db.free_bytes(self.node.home)
        return free is not None and free < db.LOW_SPACE_BYTES

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
