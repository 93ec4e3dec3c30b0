"""Start-up of the wake-sync-sleep verbs: wall and CPU per call of `ssp-agent
write` and `ssp-agent sync --broker URL --once`, against `python -c pass` measured in the same
rounds, their peak RSS, and the fsync/fdatasync calls each makes (SQLite's included).

Modules run from cached bytecode, as an installed wheel's do (the bench's own PYTHONPYCACHEPREFIX,
filled by warm-up calls). Each round, in one temporary directory with a private mosquitto: `python -c pass`; node A
`write`s one reading; A `sync --once` offers it (B, asleep, is not present: no answer to wait
for); B `sync --once` takes it in from its persistent session, answers, and leaves. Every call is a
fresh process (`python -m agent.cli`, what the `ssp-agent` script runs); its CPU time and peak RSS
come from wait4(2). fsyncs are counted by an LD_PRELOAD shim (bench/fsync_shim.c) when a C compiler
is there, else by `strace -f` when that is there, else not at all (said so).

    python bench/bench_startup.py [--rounds 7] [--quick] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import fsyncshim  # noqa: E402  (bench/)
from _harness import ROOT, median, record  # noqa: E402  (bench/: the shared set-up)

# --code DIR (before/after comparisons): run the CLI of another checkout
CODE = os.path.abspath(sys.argv[sys.argv.index("--code") + 1]) if "--code" in sys.argv else str(ROOT)
from agent.simpeer import manifest_text, readings_table  # noqa: E402
from agent.transport.broker import Broker, find_mosquitto  # noqa: E402

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")


class Call:
    def __init__(self, wall: float, cpu: float, rss_kb: int, fsyncs: int | None, out: str) -> None:
        self.wall, self.cpu, self.rss_kb, self.fsyncs, self.out = wall, cpu, rss_kb, fsyncs, out


def run(argv: list[str], env: dict, count: str | None, strace: bool, cwd: str | None = None) -> Call:
    """One process: wall from start to reaped, CPU (user + system) and peak RSS from wait4."""
    if count is not None and os.path.exists(count):
        os.unlink(count)
    trace = None
    if strace:
        trace = count + ".strace"
        argv = ["strace", "-f", "-qq", "-e", "trace=fsync,fdatasync", "-o", trace, *argv]
    with tempfile.TemporaryFile() as so, tempfile.TemporaryFile() as se:
        t = time.perf_counter()
        p = subprocess.Popen(argv, env=env, stdout=so, stderr=se, cwd=cwd)
        _pid, status, ru = os.wait4(p.pid, 0)   # this child's own rusage (Popen.wait would reap it)
        wall = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        so.seek(0)
        se.seek(0)
        out, err = so.read(), se.read()
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed: {err.decode()[-2000:]}")
    fsyncs = None
    if strace and trace:
        with open(trace) as f:
            fsyncs = sum(1 for line in f if "fsync(" in line or "fdatasync(" in line)
    elif count is not None:
        fsyncs = sum(a + b for _pid, a, b in fsyncshim.read_counts(count))
    return Call(wall, ru.ru_utime + ru.ru_stime, ru.ru_maxrss, fsyncs, out.decode())


class Setup:
    """Two homes (A writes and offers, B takes in and answers) run by one checkout's CLI."""

    def __init__(self, d: str, code: str, shim: str | None, use_strace: bool) -> None:
        self.d, self.use_strace = d, use_strace
        os.makedirs(d)
        self.count = os.path.join(d, "fsyncs")
        # Bytecode cached, as on a device (pip compiles an installed wheel): without it every call
        # compiles each module from source, which this machine's PYTHONDONTWRITEBYTECODE=1 forces
        # and which would then dominate the figures. The cache lives in the bench's directory.
        self.base = dict(os.environ, PYTHONPATH=code, SSP_AGENT_CLOCK_TRUSTED="1",
                         SSP_AGENT_WITNESS_DIR=os.path.join(d, "witness"),
                         PYTHONPYCACHEPREFIX=os.path.join(d, "pycache"))
        self.base.pop("PYTHONDONTWRITEBYTECODE", None)
        self.env = fsyncshim.env(shim, count_file=self.count, base=self.base) if shim else self.base
        self.cli = [sys.executable, "-m", "agent.cli"]
        man = os.path.join(d, "m.toml")
        with open(man, "w") as f:
            f.write(manifest_text(MESH, readings_table()))
        keys = {}
        for n in ("a", "b"):
            out = subprocess.run(self.cli + ["--home", os.path.join(d, n), "init", "--manifest", man], env=self.base,
                                 capture_output=True, text=True, check=True, cwd=d).stdout
            keys[n] = json.loads(out)
        for me, other in (("a", "b"), ("b", "a")):
            subprocess.run(self.cli + ["--home", os.path.join(d, me), "peer", "add", "--site-id",
                                       keys[other]["site_id"], "--public-key", keys[other]["public_key"]],
                           env=self.base, check=True, capture_output=True, cwd=d)
        self.calls: dict[str, list[Call]] = {"python -c pass": [], "write": [], "sync --once (offer)": [],
                                             "sync --once (take in, answer)": []}

    def call(self, argv: list[str]) -> Call:
        # cwd outside any checkout: `python -m` puts the working directory first on sys.path
        return run(argv, self.env, self.count, self.use_strace, cwd=self.d)

    def first_wake(self, url: str) -> None:
        # not measured: B's first wake creates its persistent session; A's first write creates
        # the clock witness file (two fsyncs once per site)
        self.call(self.cli + ["--home", os.path.join(self.d, "b"), "sync", "--broker", url, "--once"])
        self.call(self.cli + ["--home", os.path.join(self.d, "a"), "write", "app.readings", "--key",
                              json.dumps({"device": "warm-up", "seq": 0}), "--set", '{"temp": 20.5}'])

    def round(self, r: int, url: str) -> None:
        a, b = os.path.join(self.d, "a"), os.path.join(self.d, "b")
        self.calls["python -c pass"].append(self.call([sys.executable, "-c", "pass"]))
        self.calls["write"].append(self.call(self.cli + ["--home", a, "write", "app.readings", "--key",
                                                         json.dumps({"device": "d1", "seq": r}), "--set",
                                                         '{"temp": 20.5}']))
        self.calls["sync --once (offer)"].append(self.call(self.cli + ["--home", a, "sync", "--broker", url,
                                                                       "--once"]))
        got = self.call(self.cli + ["--home", b, "sync", "--broker", url, "--once"])
        if json.loads(got.out)["applied"] < 1:
            raise SystemExit(f"B took in nothing in round {r}: {got.out}")
        self.calls["sync --once (take in, answer)"].append(got)


def report(title: str, calls: dict[str, list[Call]], how: str | None) -> dict[str, float]:
    base_wall = median([c.wall for c in calls["python -c pass"]])
    base_cpu = median([c.cpu for c in calls["python -c pass"]])
    fig: dict[str, float] = {}
    n = len(calls["python -c pass"])
    print(f"{title}: {n} round(s); medians, range in brackets; fsyncs counted by "
          f"{how or 'nothing (no cc, no strace)'}")
    print(f"{'call':32s} {'wall ms':>20s} {'CPU ms':>20s} {'wall - pass':>11s} {'CPU - pass':>10s} "
          f"{'peak RSS MB':>11s} {'fsyncs':>6s}")
    for name, cs in calls.items():
        w = [c.wall * 1e3 for c in cs]
        u = [c.cpu * 1e3 for c in cs]
        m = [c.rss_kb / 1024 for c in cs]
        fs = [c.fsyncs for c in cs if c.fsyncs is not None]
        print(f"{name:32s} {median(w):7.1f} [{min(w):5.1f}-{max(w):5.1f}] {median(u):7.1f} [{min(u):5.1f}-{max(u):5.1f}] "
              f"{median(w) - base_wall * 1e3:11.1f} {median(u) - base_cpu * 1e3:10.1f} {max(m):11.1f} "
              f"{(str(int(median(fs))) if fs else 'n/a'):>6s}")
        key = {"python -c pass": "python_pass", "write": "write", "sync --once (offer)": "sync_once_offer",
               "sync --once (take in, answer)": "sync_once_take_in"}[name]
        fig[f"{key}_wall_ms"] = median(w)
        fig[f"{key}_cpu_ms"] = median(u)
        fig[f"{key}_peak_rss_mb"] = max(m)
        if fs:
            fig[f"{key}_fsyncs"] = median(fs)
    print(f"  wall / python -c pass: write {fig['write_wall_ms'] / (base_wall * 1e3):.1f}x, "
          f"sync --once {fig['sync_once_offer_wall_ms'] / (base_wall * 1e3):.1f}x / "
          f"{fig['sync_once_take_in_wall_ms'] / (base_wall * 1e3):.1f}x; CPU / python -c pass: write "
          f"{fig['write_cpu_ms'] / (base_cpu * 1e3):.1f}x, sync --once {fig['sync_once_offer_cpu_ms'] / (base_cpu * 1e3):.1f}x")
    return fig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 7; 1 with --quick)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--code", help="run the CLI of another checkout")
    ap.add_argument("--before", help="also run this checkout's CLI in the same rounds, interleaved (before/after)")
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 7)
    if find_mosquitto() is None:
        raise SystemExit("mosquitto is not installed (apt-get install -y mosquitto)")
    d = tempfile.mkdtemp(prefix="bench-startup-")
    try:
        shim = fsyncshim.build(d)
        use_strace = shim is None and shutil.which("strace") is not None
        setups = {"this checkout" if not args.code else args.code: Setup(os.path.join(d, "new"), CODE, shim, use_strace)}
        if args.before:
            setups = {f"before ({args.before})": Setup(os.path.join(d, "old"), os.path.abspath(args.before), shim,
                                                       use_strace), **setups}
        with Broker(workdir=os.path.join(d, "broker")) as br:
            for st in setups.values():
                st.first_wake(br.url)
            for r in range(rounds):
                for st in setups.values():
                    st.round(r, br.url)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    how = "LD_PRELOAD shim" if shim else "strace" if use_strace else None
    out = {}
    for title, st in setups.items():
        out[title] = report(title, st.calls, how)
    if args.json:
        print(json.dumps({t: {k: round(v, 2) for k, v in f.items()} for t, f in out.items()}))
    *before, (_, fig) = out.items()   # the measured checkout is the last setup; --before's goes first
    before = {f"before_{k}": v for _, f in before for k, v in f.items() if not k.startswith("python_pass")}
    record({k: v for k, v in fig.items() if not k.startswith("python_pass")} | before,
           {k: v for k, v in fig.items() if k.startswith("python_pass")} | {"rounds": rounds},
           f"CPU per call: `write` {fig['write_cpu_ms']:.0f} ms ({fig['write_cpu_ms'] / fig['python_pass_cpu_ms']:.1f}x "
           f"`python -c pass`), `sync --once` {fig['sync_once_offer_cpu_ms']:.0f} ms "
           f"({fig['sync_once_offer_cpu_ms'] / fig['python_pass_cpu_ms']:.1f}x); wall `write` {fig['write_wall_ms']:.0f} ms, "
           f"`sync --once` offering {fig['sync_once_offer_wall_ms']:.0f} ms; peak RSS `write` {fig['write_peak_rss_mb']:.1f} MB"
           + (f"; fsyncs per `write` {fig['write_fsyncs']:g}" if "write_fsyncs" in fig else ""), parameters=vars(args))


if __name__ == "__main__":
    main()
