"""Sync over a serial line (docs/serial.md): the one session (agent/core/session.py, through
`SyncDriver.session(path="serial")`) over the reliable link (serial_link.py) over a port.

- `SerialEndpoint`, sans I/O: joins one SerialLink and one Session. A link incarnation that comes
  up gets a fresh session; one that goes down drops it, and what no answer confirmed is offered
  again by the next (cursors move only on answers, §14.1).
- `SerialPort`: one pyserial port driving its endpoint, from `ssp-agent run`'s loop (`service`)
  or on its own (`step`, `sync_once`). A port that disappears (a USB adapter pulled) is opened
  again by its name every REOPEN_S.

Two clocks: the link's timers run on a monotonic clock (a clock step must not end a link); the
session and the apply path get wall-clock milliseconds (HLCs, the skew bound)."""
from __future__ import annotations

import errno
import logging
import os
import select
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable

from ..core.budget import SurfaceBudget, not_surfaced
from ..faults import LOCAL_FAULTS, describe
from ..outcomes import STATUSES
from ..timesource import SYSTEM, Clock
from .serial_link import LinkConfig, LinkError, SerialLink

log = logging.getLogger("ssp_agent.serial")

PATH = "serial"
REOPEN_S = 0.5  # a port that went away is opened again this often
EVENTS_KEPT = 1000  # an endpoint's latest link and session events kept (SerialEndpoint.events)
LOSS_WINDOW_MS = 60_000
LOSSES_SURFACED_PER_WINDOW = 20  # surfaced rows per kind and reason and window (SerialEndpoint._admit)


class SerialError(Exception):
    """A local fault of the serial transport (the port cannot be opened, the other end never
    answered): exit 1 with this message."""


class _Counting:
    """The session's Provider (sync.LinkProvider), passed through, remembering how full the last
    body or answer sent was (a full one means more is waiting) and counting completed exchanges."""

    def __init__(self, inner, batch_limit: int, admit: Callable[[str, str, int], list[str]] | None = None) -> None:
        self.inner, self.batch_limit = inner, batch_limit
        self.admit = admit  # the endpoint's flood bound on surfaced rows (SerialEndpoint._admit)
        self.offered = 0
        self.received = 0  # events in bodies, answers and pushes received
        self.confirms = 0  # exchanges completed, either role (our body answered, our answer acknowledged)

    def hello_info(self):
        return self.inner.hello_info()

    def cursor(self, peer):
        return self.inner.cursor(peer)

    def records_pending(self, peer):
        return self.inner.records_pending(peer)

    def outgoing(self, peer, mode, now, **kw):
        out = self.inner.outgoing(peer, mode, now, **kw)
        self.offered += out.n_events
        return out

    def incoming(self, peer, body, *rest):
        self.received += len(body.events)
        return self.inner.incoming(peer, body, *rest)

    def confirm(self, *args):
        self.confirms += 1
        return self.inner.confirm(*args)

    def protocol_error(self, peer, reason, detail, now):
        if self.admit is None:
            return self.inner.protocol_error(peer, reason, detail, now)
        for d in self.admit("refused", reason, now, detail):
            self.inner.protocol_error(peer, reason, d, now)


class _Recent(deque):
    """An endpoint's link and session events: the latest EVENTS_KEPT (a `run` that lasts months
    would otherwise keep one per exchange, every cadence, for ever), and counts of every kind."""

    def __init__(self) -> None:
        super().__init__(maxlen=EVENTS_KEPT)
        self.counts: Counter = Counter()
        self.down_reasons: set[str] = set()

    def append(self, item: tuple[str, str]) -> None:
        super().append(item)
        self.counts[item[0]] += 1
        if item[0] == "link_down":
            self.down_reasons.add(item[1])


@dataclass
class SessionSettings:
    realtime: bool = True
    secure: bool = False
    cycle_ms: int = 30_000
    answer_timeout_ms: int = 60_000
    batch_limit: int = 1000
    once: bool = False  # sync --once: no cadence; the end with the larger site_id starts an exchange
    # only if the other end has not started one within `responder_wait_ms` (one exchange carries
    # both directions, so two at once would send the same events twice)
    responder_wait_ms: int = 5_000


class SerialEndpoint:
    def __init__(self, driver, link: SerialLink, write: Callable[[bytes], None], settings: SessionSettings) -> None:
        self.driver, self.link, self.write, self.settings = driver, link, write, settings
        self.session = None
        self.provider: _Counting | None = None
        self.totals = {s: 0 for s in STATUSES}  # what happened to received events, every session
        receive = driver.receive

        def counted(*args, **kw):
            k, outs = receive(*args, **kw)
            for o in outs:
                self.totals[o.status] += 1
            return k, outs
        driver.receive = counted  # the one apply path's outcomes, counted for the summary
        self.offered = 0
        self.exchanges = 0  # completed, either role, all sessions
        self.sessions = 0
        self._ready_at: int | None = None
        self._rcv_at_ready = 0
        self._seen_confirms = 0
        self._moved_mark = 0
        self.empty_exchanges = 0  # completed exchanges that moved no event either way
        self.events = _Recent()  # link and session events, for the caller: the latest, and counts of all
        self.name = ""  # the port, in surfaced rows
        self._loss_budget = SurfaceBudget(LOSSES_SURFACED_PER_WINDOW, LOSS_WINDOW_MS)  # (kind, reason), wall ms

    # ------------------------------------------------------------------ inputs
    def start(self, mono: int) -> None:
        self.link.start(mono)
        self._flush()

    def receive_bytes(self, data: bytes, mono: int, wall: int) -> None:
        self.link.receive_bytes(data, mono)
        self._pump(mono, wall)

    def handle_timer(self, mono: int, wall: int) -> None:
        t = self.link.timer()
        if t is not None and t <= mono:
            self.link.handle_timer(mono)
        s = self.session
        if s is not None:
            st = s.timer()
            if st is not None and st <= wall:
                s.handle_timer(wall)
            if self._ready_at is not None and mono >= self._ready_at + self.settings.responder_wait_ms:
                if self.link.stream_received > self._rcv_at_ready + 512:
                    # Bytes are arriving: the other end's body, most likely. Keep waiting for it.
                    self._ready_at, self._rcv_at_ready = mono, self.link.stream_received
                else:
                    self._ready_at = None
                    if self.provider is not None and not self.provider.confirms and not s.busy:
                        s.cycle(wall)  # the other end did not start one: start it here
        self._pump(mono, wall)

    def timer(self, mono: int, wall: int) -> int | None:
        """The next deadline, on the monotonic clock."""
        ts = [t for t in (self.link.timer(),) if t is not None]
        if self.session is not None:
            st = self.session.timer()
            if st is not None:
                ts.append(mono + (st - wall))
        if self._ready_at is not None:
            ts.append(self._ready_at + self.settings.responder_wait_ms)
        return min(ts) if ts else None

    def local_events(self, mono: int, wall: int) -> None:
        """The node wrote: a realtime session pushes (coalesced, §33)."""
        if self.session is not None:
            self.session.local_events(wall)
            self._pump(mono, wall)

    # ------------------------------------------------------------------ state
    @property
    def ready(self) -> bool:
        return self.session is not None and self.session.state == "ready"

    @property
    def completed(self) -> int:
        """Exchanges completed, either role, over every session so far."""
        return self.exchanges + (self.provider.confirms if self.provider is not None else 0)

    def busy(self) -> bool:
        """An exchange in flight either way, or bytes not yet acknowledged by the other end."""
        s = self.session
        return bool(s is not None and s.busy) or not self.link.idle()

    def summary(self) -> dict[str, Any]:
        c = self.totals
        offered = self.offered + (self.provider.offered if self.provider else 0)
        ls = self.link.stats
        return {"pushed": offered, "applied": c["applied"], "duplicate": c["duplicate"], "dropped": c["dropped"],
                "rejected": c["rejected"], "held": c["held"], "exchanges": self.completed,
                "timeouts": self.events.counts["timeout"],
                "protocol_errors": self.events.counts["protocol_error"] + self.events.counts["peer_error"],
                "peer": self.session.peer.hex() if self.session is not None and self.session.peer else None,
                # events after the durable cursor on this path for the current peer (offered or not,
                # never answered for), as `run` over MQTT reports per peer
                "unanswered": self._unanswered(),
                "realtime": bool(self.session is not None and self.session.realtime),
                "link": {"state": self.link.state, "incarnations": self.sessions, "bytes_out": ls["bytes_out"],
                         "bytes_in": ls["bytes_in"], "retransmits": ls["retransmits"] + ls["fast_retransmits"],
                         "frames_rejected": self.link.rejected_frames, "duplicates": ls["duplicates"],
                         "segment_size": self.link.segment_size, "downs": ls["downs"],
                         "compressed": self.link.peer_zlib, "message_bytes_out": ls["message_bytes_out"],
                         "message_wire_bytes_out": ls["message_wire_bytes_out"],
                         "down_reasons": sorted(self.events.down_reasons)}}

    def _unanswered(self) -> int | None:
        peer = self.session.peer if self.session is not None else None
        if peer is None:
            return None
        return self.driver.backlog(peer, PATH)

    # ------------------------------------------------------------------ glue
    def _new_session(self, wall: int) -> None:
        self._retire_session()
        st = self.settings
        s = self.driver.session(PATH, None, secure=st.secure, binding_unsolicited=True,
                                realtime_capable=st.realtime, cycle_ms=st.cycle_ms,
                                answer_timeout_ms=st.answer_timeout_ms, link_max=self.link.cfg.max_message)
        self.provider = _Counting(s.provider, st.batch_limit, self._admit)
        s.provider = self.provider
        self.session = s
        self.sessions += 1
        s.start(wall)

    def _retire_session(self) -> None:
        if self.provider is not None:
            self.offered += self.provider.offered
            self.exchanges += self.provider.confirms
        self.session, self.provider = None, None
        self._seen_confirms = self._moved_mark = 0
        self._ready_at = None

    def _after(self, s, mono: int) -> None:
        """Account for what the session just did (exchanges that moved nothing end a `--once`;
        whether the next exchange starts at once is the session's chain rule, `Session.chain`)."""
        p = self.provider
        moved = None
        if p is not None and p.confirms != self._seen_confirms:
            # An exchange completed (either role): did events move either way since the last one?
            self._seen_confirms = p.confirms
            total = p.offered + p.received
            moved, self._moved_mark = total - self._moved_mark, total
            if moved == 0:
                self.empty_exchanges += 1
        for ev in s.events:
            self.events.append((ev.kind, ev.detail))
            if ev.kind == "ready" and self.settings.once and s.peer is not None \
                    and self.driver.node.site_id > s.peer:
                self._ready_at = mono  # the smaller site_id starts (the session's stagger)
                self._rcv_at_ready = self.link.stream_received
        s.events.clear()

    def _admit(self, kind: str, reason: str, wall: int, detail: str) -> list[str]:
        """The rows to surface for one more (kind, reason): at most LOSSES_SURFACED_PER_WINDOW per
        LOSS_WINDOW_MS (each row is a transaction, an fsync, on the loop that serves every other
        link too, and a peer can end incarnations or send refused frames at will); the rest are
        counted and told in one row when the next window starts: the one pure budget
        (`exchange.SurfaceBudget`) the MQTT runner bounds its refusals and broker losses with."""
        surface, told = self._loss_budget.admit((kind, reason), wall)
        rows: list[str] = []
        if told:
            rows.append(not_surfaced(told, LOSS_WINDOW_MS / 1000))
        if surface:
            rows.append(detail)
        return rows

    def _surface_loss(self, reason: str, wall: int) -> None:
        """An incarnation ended: shown by `ssp-agent events` (kind `link_lost`, its code from
        agent/core/reasons.py, source `link:serial`), not only in the summary; bounded (`_admit`)."""
        peer = self.session.peer if self.session is not None else None
        for detail in self._admit("link_lost", reason, wall, f"{self.name or 'serial line'}: incarnation {self.sessions} ended"):
            try:
                self.driver.node.surface_refused(f"link:{PATH}", reason, detail, peer, wall, kind="link_lost")
            except Exception as e:  # noqa: BLE001 - a row not written must never stop the line's loop
                self.events.append(("warning", f"could not surface {reason}: {e}"))

    def _flush(self) -> None:
        data = self.link.data_to_send()
        if data:
            self.write(data)

    def _pump(self, mono: int, wall: int) -> None:
        for ev in self.link.events:
            self.events.append(("link_" + ev[0], ev[1]))
            if ev[0] == "up":
                self._new_session(wall)
            elif ev[0] == "down":
                self._surface_loss(ev[1], wall)
                self._retire_session()  # SSP re-offers what no answer confirmed
        self.link.events.clear()
        self._flush()  # acknowledgements first: the peer keeps sending while this node applies
        s = self.session
        if s is not None:
            self._after(s, mono)  # session timers may have produced events too
            for m in self.link.messages():
                try:
                    s.receive(m, wall)
                except LOCAL_FAULTS:
                    raise
                except Exception as e:  # noqa: BLE001 - the net under the boundaries (agent/faults.py)
                    log.warning("handling a frame on %s raised", self.name or "a serial line", exc_info=e)
                    s.unhandled(describe(e), wall)
                # One message at a time: an acknowledgement and the next body often arrive in one
                # read, and each exchange's movement must be told apart (the end of a --once).
                self._after(s, mono)
            # An exchange this end started moved events: the next one now (the session's rule).
            s.chain(wall)
            for f in s.data_to_send():
                try:
                    self.link.send_message(f, mono)
                except LinkError as e:  # a body over the link's bound: configuration, surfaced
                    self.events.append(("warning", str(e)))
        self._flush()


# ---------------------------------------------------------------------- the port loop
def link_config(profile, baud: int) -> LinkConfig:
    g = lambda k, d: getattr(profile, k, d)  # noqa: E731 - profiles from before [serial] lack these
    return LinkConfig(baud=baud, max_payload=int(g("serial_frame_bytes", 1024)), window=int(g("serial_window_bytes", 8192)),
                      keepalive_ms=int(g("serial_keepalive_s", 1.0) * 1000), dead_ms=int(g("serial_dead_s", 10.0) * 1000),
                      max_message=int(g("serial_max_message_bytes", 17 * 1024 * 1024)),
                      compress=bool(g("serial_compress", True)))


def session_settings(profile, baud: int, *, realtime: bool, secure: bool, cadence_s: float | None = None,
                     once: bool = False) -> SessionSettings:
    g = lambda k, d: getattr(profile, k, d)  # noqa: E731
    batch = int(g("serial_batch_limit", g("batch_limit", 1000)))
    # An answer can only come after the body crossed the line: allow for a full body at this
    # baud (events of ~400 bytes) four times over (a noisy line resends much of it), plus the
    # profile's margin and at least a minute (a body given up on is sent again whole).
    line_ms = 2 * batch * 400 * 10_000 // max(1, baud)
    return SessionSettings(realtime=realtime, secure=secure,
                           # --once: the exchange at the handshake is the cycle; no cadence
                           cycle_ms=10**12 if once else int((cadence_s if cadence_s is not None else g("cadence_s", 30)) * 1000),
                           answer_timeout_ms=2 * line_ms + max(60_000, int(g("serial_timeout_s", 30.0) * 1000)),
                           batch_limit=batch, once=once)


class SerialPort:
    """One node on one serial port."""

    def __init__(self, node, port: str, baud: int, driver: Callable[[Any, int], Any], *, realtime: bool = True,
                 secure: bool = False, cadence_s: float | None = None, nonce: int | None = None, once: bool = False,
                 clock: Clock = SYSTEM) -> None:
        """`driver(node, batch_limit)`: the session's node side (agent/sync.py's SyncDriver); passed
        in so the transport moves bytes and imports nothing of the node's."""
        self.node, self.port, self.baud = node, port, baud
        self.clock = clock  # the link's timers on its monotonic time, the session on its wall time
        prof = node.profile
        self.settings = session_settings(prof, baud, realtime=realtime, secure=secure, cadence_s=cadence_s, once=once)
        self.driver = driver(node, self.settings.batch_limit)
        link = SerialLink(link_config(prof, baud), nonce if nonce is not None else int.from_bytes(os.urandom(4), "big"))
        self._fd: int | None = None
        self._ser = None
        self._pending = bytearray()
        self._reopen_at = 0.0
        self.endpoint = SerialEndpoint(self.driver, link, self._write, self.settings)
        self.endpoint.name = port
        self.timeout_s = float(getattr(prof, "serial_timeout_s", 30.0))
        self._open()
        self.endpoint.start(clock.mono_ms())
        self._drain_writes()

    # ------------------------------------------------------------------ port
    def _open(self) -> None:
        import serial
        try:
            self._ser = serial.Serial(self.port, baudrate=self.baud, timeout=0, write_timeout=0, exclusive=True)
        except (serial.SerialException, OSError, ValueError) as e:
            raise SerialError(f"cannot open serial port {self.port}: {e}; check the port name "
                              "(ls -l /dev/serial/by-id/) and that no other program holds it") from None
        self._fd = self._ser.fileno()
        os.set_blocking(self._fd, False)

    def _close_port(self) -> None:
        if self._ser is not None:
            try:
                self._ser.close()
            except Exception:  # noqa: BLE001 - closing a port that vanished
                pass
        self._ser, self._fd = None, None

    def close(self) -> None:
        self._close_port()

    def _write(self, data: bytes) -> None:
        if self._fd is None:
            return  # the adapter is gone: what would cross a pulled cable is lost (the link resends)
        self._pending += data
        self._drain_writes()

    def _drain_writes(self) -> None:
        while self._pending and self._fd is not None:
            try:
                n = os.write(self._fd, self._pending)
            except BlockingIOError:
                return  # the line is slower than us; the loop waits for room
            except OSError as e:
                self._lost_port(e)
                return
            del self._pending[:n]

    def _lost_port(self, e: OSError) -> None:
        # The adapter went away (USB pulled): the link's dead timer ends the incarnation; the port
        # is reopened every REOPEN_S meanwhile, by its name (a /dev/serial/by-id/ link comes back).
        self._close_port()
        self._pending.clear()
        self._reopen_at = self.clock.mono() + REOPEN_S
        self.endpoint.events.append(("port_lost", f"{e.strerror or e}"))
        log.warning("serial port %s lost (%s); reopening it every %g s", self.port, e.strerror or e, REOPEN_S)

    def _reopen(self) -> None:
        try:
            self._open()
        except SerialError:
            self._reopen_at = self.clock.mono() + REOPEN_S
            return
        self.endpoint.events.append(("port_reopened", self.port))
        log.warning("serial port %s is back", self.port)

    # ------------------------------------------------------------------ loop
    # The one runtime loop (agent/runtime.py) waits on many ports at once: it asks each for its
    # descriptor, whether it has bytes to write and how long it may wait, and calls `service`
    # after poll(); `step` is the same for one port alone (`sync --once`).
    def fileno(self) -> int | None:
        """The open port's descriptor; None while the adapter is gone."""
        return self._fd

    @property
    def wants_write(self) -> bool:
        return bool(self._pending) and self._fd is not None

    def wait_s(self, cap: float) -> float:
        """Seconds until this port needs its loop: the link's or the session's next timer, or the
        next attempt to reopen a port that went away; at most `cap`."""
        mono = self.clock.mono_ms()
        ts = [cap]
        t = self.endpoint.timer(mono, self.clock.wall_ms())
        if t is not None:
            ts.append((t - mono) / 1000)
        if self._fd is None:
            ts.append(self._reopen_at - self.clock.mono())
        return max(0.0, min(ts))

    def service(self, readable: bool, writable: bool) -> int:
        """One turn after the wait: reopen the port if it is gone and due, read what arrived,
        write what the line takes, run the timers that are due. Returns the bytes read."""
        n = 0
        if self._fd is None:
            if self.clock.mono() >= self._reopen_at:
                self._reopen()
        elif readable:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                data = None
            except OSError as e:
                self._lost_port(e)
                data = None
            if data == b"":
                # End of file on a tty: the device behind it is gone (a pty whose other side
                # closed; some USB drivers on unplug). Reading on would spin the loop.
                self._lost_port(OSError(errno.EIO, "hang-up"))
            elif data:
                n = len(data)
                self.endpoint.receive_bytes(data, self.clock.mono_ms(), self.clock.wall_ms())
        if self._pending:
            self._drain_writes()
        self.endpoint.handle_timer(self.clock.mono_ms(), self.clock.wall_ms())
        return n

    def step(self, max_wait_s: float = 0.2) -> None:
        wait = self.wait_s(max_wait_s)
        fd = self._fd
        if fd is None:
            self.clock.sleep(wait)
            self.service(False, False)
            return
        try:
            r, w, _ = select.select([fd], [fd] if self._pending else [], [], wait)
        except (OSError, ValueError) as e:
            self._lost_port(OSError(errno.EIO, str(e)))
            return
        self.service(bool(r), bool(w))

    def sync_once(self, timeout_s: float | None = None, linger_s: float = 0.3) -> dict:
        """One full exchange in both directions (`sync --serial`, docs/serial.md):
        handshake, this node's body answered (and following full bodies), the peer's bodies
        answered and acknowledged, every byte acknowledged by the link; then a short quiet
        linger for a body the other end is about to send. SerialError when the other end never
        answers within `timeout_s` (the profile's serial timeout)."""
        ep = self.endpoint
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        t0 = self.clock.mono()
        deadline = t0 + timeout_s
        while not ep.ready:
            if self.clock.mono() > deadline:
                raise SerialError(f"no answer on {self.port} within {timeout_s:g} s (link {ep.link.state}); "
                                  "check the cable, the baud rate and that the other end runs ssp-agent")
            self.step(0.1)
        quiet_since = None
        heard = ep.link.stats["data_in"]
        # Without an exchange that moved nothing (a peer that does not chain), silence ends it:
        # long enough that a body crawling through retransmissions is not taken for silence.
        fallback_s = max(3.0, 2 * ep.link.cfg.max_rto_ms / 1000)
        while True:
            now = self.clock.mono()
            if ep.completed > 0 and now > deadline + self.settings.answer_timeout_ms / 1000:
                break  # an exchange completed; the other end keeps sending (a busy `run`): enough
            done = ep.ready and ep.completed > 0 and not ep.busy()
            if ep.link.stats["data_in"] != heard:
                # Data still arriving (in order or not, retransmissions too): the other end's next
                # body (it chains one at once after our acknowledgement), or more of one. Not quiet.
                heard, quiet_since = ep.link.stats["data_in"], None
            elif done:
                # Ended by an exchange that moved nothing (the starting end chains until one does),
                # or, with a peer that does not chain, by a longer silence.
                quiet_since = quiet_since or now
                if now - quiet_since >= (linger_s if ep.empty_exchanges else fallback_s):
                    break
            else:
                quiet_since = None
                if now > deadline + self.settings.answer_timeout_ms / 1000:
                    raise SerialError(f"the exchange on {self.port} did not complete within "
                                      f"{timeout_s + self.settings.answer_timeout_ms / 1000:g} s "
                                      f"(link {ep.link.state}); nothing unconfirmed was lost: the next sync re-offers it")
                if not ep.ready and ep.completed == 0 and now > deadline:
                    raise SerialError(f"the line on {self.port} failed before an exchange completed (link "
                                      f"{ep.link.state}); check the cable")
            self.step(0.05)
        return ep.summary()
