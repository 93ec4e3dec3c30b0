"""A seeded faulty serial line between two pseudo-terminals, for tests and bench/bench_serial.py.

    python tools/serial_relay.py --ber 1e-4 --drop 0.01 --baud 115200 --seed 7

creates two pty pairs, prints `READY <port A> <port B>` and relays bytes between them: each end
opens its port with pyserial as it would a USB-serial adapter. In-process, `Relay` does the same
in a thread with `pull()` / `plug()` (a pulled cable: everything sent meanwhile is lost),
`stall(ms)` (nothing delivered for a while, then all of it), `inject(i, data)` (noise on the
line: `data` reaches end i between two frames), and `unplug(i)` / `replug(i)` (the
USB adapter at one end pulled from its computer: that end's pty is closed, so the program holding
it reads end of file, and its name is gone until a new pty comes back under it; with `names`,
the ports are symlinks, as /dev/serial/by-id/ names are).

`LineFaults` is the fault model, also used on its own by the simulated line of the sans-I/O
tests: it cuts the byte stream into frames at 0x00 delimiters (what a frame is on this line:
firmware_bridge/framing.py) and drops, duplicates, reorders and truncates whole frames, then
flips bits at a bit error rate. Seeded: the same seed and input give the same faults.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import select
import sys
import threading
import time
import tty
from collections import deque
from dataclasses import dataclass, field


@dataclass
class LineFaults:
    seed: int = 0
    ber: float = 0.0  # each bit flipped with this probability
    drop: float = 0.0  # per frame
    duplicate: float = 0.0
    reorder: float = 0.0  # the frame is held and sent after the next one
    truncate: float = 0.0  # the frame is cut at a random point (its delimiter lost with the tail)
    counts: dict = field(default_factory=lambda: {"frames": 0, "dropped": 0, "duplicated": 0, "reordered": 0,
                                                  "truncated": 0, "bit_flips": 0, "bytes": 0})

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self._partial = bytearray()
        self._held: bytes | None = None
        self._next_flip = self._gap()

    def _gap(self) -> int:
        if self.ber <= 0:
            return 1 << 62
        return int(math.log(1.0 - self.rng.random()) / math.log(1.0 - self.ber))

    def apply(self, data: bytes) -> bytes:
        """Bytes in as sent; bytes out as the far end receives them. A frame is held until its
        closing delimiter has passed through (frame faults need the whole frame)."""
        self._partial += data
        out = bytearray()
        while True:
            z = self._partial.find(0)
            if z < 0:
                break
            frame = bytes(self._partial[:z + 1])
            del self._partial[:z + 1]
            out += self._frame(frame)
        return self._flip(bytes(out))

    def flush(self) -> bytes:
        """What is held (a partial frame, a frame held for reordering), as is."""
        out = bytes(self._partial) + (self._held or b"")
        self._partial.clear()
        self._held = None
        return self._flip(out)

    def _frame(self, f: bytes) -> bytes:
        c, r = self.counts, self.rng
        if f == b"\x00":
            return f  # a bare delimiter (the lead of the next frame)
        c["frames"] += 1
        if self.drop and r.random() < self.drop:
            c["dropped"] += 1
            return b""
        if self.truncate and r.random() < self.truncate:
            c["truncated"] += 1
            f = f[:r.randrange(0, max(1, len(f) - 1))]
        if self.duplicate and r.random() < self.duplicate:
            c["duplicated"] += 1
            f = f + f
        if self.reorder and self._held is None and r.random() < self.reorder:
            c["reordered"] += 1
            self._held = f
            return b""
        if self._held is not None:
            f, self._held = f + self._held, None
        return f

    def _flip(self, data: bytes) -> bytes:
        self.counts["bytes"] += len(data)
        if self.ber <= 0 or not data:
            return data
        buf = bytearray(data)
        nbits = len(buf) * 8
        pos = self._next_flip
        while pos < nbits:
            buf[pos // 8] ^= 0x80 >> (pos % 8)
            self.counts["bit_flips"] += 1
            pos += 1 + self._gap()
        self._next_flip = pos - nbits
        return bytes(buf)


def _pty() -> tuple[int, int, str]:
    master, slave = os.openpty()
    tty.setraw(slave)  # no echo, no line discipline: bytes as they are
    os.set_blocking(master, False)
    return master, slave, os.ttyname(slave)


class Relay:
    """Two ptys joined through LineFaults (one per direction), optionally throttled to `baud`
    (10 bits a byte: 8N1), in a thread."""

    def __init__(self, faults_ab: LineFaults | None = None, faults_ba: LineFaults | None = None,
                 baud: int | None = None, names: tuple[str | None, str | None] = (None, None)) -> None:
        self.faults = (faults_ab or LineFaults(), faults_ba or LineFaults(seed=1))
        self.baud = baud
        a, b = _pty(), _pty()
        self._masters: list[int | None] = [a[0], b[0]]
        self._slaves: list[int | None] = [a[1], b[1]]  # kept open: a master never sees EIO between opens
        self._names = names
        self.ports = (self._name(0, a[2]), self._name(1, b[2]))
        self._plug_requests: deque = deque()  # (end, plugged?, done event): handled by the relay thread
        self._injected: deque = deque()  # (end, bytes): noise handed to the relay thread
        self.injected = [0, 0]  # noise bytes delivered to each end
        self._q: tuple[deque, deque] = (deque(), deque())  # bytes due at the far end: (due, data)
        self._free_at = [0.0, 0.0]
        self.sent = [0, 0]  # bytes written by each end (before faults)
        self.delivered = [0, 0]  # bytes from each end delivered to the far end
        self.first_at: list[float | None] = [None, None]  # monotonic time of the first and last byte
        self.last_at = [0.0, 0.0]                          # from each end delivered
        self._pulled = False
        self._stall_until = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Relay":
        self._thread.start()
        return self

    def pull(self) -> None:
        with self._lock:
            self._pulled = True
            for q in self._q:
                q.clear()

    def plug(self) -> None:
        with self._lock:
            self._pulled = False

    def _name(self, i: int, tty_name: str) -> str:
        """End i's port name: the pty's own, or the symlink `names[i]` pointed at it (atomically)."""
        link = self._names[i]
        if link is None:
            return tty_name
        tmp = f"{link}.new"
        os.symlink(tty_name, tmp)
        os.replace(tmp, link)
        return link

    def unplug(self, i: int) -> None:
        """End i's adapter leaves its computer: its pty closes (the holder reads end of file) and
        its name disappears (with `names`; a bare pty's name goes with it)."""
        self._plug_request(i, False)

    def replug(self, i: int) -> None:
        """End i's adapter is back: a new pty under the same name (`names` required)."""
        assert self._names[i] is not None, "replug needs a stable name (names=...)"
        self._plug_request(i, True)

    def _plug_request(self, i: int, plugged: bool) -> None:
        done = threading.Event()
        self._plug_requests.append((i, plugged, done))
        assert done.wait(10), "the relay thread did not handle the request"

    def _handle_plug_requests(self, pending: list[bytearray]) -> None:
        # On the relay thread: an fd is never closed while it is in that thread's select().
        while self._plug_requests:
            i, plugged, done = self._plug_requests.popleft()
            with self._lock:
                if not plugged and self._masters[i] is not None:
                    for fd in (self._masters[i], self._slaves[i]):
                        os.close(fd)
                    self._masters[i] = self._slaves[i] = None
                    if self._names[i] is not None:
                        os.unlink(self._names[i])
                    self._q[1 - i].clear()
                    pending[i].clear()
                elif plugged and self._masters[i] is None:
                    m, sl, name = _pty()
                    self._masters[i], self._slaves[i] = m, sl
                    self._name(i, name)
            done.set()

    def inject(self, i: int, data: bytes) -> None:
        """`data` reaches end i as if the line made it up, between two of the frames the far end
        sent (the relay queues whole frames; with `baud`, 64-byte pieces of them, so it may land
        inside a frame); nothing while end i is unplugged."""
        self._injected.append((i, bytes(data)))

    def stall(self, ms: float) -> None:
        with self._lock:
            self._stall_until = time.monotonic() + ms / 1000

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for fd in self._masters + self._slaves:
            if fd is None:
                continue
            try:
                os.close(fd)
            except OSError:
                pass

    def _run(self) -> None:
        pending: list[bytearray] = [bytearray(), bytearray()]  # accepted by the line, not yet by the pty
        while not self._stop.is_set():
            self._handle_plug_requests(pending)
            now = time.monotonic()
            waits = [0.05]
            for q in self._q:
                if q:
                    waits.append(max(0.0, q[0][0] - now))
            if any(pending):
                waits.append(0.002)
            r, _, _ = select.select([fd for fd in self._masters if fd is not None], [], [], min(waits))
            now = time.monotonic()
            for i, fd in enumerate(self._masters):
                if fd is None or fd not in r:
                    continue
                try:
                    data = os.read(fd, 65536)
                except (BlockingIOError, OSError):
                    continue
                with self._lock:
                    self.sent[i] += len(data)
                    if self._pulled:
                        continue
                    out = self.faults[i].apply(data)
                    if out and self.baud:
                        # Bytes reach the far end as the line sends them, not all at the end.
                        for k in range(0, len(out), 64):
                            piece = out[k:k + 64]
                            self._free_at[i] = max(now, self._free_at[i]) + len(piece) * 10 / self.baud
                            self._q[i].append((self._free_at[i], piece))
                    elif out:
                        self._q[i].append((now, out))
            with self._lock:
                stalled = now < self._stall_until
                for i, q in enumerate(self._q):
                    while q and q[0][0] <= now and not stalled:
                        pending[1 - i] += q.popleft()[1]
                while self._injected:
                    j, noise = self._injected.popleft()
                    if self._masters[j] is not None:
                        pending[j] += noise
                        self.injected[j] += len(noise)
            for j, fd in enumerate(self._masters):
                if fd is None:
                    pending[j].clear()  # unplugged: nothing reaches that end
                    continue
                if pending[j]:
                    try:
                        n = os.write(fd, pending[j])
                    except (BlockingIOError, OSError):
                        n = 0
                    if n:
                        self.delivered[1 - j] += n
                        t = time.monotonic()
                        self.first_at[1 - j] = self.first_at[1 - j] or t
                        self.last_at[1 - j] = t
                    del pending[j][:n]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ber", type=float, default=0.0)
    ap.add_argument("--drop", type=float, default=0.0)
    ap.add_argument("--duplicate", type=float, default=0.0)
    ap.add_argument("--reorder", type=float, default=0.0)
    ap.add_argument("--truncate", type=float, default=0.0)
    ap.add_argument("--baud", type=int, default=None, help="throttle each direction to this line rate (8N1)")
    a = ap.parse_args(argv)
    kw = dict(ber=a.ber, drop=a.drop, duplicate=a.duplicate, reorder=a.reorder, truncate=a.truncate)
    relay = Relay(LineFaults(seed=a.seed, **kw), LineFaults(seed=a.seed + 1, **kw), baud=a.baud).start()
    print(f"READY {relay.ports[0]} {relay.ports[1]}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        relay.close()
        sys.exit(0)


if __name__ == "__main__":
    main()
