"""Quiet links: what a node sends a peer that is offline for an hour.

    python bench/bench_quiet.py [--minutes 60] [--scale 0.02] [--root CHECKOUT]

Three nodes on the pi-zero-2w profile (cadence 60 s, 250 events per body, 64 KiB bodies) and a real
mosquitto. A writes one reading every 30 s; B is online throughout; C has a persistent session and is
offline for the whole period. Time is compressed by `--scale` (0.02: an hour in 72 s; the cadence,
the answer timeout and the write interval are scaled alike). Then, before C comes back, a bare
client connects as C and counts what waited for it in the broker (bodies, bytes, distinct ranges,
without acknowledging them); then C runs until it holds all of A's events.

Figures, per event delivered to C (A's events C holds at the end): bodies and bytes A published to
C's inbox, over the hour and the catch-up; and the same for B, online. `--root` runs another
checkout of the agent (the code before the fix: `git worktree add /tmp/before <commit>`)."""
from __future__ import annotations

import argparse
import queue
import sys
import tempfile
import time
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--minutes", type=float, default=60.0, help="simulated minutes C is offline")
ap.add_argument("--scale", type=float, default=0.02, help="wall seconds per simulated second")
ap.add_argument("--root", default=str(Path(__file__).resolve().parents[1]), help="the agent checkout to run")
ap.add_argument("--record", action="store_true", help="write bench/results/bench_quiet.json (bench/_harness.py record)")
args = ap.parse_args()
from _harness import bench_env, introduce, record  # noqa: E402  (bench/: the shared set-up; imports no agent module)

sys.path.insert(0, args.root)   # after the harness, which puts this checkout on the path: --root goes first
bench_env()

from agent.node import Node  # noqa: E402
from agent.runner import RunConfig, Runner  # noqa: E402
from agent.simpeer import manifest_text, readings_table  # noqa: E402
from agent.transport.broker import Broker  # noqa: E402
from agent.transport.mqtt import MqttLink, MqttSettings  # noqa: E402

MESH = bytes.fromhex("9e1e0000000000000000000000000042")
MANIFEST = manifest_text(MESH, readings_table())
T = "app.readings"


def settings(url: str, prof) -> MqttSettings:
    return MqttSettings.from_url(url, backoff_min_s=0.05, backoff_max_s=0.5, body_limit_bytes=int(prof.body_limit_bytes),
                                 max_events=int(prof.batch_limit), session_expiry_s=int(prof.session_expiry_s))


def runner(node: Node, url: str, scale: float) -> Runner:
    prof = node.profile
    cfg = RunConfig.from_profile(prof, cadence_s=float(prof.cadence_s) * scale, answer_timeout_s=15.0 * scale)
    r = Runner(node, settings(url, prof), cfg)
    assert r.start(10), r.link.last_error
    return r


def counted(r: Runner) -> dict:
    """Bodies and bytes the runner publishes, per peer (wraps its link's push)."""
    tally: dict = {}
    push = r.link.push

    def counting(peer, body, user, correlation=None):
        t = tally.setdefault(peer, [0, 0])
        t[0] += 1
        t[1] += len(body)
        return push(peer, body, user, correlation)
    r.link.push = counting
    return tally


def waiting_for(url: str, node: Node, sender: bytes, idle_s: float = 2.0) -> tuple[int, int, int]:
    """(bodies, bytes, distinct ranges) queued in the broker for `node` from `sender`, read by a
    bare client under the node's client id that acknowledges nothing (the broker keeps them)."""
    link = MqttLink(MqttSettings.from_url(url), MESH, node.site_id).start()
    assert link.wait_connected(10), link.last_error
    n = nbytes = 0
    ranges = set()
    try:
        while True:
            try:
                m = link.inbound.get(timeout=idle_s)
            except queue.Empty:
                break
            if m.kind == "req" and m.sender == sender:
                n += 1
                nbytes += len(m.payload)
                ranges.add((m.props.get("ssp-start"), m.props.get("ssp-end")))
    finally:
        link.abort()
    return n, nbytes, len(ranges)


def held_from(node: Node, site: bytes) -> int:
    return node.conn.execute("SELECT count(*) FROM events WHERE site_id=?", (site,)).fetchone()[0]


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="ssp-bench-quiet-"))
    broker = Broker(workdir=root / "broker").start()
    a, b, c = nodes = [Node.init(root / n, MANIFEST, profile="pi-zero-2w")[0] for n in "abc"]
    introduce(*nodes)
    rc = runner(c, broker.url, args.scale)
    rc.close()  # C's persistent session exists; C is gone
    ra, rb = runner(a, broker.url, args.scale), runner(b, broker.url, args.scale)
    tally = counted(ra)
    write_every = 30.0 * args.scale
    wall = args.minutes * 60.0 * args.scale
    t0 = time.monotonic()
    written = 0
    while time.monotonic() - t0 < wall:
        if written * write_every <= time.monotonic() - t0:
            a.write(T, {"device": "a", "seq": written}, {"temp": 20.0 + written % 10})
            written += 1
        ra.step(0.005)
        rb.step(0.005)
    off_bodies, off_bytes = tally.get(c.site_id, [0, 0])
    q_bodies, q_bytes, q_ranges = waiting_for(broker.url, c, a.site_id)
    rc = runner(c, broker.url, args.scale)
    t1 = time.monotonic()
    while held_from(c, a.site_id) < written or ra.sync.cursor(c.site_id) < a.conn.execute(
            "SELECT max(seq) FROM events").fetchone()[0]:
        for r in (ra, rb, rc):
            r.step(0.005)
        if time.monotonic() - t1 > 300:
            raise SystemExit("C did not catch up within 300 s")
    got_c, got_b = held_from(c, a.site_id), held_from(b, a.site_id)
    to_c, to_b = tally.get(c.site_id, [0, 0]), tally.get(b.site_id, [0, 0])
    print(f"code: {args.root}; {args.minutes:g} simulated minutes at scale {args.scale:g}; A wrote {written} events")
    print(f"C offline: A sent it {off_bodies} bodies, {off_bytes} bytes; waiting in the broker when C came back: "
          f"{q_bodies} bodies ({q_ranges} distinct ranges), {q_bytes} bytes")
    print(f"to C (offline, then catch-up): {to_c[0] / max(got_c, 1):.3f} bodies and {to_c[1] / max(got_c, 1):.0f} bytes "
          f"per delivered event ({got_c} delivered)")
    print(f"to B (online): {to_b[0] / max(got_b, 1):.3f} bodies and {to_b[1] / max(got_b, 1):.0f} bytes "
          f"per delivered event ({got_b} delivered)")
    per_day = off_bytes / max(args.minutes, 1e-9) * 60 * 24
    print(f"bytes sent to an offline peer, per simulated day at this rate: {per_day / 1e6:.1f} MB")
    record({"waiting_bodies": q_bodies, "waiting_bytes": q_bytes, "waiting_ranges": q_ranges,
            "offline_bodies_per_delivered_event": to_c[0] / max(got_c, 1),
            "offline_bytes_per_delivered_event": to_c[1] / max(got_c, 1), "offline_bytes_per_day": per_day},
           {"online_bodies_per_delivered_event": to_b[0] / max(got_b, 1),
            "online_bytes_per_delivered_event": to_b[1] / max(got_b, 1), "events_written": written},
           f"waiting for the offline peer: {q_bodies} bodies, {q_bytes / 1e3:.1f} KB; sent to it per delivered event "
           f"{to_c[0] / max(got_c, 1):.3f} bodies and {to_c[1] / max(got_c, 1):.0f} bytes (an online peer: "
           f"{to_b[0] / max(got_b, 1):.3f} and {to_b[1] / max(got_b, 1):.0f})",
           parameters={k: v for k, v in vars(args).items() if k != "record"})
    for r in (ra, rb, rc):
        r.close()
    for n in nodes:
        n.close()
    broker.close()


if __name__ == "__main__":
    main()
