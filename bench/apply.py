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

One more import, instrumented, shows where the CPU goes: the applying thread's microseconds an
event by section (each kind of SQLite statement, the decode it does, sealing, the feed record, the
merge, the hand-off to the workers, and the apply path's own Python as the rest), the workers' parts
(verification, envelope parse, decode, pickling), the ratio both cores would allow evenly loaded,
and an estimate for four cores.

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


class _Sections:
    """Exclusive CPU time of named sections of the applying thread (time spent in a section
    nested inside another counts for the inner one only): where the applying thread's CPU goes,
    measured on the real import. The thread's CPU clock costs about half a microsecond a read:
    its share inside each section and outside them (`calibrate`) is taken off (`spent_net`)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.entries: dict[str, int] = {}
        self.nested: dict[str, int] = {}   # sections entered inside each one
        self.stack: list[list] = []
        self.inside = self.outside = 0.0

    def wrap(self, name: str, fn):
        clock, spent, entries, nested, stack = time.thread_time, self.spent, self.entries, self.nested, self.stack

        def timed(*a, **k):
            frame = [clock(), 0.0, 0]
            stack.append(frame)
            try:
                return fn(*a, **k)
            finally:
                stack.pop()
                dt = clock() - frame[0]
                spent[name] = spent.get(name, 0.0) + dt - frame[1]
                entries[name] = entries.get(name, 0) + 1
                nested[name] = nested.get(name, 0) + frame[2]
                if stack:
                    stack[-1][1] += dt
                    stack[-1][2] += 1
        return timed

    def calibrate(self, n: int = 20_000) -> None:
        """The clock's cost inside a section (what an empty one records) and outside it (what the
        wrapper adds to the caller beyond that), per entry."""
        probe = _Sections()
        f = probe.wrap("empty", lambda: None)
        c = time.thread_time()
        for _ in range(n):
            f()
        total = time.thread_time() - c
        c = time.thread_time()
        for _ in range(n):
            (lambda: None)()
        bare = time.thread_time() - c
        self.inside = probe.spent["empty"] / n
        self.outside = max(0.0, (total - bare) / n - self.inside)

    def spent_net(self) -> tuple[dict[str, float], float]:
        """(section -> CPU seconds without the instrumentation's cost: its own clock reads, and the
        wrappers of the sections nested in it; the instrumentation's whole cost)."""
        net = {k: max(0.0, v - self.entries[k] * self.inside - self.nested[k] * self.outside)
               for k, v in self.spent.items()}
        return net, sum(self.entries.values()) * (self.inside + self.outside)


class _TimedConn:
    """The node's connection with its statements timed, by kind (sections `sql_*`)."""

    KINDS = (("INSERT OR IGNORE INTO events", "sql_log"), ("INSERT INTO feed", "sql_feed"),
             ('INSERT INTO "_ssp_rows', "sql_rows"), ("COMMIT", "sql_commit"))

    def __init__(self, conn, sections: _Sections) -> None:
        self._conn = conn
        by = {k: (sections.wrap(k, conn.execute), sections.wrap(k, conn.executemany))
              for k in [k for _, k in self.KINDS] + ["sql_other"]}
        of: dict[str, tuple] = {}   # statement text -> its kind's timed pair (one look-up a call)

        def kind(sql: str) -> tuple:
            k = of[sql] = by[next((k for prefix, k in self.KINDS if sql.startswith(prefix)), "sql_other")]
            return k
        self.execute = lambda sql, *a: (of.get(sql) or kind(sql))[0](sql, *a)
        self.executemany = lambda sql, *a: (of.get(sql) or kind(sql))[1](sql, *a)

    def __getattr__(self, name):
        return getattr(self._conn, name)


BREAKDOWN = (("sql_log", "SQLite: the log insert (§12.4)"), ("sql_feed", "SQLite: the feed append"),
             ("sql_rows", "SQLite: the row writes (one upsert a row a window)"),
             ("sql_commit", "SQLite: the commits (WAL, synchronous=FULL)"),
             ("sql_other", "SQLite: duplicate look-ups and the rest"),
             ("decode", "payload decode done on this thread (the share the workers leave)"),
             ("prepare_here", "chunks this thread prepared itself (verify included)"),
             ("seal", "sealing the log's copy (XChaCha20-Poly1305, nonce)"),
             ("feed", "feed record text"), ("merge", "merge (§13)"),
             ("event_id", "BLAKE3 event_id"), ("hand_off", "hand-off to the workers (pickle, pipe)"),
             ("read_answers", "reading the workers' answers (the pipe; CPU, not the wait)"))


def breakdown(home: Path, manifest: str, body: bytes, n: int) -> dict:
    """One more import, instrumented: the applying thread's CPU per event by section, what is
    left (the apply path's own Python: checks, outcomes, tuples), the time it waited for the
    workers, and the workers' CPU per event."""
    from agent import apply as ap, applyworker, feed
    from agent.core import events as ev
    from agent.store import atrest
    sec = _Sections()
    saved = [(ev, "decoded_event"), (ev, "event_id"), (atrest.LogSeal, "seal"), (feed, "note_change"),
             (ap, "merge_upsert"), (applyworker.ApplyWorkers, "submit"), (applyworker.ApplyWorker, "result"),
             (applyworker, "_read_frame")]
    saved = [(o, a, getattr(o, a)) for o, a in saved]
    import agent.core.prepare
    prepare_here = agent.core.prepare.prepare
    try:
        ev.decoded_event = sec.wrap("decode", ev.decoded_event)
        ev.event_id = sec.wrap("event_id", ev.event_id)
        atrest.LogSeal.seal = sec.wrap("seal", atrest.LogSeal.seal)
        feed.note_change = sec.wrap("feed", feed.note_change)
        ap.merge_upsert = sec.wrap("merge", ap.merge_upsert)
        applyworker.ApplyWorkers.submit = sec.wrap("hand_off", applyworker.ApplyWorkers.submit)
        applyworker.ApplyWorker.result = sec.wrap("hand_off", applyworker.ApplyWorker.result)
        applyworker._read_frame = sec.wrap("read_answers", applyworker._read_frame)
        agent.core.prepare.prepare = sec.wrap("prepare_here", prepare_here)
        node, _ = Node.init(home, manifest)
        timed = _TimedConn(node.state.conn, sec)
        node.state.conn = timed
        for t in node.tables.values():
            t.rows.conn = timed
        ct = time.thread_time()
        import_body(node, body)
        thread = time.thread_time() - ct
        workers = (node._pool.cpu_seconds() or 0.0) if node._pool else 0.0
        share = (node._pool.share, node._pool.here) if node._pool else (0.0, 0.0)
        node.state.conn = timed._conn
        node.close()
    finally:
        for o, a, f in saved:
            setattr(o, a, f)
        agent.core.prepare.prepare = prepare_here
    sec.calibrate()
    net, cost = sec.spent_net()
    us = {k: v / n * 1e6 for k, v in net.items()}
    thread -= cost   # the instrumentation's own cost
    out = {k: us.get(k, 0.0) for k, _ in BREAKDOWN}
    out["rest"] = thread / n * 1e6 - sum(out.values())
    return {"thread": thread / n * 1e6, "workers": workers / n * 1e6, "sections": out,
            "decode_share_workers": share[0], "prepared_here_share": share[1]}


def worker_parts(events: list[bytes], keys: dict[bytes, bytes]) -> dict:
    """A worker's CPU per event by part, on this thread: envelope parse and Sig_structure, the
    verification, the payload decode (when it decodes), pickling its answer."""
    import pickle
    from agent.core import cose, events as ev
    from agent.core.prepare import prepare
    sample = events[:4096]
    keyring = {k: (v, None) for k, v in keys.items()}
    c = time.thread_time()
    parsed = [cose.parse_sign1(e) for e in sample]
    tbs = [(keys[p.kid], p.sig_structure(MESH), p.signature) for p in parsed]
    parse = time.thread_time() - c
    c = time.thread_time()
    for p in parsed:
        ev.decoded_event(b"", p, b"")
    decode = time.thread_time() - c
    res = [prepare(sample[i:i + 256], keyring, MESH) for i in range(0, len(sample), 256)]
    c = time.thread_time()
    for r in res:
        pickle.loads(pickle.dumps((r, len(r), 0.0), protocol=pickle.HIGHEST_PROTOCOL))
    pickling = time.thread_time() - c
    del tbs
    n = len(sample)
    return {"parse": parse / n * 1e6, "decode": decode / n * 1e6, "pickle": pickling / n * 1e6}


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
    rounds, cpu_bounds, v_cpus = [], [], []
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
            v_cpus.append(v_cpu)
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
        bd = breakdown(Path(d) / "breakdown", manifest, body, args.events)
        wp = worker_parts(events, keys)
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
    v_us = sorted(v_cpus)[len(v_cpus) // 2] * 1e6
    total = bd["thread"] + bd["workers"]
    print(f"where the CPU goes (one more import, instrumented; us an event): applying thread {bd['thread']:.1f}, "
          f"workers {bd['workers']:.1f}, together {total:.1f} against {v_us:.1f} for one raw verify; the workers "
          f"decoded {bd['decode_share_workers']:.2f} of the chunks, this thread prepared {bd['prepared_here_share']:.2f} "
          f"itself")
    for k, label in BREAKDOWN + (("rest", "the apply path's own Python (checks, outcomes, tuples, the loop)"),):
        print(f"  applying thread  {bd['sections'][k]:6.1f}  {label}")
    print(f"  workers          {v_us:6.1f}  verification; {wp['parse']:.1f} envelope parse and Sig_structure, "
          f"{wp['decode']:.1f} payload decode when they decode, {wp['pickle']:.1f} pickling an answer (both sides)")
    print(f"  limit of the ratio with both cores busy and evenly loaded: 2 x {v_us:.1f} / {total:.1f} = "
          f"{2 * v_us / total:.2f} (1.0 needs {total - 2 * v_us:.1f} us less an event)")
    # Four cores: three workers verify and decode everything, so the applying thread alone
    # (without the decoding and verifying it did here) is the limit.
    alone = bd["thread"] - bd["sections"]["decode"] - bd["sections"]["prepare_here"]
    four = v_us / max(alone, total / 4)
    print(f"  on 4 cores (estimate): the applying thread alone, {alone:.1f} us an event, bounds the ratio at "
          f"{four:.2f}, keeping {total / max(alone, total / 4) / 4:.0%} of the 4 cores busy")
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
            "peak_rss_this_process_mb": peak, **rss_mb,
            "thread_cpu_us_per_event": bd["thread"], "worker_cpu_us_per_event": bd["workers"],
            "balanced_limit_ratio": 2 * v_us / total, "four_core_estimate_ratio": four,
            **{f"thread_us_{k}": v for k, v in bd["sections"].items()},
            **{f"worker_us_{k}": v for k, v in wp.items()}},
           {"raw_verify_per_s": of_rounds(v for _, v in rounds), "raw_sqlite_rows_per_s": sqlite_rate,
            "events": args.events, "event_bytes": raw_bytes / args.events},
           f"apply / raw verify {ratios[len(ratios) // 2]:.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f}) on "
           f"{len(os.sched_getaffinity(0))} cores; CPU bound {cb[len(cb) // 2]:.2f}"
           + "".join(f"; peak RSS {r['tree_peak_kb'] / 1024:.1f} MB importing {label}" for label, r in rss),
           parameters=vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
