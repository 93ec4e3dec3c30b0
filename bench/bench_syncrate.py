"""Sync and rehydration against apply-only, all in the same run.

Per round, with the same N signed events (5 simulated producers, ~2 000 rows):

1. **apply-only**: a mailbox import of one body of the N events into a fresh node, in this
   process (`import_mailbox_body`, the path bench/apply.py measures);
2. **MQTT sync A -> B**: A (in this process, a `Runner` with the pi-3-4 profile's bodies: 1 000
   events, 256 KiB, a window of 4, unauthenticated binding, so every answer carries a signed
   acknowledgement) holds the N events; B is a real `ssp-agent run` process on a fresh home.
   Timed from A's first batch cycle (once B's retained presence has reached A) to A's cursor for B
   at A's last event: every body applied, committed, answered and its acknowledgement checked;
3. **MQTT rehydration of a fresh B from A**: a fresh home runs `ssp-agent rehydrate --from A`
   (horizons to zero, the self-signed rehydrate record), then `ssp-agent run`; its first body
   carries the record to A, which resets its cursors for it (agent/rehydrate.py). Timed from A's
   first batch cycle after that reset to A's cursor at its last event, as in 2.
4. **serial sync at the line's limit**: bench/bench_serial.py's measure (two `ssp-agent sync
   --serial --once` on a pty pair joined by tools/serial_relay.py throttled to 115 200 baud,
   clean line, compression off): there the limit is the line, so the figure is the ratio to
   the line's raw event rate (11 520 bytes/s / mean event size), not to apply-only.

Prints each round, then medians with the range, and the ratios sync/apply and rehydrate/apply
(each round's own ratio; the median of those). Both MQTT endpoints live on this 2-core machine
with mosquitto: B's apply (both cores when verifying) competes with A's selection, the broker
and the acknowledgement checks, which a real pair of devices would not share.

    python bench/bench_syncrate.py [--events 20000] [--rounds 3] [--serial-events 600] [--window 4]
                                   [--max-events N] [--secure] [--no-serial]
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

from _harness import (ROOT, bench_env, child_env, cli, load_average, med_range, median, node_cpu_s, proc_tree_cpu_s,  # noqa: E402
                      of_rounds, readings_events, record, stop)  # (bench/: the shared set-up)
from agent.node import Node  # noqa: E402
from agent.profile import load_profile  # noqa: E402
from agent.runner import RunConfig, Runner  # noqa: E402
from agent.simpeer import SimPeer, manifest_text, readings_table  # noqa: E402
from agent.sync import import_mailbox_body  # noqa: E402
from agent.transport.broker import Broker  # noqa: E402
from agent.transport.mqtt import MqttSettings  # noqa: E402

MESH = bytes.fromhex("be4c0000000000000000000000000515")
PROFILE = "pi-3-4"


def start_receiver(home: Path, url: str, env: dict, log: Path) -> subprocess.Popen:
    """A real `ssp-agent run` (its own process, as a device) on `home`."""
    return subprocess.Popen(cli(home, "run", "--broker", url, "--cadence", "3600", "--no-realtime"),
                            stdout=subprocess.DEVNULL, stderr=open(log, "ab"), env=env, cwd=str(ROOT))


def wait_presence(ra: Runner, site: bytes, timeout: float = 60.0) -> None:
    t = time.monotonic()
    while site not in ra.caps:
        ra.pump(0.05)
        if time.monotonic() - t > timeout:
            raise SystemExit(f"no presence from {site.hex()} within {timeout}s")


def drive(ra: Runner, peer: bytes, last: int, timeout: float = float(os.environ.get("BENCH_SYNCRATE_TIMEOUT", 900))) -> float:
    """A's batch cycle, then its loop until its cursor for `peer` passes `last`: seconds."""
    # Only `peer` is offered to: the simulated producers are in A's keyring (A verifies their
    # events) but run no node, and a body to a site with no session at the broker is lost and
    # would hold that peer's window until the answer timeout.
    ra.sync.peers = lambda: [peer]
    t0 = time.perf_counter()
    ra.batch_cycle()
    while ra.sync.cursor(peer) < last:
        ra.step(0.02)   # pump, expiry (an unanswered window is re-offered), no other cycles (cadence 1 h)
        if time.perf_counter() - t0 > timeout:
            raise SystemExit(f"timed out: cursor {ra.sync.cursor(peer)} of {last}; {dict(ra.stats)}")
    return time.perf_counter() - t0


def cpu_drive(ra: Runner, peer: bytes, last: int, receiver: subprocess.Popen, broker: Broker) -> dict:
    """`drive`, with the CPU seconds each party spent meanwhile: the sender (this process: its
    runner, paho thread, acknowledgement checks; and its node's apply workers), the receiver
    process with its apply workers (child processes), and mosquitto."""
    c_a, c_b, c_m = node_cpu_s(ra.node), proc_tree_cpu_s(receiver.pid), proc_tree_cpu_s(broker.proc.pid)
    secs = drive(ra, peer, last)
    return {"s": secs, "cpu_a": node_cpu_s(ra.node) - c_a, "cpu_b": proc_tree_cpu_s(receiver.pid) - c_b,
            "cpu_broker": proc_tree_cpu_s(broker.proc.pid) - c_m}


def held(home: Path) -> int:
    n = Node.open(home, read_only=True)
    try:
        return n.conn.execute("SELECT count(*) FROM events").fetchone()[0]
    finally:
        n.close()


def one_round(k: int, root: Path, evs: list[bytes], sims: list[SimPeer], args, env: dict) -> dict:
    n = len(evs)
    man = manifest_text(MESH, readings_table(), sims)
    prof = load_profile(PROFILE)
    d = root / f"r{k}"
    d.mkdir()
    # 1. apply-only: one mailbox body into a fresh node
    ref = Node.init(d / "ref", man, profile=prof)[0]
    body = sims[0].body(evs)
    t, c = time.perf_counter(), node_cpu_s(ref)
    r = import_mailbox_body(ref, body)
    t_apply = time.perf_counter() - t
    cpu_apply = node_cpu_s(ref) - c   # this process and the node's apply workers
    assert r["applied"] == n, r
    ref.close()
    del body

    # A holds the events; B (sync) and C (rehydration) are fresh homes that trust A
    a = Node.init(d / "a", man, profile=prof)[0]
    for i in range(0, n, 5000):
        a.apply_batch(evs[i:i + 5000])
    a_key = a.keyring[a.site_id][0]
    recv = {}
    for name in ("b", "c"):
        x = Node.init(d / name, man, profile=prof)[0]
        x.add_peer(a.site_id, a_key, None)
        a.add_peer(x.site_id, x.keyring[x.site_id][0], None)
        recv[name] = x.site_id
        x.close()
    last = a.conn.execute("SELECT max(seq) FROM events").fetchone()[0]
    out = {"apply_s": t_apply, "cpu_apply": cpu_apply}
    with Broker(workdir=d / "broker") as br:
        settings = MqttSettings.from_url(br.url)
        settings.body_limit_bytes = int(prof.body_limit_bytes)
        settings.max_events = int(args.max_events or prof.batch_limit)
        cfg = RunConfig(cadence_s=3600, realtime=False, window=args.window, secure=args.secure,
                        max_events=settings.max_events)
        ra = Runner(a, settings, cfg)
        assert ra.start(10)
        try:
            # 2. sync A -> B
            pb = start_receiver(d / "b", br.url, env, d / "b.log")
            try:
                ra.sync.peers = lambda: [recv["b"]]
                wait_presence(ra, recv["b"])
                d2 = cpu_drive(ra, recv["b"], last, pb, br)
                out["sync_s"] = d2.pop("s")
                out.update({f"sync_{k}": v for k, v in d2.items()})
                out["sync_bodies"] = ra.stats["bodies_pushed"]
                out["sync_unanswered"] = ra.stats["unanswered"]
            finally:
                stop(pb)
            # 3. rehydration of a fresh C from A
            p = subprocess.run(cli(d / "c", "rehydrate", "--from", a.site_id.hex()), env=env,
                               capture_output=True, text=True, cwd=str(ROOT))
            if p.returncode:
                raise SystemExit(f"rehydrate: {p.stderr}")
            pc = start_receiver(d / "c", br.url, env, d / "c.log")
            try:
                ra.sync.peers = lambda: [recv["c"]]
                wait_presence(ra, recv["c"])
                t = time.monotonic()
                # C's first batch cycle carries its rehydrate record; A resets its cursors for C.
                while a.conn.execute("SELECT count(*) FROM rehydrate_served WHERE subject=?",
                                     (recv["c"],)).fetchone()[0] == 0:
                    ra.pump(0.05)
                    if time.monotonic() - t > 60:
                        raise SystemExit("the rehydrate record never reached A")
                b0 = ra.stats["bodies_pushed"]
                d3 = cpu_drive(ra, recv["c"], last, pc, br)
                out["rehydrate_s"] = d3.pop("s")
                out.update({f"rehydrate_{k}": v for k, v in d3.items()})
                out["rehydrate_bodies"] = ra.stats["bodies_pushed"] - b0
            finally:
                stop(pc)
        finally:
            ra.close()
    a.close()
    out["b_held"], out["c_held"] = held(d / "b"), held(d / "c")
    assert out["b_held"] == n and out["c_held"] == n, out
    return out


class _Kept:
    def __init__(self, path: str) -> None:
        self.path = path

    def __enter__(self) -> str:
        Path(self.path).mkdir(parents=True)
        return self.path

    def __exit__(self, *exc) -> None:
        pass


def med0(xs: list[float]) -> str:
    """Median (range) in whole units: events/s, microseconds."""
    return med_range(xs, "{:.0f}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=int, default=RunConfig.window, help="bodies in flight (A's RunConfig)")
    ap.add_argument("--max-events", type=int, default=None, help="events per body (default: the profile's)")
    ap.add_argument("--secure", action="store_true", help="secure binding: answers without signed acknowledgements")
    ap.add_argument("--serial-events", type=int, default=600)
    ap.add_argument("--no-serial", action="store_true")
    args = ap.parse_args()
    print(f"load average before: {load_average()}", flush=True)
    sims = [SimPeer(MESH) for _ in range(5)]
    print(f"generating {args.events} signed events from {len(sims)} producers ...", flush=True)
    evs = readings_events(args.events, sims)
    n, mean = len(evs), sum(len(e) for e in evs) / len(evs)
    rounds, serial = [], []
    keep = os.environ.get("BENCH_SYNCRATE_KEEP")   # a directory to keep the homes and logs in (debugging)
    with (tempfile.TemporaryDirectory() if not keep else _Kept(keep)) as d:
        root = Path(d)
        bench_env(root / "witness")
        env = child_env()
        for k in range(max(1, args.rounds)):
            r = one_round(k, root, evs, sims, args, env)
            rounds.append(r)
            print(f"round {k + 1}: apply-only {n / r['apply_s']:7.0f}/s, MQTT sync {n / r['sync_s']:7.0f}/s "
                  f"({r['sync_bodies']} bodies), rehydration {n / r['rehydrate_s']:7.0f}/s "
                  f"({r['rehydrate_bodies']} bodies); ratios {r['apply_s'] / r['sync_s']:.2f} / "
                  f"{r['apply_s'] / r['rehydrate_s']:.2f}", flush=True)
            if not args.no_serial:
                from bench_serial import one as serial_one
                sd = root / f"serial{k}"
                sd.mkdir()
                s = serial_one(sd, args.serial_events, 0.0, 115_200, k + 1, False)
                serial.append(s)
                print(f"round {k + 1}: serial {s['events_per_s']} events/s, line limit "
                      f"{s['line_limit_events_per_s']}/s, ratio {s['ratio_to_line_limit']}", flush=True)
    apply_r = [n / r["apply_s"] for r in rounds]
    sync_r = [n / r["sync_s"] for r in rounds]
    reh_r = [n / r["rehydrate_s"] for r in rounds]
    print()
    print(f"events: {n} ({mean:.0f} bytes each); MQTT bodies of <= {args.max_events or load_profile(PROFILE).batch_limit} "
          f"events, window {args.window}, {'secure binding' if args.secure else 'signed acknowledgements'}; "
          f"{len(rounds)} rounds, median (range)")
    print(f"apply-only (mailbox import):        {med0(apply_r)} events/s")
    print(f"MQTT sync A->B (answered):          {med0(sync_r)} events/s")
    print(f"MQTT rehydration of a fresh node:   {med0(reh_r)} events/s")
    print(f"ratio sync / apply-only:            {med_range([r['apply_s'] / r['sync_s'] for r in rounds], '{:.2f}')}"
          f"   (target >= 0.8)")
    print(f"ratio rehydration / apply-only:     "
          f"{med_range([r['apply_s'] / r['rehydrate_s'] for r in rounds], '{:.2f}')}   (target >= 0.8)")
    us = lambda key: [r[key] / n * 1e6 for r in rounds]  # noqa: E731
    print(f"CPU per event (us, all threads and apply workers): apply-only {med0(us('cpu_apply'))}; sync: receiver "
          f"{med0(us('sync_cpu_b'))}, sender {med0(us('sync_cpu_a'))}, mosquitto "
          f"{med0(us('sync_cpu_broker'))}; rehydration: receiver {med0(us('rehydrate_cpu_b'))}, "
          f"sender {med0(us('rehydrate_cpu_a'))}, mosquitto {med0(us('rehydrate_cpu_broker'))}")
    total = [(r["sync_cpu_a"] + r["sync_cpu_b"] + r["sync_cpu_broker"]) / r["sync_s"] for r in rounds]
    print(f"cores busy during sync (sender + receiver + mosquitto): {med_range(total, '{:.2f}')} of "
          f"{os.cpu_count()}")
    if serial:
        print(f"serial 115 200 baud ({args.serial_events} events of {serial[0]['mean_event_bytes']} bytes): "
              f"{med_range([s['events_per_s'] for s in serial], '{:.1f}')} events/s, line's raw event rate "
              f"{med_range([s['line_limit_events_per_s'] for s in serial], '{:.1f}')}/s")
        print(f"ratio serial sync / line limit:     "
              f"{med_range([s['ratio_to_line_limit'] for s in serial], '{:.3f}')}   (target >= 0.8)")
    print(f"load average after: {load_average()}")
    print(json.dumps({"rounds": rounds, "serial": serial}))
    ratios = {k: [r["apply_s"] / r[f"{k}_s"] for r in rounds] for k in ("sync", "rehydrate")}
    record({"ratio_sync_apply_only": of_rounds(ratios["sync"]), "ratio_rehydrate_apply_only": of_rounds(ratios["rehydrate"]),
            "sync_events_per_s": of_rounds(sync_r), "rehydrate_events_per_s": of_rounds(reh_r),
            **{f"cpu_us_per_event_{k}": of_rounds(us(k)) for k in ("cpu_apply", "sync_cpu_b", "sync_cpu_a",
                                                                   "rehydrate_cpu_b")},
            "cores_busy_sync": of_rounds(total),
            **({"ratio_serial_line_limit": of_rounds(s["ratio_to_line_limit"] for s in serial),
                "serial_events_per_s": of_rounds(s["events_per_s"] for s in serial)} if serial else {})},
           {"apply_only_events_per_s": of_rounds(apply_r), "events": n, "event_bytes": mean,
            **({"serial_line_limit_events_per_s": of_rounds(s["line_limit_events_per_s"] for s in serial)}
               if serial else {})},
           f"sync {median(ratios['sync']):.2f} of apply-only ({min(ratios['sync']):.2f}-"
           f"{max(ratios['sync']):.2f}), rehydration {median(ratios['rehydrate']):.2f} "
           f"({min(ratios['rehydrate']):.2f}-{max(ratios['rehydrate']):.2f}); apply-only {median(apply_r):.0f}/s"
           + (f"; serial {median(s['ratio_to_line_limit'] for s in serial):.3f} of the line's limit"
              if serial else "; serial not run"), parameters=vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
