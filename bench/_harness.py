"""The set-up the benchmarks share: the checkout on sys.path and in a child's PYTHONPATH, the
environment a bench runs in, a process's CPU and memory from /proc, the one-thread raw verify
denominator, the generated readings, nodes that trust each other, B served in its own thread
while A catches it up, the median and range of rounds, and the result file a bench records
(`record`: bench/results/<bench>.json, what bench/table.py renders into docs/performance.md's table).

A bench imports it first (`python bench/x.py` puts bench/ on sys.path):

    from _harness import ROOT, bench_env, ...

Nothing from `agent` is imported at module level: bench_quiet.py and bench_startup.py can run
another checkout's agent (--root, --code), whose modules must be the first ones imported.

Every bench accepts `--record`: importing this module takes it out of sys.argv (so no bench's own
parser needs to know it) and notes the load average then, as the bench's start; the bench's output
step calls `record(...)`, which writes its result file only when `--record` was given, so the
smoke test's tiny runs (tests/test_bench_smoke.py) never overwrite a real result.

`parse_args(ap)` adds `--against REV` (and `--against-rounds N`) to a bench's parser: the bench
then runs as a same-run A/B (`against`) of this checkout and REV checked out in a temporary git
worktree, each tree's own bench script in child processes, rounds alternating."""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import resource
import shutil
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

# The bench's start, for its result file: the command line as given and the load average before
# any work (this module is the first thing a bench imports).
COMMAND = [Path(sys.argv[0]).as_posix() if sys.argv else "", *sys.argv[1:]]
_STARTED = (time.time(), os.getloadavg())
RECORD = "--record" in sys.argv[1:]
if RECORD:
    sys.argv[:] = [a for a in sys.argv if a != "--record"]


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


# -- result files ------------------------------------------------------------------------------

RESULTS = Path(os.environ.get("SSP_BENCH_RESULTS") or ROOT / "bench" / "results")
RESULT_SCHEMA = 1
# A figure or denominator is a number, or the rounds of one: `of_rounds(xs)`.
ROUND_KEYS = ("median", "min", "max", "n")


def of_rounds(xs) -> dict:
    """The median and range of a bench's rounds, as a result file holds them."""
    xs = sorted(float(x) for x in xs)
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "n": len(xs)}


def _checked(kind: str, named: dict) -> dict:
    """`named` with every value a finite number or an `of_rounds` dict (a result file holds nothing
    a reader has to guess at: no strings, no infinities)."""
    out = {}
    for name, v in named.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"{kind}: names are non-empty strings: {name!r}")
        if isinstance(v, dict):
            if tuple(v) != ROUND_KEYS:
                raise ValueError(f"{kind} {name}: rounds hold {ROUND_KEYS}, not {tuple(v)}")
            v = {k: _checked(kind, {name: x})[name] for k, x in v.items()}
            out[name] = v
            continue
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise ValueError(f"{kind} {name}: {v!r} is not a finite number")
        out[name] = v if isinstance(v, int) else float(f"{v:.6g}")
    return out


def measures(doc: str | None) -> str:
    """What a bench measures: the first sentence of its docstring, on one line."""
    para = " ".join((doc or "").strip().split("\n\n", 1)[0].split())
    for end in (". ", ".\u00a0"):
        if end in para:
            return para.split(end, 1)[0] + "."
    return para


def machine() -> dict:
    """The machine a result was measured on."""
    import sqlite3
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpus_allowed": len(os.sched_getaffinity(0)), "cpu_model": model,
            "python": platform.python_version(), "sqlite": sqlite3.sqlite_version,
            "kernel": platform.release(), "arch": platform.machine()}


def git_commit(root: str | os.PathLike = ROOT) -> dict:
    """The checkout's commit and whether its tracked files differ from it."""
    def git(*a):
        return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def record(figures: dict, denominators: dict, summary: str, *, parameters: dict | None = None,
           bench: str | None = None, points: list[dict] | None = None) -> Path | None:
    """A bench's result, recorded at its end (its output step) when it was run with `--record`:
    bench/results/<bench>.json (or $SSP_BENCH_RESULTS/) holding the bench's name and what it
    measures (its docstring's first sentence), the command line, the date (UTC), the commit, the
    load average at the start and at the end, the machine, the raw denominators measured in the
    same run and the figures as named numbers (`of_rounds(xs)` where the bench runs rounds), and one
    short human line; `points`, a curve (bench_fleet's: one {devices, convergence_s,
    gateway_cpu_s_per_device} per size, numbers or rounds), the plot bench/table.py draws from it.
    Returns the file written, or None without `--record`.

    docs/performance.md's table is rendered from these files by bench/table.py."""
    figures, denominators = _checked("figure", figures), _checked("denominator", denominators)
    points = [_checked("point", pt) for pt in points] if points else None
    summary = " ".join(summary.split())
    if not summary:
        raise ValueError("a result needs its one human line")
    if not RECORD:
        return None
    main = sys.modules.get("__main__")
    name = bench or Path(getattr(main, "__file__", None) or COMMAND[0]).stem
    t0, load0 = _STARTED
    result = {
        "schema": RESULT_SCHEMA,
        "bench": name,
        "status": "measured",
        "measures": measures(getattr(main, "__doc__", None)),
        "command": " ".join(["python", *COMMAND]),
        "date": datetime.datetime.fromtimestamp(t0, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "duration_s": round(time.time() - t0, 1),
        **git_commit(),
        "load_average": {"start": [round(x, 2) for x in load0], "end": [round(x, 2) for x in os.getloadavg()]},
        "machine": machine(),
        "parameters": {k: v for k, v in (parameters or {}).items()
                       if v is None or isinstance(v, (str, int, float, bool))},
        "denominators": denominators,
        "figures": figures,
        **({"points": points} if points else {}),
        "summary": summary,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)
    print(f"recorded: {path} (render docs/performance.md's table with: python bench/table.py)")
    return path


# -- same-run A/B (--against) ------------------------------------------------------------------

@contextlib.contextmanager
def checkout(rev: str, root: str | os.PathLike = ROOT):
    """The tree of `rev`: a directory holding a checkout as it is, or a git revision of `root`'s
    repository checked out (detached) into a temporary worktree, removed afterwards."""
    if Path(rev).is_dir():
        yield Path(rev).resolve()
        return
    d = Path(tempfile.mkdtemp(prefix="ssp-bench-against-")) / "tree"
    p = subprocess.run(["git", "-C", str(root), "worktree", "add", "--detach", "--quiet", str(d), rev],
                       capture_output=True, text=True)
    if p.returncode != 0:
        shutil.rmtree(d.parent, ignore_errors=True)
        raise SystemExit(f"--against {rev}: cannot check it out: {p.stderr.strip()}")
    try:
        yield d
    finally:
        subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(d)], capture_output=True)
        subprocess.run(["git", "-C", str(root), "worktree", "prune"], capture_output=True)
        shutil.rmtree(d.parent, ignore_errors=True)


def _one_run(tree: Path, script: str, argv: list[str], out: Path) -> dict:
    """One run of `tree`'s own `script` with `argv`, recorded into `out` (its record step, which
    every tree with bench/_harness.py has): the result it wrote."""
    out.mkdir(parents=True)
    env = {**os.environ, "SSP_BENCH_RESULTS": str(out), "PYTHONPATH": str(tree)}
    p = subprocess.run([sys.executable, str(tree / script), *argv, "--record"], cwd=tree, env=env,
                       capture_output=True, text=True)
    files = sorted(out.glob("*.json"))
    if p.returncode != 0 or not files:
        raise SystemExit(f"--against: {script} in {tree} failed or recorded nothing:\n{p.stderr[-3000:]}")
    return json.loads(files[0].read_text())


def _medians(named: dict) -> dict[str, float]:
    return {k: (v["median"] if isinstance(v, dict) else v) for k, v in named.items()
            if isinstance(v, dict) or (isinstance(v, (int, float)) and not isinstance(v, bool))}


def against(rev: str, rounds: int, argv: list[str], script: str | None = None) -> dict:
    """Same-run A/B: `rounds` runs of this checkout's bench `script` (bench/<bench>.py, by default
    the one running) with `argv` and as many of REV's own, alternating and the order swapped every
    round, so a neighbour's load falls on both alike. Prints, for every figure and denominator
    both record, each side's median with its range and the ratio this / REV per round pair (median
    and range); returns {name: {"this": [..], "rev": [..], "ratio": [..]}}."""
    script = script or Path(sys.argv[0]).resolve().relative_to(ROOT).as_posix()
    load0 = load_average()
    runs: dict[str, list[dict]] = {"this": [], "rev": []}
    with checkout(rev) as tree, tempfile.TemporaryDirectory(prefix="ssp-bench-ab-") as d:
        if not (tree / script).is_file():
            raise SystemExit(f"--against {rev}: it has no {script}")
        for k in range(max(1, rounds)):
            for side in (("this", "rev") if k % 2 == 0 else ("rev", "this")):
                print(f"--against: round {k + 1}, {'this checkout' if side == 'this' else rev} ...", flush=True)
                runs[side].append(_one_run(ROOT if side == "this" else tree, script, argv, Path(d) / f"{side}{k}"))
    out: dict[str, dict] = {}
    for kind in ("figures", "denominators"):
        this = [_medians(r[kind]) for r in runs["this"]]
        old = [_medians(r[kind]) for r in runs["rev"]]
        for name in this[0]:
            if all(name in r for r in this + old):
                a, b = [r[name] for r in this], [r[name] for r in old]
                out[f"{kind[:-1]} {name}"] = {"this": a, "rev": b,
                                              "ratio": [x / y for x, y in zip(a, b) if y]}
    commit = runs["rev"][0].get("commit", "")[:7]
    print(f"{script} {' '.join(argv)}: this checkout against {rev} ({commit}), {max(1, rounds)} round(s) each, "
          f"alternating; load average {load0} at the start, {load_average()} at the end")
    print(f"{'':48s} {'this: median (range)':>24s} {'REV: median (range)':>24s} {'this / REV':>22s}")
    for name, v in out.items():
        fmt = "{:.0f}" if max(map(abs, v["this"] + v["rev"])) >= 1000 else "{:.4g}"
        ratio = med_range(v["ratio"], "{:.3f}") if v["ratio"] else "-"
        print(f"{name:48s} {med_range(v['this'], fmt):>24s} {med_range(v['rev'], fmt):>24s} {ratio:>22s}")
    if RECORD:
        print("--against: nothing recorded (a result file holds one checkout's run)")
    return out


def parse_args(ap):
    """`ap.parse_args()` with `--against REV` and `--against-rounds N` added; given --against,
    the same-run A/B runs instead of the bench (`against`, with the rest of the command line)
    and the process exits."""
    ap.add_argument("--against", metavar="REV",
                    help="same-run A/B: this checkout against REV (a git revision, or a checkout's directory), "
                         "each tree's own bench with the other arguments, rounds alternating; ratios this / REV")
    ap.add_argument("--against-rounds", type=int, default=3, metavar="N", help="--against: runs of each tree")
    args = ap.parse_args()
    if args.against:
        argv, skip = [], 0
        for a in COMMAND[1:]:
            if skip:
                skip -= 1
            elif a in ("--against", "--against-rounds"):
                skip = 1
            elif not a.startswith(("--against=", "--against-rounds=")) and a != "--record":
                argv.append(a)
        against(args.against, args.against_rounds, argv)
        raise SystemExit(0)
    return args
