"""Lifecycle benchmark: a Pi Zero 2 W profile node over a simulated 30 days of sensor
readings, store size and RSS over time with eviction on (the profile's job, every
eviction.interval_s of simulated time) against the same stream with eviction off; then
rehydration throughput from a gateway (a fresh node pulling the gateway's whole log over an
in-memory session) against the core apply rate of the same events (bench/apply.py's measure).

Scaling, said plainly: 1 reading per second per sensor for 30 days is 2.59 M events per sensor.
To run in minutes this generates, by default, 2 sensors at one reading every 30 simulated seconds
(172 800 events); `--period-s 1 --sensors N` runs the unscaled stream. Store size at the real rate
is the eviction-on figure x (30 / period) (bounded by the horizon, it scales linearly with rate);
the eviction-off figure scales the same way. Readings are upserts into a ring of 1 440 slots per
sensor (key = sensor, slot), so the materialized table stays bounded and what grows is the log.
Time is simulated (a generated clock); nothing sleeps.

    python bench/bench_lifecycle.py [--days 30] [--sensors 2] [--period-s 30] [--rehydrate-only]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import introduce, med_range, of_rounds, peak_rss_kb, proc_mem_mb, record, trusted_clock  # noqa: E402  (bench/: the shared set-up)
from agent.simpeer import readings_table  # noqa: E402

MESH = bytes.fromhex("be4c0000000000000000000000000006")
T0 = 1_790_000_000_000
DAY = 86_400_000
TABLE = readings_table("telemetry")


def stream_run(evict: bool, days: int, sensors: int, period_s: int, out: str) -> None:
    """One mode in its own process (so peak RSS is that mode's)."""
    from agent.node import Node
    from agent.simpeer import SimPeer
    with tempfile.TemporaryDirectory() as d:
        os.environ["SSP_AGENT_WITNESS_DIR"] = os.path.join(d, "w")
        peers = [SimPeer(MESH) for _ in range(sensors)]
        man = f'mesh_id = "{MESH.hex()}"\n' + "".join(p.manifest_peer() for p in peers) + TABLE
        node, _ = Node.init(Path(d) / "n", man, profile="pi-zero-2w")
        step = period_s * 1000
        interval = int(node.profile.eviction_interval_s * 1000)
        samples, next_evict, n_events, t_apply = [], T0 + interval, 0, 0.0
        batch: list[bytes] = []
        end = T0 + days * DAY
        t = T0
        i = 0
        sample_every = DAY // 2
        next_sample = T0
        wall = time.perf_counter()
        while t < end:
            for k, p in enumerate(peers):
                batch.append(p.event("app.readings", {"device": f"s{k}", "seq": i % 1440},
                                     {"temp": 20.0 + (i % 100) / 10}, (t, 0)))
            i += 1
            t += step
            if len(batch) >= 500 or t >= end:
                a = time.perf_counter()
                node.apply_batch(batch, t)
                t_apply += time.perf_counter() - a
                n_events += len(batch)
                batch = []
            if evict and t >= next_evict:
                node.run_eviction(now=t)
                next_evict = t + interval
            if t >= next_sample:
                samples.append({"day": round((t - T0) / DAY, 2), "store_mb": round(node.store_bytes() / 2**20, 2),
                                "rss_mb": round(proc_mem_mb(), 1), "events_in_log": node.conn.execute(
                                    "SELECT count(*) FROM events").fetchone()[0]})
                next_sample += sample_every
        if evict:
            node.run_eviction(now=t)
        samples.append({"day": days, "store_mb": round(node.store_bytes() / 2**20, 2), "rss_mb": round(proc_mem_mb(), 1),
                        "events_in_log": node.conn.execute("SELECT count(*) FROM events").fetchone()[0]})
        res = {"evict": evict, "events": n_events, "apply_s": round(t_apply, 1),
               "wall_s": round(time.perf_counter() - wall, 1), "peak_rss_mb": round(peak_rss_kb() / 1024, 1),
               "budget_mb": node.profile.disk_budget_bytes / 2**20, "samples": samples}
        node.close()
    Path(out).write_text(json.dumps(res))


def rehydration(n_events: int) -> dict:
    from agent.sync import import_mailbox_body as import_body
    from agent.node import Node
    from agent.simpeer import SimPeer
    from agent.sync import SyncDriver
    from agent.transport.memory import MemoryLink, Pair
    from agent import rehydrate
    with tempfile.TemporaryDirectory() as d:
        os.environ["SSP_AGENT_WITNESS_DIR"] = os.path.join(d, "w")
        peers = [SimPeer(MESH) for _ in range(4)]
        man = f'mesh_id = "{MESH.hex()}"\n' + "".join(p.manifest_peer() for p in peers) + TABLE
        now = time.time_ns() // 1_000_000
        events = [peers[i % 4].event("app.readings", {"device": f"s{i % 4}", "seq": (i // 4) % 2000},
                                     {"temp": float(i % 300)}, (now - 3_600_000 + i // 4, i % 4)) for i in range(n_events)]
        # core apply rate of the same events (one mailbox body, as bench/apply.py measures it)
        ref, _ = Node.init(Path(d) / "ref", man, profile="gateway")
        a = time.perf_counter()
        import_body(ref, peers[0].body(events))
        apply_rate = n_events / (time.perf_counter() - a)
        ref.close()
        gw, _ = Node.init(Path(d) / "gw", man, profile="gateway")
        gw.apply_batch(events, now)
        # The gateway runs in its own process in a deployment: its apply workers (agent/applyworker.py,
        # at most one set per process) go, so the fresh node can start its own, as the apply-only side did.
        gw.pipeline.close()
        new, _ = Node.init(Path(d) / "new", man, profile="pi-zero-2w")
        introduce(gw, new)
        dg, dn = SyncDriver(gw, batch_limit=gw.profile.batch_limit), SyncDriver(new, batch_limit=2000)
        rehydrate.start(new, gw.site_id, now=now)
        a = time.perf_counter()
        p = Pair(dn.session("memory", gw.site_id, secure=True), dg.session("memory", new.site_id, secure=True),
                 MemoryLink())
        p.start(now)
        t = p.run(now, now + 60_000)
        while new.conn.execute("SELECT count(*) FROM events").fetchone()[0] < n_events:
            t = p.exchange(t + 1, t + 60_000)
        dt = time.perf_counter() - a
        assert new.dump() == gw.dump()
        st = rehydrate.status(new)["rehydrating"]
        gw.close()
        new.close()
    return {"events": n_events, "rehydrate_events_per_s": round(n_events / dt), "apply_events_per_s": round(apply_rate),
            "ratio": round(n_events / dt / apply_rate, 2), "status_events_applied": st["events_applied"]}


def main() -> int:
    trusted_clock()
    ap = argparse.ArgumentParser()
    ap.add_argument("--days", type=int, default=30)
    ap.add_argument("--sensors", type=int, default=2)
    ap.add_argument("--period-s", type=int, default=30)
    ap.add_argument("--rehydrate-events", type=int, default=50_000)
    ap.add_argument("--rehydrate-rounds", type=int, default=3, help="rehydration rounds (median and range)")
    ap.add_argument("--rehydrate-only", action="store_true",
                    help="run only the rehydration part, print it and record nothing (a result holds both parts)")
    ap.add_argument("--_mode", choices=["on", "off"])
    ap.add_argument("--_out")
    args = ap.parse_args()
    if args._mode:
        stream_run(args._mode == "on", args.days, args.sensors, args.period_s, args._out)
        return 0
    if args.rehydrate_only:
        for _ in range(max(1, args.rehydrate_rounds)):
            print("  " + json.dumps(rehydration(args.rehydrate_events)), flush=True)
        return 0
    per_day = args.sensors * 86_400 // args.period_s
    print(f"stream: {args.days} simulated days, {args.sensors} sensors, 1 reading / {args.period_s} s each "
          f"({per_day} events/day, {per_day * args.days} total); profile pi-zero-2w (telemetry horizon 2d)", flush=True)
    res = {}
    with tempfile.TemporaryDirectory() as d:
        for mode in ("on", "off"):
            out = os.path.join(d, mode + ".json")
            subprocess.run([sys.executable, __file__, "--_mode", mode, "--_out", out, "--days", str(args.days),
                            "--sensors", str(args.sensors), "--period-s", str(args.period_s)], check=True)
            res[mode] = json.loads(Path(out).read_text())
    print(f"{'day':>5} | {'store MB (evict on)':>19} {'log events':>10} {'RSS MB':>7} | "
          f"{'store MB (evict off)':>20} {'log events':>10} {'RSS MB':>7}")
    for a, b in zip(res["on"]["samples"], res["off"]["samples"]):
        if a["day"] % 3 == 0 or a["day"] == args.days:
            print(f"{a['day']:5} | {a['store_mb']:19.2f} {a['events_in_log']:10} {a['rss_mb']:7.1f} | "
                  f"{b['store_mb']:20.2f} {b['events_in_log']:10} {b['rss_mb']:7.1f}")
    scale = args.period_s
    for m in ("on", "off"):
        r = res[m]
        final = r["samples"][-1]["store_mb"]
        print(f"eviction {m:3}: {r['events']} events applied in {r['apply_s']} s (wall {r['wall_s']} s), "
              f"final store {final:.2f} MB (x{scale} for 1 reading/s: ~{final * scale:.0f} MB; budget "
              f"{r['budget_mb']:.0f} MB), peak RSS {r['peak_rss_mb']} MB")
    print("rehydration from a gateway (in-memory session, batch 2000) vs core apply (one mailbox body):", flush=True)
    rounds = []
    for _ in range(max(1, args.rehydrate_rounds)):
        rounds.append(rehydration(args.rehydrate_events))
        print("  " + json.dumps(rounds[-1]), flush=True)
    ratios = [r["rehydrate_events_per_s"] / r["apply_events_per_s"] for r in rounds]
    print(f"  rehydration / apply over {len(rounds)} rounds: {med_range(ratios)}")
    on, off = (res[m]["samples"][-1]["store_mb"] for m in ("on", "off"))
    record({"store_mb_evict_on": on, "store_mb_evict_off": off,
            "peak_rss_mb_evict_on": res["on"]["peak_rss_mb"], "peak_rss_mb_evict_off": res["off"]["peak_rss_mb"],
            "rehydrate_events_per_s": of_rounds(r["rehydrate_events_per_s"] for r in rounds),
            "ratio_rehydrate_apply": of_rounds(ratios)},
           {"apply_events_per_s": of_rounds(r["apply_events_per_s"] for r in rounds), "budget_mb": res["on"]["budget_mb"],
            "events_streamed": res["on"]["events"], "rehydrate_events": args.rehydrate_events},
           f"{args.days} simulated days: store {on:.1f} MB with eviction vs {off:.1f} MB without; rehydration from a "
           f"gateway = {med_range(ratios)} of core apply (median and range of {len(rounds)} rounds)",
           parameters={k: v for k, v in vars(args).items() if not k.startswith("_")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
