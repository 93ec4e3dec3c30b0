"""Producer subprocess for the agent-level crash test (test_node_crash.py): signed writes through
the real production path, Node.write / Node.write_many (HLC tick with its durable ceiling, the
signing bridge, the one apply path). After each call returns it prints, flushed, one line per
event:   ACK <event_id hex> <hlc physical> <hlc logical> <cose hex>
and finally DONE. It prints nothing before a write has returned: the parent is the checker.

    python node_producer.py --home H --start N --total T --seed S
"""
from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

import agent.produce as node_mod  # noqa: E402
import agent.recovery  # noqa: E402
from agent.node import Node  # noqa: E402

T = "app.readings"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--home", required=True)
    ap.add_argument("--start", type=int, required=True)
    ap.add_argument("--total", type=int, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--compact-bytes", type=int, default=0, help="journal compaction threshold (0: default)")
    ap.add_argument("--no-recovery", action="store_true", help="NEGATIVE CONTROL: skip the open-time recovery")
    ap.add_argument("--die-after-persist", type=int, default=0,
                    help="SIGKILL this process at its n-th durable output, before the event is applied "
                         "(so the negative control's window is hit, not left to the kill timing)")
    args = ap.parse_args()
    if args.no_recovery:
        agent.recovery.recover_released = lambda st: None
    if args.die_after_persist:
        import signal
        from firmware_bridge.bridge import SigningBridge
        fire, seen = SigningBridge._fire, [0]

        def die_at_persist(self, point):
            if point == "after_persist":
                seen[0] += 1
                if seen[0] == args.die_after_persist:
                    os.kill(os.getpid(), signal.SIGKILL)
            fire(self, point)
        SigningBridge._fire = die_at_persist
    if args.compact_bytes:
        node_mod.JOURNAL_COMPACT_BYTES = args.compact_bytes
    rng = random.Random(args.seed)
    node = Node.open(args.home)      # recovery of released-but-unapplied events, compaction
    print("READY", flush=True)
    i = args.start
    while i < args.total:
        n = min(rng.choice([1, 1, 1, 2, 4, 8]), args.total - i)
        writes = [(T, {"device": "p", "seq": i + k}, {"temp": float(i + k)}, False) for k in range(n)]
        ids = node.write_many(writes) if n > 1 else [node.write(*writes[0][:3])]
        lines = []
        for eid in ids:
            p, l, raw = node.conn.execute("SELECT hlc_p, hlc_l, unseal(event_id, raw) FROM events WHERE event_id=?", (eid,)).fetchone()
            lines.append(f"ACK {eid.hex()} {p} {l} {bytes(raw).hex()}\n")
        sys.stdout.write("".join(lines))
        sys.stdout.flush()
        i += n
        if rng.random() < 0.03:
            node.run_eviction()      # compaction through the eviction job, too
    node.close()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
