"""The honest receiver B of bench/bench_strategies.py in its own process, so that its CPU and
memory are its own (per honest node, not the harness's whole process). An honest
`Runner` on the node at HOME (the same loop `ssp-agent run` has), driven by commands on stdin, one
JSON line back on stdout for each:

    status       counts, B's applied watermark for the watched site, the runner's stats, the
                 scheduling-fairness figure, CPU (this process, every thread), RSS now and peak
    checkpoint   WAL checkpoint (TRUNCATE), so the home's size is the store's
    stop         close the runner and the node, then exit

    python bench/strategy_node.py HOME BROKER_URL CONFIG_JSON
    CONFIG_JSON: {"run": RunConfig fields, "allowed": [peer hex] | null, "watch": site hex, "table": T}
"""
from __future__ import annotations

import json
import queue
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from agent.node import Node  # noqa: E402
from agent.runner import RunConfig, Runner  # noqa: E402
from agent.store import sync_state as st  # noqa: E402
from agent.transport.mqtt import MqttSettings  # noqa: E402
from bench_strategies import Topology  # noqa: E402


def _mem_kb() -> tuple[int, int]:
    rss = hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    return rss, hwm


def main() -> int:
    home, url, conf = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    watch, table = bytes.fromhex(conf["watch"]), conf["table"]
    allowed = None if conf["allowed"] is None else {bytes.fromhex(x) for x in conf["allowed"]}
    node = Node.open(home)
    settings = MqttSettings.from_url(url, backoff_min_s=0.05, backoff_max_s=0.5)
    cfg = RunConfig(**conf["run"])
    r = Runner(node, settings, cfg, port=Topology(node, allowed, path="mqtt", secure=cfg.secure))
    if not r.start(10):
        print(json.dumps({"error": str(r.link.last_error)}), flush=True)
        return 1
    # How many requests B handled while a body of the watched site waited in its inbox.
    stamp: dict[int, int] = {}
    handled = [0]
    ahead: list[int] = []
    put, handle = r.link.inbound.put, r._handle

    def stamped_put(item, *x, **kw):
        stamp[id(item)] = handled[0]
        return put(item, *x, **kw)

    def counted_handle(msg):
        if msg.kind == "req":
            arrived = stamp.pop(id(msg), handled[0])
            if msg.sender == watch:
                ahead.append(handled[0] - arrived)
            handled[0] += 1
        return handle(msg)
    r.link.inbound.put, r._handle = stamped_put, counted_handle

    commands: queue.Queue = queue.Queue()

    def reader() -> None:
        for line in sys.stdin:
            commands.put(line.strip())
        commands.put("stop")
    threading.Thread(target=reader, daemon=True).start()
    print(json.dumps({"ready": True}), flush=True)
    while True:
        r.step(0.005)
        try:
            cmd = commands.get_nowait()
        except queue.Empty:
            continue
        if cmd == "status":
            n_watch = node.conn.execute("SELECT count(*) FROM events WHERE site_id=?", (watch,)).fetchone()[0]
            n_all = node.conn.execute("SELECT count(*) FROM events").fetchone()[0]
            wm = st.own_watermarks(node.conn).get((watch, table))
            rss, hwm = _mem_kb()
            out = {"watch_events": n_watch, "events": n_all, "watermark": None if wm is None else list(wm),
                   "stats": {k: v for k, v in r.stats.items() if v}, "max_handled_ahead": max(ahead, default=0),
                   "cpu_s": time.process_time(), "rss_kb": rss, "hwm_kb": hwm, "clock_ms": node.clock.physical_ms}
        elif cmd == "checkpoint":
            node.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
            out = {"ok": True}
        else:
            r.close()
            node.close()
            print(json.dumps({"stopped": True}), flush=True)
            return 0
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
