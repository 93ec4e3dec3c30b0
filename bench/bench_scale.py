"""Cost grows as the work grows, and no faster.

One node's store is filled through the one apply path to each size in turn (10 000, 100 000 and,
with --million, 1 000 000 events; 5 sites, one row per event up to 200 000 rows, then updates of
those rows), and at each size:

- apply rate of fresh bodies of --probe events (mailbox import, the same path as bench/apply.py),
  as a ratio to the raw PyNaCl verify rate of the same events measured in the same round (the
  machine is shared: the ratio is what compares across sizes); median of --rounds with range;
- `status` (in-process, and the `ssp-agent status` and `ssp-agent check` commands) wall time;
- at 100 000 events: the widening backfill of every row to a new peer (scope §2), driven through
  SyncDriver.build/confirm as a session does, total and per cycle (first, median, last);
- on a copy of the largest store: eviction (`Node.evict_table`) at rising horizons, time against
  the events each run removes.

    python bench/bench_scale.py [--million] [--probe 5000] [--rounds 3] [--quick]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import ROOT, bench_env, child_env, cli, load_average, med_range, of_rounds, raw_verify_rate, record  # noqa: E402  (bench/)
from agent.node import Node  # noqa: E402
from agent.simpeer import SimPeer, manifest_text, readings_table  # noqa: E402
from agent.store import sync_state as st  # noqa: E402
from agent.sync import SyncDriver, import_mailbox_body  # noqa: E402

MESH = bytes.fromhex("be4c0000000000000000000000000002")
T = "app.readings"
MAX_ROWS = 200_000


class Source:
    """Signed events in HLC order: event i writes row i % MAX_ROWS, so the store grows in rows up
    to MAX_ROWS and in events beyond it."""

    def __init__(self, sites: list[SimPeer], base_ms: int) -> None:
        self.sites, self.base, self.i = sites, base_ms, 0

    def next(self, n: int) -> list[bytes]:
        out = []
        for _ in range(n):
            i = self.i
            s = self.sites[i % len(self.sites)]
            out.append(s.event(T, {"device": f"dev{i % 50}", "seq": i % MAX_ROWS},
                               {"temp": float(i % 1000), "note": f"n{i % 97}"}, (self.base + i // 8, i % 8)))
            self.i += 1
        return out


def fill(node: Node, src: Source, upto: int, chunk: int = 5_000) -> float:
    """Apply events until the log holds `upto`; returns the fill rate (events/s)."""
    n0 = node.conn.execute("SELECT count(*) FROM events").fetchone()[0]
    t, done = time.perf_counter(), 0
    while n0 + done < upto:
        k = min(chunk, upto - n0 - done)
        outs = node.apply_batch(src.next(k), origin="mailbox")
        assert all(o.reason == "applied" for o in outs), {o.reason for o in outs}
        done += k
    return done / max(1e-9, time.perf_counter() - t)


def probe(node: Node, src: Source, sites: list[SimPeer], n: int, rounds: int, keys: dict) -> list[tuple]:
    """(apply rate, raw verify rate, CPU s per event in all processes) per round: one mailbox body of
    `n` fresh events each. The CPU figure moves less than the rates when neighbours load the machine."""
    out = []

    def cpu_now() -> float:   # this process and its apply workers (agent/applyworker.py)
        return time.process_time() + ((node._pool.cpu_seconds() or 0.0) if node._pool else 0.0)

    for _ in range(rounds):
        evs = src.next(n)
        body = sites[0].body(evs)
        t, c = time.perf_counter(), cpu_now()
        r = import_mailbox_body(node, body)
        rate, cpu = n / (time.perf_counter() - t), (cpu_now() - c) / n
        assert r["applied"] == n, r
        out.append((rate, raw_verify_rate(evs, keys, MESH), cpu))
    return out


def timed_cli(home: Path, *verb: str) -> float:
    env = child_env()
    t = time.perf_counter()
    subprocess.run(cli(home, *verb), env=env, cwd=str(ROOT),
                   capture_output=True, timeout=600)
    return time.perf_counter() - t


def backfill(node: Node, peer: bytes) -> dict:
    """Every row of T to `peer` as a widening backfill (its live cursor already at the log's end)."""
    drv = SyncDriver(node)
    st.ensure_schema(node.conn)
    end = node.conn.execute("SELECT max(seq) FROM events").fetchone()[0]
    with node.conn:
        st.advance_cursor(node.conn, peer, "bench", end)
        st.schedule_backfill(node.conn, peer.hex(), [T], peers=[peer])
    cycles, events = [], 0
    t0 = time.perf_counter()
    while st.backfill_jobs(node.conn, peer):
        t = time.perf_counter()
        out = drv.build(peer, "bench", "batch")
        drv.confirm(peer, out.token, out.n_events)
        cycles.append(time.perf_counter() - t)
        events += out.n_events
        if len(cycles) > 10_000:
            raise RuntimeError("backfill does not finish")
    return {"seconds": time.perf_counter() - t0, "events": events, "cycles": cycles}


def evictions(home: Path, copy: Path, base_ms: int, steps: list[int]) -> list[tuple[int, float]]:
    """On a copy of the store: raise T's horizon so that each step removes `k` more events."""
    shutil.copytree(home, copy)
    node = Node.open(copy, check_machine=False)
    out, removed = [], 0
    try:
        for k in steps:
            removed += k
            # event i carries HLC (base + i // 8, i % 8): below (base + removed // 8, 0) are the first ones
            h = (base_ms + removed // 8, 0)
            t = time.perf_counter()
            n = node.evict_table(T, h, now=base_ms + 10_000_000, clock_override=True)
            out.append((n, time.perf_counter() - t))
    finally:
        node.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--million", action="store_true", help="also fill to 1 000 000 events (minutes)")
    ap.add_argument("--probe", type=int, default=5_000, help="events per probe body")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    args = ap.parse_args()
    sizes = [10_000, 100_000] + ([1_000_000] if args.million else [])
    backfill_at = 100_000
    if args.quick:
        sizes, backfill_at, args.probe, args.rounds = [500, 2_000], 2_000, 200, 1
    print(f"load average before: {load_average()}", flush=True)
    sites = [SimPeer(MESH) for _ in range(5)]
    newcomer = SimPeer(MESH)   # the peer a widening backfills
    keys = {s.site_id: s.public_key for s in sites}
    base = time.time_ns() // 1_000_000 - 10 * 24 * 3_600_000
    src = Source(sites, base)
    results = []
    with tempfile.TemporaryDirectory() as d:
        bench_env(os.path.join(d, "witness"))
        home = Path(d) / "node"
        node, _ = Node.init(home, manifest_text(MESH, readings_table("telemetry"), sites + [newcomer]))
        bf = None
        try:
            for size in sizes:
                fill_rate = fill(node, src, size)
                rounds = probe(node, src, sites, args.probe, args.rounds, keys)
                n_events = node.conn.execute("SELECT count(*) FROM events").fetchone()[0]
                t = time.perf_counter()
                node.status()
                status_in = time.perf_counter() - t
                node.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                status_cli, check_cli = timed_cli(home, "status"), timed_cli(home, "check")
                results.append((size, n_events, fill_rate, rounds, status_in, status_cli, check_cli))
                ratios = [a / v for a, v, _ in rounds]
                print(f"{n_events:>9} events in the store: apply {med_range([a for a, _, _ in rounds], '{:.0f}')} "
                      f"events/s, ratio to raw verify {med_range(ratios)}, CPU "
                      f"{med_range([c * 1e6 for _, _, c in rounds], '{:.0f}')} us/event; fill {fill_rate:.0f} events/s; "
                      f"status {status_in * 1e3:.1f} ms in-process, `status` {status_cli:.2f} s, "
                      f"`check` {check_cli:.2f} s", flush=True)
                if size == backfill_at:
                    bf = backfill(node, newcomer.site_id)
                    c = bf["cycles"]
                    print(f"backfill of {size} rows to a new peer: {bf['events']} events in {bf['seconds']:.1f} s "
                          f"({bf['events'] / bf['seconds']:.0f} events/s), {len(c)} cycles: first "
                          f"{c[0] * 1e3:.1f} ms, median {statistics.median(c) * 1e3:.1f} ms, last {c[-1] * 1e3:.1f} ms",
                          flush=True)
        finally:
            node.close()
        n_last = results[-1][1]
        steps = [n_last // 100, n_last // 10, n_last // 2] if not args.quick else [100, 400]
        ev = evictions(home, Path(d) / "evict", base, steps)
        for n, s in ev:
            print(f"eviction: {n:>8} events removed in {s:.2f} s ({s / max(1, n) * 1e6:.1f} us/event)", flush=True)
    first, last = results[0], results[-1]
    r0 = statistics.median([a / v for a, v, _ in first[3]])
    r1 = statistics.median([a / v for a, v, _ in last[3]])
    print(f"apply ratio at {last[1]} events / at {first[1]} events: {r1 / r0:.2f} (flat: ~1.0)")
    print(f"load average after: {load_average()}")
    figures, denominators = {}, {}
    for size, n_events, fill_rate, rs, status_in, status_cli, check_cli in results:
        figures[f"ratio_apply_raw_verify_{n_events}_events"] = of_rounds(a / v for a, v, _ in rs)
        figures[f"cpu_us_per_event_{n_events}_events"] = of_rounds(c * 1e6 for _, _, c in rs)
        figures[f"status_in_process_ms_{n_events}_events"] = status_in * 1e3
        figures[f"status_cli_s_{n_events}_events"] = status_cli
        figures[f"check_cli_s_{n_events}_events"] = check_cli
        denominators[f"raw_verify_per_s_{n_events}_events"] = of_rounds(v for _, v, _ in rs)
    figures["ratio_largest_smallest_store"] = r1 / r0
    if bf:
        figures |= {"backfill_events": bf["events"], "backfill_s": bf["seconds"], "backfill_cycles": len(bf["cycles"])}
    for n, s in ev:
        figures[f"eviction_s_{n}_events_removed"] = s
    record(figures, denominators,
           "apply / raw verify " + " / ".join(f"{statistics.median([a / v for a, v, _ in r[3]]):.2f}" for r in results)
           + " at " + " / ".join(str(r[1]) for r in results) + f" events: {r1 / r0:.2f} of the small store's ratio; "
           + "`status` in-process " + " / ".join(f"{r[4] * 1e3:.1f}" for r in results) + " ms; eviction "
           + " / ".join(f"{n} events in {s:.2f} s" for n, s in ev), parameters=vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
