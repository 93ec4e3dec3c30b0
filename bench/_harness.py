"""The set-up the benchmarks share: the checkout on sys.path and in a child's PYTHONPATH, the
environment a bench runs in, a process's CPU and memory from /proc, the one-thread raw verify
denominator, the generated readings, nodes that trust each other, B served in its own thread
while A catches it up, and the median and range of rounds.

A bench imports it first (`python bench/x.py` puts bench/ on sys.path):

    from _harness import ROOT, bench_env, ...

Nothing from `agent` is imported at module level: bench_quiet.py and bench_startup.py can run
another checkout's agent (--root, --code), whose modules must be the first ones imported."""
from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(1, str(ROOT))

TICK = os.sysconf("SC_CLK_TCK")


# -- environment -------------------------------------------------------------------------------

def trusted_clock() -> None:
    """Declare the wall clock trustworthy (docs/apply.md "Clocks without an RTC": the benches use
    simulated or back-dated clocks, on machines that may run no time sync), unless the caller did."""
    os.environ.setdefault("SSP_AGENT_CLOCK_TRUSTED", "1")


def bench_env(witness_dir: str | os.PathLike | None = None) -> None:
    """The environment every bench runs its nodes in (set only where the caller has not): a
    trusted clock, and a clock witness directory of the bench's own (`witness_dir`, or a fresh
    temporary one) instead of the user's."""
    trusted_clock()
    if "SSP_AGENT_WITNESS_DIR" not in os.environ:
        os.environ["SSP_AGENT_WITNESS_DIR"] = str(witness_dir) if witness_dir is not None else \
            tempfile.mkdtemp(prefix="ssp-bench-witness-")


def child_env(root: str | os.PathLike = ROOT, **extra: str) -> dict:
    """The environment of a child process running the agent of the checkout `root`."""
    return {**os.environ, "PYTHONPATH": str(root), **extra}


def cli(home: str | os.PathLike, *argv: str) -> list[str]:
    """argv of `ssp-agent --home HOME ARGV...` as a fresh process (what the script runs)."""
    return [sys.executable, "-m", "agent.cli", "--home", str(home), *argv]


def stop(p: subprocess.Popen, timeout: float = 30.0) -> None:
    """Terminate a child and reap it (killed if it does not leave within `timeout`)."""
    p.terminate()
    try:
        p.wait(timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def load_average() -> str:
    """The 1, 5 and 15 minute load averages, as the benches print them before and after."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# -- processes ---------------------------------------------------------------------------------

def proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), seconds, from /proc."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / TICK


def proc_tree_cpu_s(pid: int) -> float:
    """CPU seconds of a process and everything it started: its own, its reaped children's
    (cutime + cstime) and, recursively, its live children's (a node's apply workers,
    agent/applyworker.py, are child processes)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    total = sum(int(x) for x in f[11:15]) / TICK
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids = children.read_text().split()
        except OSError:
            continue
        total += sum(proc_tree_cpu_s(int(k)) for k in kids)
    return total


def node_cpu_s(*nodes) -> float:
    """CPU seconds of this process (all its threads) and of the apply workers of `nodes` (child
    processes, agent/applyworker.py): what this process's nodes have spent, without the other
    children a bench starts (mosquitto, a receiver's process)."""
    return time.process_time() + sum((n._pool.cpu_seconds() or 0.0) for n in nodes if n._pool)


def proc_mem_mb(pid: int | str = "self", key: str = "VmRSS") -> float:
    """A memory line of /proc/PID/status in MB: VmRSS (now) or VmHWM (this process image's peak;
    unlike ru_maxrss, not carried over fork and exec from a large parent)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def peak_rss_kb() -> int:
    """This process's peak RSS so far (getrusage ru_maxrss), KiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def home_bytes(p: Path) -> int:
    """Bytes of every file under a node's home."""
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


# -- rounds ------------------------------------------------------------------------------------

def rate(n: int, seconds: float) -> float:
    """`n` per second (infinite when no time was measurable)."""
    return n / seconds if seconds > 0 else float("inf")


def median(xs) -> float:
    return statistics.median(list(xs))


def med_range(xs, fmt: str = "{:.2f}") -> str:
    """`median (min-max)` of a bench's rounds."""
    xs = sorted(xs)
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(xs[0])}-{fmt.format(xs[-1])})"


# -- events and nodes --------------------------------------------------------------------------

def readings_events(n: int, sites: list, base_ms: int | None = None) -> list[bytes]:
    """`n` signed `app.readings` upserts from the simulated producers `sites` in turn, over 2 000
    rows of 50 devices, four per millisecond from `base_ms` (default: an hour ago)."""
    base = time.time_ns() // 1_000_000 - 3_600_000 if base_ms is None else base_ms
    return [sites[i % len(sites)].event("app.readings", {"device": f"dev{i % 50}", "seq": i % 2000},
                                        {"temp": float(i % 400) / 10, "note": f"n{i % 97}"}, (base + i // 4, i % 4))
            for i in range(n)]


def raw_verify(events: list[bytes], keys: dict[bytes, bytes], mesh: bytes, chunk: int = 1000) -> tuple[float, float]:
    """One thread's raw Ed25519 verify of the same events (the apply benches' denominator):
    (verifies per wall second, CPU seconds of this thread per verify). Only the verify calls are
    timed. Prepared `chunk` at a time, so that the measurement does not leave a large heap behind
    for what the bench measures next."""
    from agent.core import cose
    spent = cpu = 0.0
    for i in range(0, len(events), chunk):
        parsed = [cose.parse_sign1(e) for e in events[i:i + chunk]]
        tbs = [(keys[p.kid], p.sig_structure(mesh), p.signature) for p in parsed]
        t, c = time.perf_counter(), time.thread_time()
        for pk, m, sig in tbs:
            assert cose.verify_ed25519(pk, m, sig)
        spent += time.perf_counter() - t
        cpu += time.thread_time() - c
    return len(events) / spent, cpu / len(events)


def raw_verify_rate(events: list[bytes], keys: dict[bytes, bytes], mesh: bytes, chunk: int = 1000) -> float:
    """Verifies per wall second of `raw_verify`."""
    return raw_verify(events, keys, mesh, chunk)[0]


def introduce(*nodes) -> None:
    """Every node trusts every other one (its keyring holds their public keys)."""
    for x in nodes:
        for y in nodes:
            if x is not y:
                x.add_peer(y.site_id, y.keyring[y.site_id][0], None)


def trust(node, sims) -> None:
    """`node` trusts the simulated producers `sims` (agent.simpeer.SimPeer)."""
    for s in sims:
        node.add_peer(s.site_id, s.public_key, None)


def catch_up(ra, rb, a, b, timeout: float = 600.0) -> float:
    """Seconds from A's first batch cycle until A's cursor for B is at A's last event (every
    body applied and answered), with B's runner pumped in its own thread, as in its own process."""
    stop_b = threading.Event()

    def serve_b():
        while not stop_b.is_set():
            rb.pump(0.05)
    th = threading.Thread(target=serve_b, daemon=True)
    th.start()
    try:
        last = a.conn.execute("SELECT max(seq) FROM events").fetchone()[0]
        t0 = time.perf_counter()
        ra.batch_cycle()
        while ra.sync.cursor(b.site_id) < last:
            ra.pump(0.05)
            if time.perf_counter() - t0 > timeout:
                raise SystemExit("timed out")
        return time.perf_counter() - t0
    finally:
        stop_b.set()
        th.join()
