"""A worker process that runs the verify-ahead part of the apply path (agent/core/prepare.py:
envelope parse, Ed25519 verification, strict payload decode) on another core, while the thread
that holds SQLite applies the events before them (docs/apply.md "Speed").

A process, not threads: everything around the verification holds the GIL, and on 2 cores two
verify threads made the import no faster. The protocol is private to this module: frames of an
8-byte length and a pickle over the worker's stdin and stdout, answered in order; the worker reads
requests on a thread of its own, so the parent may send a bounded number of chunks ahead without
a deadlock. Only public data crosses (signed event bytes, public keys). If the worker fails or
dies, the parent prepares on its own thread: the same results, only later."""
from __future__ import annotations

import os
import pickle
import struct
import sys

_LEN = struct.Struct(">Q")
PIPE_BYTES = 1 << 20


def _read_exact(f, n: int) -> bytes | None:
    data = f.read(n)
    return data if data is not None and len(data) == n else None


def _read_frame(f) -> bytes | None:
    head = _read_exact(f, _LEN.size)
    if head is None:
        return None
    return _read_exact(f, _LEN.unpack(head)[0])


def _write_frame(f, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(_LEN.pack(len(data)))
    f.write(data)
    f.flush()


def main() -> int:
    """The worker: answer requests until stdin closes."""
    import queue
    import signal
    import threading
    import time

    from .core.prepare import prepare

    # Ctrl-C reaches the whole process group: the node handles it, and this worker ends when the
    # node closes the pipe (or exits), not with a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    # The answers go to a copy of fd 1; fd 1 itself now points at stderr, so that nothing printed
    # by accident (a warning) can corrupt a frame.
    out = os.fdopen(os.dup(1), "wb", buffering=1 << 16)
    os.dup2(2, 1)
    inp = os.fdopen(0, "rb", buffering=1 << 16)
    q: queue.SimpleQueue = queue.SimpleQueue()

    def reader() -> None:
        while True:
            frame = _read_frame(inp)
            q.put(frame)
            if frame is None:
                return

    threading.Thread(target=reader, daemon=True).start()
    keyring: dict = {}
    while True:
        frame = q.get()
        if frame is None:
            return 0
        sent_keyring, mesh_id, raws, decode = pickle.loads(frame)
        if sent_keyring is not None:
            keyring = sent_keyring
        try:
            t = time.thread_time()
            results = prepare(raws, keyring, mesh_id, decode)
            _write_frame(out, (results, len(raws), time.thread_time() - t))
        except BrokenPipeError:
            return 0


class WorkerGone(RuntimeError):
    """The worker process failed or exited: the caller prepares on its own thread instead."""


class ApplyWorker:
    """The parent's side: one worker process, requests answered in order."""

    def __init__(self) -> None:
        # Imported here, not at the top: the worker process imports this module too, and every
        # module it loads is resident memory.
        import json
        import subprocess
        from pathlib import Path
        # `-S`: no site initialisation (about 5 MB less resident); the worker gets
        # this process's module path instead, this package's own tree first, so both run the same code.
        paths = [str(Path(__file__).resolve().parents[1])] + [p for p in sys.path if p]
        self.proc = subprocess.Popen([sys.executable, "-S", "-c", "import sys, json; sys.path[:0] = json.loads(sys.argv[1]); "
                                      "from agent import applyworker; sys.exit(applyworker.main())", json.dumps(paths)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True, bufsize=1 << 16)
        self._in, self._out = self.proc.stdin, self.proc.stdout
        # Pipes large enough for the chunks in flight (three of at most 256 KiB each way): the
        # applying thread's write of a request then never waits for the worker's reader thread,
        # which must first take the worker's GIL from its busy main thread (measured: ~15 us an
        # event of the applying thread blocked in that write with the default 64 KiB pipe).
        for f in (self._in, self._out):
            try:
                import fcntl
                fcntl.fcntl(f.fileno(), getattr(fcntl, "F_SETPIPE_SZ", 1031), PIPE_BYTES)
            except OSError:
                pass   # not Linux, or above /proc/sys/fs/pipe-max-size: the default works, slower
        self.sent = self.answered = 0
        self.last_n, self.last_cpu = 0, 0.0   # the last answer's events and the worker's CPU for them
        self._keyring: dict | None = None   # the keyring the worker holds

    @property
    def pid(self) -> int:
        return self.proc.pid

    def submit(self, keyring: dict, mesh_id: bytes, raws: list[bytes], decode: bool = True) -> int:
        """Send one request; returns its number (answers come in this order)."""
        # The keyring travels only when it changed (a gateway's keyring has an entry per device).
        sent = None if keyring == self._keyring else keyring
        try:
            _write_frame(self._in, (sent, mesh_id, raws, decode))
        except (BrokenPipeError, OSError, ValueError) as e:
            raise WorkerGone(f"apply worker: {e}") from None
        self._keyring = keyring
        self.sent += 1
        return self.sent

    def result(self, n: int) -> list:
        """The answer to request `n`, which must be the oldest one not yet read."""
        if n != self.answered + 1:
            raise RuntimeError("apply worker answers are read in request order")
        frame = _read_frame(self._out)
        if frame is None:
            raise WorkerGone(f"apply worker exited (code {self.proc.poll()})")
        self.answered += 1
        results, self.last_n, self.last_cpu = pickle.loads(frame)
        return results

    def drain(self) -> None:
        """Read and drop the answers still in flight (a batch that stopped early)."""
        while self.answered < self.sent:
            self.result(self.answered + 1)

    def peak_rss_kb(self) -> int | None:
        """The worker's peak resident set (VmHWM), for the benchmarks' process-tree figure."""
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1])
        except OSError:
            return None
        return None

    def cpu_seconds(self) -> float | None:
        """The worker's CPU time so far (user + system), for the benchmarks."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        try:
            self._in.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired: it did not exit
            self.proc.kill()
            self.proc.wait()
        self._out.close()


class NoneAvailable(RuntimeError):
    """The process already runs as many workers as it may: this node prepares on its own thread."""


# Workers alive in this process, over all its nodes: at most `limit` (one node per process is the
# agent's case; a process that runs many nodes, as the fleet benchmark does with hundreds, must
# not start a worker per node). Nodes may live on different threads: counted under a lock.
_live = 0
_live_lock = None


def _lock():
    global _live_lock
    if _live_lock is None:
        import threading
        _live_lock = threading.Lock()
    return _live_lock


class ApplyWorkers:
    """Several workers, chunks dealt round-robin; answers read in the order requested."""

    def __init__(self, n: int, limit: int | None = None) -> None:
        global _live
        self.workers: list[ApplyWorker] = []
        with _lock():
            n = max(1, n) if limit is None else min(max(1, n), limit - _live)
            if n <= 0:
                raise NoneAvailable(f"{_live} apply workers already run in this process")
            _live += n
        self._reserved = n
        try:
            for _ in range(n):
                self.workers.append(ApplyWorker())
        except BaseException:
            self.close()
            raise
        self._next = 0
        # Which side decodes the payloads (~18 us an event on the build machine, against ~50 for
        # a verification and ~65 for the rest of the applying thread's work): the share of chunks
        # the workers decode moves toward the side with less CPU an event, the applying thread's
        # (measured between two answers: the chunk it applied) against the workers' (each answer
        # carries its CPU time; the workers run side by side). CPU, not waiting: a worker that
        # waits for a core it shares with a neighbour would otherwise look slow. With one worker
        # beside it (two cores) it settles where the two are even; with more workers the applying
        # thread is the slower side, and they decode everything.
        self.share = self.FIRST_SHARE if self.FIRST_SHARE is not None else 1.0 if len(self.workers) > 1 else 0.5
        self._acc = 0.0
        # Beyond that, when the workers are the slower side even decoding nothing (one worker
        # verifying beside an applying thread that needs less than a verification an event), the
        # share of chunks the applying thread prepares itself, verification included (`here`):
        # then both cores verify.
        self.here = self.FIRST_HERE
        self._here_acc = 0.0
        self._here_n = 0                   # events prepared on the applying thread since the last answer
        self._mark: float | None = None   # the applying thread's CPU clock at the last answer
        self._mark_n = 0                   # events of that answer (the chunk applied since)
        self._mine = self._theirs = (0.0, 0.0)   # (CPU, events) of each side, decaying

    FIRST_SHARE: float | None = None   # tests pin it (with STEP 0)
    DECAY = 0.9   # an answer's weight in the averages (~10 answers of 256 events)
    FIRST_HERE = 0.0
    HERE_MAX = 0.5
    STEP = 0.125

    def prepares_here(self) -> bool:
        """Whether the applying thread prepares the next chunk itself (the share `here`)."""
        self._here_acc += self.here
        if self._here_acc >= 1.0:
            self._here_acc -= 1.0
            return True
        return False

    def prepared_here(self, n: int) -> None:
        """The applying thread prepared `n` events itself (its CPU for them is its own side's)."""
        self._here_n += n

    def submit(self, keyring: dict, mesh_id: bytes, raws: list[bytes]) -> tuple:
        w = self.workers[self._next % len(self.workers)]
        self._next += 1
        self._acc += self.share
        decode = self._acc >= 1.0
        if decode:
            self._acc -= 1.0
        return w, w.submit(keyring, mesh_id, raws, decode)

    def result(self, ticket: tuple) -> list:
        import time
        w, n = ticket
        out = w.result(n)
        now = time.thread_time()
        if self._mark is not None and self._mark_n and w.last_n:
            # CPU an event on each side: this thread's over the events it applied (and prepared)
            # since the last answer, the workers' over the events they prepared; both averaged
            # over the last few thousand events (DECAY), so that what this thread does once a
            # window (its rows written, the commit) counts for the events it serves, not only
            # for the chunk it happened to follow.
            d = self.DECAY
            self._mine = (self._mine[0] * d + now - self._mark, self._mine[1] * d + self._mark_n + self._here_n)
            self._theirs = (self._theirs[0] * d + w.last_cpu, self._theirs[1] * d + w.last_n)
            mine = self._mine[0] / self._mine[1]
            theirs = self._theirs[0] / self._theirs[1] / len(self.workers) * (1.0 - self.here)
            if mine > theirs:   # work moves to the workers: first what this thread verifies
                if self.here > 0:
                    self.here = max(0.0, self.here - self.STEP)
                else:
                    self.share = min(1.0, self.share + self.STEP)
            elif self.share > 0:   # work moves here: first the decoding
                self.share = max(0.0, self.share - self.STEP)
            else:
                self.here = min(self.HERE_MAX, self.here + self.STEP)
        self._mark, self._mark_n, self._here_n = now, w.last_n, 0
        return out

    def drain(self) -> None:
        for w in self.workers:
            w.drain()

    def peak_rss_kb(self) -> int | None:
        peaks = [w.peak_rss_kb() for w in self.workers]
        return None if None in peaks else sum(peaks)

    def cpu_seconds(self) -> float | None:
        cpu = [w.cpu_seconds() for w in self.workers]
        return None if None in cpu else sum(cpu)

    def close(self) -> None:
        global _live
        for w in self.workers:
            w.close()
        self.workers = []
        with _lock():
            _live -= self._reserved
            self._reserved = 0
