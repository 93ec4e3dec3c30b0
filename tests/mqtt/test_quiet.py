"""Quiet links (issue 12 item 6) and the memory bound of issue 11 item 4, on a real mosquitto.

- An idle `run` costs the same whatever the store holds: its step looked for the node's newest own
  write with `max(seq) ... WHERE origin='local'`, a scan of the whole log 20 times a second (about
  20% of a core at 100 000 events, bench/bench_idle.py). Counted here in SQLite VM instructions,
  not in time.
"""
from __future__ import annotations

import time

from agent.simpeer import SimPeer
from agent.store import sync_state as st

from .helpers import MESH, T, make_nodes, runner


def _grow(node, producer: SimPeer, n: int) -> None:
    """`n` events received from `producer` (the node's own writes are not at the end of its log)."""
    base = int(time.time() * 1000) - 3_600_000
    have = node.conn.execute("SELECT count(*) FROM events").fetchone()[0]
    for i in range(have, have + n, 1000):
        node.apply_batch([producer.event(T, {"device": f"p{j % 50}", "seq": j}, {"temp": 1.0}, (base + j, 0))
                          for j in range(i, min(have + n, i + 1000))])


def _idle_vm_steps(r, steps: int = 40) -> int:
    """SQLite VM instructions (in units of 100) run by `steps` idle runner steps."""
    count = [0]

    def tick() -> int:
        count[0] += 1
        return 0
    r.node.conn.set_progress_handler(tick, 100)
    try:
        for _ in range(steps):
            r.step(0.001)
    finally:
        r.node.conn.set_progress_handler(None, 100)
    return count[0]


def test_idle_step_work_does_not_grow_with_the_store(broker, tmp_path):
    a, b = nodes = make_nodes(tmp_path, 2)
    producer = SimPeer(MESH)
    a.add_peer(producer.site_id, producer.public_key, None)
    a.write(T, {"device": "own", "seq": 0}, {"temp": 0.0})  # one own write, at the start of the log
    ra = runner(a, broker, cadence_s=3600)
    try:
        for p in (b.site_id, producer.site_id):  # the peers have everything: nothing to send
            st.advance_cursor(a.conn, p, "mqtt", a.conn.execute("SELECT max(seq) FROM events").fetchone()[0])
        ra.step(0.01)  # the first batch cycle (then not again for an hour)
        small = _idle_vm_steps(ra)
        _grow(a, producer, 20_000)
        top = a.conn.execute("SELECT max(seq) FROM events").fetchone()[0]
        for p in (b.site_id, producer.site_id):
            st.advance_cursor(a.conn, p, "mqtt", top)
        ra.step(0.01)  # takes note of what arrived once
        large = _idle_vm_steps(ra)
        # Before the fix: ~2 000 000 instructions a step at 20 000 events, against ~10 in an
        # empty log. The margin covers noise such as a clock check falling in one of the runs.
        assert large <= 2 * small + 20, (small, large)
    finally:
        ra.close()
        for n in nodes:
            n.close()
