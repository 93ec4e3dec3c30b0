"""Serial-link benchmark: two nodes run `ssp-agent sync --serial --once` at the same
time on the two ends of a pty pair joined by the relay (tools/serial_relay.py) throttled to the
line rate (115 200 baud, 8N1: 11 520 bytes/s each way), clean and at bit error rates. Node A
holds N signed events, node B none.

Prints, per run, as ratios (nothing here is asserted; tests/test_bench_smoke.py only checks it runs):
- goodput: signed event bytes / line bytes A sent (and / line bytes both ways);
- events/s from A's first byte on the line to its last, against the line's own limit
  (11 520 bytes/s / mean event size): how close the link gets to the cable, i.e. raw signed
  event bytes per second over the line's bytes per second (above 1 only with compression);
- each run with the link's per-message compression off and on (`[serial] compress`, negotiated
  in the link's HELLO; goodput counts signed event bytes, so it exceeds 1 when compressed).

    python bench/bench_serial.py [--events 1500] [--ber-events 300] [--ber 1e-4,1e-3] [--baud 115200]
                                 [--compress off,on]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import ROOT, bench_env, child_env, cli, introduce, record  # noqa: E402  (bench/: the shared set-up)

sys.path.insert(0, str(ROOT / "tools"))

from agent.node import Node  # noqa: E402
from agent.profile import load_profile  # noqa: E402
from agent.simpeer import manifest_text, readings_table  # noqa: E402
from serial_relay import LineFaults, Relay  # noqa: E402

MESH = bytes.fromhex("5e1a0000000000000000000000000013")
T = "app.readings"


def homes(d: Path, n: int, compress: bool) -> tuple[Path, Path]:
    prof = dataclasses.replace(load_profile("pi-3-4"), serial_timeout_s=60.0, serial_compress=compress)
    a, _ = Node.init(d / "a", manifest_text(MESH, readings_table()), profile=prof)
    b, _ = Node.init(d / "b", manifest_text(MESH, readings_table()), profile=prof)
    introduce(a, b)
    for i in range(0, n, 500):
        a.write_many([(T, {"device": f"dev{k % 50}", "seq": k}, {"temp": float(k % 400) / 10, "note": f"n{k % 97}"},
                       False) for k in range(i, min(n, i + 500))])
    a.close()
    b.close()
    return d / "a", d / "b"


def one(d: Path, n: int, ber: float, baud: int, seed: int, compress: bool) -> dict:
    ha, hb = homes(d, n, compress)
    f = dict(ber=ber)
    relay = Relay(LineFaults(seed=seed, **f), LineFaults(seed=seed + 1, **f), baud=baud).start()
    env = child_env()
    try:
        procs = [subprocess.Popen(cli(h, "sync", "--serial", port, "--baud", str(baud), "--once"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                 for h, port in ((ha, relay.ports[0]), (hb, relay.ports[1]))]
        outs = [p.communicate(timeout=1800) for p in procs]
    finally:
        relay.close()
    if any(p.returncode for p in procs):
        raise SystemExit(f"sync failed: {outs}")
    sa, sb = (json.loads(o[0]) for o in outs)
    if os.environ.get("BENCH_SERIAL_DEBUG"):
        print(sa, sb, file=sys.stderr)
    a = Node.open(ha, read_only=True)
    # The log holds each event sealed at rest (docs/reliability.md "At rest"): the signed bytes
    # that crossed the line are the stored ones less the seal's fixed overhead.
    from firmware_bridge.sealing import OVERHEAD
    ev_bytes = a.conn.execute("SELECT sum(length(raw)) - ? * count(*) FROM events", (OVERHEAD,)).fetchone()[0]
    a.close()
    b = Node.open(hb, read_only=True)
    got = b.conn.execute("SELECT count(*) FROM events").fetchone()[0]
    b.close()
    if got != n or sb["applied"] != n:
        raise SystemExit(f"B holds {got} of {n} events: {sb}")
    secs = max(1e-9, relay.last_at[0] - (relay.first_at[0] or 0))
    mean = ev_bytes / n
    limit = baud / 10 / mean
    return {"ber": ber, "compress": compress, "events": n, "mean_event_bytes": round(mean, 1),
            "line_bytes_a_to_b": relay.sent[0], "line_bytes_b_to_a": relay.sent[1],
            "goodput_a_to_b": round(ev_bytes / relay.sent[0], 3),
            "goodput_both_ways": round(ev_bytes / (relay.sent[0] + relay.sent[1]), 3),
            "events_per_s": round(n / secs, 1), "line_limit_events_per_s": round(limit, 1),
            "ratio_to_line_limit": round(n / secs / limit, 3), "seconds": round(secs, 2),
            "retransmits_a": sa["link"]["retransmits"], "frames_rejected_b": sb["link"]["frames_rejected"],
            "segment_size_end_a": sa["link"]["segment_size"], "compressed": sa["link"].get("compressed"),
            "message_bytes_a": sa["link"].get("message_bytes_out"),
            "message_wire_bytes_a": sa["link"].get("message_wire_bytes_out")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=1500)
    ap.add_argument("--ber-events", type=int, default=300)
    ap.add_argument("--ber", default="1e-4,1e-3", help="comma-separated bit error rates ('' for none)")
    ap.add_argument("--baud", type=int, default=115_200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--compress", default="off,on", help="link compression per run: off, on or off,on")
    args = ap.parse_args()
    modes = [m.strip() == "on" for m in args.compress.split(",") if m.strip()]
    runs = [(0.0, args.events)] + [(float(x), args.ber_events) for x in args.ber.split(",") if x.strip()]
    rows = []
    for (ber, n), compress in [(r, c) for r in runs for c in modes]:
        with tempfile.TemporaryDirectory() as d:
            bench_env(os.path.join(d, "witness"))
            t0 = time.perf_counter()
            r = one(Path(d), n, ber, args.baud, args.seed, compress)
            r["wall_s"] = round(time.perf_counter() - t0, 1)
            rows.append(r)
            print(json.dumps(r), flush=True)
    print()
    print(f"{'BER':>8} {'zlib':>5} {'events':>7} {'mean B':>7} {'goodput A->B':>13} {'both ways':>10} {'events/s':>9} "
          f"{'line limit':>11} {'ratio to line limit':>20}")
    for r in rows:
        print(f"{r['ber']:>8g} {'on' if r['compress'] else 'off':>5} {r['events']:>7} {r['mean_event_bytes']:>7} {r['goodput_a_to_b']:>13} "
              f"{r['goodput_both_ways']:>10} {r['events_per_s']:>9} {r['line_limit_events_per_s']:>11} "
              f"{r['ratio_to_line_limit']:>20}")
    tag = lambda r: f"ber_{r['ber']:g}_{'zlib' if r['compress'] else 'plain'}"  # noqa: E731
    record({f"{k}_{tag(r)}": r[k] for r in rows for k in ("goodput_a_to_b", "goodput_both_ways", "events_per_s",
                                                          "ratio_to_line_limit")},
           {f"line_limit_events_per_s_{tag(r)}": r["line_limit_events_per_s"] for r in rows}
           | {"baud": args.baud, "mean_event_bytes": rows[0]["mean_event_bytes"]},
           "; ".join(f"BER {r['ber']:g}{', compressed' if r['compress'] else ''}: {r['events_per_s']} events/s = "
                     f"{r['ratio_to_line_limit']} of the line's limit, goodput {r['goodput_a_to_b']}" for r in rows),
           parameters=vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
