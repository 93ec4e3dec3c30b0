"""A flood of requests a running node refuses, each asking for an answer (docs/mqtt.md "Memory
bound", "Answers under a flood").

The node answers every request on its inbox topic, refusals included, as a QoS 1 publish on the
connection that reads the requests. paho keeps each one (its MQTT 5 Properties, ~8 KB resident)
until the broker's PUBACK, and under a flood those PUBACKs come behind the flood on the same
socket: the answers piled up in paho. Before: 20 000 small QoS 0 requests (each a malformed body
from a fictional sender, with a response topic `answer()` accepts) grew `run`'s peak resident set
by 173 MiB. Now a refusal's answer (a courtesy) is not published while the link's unacknowledged
publishes hold their bound (`mqtt.UNACKED_BYTES`, `mqtt.UNACKED_ITEMS`); every request is still
handled and an honest peer's body is still answered.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from agent.transport.mqtt import Topics
from tests.cli_cmd import agent_cmd, agent_env, run_cli

from .helpers import MESH, make_nodes, pump_for, runner, step_until, write

N = 20000
# what `run` may grow by: the link's unacknowledged publishes (8 MiB) and the flood's records in the
# link's inbox and the intake, as far as this flood fills them; measured 6-12 MiB, 173 MiB before
GROWTH_KIB = 32 << 10


def _peak_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def _refused(home: str) -> int:
    """Bodies the running node refused so far (its `status`, served by `run`)."""
    p = run_cli("--home", home, "status", timeout=60)
    return json.loads(p.stdout)["run"]["refused_bodies"] if p.returncode == 0 else -1


class Mallory:
    """A broker client that may publish anything: requests into the node's inbox under fictional
    names, each with the Response Topic and Correlation Data the node answers on (counted)."""

    def __init__(self, port: int, site: bytes) -> None:
        self.topics, self.site = Topics(MESH), site
        self.answers, self.presence = [], []
        c = self.c = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"mallory-{uuid.uuid4().hex[:8]}",
                                 protocol=paho.MQTTv5)
        c.on_message = lambda _c, _u, m: (self.presence if m.topic.endswith("/presence") else self.answers).append(1)
        c.connect("127.0.0.1", port)
        c.loop_start()
        c.subscribe([(self.topics.presence(site), 1), (f"ssp/{MESH.hex()}/+/inbox/ans/{site.hex()}", 1)])

    def flood(self, n: int) -> None:
        """``n`` malformed bodies at QoS 0 (no Receive Maximum counts them), as fast as the broker
        takes them, each from a fresh fictional sender asking for its answer."""
        for _ in range(n):
            s = os.urandom(16)
            p = Properties(PacketTypes.PUBLISH)
            p.ResponseTopic = self.topics.answers(s, self.site)
            p.CorrelationData = os.urandom(16)
            info = self.c.publish(self.topics.requests(self.site, s), b"\xff\x00", qos=0, properties=p)
            while len(self.c._out_packet) > 2000:      # keep this client's own buffer small
                time.sleep(0.001)
        info.wait_for_publish(60)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def test_a_flood_of_refused_requests_leaves_run_s_memory_bounded_and_honest_bodies_answered(broker, tmp_path):
    a, b = make_nodes(tmp_path, 2)
    hb, site = str(b.home), b.site_id
    b.close()
    proc = subprocess.Popen([*agent_cmd(), "--home", hb, "run", "--broker", broker.url, "--cadence", "3600"],
                            env=agent_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    evil = Mallory(broker.port, site)
    ra = runner(a, broker, cadence_s=3600, realtime=False, answer_timeout_s=600)
    try:
        deadline = time.monotonic() + 30
        while not evil.presence and time.monotonic() < deadline:   # run is connected and subscribed
            time.sleep(0.1)
        assert evil.presence, "the node never published its presence"
        before = _peak_kib(proc.pid)
        evil.flood(N)
        # an honest body while the node works through the flood: its answer must go out
        ids = {write(a, i, "honest") for i in range(3)}
        ra.batch_cycle()
        assert step_until([ra], lambda: ra.stats["events_acknowledged"] >= len(ids), 120), ra.stats
        deadline = time.monotonic() + 240
        while (done := _refused(hb)) < N and time.monotonic() < deadline:
            time.sleep(1)
        grew = _peak_kib(proc.pid) - before
        assert done == N, f"{done} of {N} requests handled"
        assert proc.poll() is None
        assert evil.answers, "no refusal was answered"      # courtesy, while there is room
    finally:
        evil.close()
        ra.close()
        a.close()
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert grew < GROWTH_KIB, f"run grew {grew >> 10} MiB under {N} refused requests ({len(evil.answers)} answered)"


@pytest.mark.parametrize("secure", [False, True], ids=["signed_ack", "secure_binding"])
def test_past_the_bound_only_courtesy_answers_are_left_out(broker, tmp_path, secure):
    """With the link's unacknowledged publishes at their bound, a refusal and a body from a sender
    outside the keyring are handled and acknowledged but not answered (counted); a member's body
    is still answered, so its sender's cursor moves: with its signed acknowledgement (grouped per
    sender), and on a secure binding (answered at once)."""
    from agent.simpeer import SimPeer
    from agent.transport.mqtt import MqttLink, MqttSettings, _publish_props, wait_for
    a, b = nodes = make_nodes(tmp_path, 2)
    ra = runner(a, broker, cadence_s=3600, realtime=False, secure=secure)
    rb = runner(b, broker, cadence_s=3600, realtime=False, secure=secure)
    rb.link.unacked.max_items = 0          # held: as under a flood whose PUBACKs wait behind it
    stranger = SimPeer(MESH)
    rogue = MqttLink(MqttSettings.from_url(broker.url), MESH, stranger.site_id).start()
    assert rogue.wait_connected(5)
    topics = Topics(MESH)
    try:
        for payload in (b"\xff\x00", stranger.body([])):   # refused (malformed_cbor); an empty body, absorbed
            rogue.publish_raw(topics.requests(b.site_id, stranger.site_id), payload,
                              _publish_props({}, os.urandom(16), topics.answers(stranger.site_id, b.site_id)))
        ids = {write(a, i, "honest") for i in range(3)}
        ra.batch_cycle()
        assert step_until([ra, rb], lambda: ra.stats["events_acknowledged"] >= len(ids)
                          and rb.stats["courtesy_answers_dropped"] == 2, 20), (ra.stats, rb.stats)
        assert rb.stats["rejected_bodies"] == 1 and wait_for(rogue.inbound, "ans", 1) is None
        # every request was acknowledged to the broker: none comes back on the next connection
        rb.link.unacked.max_items = 1024
        pump_for([rb], 1)    # the acknowledgements are written
        rb.close()
        rb = runner(b, broker, cadence_s=3600, realtime=False, secure=secure)
        pump_for([rb], 2)
        assert rb.stats["bodies_received"] == 0, rb.stats
    finally:
        rogue.close()
        ra.close()
        rb.close()
        for n in nodes:
            n.close()
