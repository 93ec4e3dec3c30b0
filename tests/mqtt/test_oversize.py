"""One oversized message from a broker that lets it through (docs/mqtt.md "Memory bound").

Before: a node announced no MQTT Maximum Packet Size, so a broker without `max_packet_size`
(mosquitto's own default allows 256 MiB) handed it any PUBLISH whole: paho read each into memory
before the link could refuse it for its size. One 64 MiB body in a node's inbox, or one retained
64 MiB presence message (delivered again to every node of the mesh on every connection), took a
running node from about 40 MB to over 200 MB, beyond what a Pi Zero 2 W has to spare. Now the node
announces its body limit + PACKET_OVERHEAD at CONNECT and the broker drops larger PUBLISHes for it;
the in-flight slots mosquitto 2.0.11 then keeps are freed by the delivery watch (agent/inbox.py).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import time

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from agent.transport.mqtt import Topics, _publish_props

from .helpers import MESH, make_nodes, runner, step_until, write
from tests.cli_cmd import agent_cmd, agent_env

GROWTH_BOUND_KB = 24 * 1024
HUGE = 64 * 1024 * 1024
# more than the node's Receive Maximum (252 for the default 256 KiB bodies) or the broker's
# max_inflight_messages (100 here), whichever mosquitto applies
OVERSIZED = 300


def _vm(pid: int, key: str) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {key} for {pid}")


def _rogue(broker) -> paho.Client:
    c = paho.Client(CallbackAPIVersion.VERSION2, client_id="rogue-" + os.urandom(4).hex(), protocol=paho.MQTTv5)
    c.max_inflight_messages_set(1000)
    c.max_queued_messages_set(0)
    c.connect(broker.host, broker.port)
    c.loop_start()
    return c


def _events(home, kind: str) -> list:
    out = subprocess.run([*agent_cmd(), "--home", str(home), "events"], env=agent_env(), capture_output=True,
                         text=True, check=True)
    return [x for x in out.stdout.splitlines() if kind in x]


def _run_node(home, broker, **env):
    return subprocess.Popen([*agent_cmd(), "--home", str(home), "run", "--broker", broker.url, "--cadence", "0.5"],
                            env=agent_env(env), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


@contextlib.contextmanager
def _running_b(broker, tmp_path, **env):
    """A (in this process, a Runner) and B (`ssp-agent run`, the installed command), synced once;
    yields (a, its runner, B's home, B's site_id, B's process, rogue clients to close)."""
    a, b = nodes = make_nodes(tmp_path, 2)
    hb, b_site = b.home, b.site_id
    b.close()
    proc = _run_node(hb, broker, **env)
    ra = runner(a, broker, cadence_s=0.2, realtime=False)
    rogues: list = []
    try:
        write(a, 0, "warm")
        assert step_until([ra], lambda: ra.sync.cursor(b_site) > 0, 30), ra.stats
        yield a, ra, hb, b_site, proc, rogues
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    finally:
        for c in rogues:
            c.loop_stop()
            c.disconnect()
        ra.close()
        proc.terminate()
        proc.wait(30)
        for n in nodes:
            n.close()


def _honest_traffic_arrives(a, ra, b_site, i: int, timeout: float) -> bool:
    write(a, i, f"after-{i}")
    top = a.conn.execute("SELECT max(seq) FROM events").fetchone()[0]
    return step_until([ra], lambda: ra.sync.cursor(b_site) == top, timeout)


def test_one_huge_body_or_retained_presence_does_not_balloon_a_running_node(broker, tmp_path):
    topics = Topics(MESH)
    with _running_b(broker, tmp_path) as (a, ra, _hb, b_site, proc, rogues):
        before = _vm(proc.pid, "VmHWM")
        c = _rogue(broker)
        rogues.append(c)
        big = os.urandom(HUGE)
        fake = os.urandom(16)
        c.publish(topics.requests(b_site, fake), big, qos=1,
                  properties=_publish_props({}, os.urandom(16), topics.answers(fake, b_site))).wait_for_publish(120)
        c.publish(topics.presence(os.urandom(16)), big, qos=1, retain=True).wait_for_publish(120)
        del big
        assert _honest_traffic_arrives(a, ra, b_site, 1, 60), ra.stats
        grown = _vm(proc.pid, "VmHWM") - before
        assert grown <= GROWTH_BOUND_KB, f"B's peak RSS grew by {grown} KiB (bound {GROWTH_BOUND_KB} KiB)"


def test_oversized_bodies_past_the_inflight_window_do_not_stop_deliveries(broker, tmp_path):
    """mosquitto 2.0.11 keeps the in-flight slot of each QoS 1 PUBLISH it drops for a client's
    Maximum Packet Size; OVERSIZED of them (past the in-flight window) stopped every later
    delivery to the node. Its delivery watch probes after a quiet spell and reconnects when the
    probe does not come back, which frees them; the event says so."""
    topics = Topics(MESH)
    with _running_b(broker, tmp_path, SSP_AGENT_PROBE_QUIET_S="3", SSP_AGENT_PROBE_WAIT_S="3") as \
            (a, ra, hb, b_site, _proc, rogues):
        c = _rogue(broker)
        rogues.append(c)
        over = os.urandom(256 * 1024 + 4096)    # the default profile's body limit is 256 KiB
        infos = []
        for _ in range(OVERSIZED):
            fake = os.urandom(16)
            infos.append(c.publish(topics.requests(b_site, fake), over, qos=1,
                                   properties=_publish_props({}, os.urandom(16), topics.answers(fake, b_site))))
        for info in infos:
            info.wait_for_publish(60)
        assert _honest_traffic_arrives(a, ra, b_site, 1, 60), ra.stats
    assert any("deliveries stuck" in e for e in _events(hb, "link_lost")), _events(hb, "link_lost")


def test_a_probe_the_broker_takes_but_never_delivers_backs_off(tmp_path):
    """A broker that accepts the probe (PUBACK success) but never delivers it back (here an ACL
    that lets the node publish anywhere and read only presence) looks like stuck deliveries every time. The watch then
    doubles its quiet time after each reconnect that brought nothing fresh; the node's own
    presence, echoed back on every connection, is not fresh traffic (before, that echo set the
    quiet time back to its base, so the node reconnected, and republished its presence to the
    whole mesh, every quiet time + wait, for ever)."""
    from agent import inbox
    from agent.transport.broker import Broker
    from agent.transport.mqtt import MqttLink, MqttSettings
    site = os.urandom(16)
    acl = tmp_path / "acl"
    acl.write_text("topic write ssp/#\ntopic read ssp/+/+/presence\n")   # its inbox is never delivered
    with Broker(workdir=tmp_path / "b", extra_conf=f"acl_file {acl}") as br:
        link = MqttLink(MqttSettings.from_url(br.url, backoff_min_s=0.05, backoff_max_s=0.2), MESH, site,
                        presence_payload=lambda: b"hello")
        link._prober.watch = inbox.DeliveryWatch(quiet_s=1, wait_s=1)
        link.start()
        try:
            assert link.wait_connected(10)
            time.sleep(20)
            stuck = [d for _t, d in link.losses if "deliveries stuck" in d]
        finally:
            link.close()
    # quiet 1 s, 2 s, 4 s, 8 s (each + 1 s wait): 4 reconnects in 20 s; at a fixed quiet time, 10
    assert 2 <= len(stuck) <= 5, stuck
