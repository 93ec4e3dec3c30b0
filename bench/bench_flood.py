"""Flood benchmark: how much a rogue MQTT client with broker access delays honest
traffic, and what each hostile message and byte costs the receiving node. All figures are ratios
against the no-flood run in the same process run.

    python bench/bench_flood.py [--events 2000] [--rate 300] [--seconds 20] [--max-events 200]

Per run, a fresh private mosquitto and two honest nodes A and B (realtime off, batch cadence 0.5 s).
A writes N events; the figure is the time until B holds all N. In the flood run a rogue client (a
separate process, paho) publishes into B's inbox topics for `--seconds` at `--rate` messages/s:
garbage, not-a-map, unknown version, oversized, replays of A's body, bodies signed by a stranger,
poison meta, a mixed-key map, a lying watermark, a small value-sharing body (the shapes of
tests/mqtt/test_rogue.py), each under a fresh fictional sender or A's name, and presence of
fictional sites. The honest writes start 1 s into the flood, so they queue behind it.
B's cost: CPU time of the thread stepping B (time.thread_time around B's steps), peak RSS of the
process (both nodes; the rogue is another process), and the growth of B's home on disk."""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

from _harness import ROOT, bench_env, home_bytes, introduce, peak_rss_kb, record  # noqa: E402  (bench/: the shared set-up)

bench_env()
from agent.core.codec import encode  # noqa: E402
from agent.node import Node  # noqa: E402
from agent.runner import RunConfig, Runner  # noqa: E402
from agent.simpeer import SimPeer, manifest_text, readings_table  # noqa: E402
from agent.transport.broker import Broker  # noqa: E402
from agent.transport.mqtt import MqttSettings, Topics, _publish_props  # noqa: E402

MESH = bytes.fromhex("f10d0000000000000000000000000042")
MANIFEST = manifest_text(MESH, readings_table())
T = "app.readings"


def _shapes(a_site: bytes, honest_body: bytes, body_limit: int) -> list[tuple[bytes, bool, dict]]:
    """(payload, under A's name, user properties) of each rogue message kind, in rotation."""
    sys.path.insert(0, str(ROOT))
    from tests.hostile.poison import DEEP_META, MIXED_KEY_BODY, shared_events_body, watermark_body
    stranger = SimPeer(MESH)
    now = int(time.time() * 1000)
    forged = stranger.body([stranger.event(T, {"device": "evil", "seq": i}, {"temp": 6.0}, (now, i))
                            for i in range(3)])
    return [
        (b"\xff\x00garbage", False, {}),
        (encode([1, 2, 3]), False, {}),
        (encode({"ssp_version": 2, "from_site_id": "00" * 16}), False, {}),
        (b"\x00" * (body_limit + 1), False, {}),
        (honest_body, True, {}),  # a replay under A's name
        (forged, False, {}),
        (honest_body, True, {"ssp-meta": DEEP_META}),
        (MIXED_KEY_BODY, True, {}),
        (watermark_body(a_site), True, {}),
        (shared_events_body(200, 256), True, {}),
        (honest_body, False, {"ssp-meta": "{not json"}),
    ]


def rogue(url: str, b_site: str, a_site: str, honest_body: bytes, body_limit: int, rate: float,
          seconds: float, fictional_only: bool, out) -> None:
    """The flooder (own process): `rate` messages/s for `seconds` into B's inbox; presence of
    fictional sites every 20th message. Reports (messages, bytes) through `out`."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion
    b, a = bytes.fromhex(b_site), bytes.fromhex(a_site)
    topics = Topics(MESH)
    shapes = _shapes(a, honest_body, body_limit)
    if fictional_only:  # no message under A's name, none over the body limit
        shapes = [x for x in shapes if not x[1] and len(x[0]) <= body_limit]
    s = MqttSettings.from_url(url)
    c = paho.Client(CallbackAPIVersion.VERSION2, client_id="rogue-" + os.urandom(4).hex(), protocol=paho.MQTTv5)
    c.max_inflight_messages_set(1000)
    c.max_queued_messages_set(0)
    c.connect(s.host, s.port)
    c.loop_start()
    n = nbytes = 0
    t0 = time.monotonic()
    while True:
        now = time.monotonic() - t0
        if now >= seconds:
            break
        due = int(now * rate)
        while n < due:
            payload, as_a, user = shapes[n % len(shapes)]
            sender = a if as_a else os.urandom(16)
            if n % 20 == 19:
                topic, props, payload = topics.presence(os.urandom(16)), None, os.urandom(40)
            else:
                topic = topics.requests(b, sender)
                props = _publish_props(user, os.urandom(16), topics.answers(sender, b))
            c.publish(topic, payload, qos=1, properties=props)
            n += 1
            nbytes += len(payload)
        time.sleep(0.005)
    time.sleep(0.5)
    c.loop_stop()
    c.disconnect()
    out.send((n, nbytes))


def one_run(n_events: int, max_events: int, flood: dict | None) -> dict:
    root = Path(tempfile.mkdtemp(prefix="ssp-bench-flood-"))
    broker = Broker(workdir=root / "broker").start()
    a = Node.init(root / "a", MANIFEST)[0]
    b = Node.init(root / "b", MANIFEST)[0]
    introduce(a, b)
    s = MqttSettings.from_url(broker.url, backoff_min_s=0.05, backoff_max_s=0.5)
    cfg = dict(cadence_s=0.5, answer_timeout_s=5.0, realtime=False, max_events=max_events)
    ra, rb = Runner(a, s, RunConfig(**cfg)), Runner(b, s, RunConfig(**cfg))
    assert ra.start(10) and rb.start(10)
    b_cpu = 0.0

    def step_both() -> None:
        nonlocal b_cpu
        ra.step(0.005)
        t = time.thread_time()
        rb.step(0.005)
        b_cpu += time.thread_time() - t

    # warm up: one honest event, whose body the rogue replays
    w = a.write(T, {"device": "warm", "seq": 0}, {"temp": 0.0})
    while not b.conn.execute("SELECT 1 FROM events WHERE event_id=?", (w,)).fetchone():
        step_both()
    honest_body = SimPeer(MESH, site_id=a.site_id).body([a.conn.execute("SELECT unseal(event_id, raw) FROM events").fetchone()[0]])
    disk0, cpu0, rss0 = home_bytes(root / "b"), b_cpu, peak_rss_kb()
    proc = None
    if flood:
        rx, tx = mp.Pipe(duplex=False)
        proc = mp.get_context("spawn").Process(target=rogue, args=(
            broker.url, b.site_id.hex(), a.site_id.hex(), honest_body, rb.settings.body_limit_bytes,
            flood["rate"], flood["seconds"], flood["fictional_only"], tx))
        proc.start()
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:
            step_both()
    base = b.conn.execute("SELECT count(*) FROM events").fetchone()[0]
    for i in range(0, n_events, 500):
        a.write_many([(T, {"device": f"d{j % 50}", "seq": j}, {"temp": float(j)}, False)
                      for j in range(i + 1, min(n_events, i + 500) + 1)])
    t0 = time.monotonic()
    while b.conn.execute("SELECT count(*) FROM events").fetchone()[0] < base + n_events:
        step_both()
        if time.monotonic() - t0 > 900:
            raise SystemExit("honest events did not converge within 900 s")
    converge = time.monotonic() - t0
    out = {"converge_s": converge}
    if proc is not None:
        while proc.is_alive() or not rb.link.inbound.empty():  # let B take in the rest of the flood
            step_both()
            if rx.poll():
                out["rogue"] = rx.recv()
        proc.join()
        if "rogue" not in out:
            out["rogue"] = rx.recv()
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:
            step_both()
    out.update(b_cpu_s=b_cpu - cpu0, rss_kb=peak_rss_kb() - rss0,
               disk_bytes=home_bytes(root / "b") - disk0, stats=dict(rb.stats), present=len(rb.link.present),
               caps=len(rb.caps), surfaced=b.conn.execute("SELECT count(*) FROM surfaced").fetchone()[0])
    ra.close(); rb.close(); a.close(); b.close(); broker.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=2000)
    ap.add_argument("--max-events", type=int, default=200)
    ap.add_argument("--rate", type=float, default=300.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--fictional-only", action="store_true",
                    help="flood only under fictional senders and under the body limit (no spoofing of A)")
    args = ap.parse_args()
    print(f"honest: {args.events} events A -> B; flood: {args.rate:g} msg/s for {args.seconds:g} s"
          f"{' (fictional senders only)' if args.fictional_only else ''}", flush=True)
    quiet = one_run(args.events, args.max_events, None)
    print(f"no flood: converged in {quiet['converge_s']:.2f} s, B cpu {quiet['b_cpu_s']:.2f} s", flush=True)
    fl = one_run(args.events, args.max_events, {"rate": args.rate, "seconds": args.seconds,
                                                          "fictional_only": args.fictional_only})
    n, nbytes = fl["rogue"]
    st = fl["stats"]
    print(f"flood: {n} rogue messages, {nbytes} bytes; converged in {fl['converge_s']:.2f} s")
    print(f"slowdown ratio flood / no flood: {fl['converge_s'] / quiet['converge_s']:.2f}")
    print(f"B refused bodies {st.get('rejected_bodies', 0)}, refused presence {st.get('refused_presence', 0)}, "
          f"surfaced rows {fl['surfaced']}, present {fl['present']}, caps {fl['caps']}, "
          f"unsurfaced refusals {st.get('refusals_not_surfaced', 0)}, presence evicted {st.get('presence_evicted', 0)}")
    extra_cpu = fl["b_cpu_s"] - quiet["b_cpu_s"]
    print(f"B cpu: {fl['b_cpu_s']:.2f} s vs {quiet['b_cpu_s']:.2f} s (ratio {fl['b_cpu_s'] / max(quiet['b_cpu_s'], 1e-9):.2f}); "
          f"extra {extra_cpu * 1e6 / max(n, 1):.0f} us per rogue message, {extra_cpu * 1e9 / max(nbytes, 1):.1f} ns per rogue byte")
    print(f"peak RSS growth: {fl['rss_kb']} KiB vs {quiet['rss_kb']} KiB; "
          f"{max(fl['rss_kb'] - quiet['rss_kb'], 0) * 1024 / max(n, 1):.1f} bytes per rogue message")
    ddisk = fl["disk_bytes"] - quiet["disk_bytes"]
    print(f"B home growth: {fl['disk_bytes']} vs {quiet['disk_bytes']} bytes; "
          f"{ddisk / max(n, 1):.1f} bytes per rogue message, {ddisk / max(nbytes, 1):.4f} per rogue byte")
    record({"slowdown_ratio": fl["converge_s"] / quiet["converge_s"], "flood_converge_s": fl["converge_s"],
            "cpu_ratio": fl["b_cpu_s"] / max(quiet["b_cpu_s"], 1e-9),
            "extra_cpu_us_per_rogue_message": extra_cpu * 1e6 / max(n, 1),
            "disk_bytes_per_rogue_message": ddisk / max(n, 1), "rogue_messages": n, "rogue_bytes": nbytes},
           {"no_flood_converge_s": quiet["converge_s"], "no_flood_b_cpu_s": quiet["b_cpu_s"]},
           f"{args.rate:g} rogue msg/s for {args.seconds:g} s: convergence x{fl['converge_s'] / quiet['converge_s']:.2f} "
           f"of no flood, {extra_cpu * 1e6 / max(n, 1):.0f} us of B's CPU and {ddisk / max(n, 1):.1f} bytes of its disk "
           f"per rogue message", parameters=vars(args))


if __name__ == "__main__":
    main()
