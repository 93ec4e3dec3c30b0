"""What a flood into a node's inbox can make `run` hold in memory (docs/mqtt.md "Memory bound").

Before: what the link took from the broker waited in an unbounded queue, and each pump moved up to
10 000 of those messages into the intake, whose queue of messages from sites outside the keyring
was unbounded too; the bound was meant to come from the broker's Receive Maximum, which counts no
QoS 0 publish (and which mosquitto 2.0.11 overran once the node acknowledged some). A client that
may only publish pushed a running node from 36 MiB to 6.0 GiB in 25 s with QoS 0 copies of one
well-formed 160 KB body signed by a site outside the keyring (each costs the node about 33 ms), and
to 4.3 GiB with QoS 1. Now both queues are bounded in bytes: paho's network thread waits for room
(agent/inbox.py: TCP pushes back on the broker) and the pump takes from the link only while the
intake holds less than its budget.
"""
from __future__ import annotations

import os
import time
import uuid

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.transport.mqtt import Topics

from .helpers import MESH, event_ids, make_nodes, runner, step_until, write
from tests.waiting import HANG_S

BODY = 200 * 1024        # under the nodes' body limit (256 KiB), so the link keeps every payload
N = 200                  # 40 MB in all
LINK_BUDGET, INTAKE_BUDGET = 2 << 20, 4 << 20


@pytest.mark.parametrize("carried_in", ["payload", "user_properties"])
def test_a_qos0_flood_waits_within_the_link_and_intake_budgets(broker, tmp_path, carried_in):
    """The bytes are counted wherever a message carries them: a small payload with 200 KiB of
    MQTT user properties holds as much memory as a 200 KiB payload (before the count included
    them, such a flood passed the byte budgets as 512 bytes a message)."""
    a, b = nodes = make_nodes(tmp_path, 2)
    ra = runner(a, broker, cadence_s=3600, realtime=False)
    rb = runner(b, broker, cadence_s=3600, realtime=False)
    rb.link.inbound.budget = LINK_BUDGET
    rb.intake.budget = INTAKE_BUDGET
    rb.cfg.others_per_step = 4
    evil = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"mallory-{uuid.uuid4().hex[:8]}", protocol=paho.MQTTv5)
    evil.connect("127.0.0.1", broker.port)
    evil.loop_start()
    topics = Topics(MESH)
    try:
        assert step_until([ra, rb], lambda: a.site_id in rb.caps, 5)
        for _ in range(N):   # QoS 0: no Receive Maximum counts these
            if carried_in == "payload":
                info = evil.publish(topics.requests(b.site_id, os.urandom(16)), os.urandom(BODY), qos=0)
            else:
                props = Properties(PacketTypes.PUBLISH)
                props.UserProperty = [(f"k{i}", "v" * 1020) for i in range(BODY // 1024)]
                info = evil.publish(topics.requests(b.site_id, os.urandom(16)), b"x", qos=0, properties=props)
        info.wait_for_publish(60)
        # b's loop takes nothing meanwhile: what its link took from the broker is what waits
        time.sleep(3)
        waiting = rb.link.inbound.qsize()
        assert waiting * BODY <= LINK_BUDGET + BODY, f"{waiting} bodies ({waiting * BODY >> 20} MiB) wait in the link"
        # one step: the pump takes into the intake only up to its budget
        rb.step(0.01)
        held = len(rb.intake.others)
        assert held * BODY <= INTAKE_BUDGET + BODY, f"{held} bodies ({held * BODY >> 20} MiB) wait in the intake"
        assert rb.intake.held <= INTAKE_BUDGET + BODY + 4096
        # the flood is worked through in its turn, and an honest body still arrives
        ids = {write(a, i, "honest") for i in range(3)}
        ra.batch_cycle()
        assert step_until([ra, rb], lambda: ids <= event_ids(b), 120), rb.stats
        assert step_until([ra, rb], lambda: rb.stats["rejected_bodies"] >= N, 120), rb.stats
        assert rb.link.inbound.held == 0 or rb.link.inbound.qsize() > 0
    finally:
        evil.loop_stop()
        evil.disconnect()
        ra.close()
        rb.close()
        for n in nodes:
            n.close()


def _peak_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_run_holds_a_flood_of_well_formed_bodies_within_its_budgets(broker, tmp_path):
    """Through the installed command: 1 500 QoS 0 copies of one well-formed sync body signed by a
    site of the mesh outside the keyring (each costs the node real work) leave `run`'s peak memory
    within its budgets (link 8 MiB, intake 64 MiB), and SIGTERM still stops it with exit 0.
    Before: the node kept taking the flood while it worked through it (6.0 GiB in 25 s)."""
    import signal
    import subprocess

    from agent.node import Node
    from agent.sync import export_mailbox_body
    from tests.cli_cmd import agent_cmd, agent_env

    from .helpers import MANIFEST, T
    a, b = make_nodes(tmp_path, 2)
    rogue = Node.init(tmp_path / "rogue", MANIFEST)[0]          # same mesh, in nobody's keyring
    rogue.add_peer(b.site_id, b.keyring[b.site_id][0], None)
    for i in range(500):
        rogue.write(T, {"device": "rogue", "seq": i}, {"temp": float(i), "note": "x" * 60})
    export_mailbox_body(rogue, b.site_id, tmp_path / "body")
    body = (tmp_path / "body").read_bytes()
    assert 64 * 1024 < len(body) < 256 * 1024
    hb, rogue_site = str(b.home), rogue.site_id
    for n in (a, b, rogue):
        n.close()
    proc = subprocess.Popen([*agent_cmd(), "--home", hb, "run", "--broker", broker.url, "--cadence", "1"],
                            env=agent_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    evil = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"mallory-{uuid.uuid4().hex[:8]}", protocol=paho.MQTTv5)
    evil.connect("127.0.0.1", broker.port)
    evil.loop_start()
    try:
        topics = Topics(MESH)
        seen = []
        evil.on_message = lambda c, u, m: seen.append(m.topic) if m.payload else None
        evil.subscribe(topics.presence(b.site_id), qos=1)
        deadline = time.monotonic() + HANG_S
        while not seen and time.monotonic() < deadline:   # b is connected and subscribed
            time.sleep(0.1)
        assert seen, "the node never published its presence"
        before = _peak_kib(proc.pid)
        for _ in range(1500):
            info = evil.publish(topics.requests(b.site_id, rogue_site), body, qos=0)
            while len(evil._out_packet) > 200:      # keep this client's own buffer small
                time.sleep(0.001)
        info.wait_for_publish(120)
        time.sleep(5)
        grown = _peak_kib(proc.pid) - before
        assert proc.poll() is None
        assert grown < 150 * 1024, f"run's peak memory grew by {grown >> 10} MiB under the flood"
    finally:
        evil.loop_stop()
        evil.disconnect()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
