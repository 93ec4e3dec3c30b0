"""Core benchmark: import one mailbox body of N valid events over ~5 sites and
~2 000 rows through the one apply path, against the raw limits measured in the same run:
PyNaCl Ed25519 verify of the same events, and raw SQLite inserts of the same rows.

Peak RSS is measured in a fresh subprocess that opens a node and imports a
mailbox file, as `ssp-agent mailbox import` does: the body of N events, and a body of ~1 KiB
events filling the 16 MiB message bound. Its VmHWM is the whole process's peak (the
interpreter and every import included); the figure before the import is printed beside it. The
apply worker processes' peaks are added (an upper bound: pages the processes share, the
interpreter's and the libraries', count twice), and the sampled peak of the node's resident set
plus the workers' private pages (each shared page once) is printed beside it.

    python bench/apply.py [--events 50000] [--rounds 3] [--cpus 0] [--no-rss] [--against REV]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import bench_env, load_average, parse_args, raw_verify, of_rounds, record  # noqa: E402  (bench/: the shared set-up)
from agent.sync import import_mailbox_body as import_body  # noqa: E402
from agent.node import Node  # noqa: E402
from agent.simpeer import SimPeer, manifest_text, readings_table  # noqa: E402

MESH = bytes.fromhex("be4c0000000000000000000000000001")


def make_events(n: int, sites: list[SimPeer], rows: int, seed: int = 1) -> list[bytes]:
    rnd = random.Random(seed)
    base = time.time_ns() // 1_000_000 - 3_600_000
    out = []
    for i in range(n):
        s = sites[i % len(sites)]
        r = rnd.randrange(rows)
        vals = {"temp": rnd.uniform(-20, 40), "note": f"n{i % 97}"} if i % 3 else {"temp": rnd.uniform(-20, 40)}
        out.append(s.event("app.readings", {"device": f"dev{r % 50}", "seq": r}, vals, (base + i // 4, i % 4)))
    return out


def make_big_events(total_bytes: int, sites: list[SimPeer], rows: int) -> list[bytes]:
    """~1 KiB events (a long note) up to a body of `total_bytes`: the 16 MiB case."""
    base = time.time_ns() // 1_000_000 - 3_600_000
    out, size, i = [], 200, 0
    while True:
        s = sites[i % len(sites)]
        e = s.event("app.readings", {"device": f"dev{i % 50}", "seq": i % rows},
                    {"temp": float(i), "note": f"{i:08d}" + "x" * 760}, (base + i // 4, i % 4))
        if size + len(e) + 5 > total_bytes:
            return out
        out.append(e)
        size += len(e) + 3
        i += 1


# The child reads its peak from /proc (VmHWM: this process image's high-water mark), not from
# getrusage: Linux carries ru_maxrss over fork and exec, so a child of a large bench process would
# report the parent's size.
_RSS_CHILD = r"""
import json, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from agent.mailbox import read_file
from agent.sync import import_mailbox_body as import_body
from agent.node import Node
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
def mem(pid):
    # (resident, private) kB of a process: Rss, and Private_Clean + Private_Dirty (pages no other
    # process maps: what the process adds to the machine's memory)
    rss = private = 0
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("Rss:"):
                rss = int(line.split()[1])
            elif line.startswith("Private_"):
                private += int(line.split()[1])
    except OSError:
        pass
    return rss, private
import os, threading
node = Node.open(Path(sys.argv[1]))
before = hwm()
# The process tree's memory: the node's resident set plus what its apply workers add (their
# private pages: the interpreter's and libraries' pages they share with the node count once),
# sampled every 20 ms.
tree = {"peak": 0}
done = threading.Event()
def sample():
    while not done.wait(0.02):
        total = mem(os.getpid())[0] + sum(mem(w.pid)[1] for w in (node._pool.workers if node._pool else []))
        tree["peak"] = max(tree["peak"], total)
threading.Thread(target=sample, daemon=True).start()
t = time.perf_counter()
r = import_body(node, read_file(Path(sys.argv[2])))
dt = time.perf_counter() - t
done.set()
worker = node._pool.peak_rss_kb() if node._pool else None   # the apply worker process (agent/applyworker.py)
node.close()
print(json.dumps({"before_kb": before, "peak_kb": hwm(), "worker_peak_kb": worker, "tree_peak_kb": tree["peak"],
                  "applied": r["applied"], "seconds": dt}))
"""


def rss_import(home: Path, body: bytes, path: Path, cpus: set[int] | None) -> dict:
    """Import `body` from a file into the node at `home` in a fresh process: its peak RSS."""
    path.write_bytes(body)
    root = os.environ.get("SSP_BENCH_ROOT") or str(Path(__file__).resolve().parents[1])
    p = subprocess.run([sys.executable, "-c", _RSS_CHILD, str(home), str(path), root], capture_output=True,
                       text=True, timeout=1800, preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    if p.returncode != 0:
        raise RuntimeError(p.stderr[-2000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def raw_sqlite_rate(n: int, path: Path) -> float:
    conn = sqlite3.connect(str(path), isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=FULL")
    conn.execute("CREATE TABLE r (device, seq, temp, note, PRIMARY KEY (device, seq))")
    rnd = random.Random(2)
    rows = [(f"dev{i % 50}", rnd.randrange(2000), float(i), "x") for i in range(n)]
    t = time.perf_counter()
    for i in range(0, n, 1000):
        conn.execute("BEGIN")
        conn.executemany("INSERT OR REPLACE INTO r VALUES (?,?,?,?)", rows[i:i + 1000])
        conn.execute("COMMIT")
    rate = n / (time.perf_counter() - t)
    conn.close()
    return rate


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=50_000)
    ap.add_argument("--sites", type=int, default=5)
    ap.add_argument("--rows", type=int, default=2_000)
    ap.add_argument("--rounds", type=int, default=3,
                    help="rounds of (raw verify, import into a fresh node); the ratio is the median of the "
                         "rounds' own ratios, so a noisy neighbour slowing one measurement moves one round only")
    ap.add_argument("--cpus", type=int, default=0,
                    help="restrict this process (and the RSS subprocess) to the first N cores (0: all); "
                         "--cpus 1 shows what a single-core device gets")
    ap.add_argument("--no-rss", action="store_true", help="skip the peak-RSS subprocess imports")
    args = parse_args(ap)   # --against REV: the same-run A/B (bench/_harness.py against)
    cpus = None
    if args.cpus:
        cpus = set(sorted(os.sched_getaffinity(0))[:args.cpus])
        os.sched_setaffinity(0, cpus)
    print(f"cores: {len(os.sched_getaffinity(0))} of {os.cpu_count()}; load average before: "
          f"{load_average()}", flush=True)
    sites = [SimPeer(MESH) for _ in range(args.sites)]
    print(f"generating {args.events} signed events over {args.sites} sites and {args.rows} rows ...", flush=True)
    events = make_events(args.events, sites, args.rows)
    body = sites[0].body(events)
    raw_bytes = sum(len(e) for e in events)
    keys = {s.site_id: s.public_key for s in sites}
    rounds, cpu_bounds = [], []
    with tempfile.TemporaryDirectory() as d:
        bench_env(os.path.join(d, "witness"))
        manifest = manifest_text(MESH, readings_table(), sites)
        for k in range(max(1, args.rounds)):
            node, _ = Node.init(Path(d) / f"node{k}", manifest)
            rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            t, c, ct = time.perf_counter(), time.process_time(), time.thread_time()
            result = import_body(node, body)
            wall = time.perf_counter() - t
            # CPU of this process (all its threads) and of the apply worker processes
            # (agent/applyworker.py), and of the applying thread alone
            node_had_workers = bool(node._pool)
            worker_cpu = (node._pool.cpu_seconds() or 0.0) if node._pool else 0.0
            apply_rate = args.events / wall
            cpu_per_event = (time.process_time() - c + worker_cpu) / args.events
            thread_cpu = (time.thread_time() - ct) / args.events
            assert result["applied"] == args.events, result
            if k == 0:
                t = time.perf_counter()
                dup = import_body(node, body)
                dup_rate = args.events / (time.perf_counter() - t)
                assert dup["duplicate"] == args.events
                peak, before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, rss0 / 1024
            node.close()
            verify_rate, v_cpu = raw_verify(events, keys, MESH)   # after the import: round 1 measures its RSS alone
            rounds.append((apply_rate, verify_rate))
            # What the ratio would be with the cores to ourselves: the applying thread and the
            # workers run side by side, so the slower of the two (CPU per event) sets the rate.
            bound = v_cpu / max(thread_cpu, worker_cpu / args.events) if node_had_workers else \
                v_cpu / cpu_per_event
            cpu_bounds.append(bound)
            print(f"round {k + 1}: apply {apply_rate:8.0f} events/s, raw verify {verify_rate:8.0f}/s, "
                  f"ratio {apply_rate / verify_rate:.2f}; CPU {cpu_per_event * 1e6:.0f} us/event in all processes, "
                  f"{thread_cpu * 1e6:.0f} us/event on the applying thread, {worker_cpu / args.events * 1e6:.0f} in "
                  f"the apply workers (one raw verify: {1e6 / verify_rate:.0f} us of wall time, {v_cpu * 1e6:.0f} us "
                  f"of CPU); CPU bound on the ratio {bound:.2f}", flush=True)
        sqlite_rate = raw_sqlite_rate(args.events, Path(d) / "raw.sqlite")
        rss = []
        if not args.no_rss:
            big = make_big_events(16 * 2**20, sites, args.rows) if args.events >= 10_000 else \
                make_big_events(64 * 2**10, sites, args.rows)
            for label, b in ((f"{args.events} events, {len(body) / 2**20:.1f} MiB body", body),
                             (f"{len(big)} events of ~1 KiB, {sites[0].body(big).__len__() / 2**20:.2f} MiB body",
                              sites[0].body(big))):
                home = Path(d) / f"rss{len(rss)}"
                Node.init(home, manifest)[0].close()
                r = rss_import(home, b, Path(d) / "body.cbor", cpus)
                rss.append((label, r))
                del b
    ratios = sorted(a / v for a, v in rounds)
    apply_med = sorted(a for a, _ in rounds)[len(rounds) // 2]
    verify_med = sorted(v for _, v in rounds)[len(rounds) // 2]
    print(f"events:                      {args.events} ({raw_bytes / args.events:.0f} bytes each on average)")
    print(f"apply path (mailbox import): {apply_med:10.0f} events/s (median of {len(rounds)} rounds)")
    print(f"re-import (all duplicates):  {dup_rate:10.0f} events/s")
    print(f"raw Ed25519 verify (PyNaCl): {verify_med:10.0f} verifies/s (median)")
    print(f"raw SQLite inserts (WAL, FULL, 1000-row txns): {sqlite_rate:10.0f} rows/s")
    print(f"ratio apply / raw verify:    {ratios[len(ratios) // 2]:10.2f}   (median of the rounds' ratios, "
          f"range {ratios[0]:.2f}-{ratios[-1]:.2f}; target >= 1.0 on 2 cores)")
    cb = sorted(cpu_bounds)
    print(f"CPU bound on the ratio:      {cb[len(cb) // 2]:10.2f}   (median, range {cb[0]:.2f}-{cb[-1]:.2f}: one raw "
          f"verify's CPU over the CPU per event of the slower of the applying thread and the apply workers, i.e. the "
          f"ratio with these cores to ourselves)")
    print(f"ratio apply / raw SQLite:    {apply_med / sqlite_rate:10.2f}")
    print(f"peak RSS (this process):     {peak:10.1f} MB over the first import and its re-import (before them "
          f"{before:.1f} MB, the generated events included)")
    for label, r in rss:
        w = r.get("worker_peak_kb") or 0
        print(f"peak RSS, fresh process:     {(r['peak_kb'] + w) / 1024:10.1f} MB importing {label} from a file: "
              f"the node's process {r['peak_kb'] / 1024:.1f} MB + its apply worker's {w / 1024:.1f} MB (the sum of the "
              f"two peaks, shared pages counted twice); sampled every 20 ms, the tree's peak is "
              f"{r['tree_peak_kb'] / 1024:.1f} MB (the node's resident set + the worker's private pages); {r['before_kb'] / 1024:.1f} MB before the import; {r['applied']} applied in "
              f"{r['seconds']:.1f} s; target <= 64 MB)")
    print(f"load average after: {load_average()}")
    rss_mb = {f"peak_rss_fresh_process_{k}_mb": r["tree_peak_kb"] / 1024 for k, (_, r) in zip(("body", "big_body"), rss)}
    record({"ratio_apply_raw_verify": of_rounds(ratios), "cpu_bound_ratio": of_rounds(cb),
            "apply_events_per_s": of_rounds(a for a, _ in rounds),
            "reimport_events_per_s": dup_rate, "ratio_apply_raw_sqlite": apply_med / sqlite_rate,
            "peak_rss_this_process_mb": peak, **rss_mb},
           {"raw_verify_per_s": of_rounds(v for _, v in rounds), "raw_sqlite_rows_per_s": sqlite_rate,
            "events": args.events, "event_bytes": raw_bytes / args.events},
           f"apply / raw verify {ratios[len(ratios) // 2]:.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f}) on "
           f"{len(os.sched_getaffinity(0))} cores; CPU bound {cb[len(cb) // 2]:.2f}"
           + "".join(f"; peak RSS {r['tree_peak_kb'] / 1024:.1f} MB importing {label}" for label, r in rss),
           parameters=vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
