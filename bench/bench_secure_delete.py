"""What zeroing superseded values costs (docs/reliability.md "Superseded values"): the
profile's `[store] secure_delete` off / fast / on (agent/store/db.py `scrub_superseded`), on the
same work, fresh nodes, rounds interleaved (the order rotates per round), on the filesystem of
--dir (a real disk: tmpfs has no write-back to count):

  import:  one mailbox body of --events events over 2 000 rows of 5 sites (bench/apply.py's
           events: most upserts supersede a row's value) through the one apply path
  write:   local writes, `write_many` batches of 100 over 200 rows (every write after the first
           200 supersedes one)
  evict:   the profile's eviction job deleting --events eight-day-old events (sealed log rows)

Per mode: events/s (median and range over the rounds), the ratio to off (median of per-round
ratios), and bytes the process wrote to the device per event (/proc/self/io write_bytes: WAL,
checkpoints, journal).

    python bench/bench_secure_delete.py [--events 10000] [--writes 3000] [--rounds 3] [--dir /var/tmp]
"""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _harness import of_rounds, record, trusted_clock  # noqa: E402  (bench/: the shared set-up)

# This VM runs no time sync; the eviction job needs a trusted clock (docs/apply.md "Clocks without an RTC").
trusted_clock()

from agent.node import Node  # noqa: E402
from agent.profile import SECURE_DELETE_MODES, load_profile  # noqa: E402
from agent.simpeer import SimPeer, manifest_text, readings_table  # noqa: E402
from agent.sync import import_mailbox_body  # noqa: E402
from apply import make_events  # noqa: E402  (bench/apply.py: the same events as the apply benchmark)

MESH = bytes.fromhex("be4c0000000000000000000000000003")
T = "app.readings"
DAY_MS = 86_400_000


def _written() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("write_bytes:"):
                return int(line.split()[1])
    return 0


def _node(d: Path, name: str, mode: str, sites) -> Node:
    prof = dataclasses.replace(load_profile(None), secure_delete=mode)
    node, _ = Node.init(d / name, manifest_text(MESH, readings_table(retention="telemetry"), sites),
                        {"kind": "software"}, prof)
    return node


def _timed(fn) -> tuple[float, int, float]:
    """Wall seconds, bytes written to the device, CPU seconds of this process (less sensitive to
    other work on a shared machine than the wall clock)."""
    w, t, c = _written(), time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, _written() - w, time.process_time() - c


def _round(d: Path, k: int, mode: str, sites, body: bytes, old_body: bytes, n: int, writes: int) -> dict:
    out = {}
    node = _node(d, f"imp-{mode}-{k}", mode, sites)
    try:
        s, b, c = _timed(lambda: import_mailbox_body(node, body))
        out["import"], out["import_B"], out["import_cpu"] = n / s, b / n, 1e6 * c / n
    finally:
        node.close()
    node = _node(d, f"wr-{mode}-{k}", mode, sites)
    try:
        batches = [[(T, {"device": "w", "seq": (i * 100 + j) % 200}, {"temp": float(i), "note": f"v{i}-{j}" * 4}, False)
                    for j in range(100)] for i in range(writes // 100)]
        s, b, c = _timed(lambda: [node.write_many(x) for x in batches])
        out["write"], out["write_B"], out["write_cpu"] = writes / s, b / writes, 1e6 * c / writes
    finally:
        node.close()
    node = _node(d, f"ev-{mode}-{k}", mode, sites)
    try:
        assert import_mailbox_body(node, old_body)["applied"] == n + 1
        node.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        rep = {}
        s, b, c = _timed(lambda: rep.update(node.run_eviction()))
        assert rep["tables"][T]["events_deleted"] == n, rep
        out["evict"], out["evict_B"], out["evict_cpu"] = n / s, b / n, 1e6 * c / n
    finally:
        node.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=10000)
    ap.add_argument("--writes", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/var/tmp")
    args = ap.parse_args()
    sites = [SimPeer(MESH) for _ in range(5)]
    body = sites[0].body(make_events(args.events, sites, rows=2000))
    now = time.time_ns() // 1_000_000
    # the old events, and one of today: eviction moves a horizon only up to the time peers vouch for
    # (docs/apply.md "What eviction never does"), so the body carries that evidence
    old = sites[1].body([sites[1].event(T, {"device": "old", "seq": i}, {"temp": 0.5, "note": "o" * 40},
                                        (now - 8 * DAY_MS + i, 0)) for i in range(args.events)]
                        + [sites[1].event(T, {"device": "today", "seq": 0}, {"temp": 0.5}, (now, 0))])
    res: dict[str, list[dict]] = {m: [] for m in SECURE_DELETE_MODES}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        for k in range(args.rounds):
            modes = SECURE_DELETE_MODES[k % 3:] + SECURE_DELETE_MODES[:k % 3]
            for m in modes:
                res[m].append(_round(Path(d), k, m, sites, body, old, args.events, args.writes))
                print(f"round {k} {m}: " + " ".join(f"{x}={v:.0f}" for x, v in res[m][-1].items()), file=sys.stderr)
    print(f"events {args.events}, writes {args.writes}, rounds {args.rounds}, dir {args.dir} "
          "(events/s and CPU us per event: median [min-max]; ratios to off: medians of per-round ratios; "
          "bytes written per event)")
    for w in ("import", "write", "evict"):
        for m in SECURE_DELETE_MODES:
            v = [r[w] for r in res[m]]
            c = [r[w + "_cpu"] for r in res[m]]
            ratio = statistics.median(a[w] / b[w] for a, b in zip(res[m], res["off"]))
            cratio = statistics.median(a[w + "_cpu"] / b[w + "_cpu"] for a, b in zip(res[m], res["off"]))
            print(f"{w:7s} {m:5s} {statistics.median(v):9.0f} ev/s [{min(v):.0f}-{max(v):.0f}] ratio {ratio:.3f}"
                  f"  cpu {statistics.median(c):7.1f} us [{min(c):.1f}-{max(c):.1f}] ratio {cratio:.3f}"
                  f"  {statistics.median(r[w + '_B'] for r in res[m]):6.0f} B/event")
    print("secure_delete cost ratios to off (import, write, evict events/s; evict bytes): " + ", ".join(
        f"{m} " + " ".join(f"{statistics.median(a[w] / b[w] for a, b in zip(res[m], res['off'])):.3f}"
                          for w in ("import", "write", "evict"))
        + f" {statistics.median(a['evict_B'] / b['evict_B'] for a, b in zip(res[m], res['off'])):.3f}"
        for m in ("fast", "on")))
    figures = {f"ratio_{w}_{m}_off": of_rounds(a[w] / b[w] for a, b in zip(res[m], res["off"]))
               for m in ("fast", "on") for w in ("import", "write", "evict")}
    figures |= {f"ratio_evict_bytes_{m}_off": of_rounds(a["evict_B"] / b["evict_B"] for a, b in zip(res[m], res["off"]))
                for m in ("fast", "on")}
    record(figures, {f"{w}_events_per_s_off": of_rounds(r[w] for r in res["off"]) for w in ("import", "write", "evict")},
           "secure_delete / off (import, write, evict events/s): " + ", ".join(
               f"{m} " + " / ".join(f"{figures[f'ratio_{w}_{m}_off']['median']:.2f}" for w in ("import", "write", "evict"))
               for m in ("fast", "on")), parameters=vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
