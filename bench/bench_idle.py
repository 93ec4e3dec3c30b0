"""Idle cost of `ssp-agent run` against the store size ("quiet links").

    python bench/bench_idle.py [--sizes 0,10000,100000] [--seconds 20] [--profile pi-zero-2w]

One home, one real mosquitto, one real `ssp-agent run` process per size. The home holds N events
(the first 100 written locally, the rest received from a producer) and two
peers in its keyring whose durable `mqtt` cursors are already at the end of the log (so a batch cycle selects nothing: the node is idle, not behind).
After a warm-up, the CPU time of the process (utime + stime from /proc/PID/stat) over `--seconds`
of wall time is the figure: CPU seconds per wall second. Flat across sizes means the idle loop
does no work that grows with the store."""
from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path

from _harness import bench_env, child_env, cli, proc_cpu_s, record, trust  # noqa: E402  (bench/: the shared set-up)

bench_env()
from agent.node import Node  # noqa: E402
from agent.simpeer import SimPeer, manifest_text, readings_table  # noqa: E402
from agent.store import sync_state as st  # noqa: E402
from agent.transport.broker import Broker  # noqa: E402

MESH = bytes.fromhex("1d1e0000000000000000000000000042")
MANIFEST = manifest_text(MESH, readings_table())
T = "app.readings"


def grow(node: Node, producer: SimPeer, upto: int) -> None:
    """Up to `upto` events in the log: the first 100 written here, the rest received from another
    producer (a gateway holds mostly other nodes' events, and its own writes are not at the end of
    the log: the case where a scan for the node's newest own write reads the whole log)."""
    have = node.conn.execute("SELECT count(*) FROM events").fetchone()[0]
    base = int(time.time() * 1000) - 3_600_000
    for i in range(have, upto, 1000):
        js = range(i, min(upto, i + 1000))
        got = [producer.event(T, {"device": f"p{j % 50}", "seq": j}, {"temp": float(j % 400)}, (base + j, 0))
               for j in js if j >= 100]
        if got:
            node.apply_batch(got)
        own = [(T, {"device": f"d{j % 50}", "seq": j}, {"temp": float(j % 400)}, False) for j in js if j < 100]
        if own:
            node.write_many(own)


def measure(home: Path, url: str, seconds: float, warmup: float) -> float:
    p = subprocess.Popen(cli(home, "run", "--broker", url), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                         env=child_env())
    try:
        sock = home / "control.sock"
        t0 = time.monotonic()
        while not sock.exists():
            if p.poll() is not None or time.monotonic() - t0 > 60:
                raise SystemExit(f"run did not start: {p.stderr.read().decode()[-2000:]}")
            time.sleep(0.1)
        time.sleep(warmup)  # start-up, the first batch cycle, the first eviction run
        c0, w0 = proc_cpu_s(p.pid), time.monotonic()
        time.sleep(seconds)
        c1, w1 = proc_cpu_s(p.pid), time.monotonic()
        return (c1 - c0) / (w1 - w0)
    finally:
        p.terminate()
        p.wait(30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="0,10000,100000")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--profile", default="pi-zero-2w")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ssp-bench-idle-"))
    broker = Broker(workdir=root / "broker").start()
    node = Node.init(root / "home", MANIFEST, profile=args.profile)[0]
    peer, producer = SimPeer(MESH), SimPeer(MESH)
    trust(node, [peer, producer])
    home = node.home
    node.close()
    rows = []
    try:
        for n in [int(x) for x in args.sizes.split(",")]:
            node = Node.open(home)
            grow(node, producer, n)
            top = node.conn.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]
            node.conn.execute("BEGIN IMMEDIATE")
            for p in (peer, producer):  # the peers have everything: idle
                st.advance_cursor(node.conn, p.site_id, "mqtt", top)
            node.conn.execute("COMMIT")
            node.close()
            ratio = measure(home, broker.url, args.seconds, args.warmup)
            rows.append((n, ratio))
            print(f"{n:>7} events: idle CPU {ratio:.4f} s per wall second ({ratio * 100:.2f}% of a core)", flush=True)
    finally:
        broker.close()
    base = rows[0][1]
    print("ratio to the empty store: " + ", ".join(f"{n}: {r / max(base, 1e-9):.2f}" for n, r in rows))
    record({**{f"idle_cpu_pct_{n}_events": r * 100 for n, r in rows},
            **{f"ratio_{n}_events_empty_store": r / max(base, 1e-9) for n, r in rows[1:]}},
           {"idle_cpu_pct_empty_store": base * 100, "seconds_measured": args.seconds},
           "idle CPU of `ssp-agent run` at " + " / ".join(str(n) for n, _ in rows) + " events: "
           + " / ".join(f"{r * 100:.2f}" for _, r in rows) + " % of a core (ratios "
           + " / ".join(f"{r / max(base, 1e-9):.2f}" for _, r in rows) + ")", parameters=vars(args))


if __name__ == "__main__":
    main()
