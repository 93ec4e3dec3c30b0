"""MQTT benchmark: events/s from node A to node B through a private mosquitto, against
the apply-only rate and the raw paho QoS1 rate of the same bytes, all measured in this run.

    python bench/bench_mqtt.py [--events 50000] [--max-events 1000] [--window 4]

A holds N signed events (from simulated producers); B starts empty. End-to-end = from B's first
batch request to B holding all N, with every body answered (A's cursor at the end)."""
from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from pathlib import Path

from _harness import bench_env, catch_up, introduce, readings_events, record, trust  # noqa: E402  (bench/: the shared set-up)

bench_env()
from agent.core.messages import SyncBody, emit_body  # noqa: E402
from agent.node import Node  # noqa: E402
from agent.runner import RunConfig, Runner  # noqa: E402
from agent.simpeer import SimPeer, manifest_text, readings_table  # noqa: E402
from agent.transport.broker import Broker  # noqa: E402
from agent.transport.mqtt import MqttLink, MqttSettings, split_sizes  # noqa: E402

MESH = bytes.fromhex("be4c0000000000000000000000000042")
MANIFEST = manifest_text(MESH, readings_table())


def node(root: Path, name: str, sims: list[SimPeer]) -> Node:
    n = Node.init(root / name, MANIFEST)[0]
    trust(n, sims)
    return n


def raw_paho_rate(url: str, bodies: list[bytes]) -> float:
    """QoS1 publish of the same body bytes from one client to a subscriber, until all arrive."""
    s = MqttSettings.from_url(url)
    a, b = os.urandom(16), os.urandom(16)
    la, lb = MqttLink(s, MESH, a).start(), MqttLink(s, MESH, b).start()
    la.wait_connected(5), lb.wait_connected(5)
    got = 0
    done = threading.Event()
    t0 = time.perf_counter()
    for body in bodies:
        la.push(b, body, {})
    while got < len(bodies):
        m = lb.inbound.get(timeout=60)
        if m.kind == "req":
            lb.ack(m)
            got += 1
    dt = time.perf_counter() - t0
    done.set()
    la.close(), lb.close()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=50_000)
    ap.add_argument("--max-events", type=int, default=1000)
    ap.add_argument("--window", type=int, default=4)
    args = ap.parse_args()
    n = args.events
    root = Path(tempfile.mkdtemp(prefix="ssp-bench-mqtt-"))
    sims = [SimPeer(MESH) for _ in range(5)]
    print(f"generating {n} signed events from {len(sims)} producers ...", flush=True)
    evs = readings_events(n, sims)
    nbytes = sum(len(e) for e in evs)

    # 1. apply-only: the same events through the one apply path, in bodies of max-events
    c = node(root, "apply", sims)
    t0 = time.perf_counter()
    for i in range(0, n, args.max_events):
        c.apply_batch(evs[i:i + args.max_events])
    t_apply = time.perf_counter() - t0
    c.close()

    # 2. end to end: A holds them, B catches up through mosquitto
    a, b = node(root, "a", sims), node(root, "b", sims)
    introduce(a, b)
    for i in range(0, n, 5000):
        a.apply_batch(evs[i:i + 5000])
    with Broker(workdir=root / "broker") as br:
        cfg = RunConfig(cadence_s=3600, realtime=False, window=args.window, max_events=args.max_events)
        ra = Runner(a, MqttSettings.from_url(br.url), cfg)
        rb = Runner(b, MqttSettings.from_url(br.url), cfg)
        assert ra.start(10) and rb.start(10)
        t_e2e = catch_up(ra, rb, a, b)
        held = b.conn.execute("SELECT count(*) FROM events").fetchone()[0]
        assert held == n, held
        bodies_sent = ra.stats["bodies_pushed"]
        ra.close(), rb.close()
        # 3. raw paho QoS1 of the same bytes (the same bodies)
        limit = ra.link.max_payload()
        bodies = []
        for x, y in split_sizes([len(e) for e in evs], 200, limit, args.max_events):
            bodies.append(emit_body(SyncBody(a.site_id, (0, 0), tuple(evs[x:y]), (), ())))
        t_raw_bodies = raw_paho_rate(br.url, bodies)
        per_event = [emit_body(SyncBody(a.site_id, (0, 0), (e,), (), ())) for e in evs[:min(n, 10_000)]]
        t_raw_msgs = raw_paho_rate(br.url, per_event)
    a.close(), b.close()

    r_apply, r_e2e = n / t_apply, n / t_e2e
    print(f"events: {n} ({nbytes / n:.0f} bytes each, {nbytes / 1e6:.1f} MB); bodies of <= {args.max_events} events, "
          f"window {args.window}")
    print(f"apply-only (one apply path, same events):        {r_apply:10.0f} events/s")
    print(f"node to node through mosquitto (answered):       {r_e2e:10.0f} events/s   "
          f"({bodies_sent} bodies)  = {100 * r_e2e / r_apply:.0f}% of apply-only")
    print(f"raw paho QoS1, same bodies, no apply:            {n / t_raw_bodies:10.0f} events/s   "
          f"({len(bodies) / t_raw_bodies:.0f} messages/s)")
    print(f"raw paho QoS1, one event per message:            {len(per_event) / t_raw_msgs:10.0f} messages/s")
    record({"mqtt_events_per_s": r_e2e, "ratio_mqtt_apply_only": r_e2e / r_apply, "bodies": bodies_sent},
           {"apply_only_events_per_s": r_apply, "raw_paho_bodies_events_per_s": n / t_raw_bodies,
            "raw_paho_one_event_messages_per_s": len(per_event) / t_raw_msgs, "events": n, "event_bytes": nbytes / n},
           f"node to node through mosquitto {r_e2e:.0f} events/s = {r_e2e / r_apply:.2f} of apply-only "
           f"({r_apply:.0f}/s) in the same run; raw paho QoS1 {len(per_event) / t_raw_msgs:.0f} one-event messages/s",
           parameters=vars(args))


if __name__ == "__main__":
    main()
