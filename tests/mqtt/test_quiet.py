"""Quiet links (issue 12 item 6) and the memory bound of issue 11 item 4, on a real mosquitto.

- An idle `run` costs the same whatever the store holds: its step looked for the node's newest own
  write with `max(seq) ... WHERE origin='local'`, a scan of the whole log 20 times a second (about
  20% of a core at 100 000 events, bench/bench_idle.py). Counted here in SQLite VM instructions,
  not in time.
- What waits in the broker for an offline peer is at most one window of distinct bodies: every
  cadence and every `sync --once` wake used to send another window to every peer in the keyring.
"""
from __future__ import annotations

import json
import queue
import subprocess
import time

from agent.node import Node
from agent.runner import RunConfig
from agent.simpeer import SimPeer
from agent.store import sync_state as st
from agent.transport.mqtt import P_COUNT, P_END, P_START, MqttLink

from .helpers import MESH, T, event_ids, make_nodes, runner, settings, step_until, write
from tests.cli_cmd import agent_cmd, agent_env


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


# ------------------------------------------------------------------ an offline peer's broker queue
def _queued_for(broker, node, sender: bytes, idle_s: float = 1.5) -> list:
    """Connect as `node` (its own client id: its persistent session) with a bare link that
    processes nothing, and take everything the broker had queued for it from `sender`."""
    link = MqttLink(settings(broker), MESH, node.site_id).start()
    assert link.wait_connected(10), link.last_error
    got = []
    try:
        while True:
            try:
                m = link.inbound.get(timeout=idle_s)
            except queue.Empty:
                break
            if m.kind == "req" and m.sender == sender:
                got.append(m)
    finally:
        link.abort()
    return got


def _assert_one_window(got: list, window: int) -> None:
    ranges = [(int(m.props[P_START]), int(m.props[P_END])) for m in got]
    assert len(got) <= window, f"{len(got)} bodies waited for the offline peer (one window is {window}): {ranges}"
    assert len(set(ranges)) == len(ranges), f"duplicate bodies waited for the offline peer: {ranges}"


def test_an_offline_peer_gets_one_window_however_many_cadences_pass(broker, tmp_path):
    """Issue 12 item 6: every cadence re-sent a window to every peer in the keyring, present or
    not (a peer with 1 000 waiting events got 2 000 in 30 s, half duplicates). B's persistent
    session is offline for many cadences and answer timeouts of A; what waits for it is at most
    one window of distinct bodies, and B then catches up from it."""
    a, b = nodes = make_nodes(tmp_path, 2)
    rb = runner(b, broker, cadence_s=3600)
    rb.close()  # B has a persistent session on the broker, and is gone
    for i in range(200):
        write(a, i, "a")
    ra = runner(a, broker, cadence_s=0.1, answer_timeout_s=0.3, max_events=10, window=4)
    try:
        deadline = time.monotonic() + 4.0  # ~40 cadences, ~13 answer timeouts
        while time.monotonic() < deadline:
            ra.step(0.01)
        got = _queued_for(broker, b, a.site_id)
        _assert_one_window(got, 4)
        assert got, "nothing was sent to the offline peer at all"
        rb = runner(b, broker, cadence_s=3600)
        assert step_until([ra, rb], lambda: event_ids(a) <= event_ids(b), 30)
    finally:
        ra.close()
        rb.close()
        for n in nodes:
            n.close()


def _sync_once(home, url: str) -> dict:
    p = subprocess.run([*agent_cmd(), "--home", str(home), "sync", "--broker", url, "--once", "--timeout", "2"],
                       capture_output=True, text=True, timeout=60, env=agent_env())
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


def test_wakes_of_a_sleeper_do_not_pile_bodies_for_an_offline_peer(broker, tmp_path):
    """The same for a wake-sync-sleep device: several `sync --once` wakes of A (real processes)
    while B's session is offline leave at most one window of distinct bodies waiting for B, and B
    still gets everything once it wakes."""
    a, b = nodes = make_nodes(tmp_path, 2)
    rb = runner(b, broker, cadence_s=3600)
    rb.close()
    for i in range(200):
        write(a, i, "a")
    window = RunConfig().window
    per_body = a.profile.batch_limit
    want = event_ids(a)
    homes = [a.home, b.home]
    for n in nodes:
        n.close()
    for _ in range(4):
        _sync_once(homes[0], broker.url)
    b = Node.open(homes[1])
    try:
        got = _queued_for(broker, b, a.site_id)
        _assert_one_window(got, window)
        assert got and sum(int(m.props[P_COUNT]) for m in got) <= window * per_body
    finally:
        b.close()
    for _ in range(6):  # B answers what waited; A's next wakes take the answers and send on
        _sync_once(homes[1], broker.url)
        _sync_once(homes[0], broker.url)
        b = Node.open(homes[1])
        done = want <= event_ids(b)
        b.close()
        if done:
            break
    assert done
