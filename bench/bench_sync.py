"""Sync benchmark: two nodes exchange N events in batches through the sans-I/O session
over the in-memory link. Prints events/s, bytes on the wire per event against the raw size of the
COSE events (the protocol's overhead ratio), and the apply-only rate of the same events in
batches of the same size, measured in the same run.

    python bench/bench_sync.py [--events 50000] [--batch 500] [--against REV]
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

from _harness import bench_env, introduce, parse_args, readings_events, record  # noqa: E402  (bench/: the shared set-up)
from agent.node import Node  # noqa: E402
from agent.simpeer import SimPeer, readings_table  # noqa: E402
from agent.sync import SyncDriver  # noqa: E402
from agent.transport.memory import MemoryLink, Pair  # noqa: E402

MESH = bytes.fromhex("be4c0000000000000000000000000002")
TABLES = readings_table()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=50_000)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--sites", type=int, default=5)
    args = parse_args(ap)   # --against REV: the same-run A/B (bench/_harness.py against)
    sites = [SimPeer(MESH) for _ in range(args.sites)]
    now = time.time_ns() // 1_000_000
    base = now - 3_600_000
    print(f"generating {args.events} signed events over {args.sites} sites ...", flush=True)
    events = readings_events(args.events, sites, base)
    raw_bytes = sum(len(e) for e in events)
    with tempfile.TemporaryDirectory() as d:
        bench_env(os.path.join(d, "witness"))
        man = f'mesh_id = "{MESH.hex()}"\n' + "".join(s.manifest_peer() for s in sites) + TABLES
        a, _ = Node.init(Path(d) / "a", man)
        b, _ = Node.init(Path(d) / "b", man)
        introduce(a, b)

        # apply-only: node a takes the events through the one apply path, batch by batch
        t0 = time.perf_counter()
        for i in range(0, len(events), args.batch):
            a.apply_batch(events[i:i + args.batch], now)
        apply_s = time.perf_counter() - t0
        # Each node runs in its own process in a deployment: a's apply workers (at most one set per
        # process, agent/applyworker.py) go, so b verifies on its own as a did.
        a.pipeline.close()

        da, dbb = SyncDriver(a, batch_limit=args.batch), SyncDriver(b, batch_limit=args.batch)
        link = MemoryLink()
        p = Pair(da.session("memory", b.site_id, secure=True, cycle_ms=10**9),
                 dbb.session("memory", a.site_id, secure=True, cycle_ms=10**9), link)
        t = now
        t0 = time.perf_counter()
        p.start(t)
        t = p.run(t, t + 10_000)
        exchanges = 0
        while dbb.stats["received_events"] < args.events:
            t = p.exchange(t + 1, t + 10_000)
            exchanges += 1
            if exchanges > args.events:
                raise SystemExit("no progress")
        sync_s = time.perf_counter() - t0
        bodies = da.stats["bodies_out"] + dbb.stats["bodies_out"]
        assert b.conn.execute("SELECT count(*) FROM events").fetchone()[0] == args.events
        assert a.dump() == b.dump()
        a.close()
        b.close()
    wire = link.bytes_sent
    # The window (4 bodies in flight, kept full by each answer) catches up from the exchange at
    # the handshake on: `cycles` counts the batch cycles started after it.
    print(f"events                 {args.events} in bodies of {args.batch} ({bodies} bodies and answers, "
          f"{exchanges} cycles after the handshake)")
    print(f"sync  (session+apply)  {args.events / sync_s:10.0f} events/s  ({sync_s:.2f} s)")
    print(f"apply only             {args.events / apply_s:10.0f} events/s  ({apply_s:.2f} s, same batches)")
    print(f"sync / apply           {apply_s / sync_s:10.2f}")
    print(f"raw COSE event bytes   {raw_bytes / args.events:10.1f} per event")
    print(f"bytes on the wire      {wire / args.events:10.1f} per event ({link.frames_sent} frames)")
    print(f"overhead ratio         {wire / raw_bytes:10.3f}  (wire bytes / raw COSE bytes)")
    record({"sync_events_per_s": args.events / sync_s, "ratio_sync_apply_only": apply_s / sync_s,
            "wire_bytes_per_event": wire / args.events, "overhead_ratio": wire / raw_bytes},
           {"apply_only_events_per_s": args.events / apply_s, "raw_event_bytes": raw_bytes / args.events,
            "events": args.events},
           f"{args.events / sync_s:.0f} events/s = {apply_s / sync_s:.2f} of apply-only in the same batches "
           f"({args.events / apply_s:.0f}/s); {wire / args.events:.1f} wire bytes per {raw_bytes / args.events:.1f}-byte "
           f"event (overhead {wire / raw_bytes:.3f})", parameters=vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
