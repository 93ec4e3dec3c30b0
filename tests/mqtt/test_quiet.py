"""Quiet links and the in-flight memory bound (docs/mqtt.md), on a real mosquitto.

- An idle `run` costs the same whatever the store holds: its step looked for the node's newest own
  write with `max(seq) ... WHERE origin='local'`, a scan of the whole log 20 times a second (about
  20% of a core at 100 000 events, bench/bench_idle.py). Counted here in SQLite VM instructions,
  not in time.
- What waits in the broker for an offline peer is at most one window of distinct bodies: every
  cadence and every `sync --once` wake used to send another window to every peer in the keyring.
- A peer's body limit is learned from what it advertises, once, and kept in the store; a forged
  advertisement is bounded (a floor, the link's maximum, replaced by the peer's own).
"""
from __future__ import annotations

import json
import os
import queue
import subprocess
import time

from agent.core.messages import Handshake, emit_handshake
from agent.node import Node
from agent.runner import RunConfig
from agent.simpeer import SimPeer
from agent.store import sync_state as st
from agent.transport.mqtt import (ADVERTISED_FLOOR, KIND_PULL, P_BODY_LIMIT, P_COUNT, P_END, P_KIND, P_START,
                                  MqttLink, Topics, _publish_props)

from .helpers import MESH, T, event_ids, make_nodes, runner, settings, step_until, write
from tests.cli_cmd import agent_cmd, agent_env
from tests.waiting import HANG_S


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
def _queued_for(broker, node, sender: bytes, idle_s: float = 1.5, pulls: list | None = None) -> list:
    """Connect as `node` (its own client id: its persistent session) with a bare link that
    processes nothing, and take the bodies the broker had queued for it from `sender`; its pulls
    (no body, docs/mqtt.md "A waking device") go to `pulls`."""
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
                if m.props.get(P_KIND) == KIND_PULL:
                    if pulls is not None:
                        pulls.append(m)
                    continue
                got.append(m)
    finally:
        link.abort()
    return got


def _assert_one_window(got: list, window: int) -> None:
    ranges = [(int(m.props[P_START]), int(m.props[P_END])) for m in got]
    assert len(got) <= window, f"{len(got)} bodies waited for the offline peer (one window is {window}): {ranges}"
    assert len(set(ranges)) == len(ranges), f"duplicate bodies waited for the offline peer: {ranges}"


def test_an_offline_peer_gets_one_window_however_many_cadences_pass(broker, tmp_path):
    """Every cadence re-sent a window to every peer in the keyring, present or
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
        pulls: list = []
        got = _queued_for(broker, b, a.site_id, pulls=pulls)
        _assert_one_window(got, window)
        assert len(pulls) <= 4 and all(not m.payload for m in pulls)  # one pull per wake, no body
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


# ------------------------------------------------------------------ the peer's body limit
def _converge(runners, a, b, timeout=40.0) -> None:
    assert step_until(runners, lambda: event_ids(a) <= event_ids(b), timeout), [r.stats for r in runners]


def _fitted(ra, rb) -> None:
    """Every body A sent fitted B: none refused, none dropped by the broker for B's Maximum Packet
    Size (which shows as silence: a give-up and a reduction), none halved."""
    assert rb.stats["rejected:too_large"] == 0, rb.stats
    assert ra.stats["push_rejected:too_large"] == 0, ra.stats
    assert ra.stats["unanswered"] == 0 and ra.stats["body_limit_reduced"] == 0, ra.stats


def test_a_peers_body_limit_is_learned_from_its_presence_and_kept_across_restarts(broker, tmp_path):
    """A gateway (256 KiB bodies) talking to a Pi Zero (64 KiB) sent bodies the
    Pi refused (`too_large`) and halved its way down, over four wakes, and forgot it on restart.
    The Pi advertises its body limit (presence, bodies, answers: `ssp-body-limit`); the gateway
    uses it from its first body and keeps it in the store, so the Pi refuses nothing, also after
    the gateway restarts while the Pi is away."""
    a, b = nodes = make_nodes(tmp_path, 2)
    pi = {"body_limit_bytes": 65536}
    rb = runner(b, broker, link=pi, cadence_s=3600, realtime=False)
    # a long answer wait: a Pi slow to answer on a loaded machine must not look like a dropped body
    # (silence halves the limit), which is not what this test is about
    slow_ok = dict(cadence_s=0.2, realtime=False, answer_timeout_s=4 * HANG_S)
    ra = runner(a, broker, **slow_ok)
    try:
        assert step_until([ra, rb], lambda: b.site_id in ra.caps)  # the Pi's presence
        for i in range(600):  # ~150 KB of events: more than one Pi body
            write(a, i, "gw")
        _converge([ra, rb], a, b)
        _fitted(ra, rb)
        ra.close()
        rb.close()
        for i in range(600, 1200):
            write(a, i, "gw")
        ra = runner(a, broker, **slow_ok)  # restarted, and the Pi is away
        for _ in range(60):
            ra.step(0.01)
        rb = runner(b, broker, link=pi, cadence_s=3600, realtime=False)
        _converge([ra, rb], a, b)
        _fitted(ra, rb)
        assert a.dump() == b.dump()
    finally:
        ra.close()
        rb.close()
        for n in nodes:
            n.close()


def _forge_presence(broker, site: bytes, limit: str) -> None:
    """A retained presence for `site` with a valid handshake of it and `ssp-body-limit: limit`,
    published by a client that is not `site` (no ACLs: anyone can)."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion
    c = paho.Client(CallbackAPIVersion.VERSION2, client_id="forger-" + os.urandom(4).hex(), protocol=paho.MQTTv5)
    c.connect(broker.host, broker.port)
    c.loop_start()
    try:
        hs = emit_handshake(Handshake(site, (0, 0), False, False, None))
        c.publish(Topics(MESH).presence(site), hs, qos=1, retain=True,
                  properties=_publish_props({P_BODY_LIMIT: limit})).wait_for_publish(5)
    finally:
        c.loop_stop()
        c.disconnect()


def test_a_forged_advertised_limit_is_floored_capped_and_replaced_by_the_peers_own(broker, tmp_path):
    """An advertised limit comes from the retained presence, which without ACLs anyone can forge.
    A forged tiny limit costs at most bodies of ADVERTISED_FLOOR (16 KiB), never less; a forged huge
    one never raises bodies above the link's own maximum; the peer's own presence replaces either
    when it connects; events flow throughout."""
    a, b = nodes = make_nodes(tmp_path, 2)
    ra = runner(a, broker, cadence_s=0.2, realtime=False)
    rb = None
    try:
        _forge_presence(broker, b.site_id, "1")
        assert step_until([ra], lambda: ra._limit(b.site_id) < ra.link.max_payload(), 10)
        assert ra._limit(b.site_id) == ADVERTISED_FLOOR
        _forge_presence(broker, b.site_id, str(10 ** 9))
        assert step_until([ra], lambda: ra._limit(b.site_id) == ra.link.max_payload(), 10)
        _forge_presence(broker, b.site_id, "1")
        assert step_until([ra], lambda: ra._limit(b.site_id) == ADVERTISED_FLOOR, 10)
        for i in range(300):
            write(a, i, "w")
        rb = runner(b, broker, link={"body_limit_bytes": 65536}, cadence_s=3600, realtime=False)
        assert step_until([ra, rb], lambda: ra._limit(b.site_id) == 65536, 10)
        _converge([ra, rb], a, b)
        assert rb.stats["rejected:too_large"] == 0
    finally:
        ra.close()
        if rb is not None:
            rb.close()
        for n in nodes:
            n.close()


# ------------------------------------------------------------------ the memory bound
def _vm(pid: int, key: str) -> int:
    """A /proc/PID/status figure in KiB (VmRSS, VmHWM: the peak)."""
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} for {pid}")


RSS_BOUND_KB = 48 * 1024  # generous: oversized payloads are not kept; presence is cut to 4 KiB (1 024 kept)


def test_a_flood_of_oversized_messages_does_not_grow_the_nodes_memory(broker, tmp_path):
    """Oversized messages (1 MiB; the profile's body limit is 256 KiB) flooded
    into a node's inbox, under fictional senders and under its honest peer's name, and as presence
    of fictional sites, were held whole in the node's memory while they waited (the presence table
    kept 1 024 payloads of any size). Now the link keeps no payload over the body limit (the size
    is enough to refuse it), cuts presence payloads to 4 KiB, and a Receive Maximum derived from the
    body limit bounds what is in flight. B is a real `ssp-agent run`; its peak RSS (VmHWM from /proc)
    after the flood stays within RSS_BOUND_KB of what it was before, and honest traffic still
    arrives."""
    a, b = nodes = make_nodes(tmp_path, 2)
    hb = b.home
    b_site = b.site_id
    b.close()
    proc = subprocess.Popen([*agent_cmd(), "--home", str(hb), "run", "--broker", broker.url, "--cadence", "0.5"],
                            env=agent_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    ra = runner(a, broker, cadence_s=0.2, realtime=False)
    try:
        write(a, 0, "warm")
        assert step_until([ra], lambda: ra.sync.cursor(b_site) > 0, 30), ra.stats  # B runs and answers
        before = _vm(proc.pid, "VmHWM")
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id="rogue-" + os.urandom(4).hex(), protocol=paho.MQTTv5)
        c.max_inflight_messages_set(100)
        c.max_queued_messages_set(0)
        c.connect(broker.host, broker.port)
        c.loop_start()
        topics = Topics(MESH)
        big = os.urandom(1024 * 1024)
        try:
            infos = []
            for i in range(240):
                sender = a.site_id if i % 2 else os.urandom(16)
                infos.append(c.publish(topics.requests(b_site, sender), big, qos=1,
                                       properties=_publish_props({}, os.urandom(16), topics.answers(sender, b_site))))
            for i in range(200):  # presence of fictional sites, each 1 MiB (a handshake is ~150 bytes)
                infos.append(c.publish(topics.presence(os.urandom(16)), big, qos=1))
            for info in infos:
                info.wait_for_publish(60)
        finally:
            c.loop_stop()
            c.disconnect()
        write(a, 1, "after")  # honest traffic after the flood: B takes it once it took the flood in
        top = a.conn.execute("SELECT max(seq) FROM events").fetchone()[0]
        assert step_until([ra], lambda: ra.sync.cursor(b_site) == top, 60), ra.stats
        for _ in range(100):
            ra.step(0.01)
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        grown = _vm(proc.pid, "VmHWM") - before
        assert grown <= RSS_BOUND_KB, f"B's peak RSS grew by {grown} KiB (bound {RSS_BOUND_KB} KiB)"
    finally:
        ra.close()
        proc.terminate()
        proc.wait(30)
        for n in nodes:
            n.close()


def test_presence_of_fictional_sites_waiting_in_the_runner_is_bounded(broker, tmp_path):
    """Presence is acknowledged on arrival, so the Receive Maximum does not hold it back: a flood
    of presence for made-up sites waited in the runner's queue of other sites' messages without a
    count bound. Past `presence_limit` such messages waiting, the oldest is dropped (counted)."""
    a, b = nodes = make_nodes(tmp_path, 2)
    rb = runner(b, broker, cadence_s=3600, realtime=False)
    rb.presence_limit = 50
    rb.cfg.others_per_step = 0  # nothing of the flood is handled: it only waits
    rogue = MqttLink(settings(broker), MESH, os.urandom(16)).start()
    assert rogue.wait_connected(5)
    try:
        for _ in range(300):
            s = os.urandom(16)
            rogue.publish_raw(Topics(MESH).presence(s), emit_handshake(Handshake(s, (0, 0), True, False, None)))
        assert step_until([rb], lambda: rb.stats["others_presence_dropped"] + len(rb._others) >= 300, 20), rb.stats
        assert len(rb._others) <= 50 and rb.stats["others_presence_dropped"] >= 250
    finally:
        rogue.close()
        rb.close()
        for n in nodes:
            n.close()


def test_a_body_lost_before_the_peer_had_a_session_is_sent_again_on_the_next_wake(broker, tmp_path):
    """A wake-sync-sleep A sends B a body while B has no broker session (the broker drops it); B
    then runs (a real `ssp-agent run`), present, with nothing to say to A. A's next wakes held the
    lost body "in flight" (quiet links) with no evidence of its loss: B answered nothing and sent
    nothing, and a wake is shorter than the answer timeout, so B never got A's events
    (tests/mqtt/test_cli.py failed intermittently on it). Now a peer that is present once a wake
    has taken in what waited for it, without the answer, lost the body: it is sent again."""
    a, b = nodes = make_nodes(tmp_path, 2)
    want = {write(a, i, "a") for i in range(5)}
    ra = runner(a, broker, cadence_s=3600, realtime=False)
    ra.sync_once(timeout_s=2)  # B never connected: no session, the body is dropped
    ra.close()
    hb = b.home
    b.close()
    proc = subprocess.Popen([*agent_cmd(), "--home", str(hb), "run", "--broker", broker.url, "--cadence", "3600"],
                            env=agent_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        assert _wait_for_presence(broker, a, b_site := nodes[1].site_id)
        for _ in range(3):  # A wakes while B runs
            ra = runner(a, broker, cadence_s=3600, realtime=False)
            ra.sync_once(timeout_s=3)
            ra.close()
            if ra.sync.cursor(b_site) >= 5:
                break
        assert ra.sync.cursor(b_site) >= 5, ra.stats
    finally:
        proc.terminate()
        proc.wait(30)
        a.close()
    b = Node.open(hb)
    try:
        assert want <= event_ids(b)
    finally:
        b.close()


def _wait_for_presence(broker, node, site: bytes, timeout: float = HANG_S) -> bool:
    """Whether `site`'s retained presence shows up (its `run` is connected)."""
    link = MqttLink(settings(broker), MESH, os.urandom(16)).start()
    try:
        assert link.wait_connected(10)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if site in link.present:
                return True
            time.sleep(0.05)
        return False
    finally:
        link.abort()
