"""A rogue broker client floods two running nodes while their owners keep writing (the outside
hostile run's broker flood): real `ssp-agent run` processes on a real mosquitto, honest writes
through the CLI (forwarded to each running agent), and one anonymous paho client publishing a
seeded mix into both nodes' inboxes and the presence topics: garbage and malformed bodies from
fictional senders, forged requests and answers under the honest peer's name with numbers that are
not numbers (`²`), presence of fictional sites and a retained poisoned presence of a member, and
large random payloads. The flood lasts as long as the writes do and at least N_FLOOD messages.

What must hold, counted, never timed: every write the CLI acknowledged reaches the other node
(waited for as an event), both nodes stay up and stop with exit 0 when told, their dumps are
equal, and the flood was taken in (each node refused bodies)."""
from __future__ import annotations

import json
import os
import random
import threading
import uuid

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from agent.transport.mqtt import Topics, _publish_props
from tests.cli_cmd import run_cli
from tests.reasons_catalogue import bad_messages, body, handshake
from tests.waiting import wait_until

from .helpers import MESH, T, make_nodes, start_run, stop_run, wait_serving

N_FLOOD = 1500          # messages at least (the outside run: 3 545 in 60 s)
WRITES = 8             # acknowledged writes on each node, made while the flood runs
POISON = "\u00b2"       # SUPERSCRIPT TWO: isdigit() yes, int() no


def flood_messages(rng: random.Random, a: bytes, b: bytes, topics: Topics):
    """(topic, payload, user properties, response topic, retain) forever, seeded."""
    catalogue = list(bad_messages(os.urandom(16)).values())
    while True:
        to, peer = (a, b) if rng.random() < 0.5 else (b, a)
        stranger = rng.randbytes(16)
        r = rng.random()
        if r < 0.30:     # garbage from a fictional sender
            yield topics.requests(to, stranger), rng.randbytes(rng.randrange(1, 4000)), {}, topics.answers(stranger, to), False
        elif r < 0.45:   # a malformed body of every shape the boundary names
            yield topics.requests(to, stranger), rng.choice(catalogue), {}, topics.answers(stranger, to), False
        elif r < 0.60:   # forged under the honest peer's name, its numbers not numbers
            user = {"ssp-body-limit": POISON, "ssp-count": POISON, "ssp-part": POISON + "/" + POISON}
            yield topics.requests(to, peer), body(peer), user, topics.answers(peer, to), False
        elif r < 0.70:   # a forged answer to the honest peer's bodies
            user = {"ssp-from": peer.hex(), "ssp-status": "ok", "ssp-processed": "1", "ssp-count": "1",
                    "ssp-rejected-at": POISON}
            yield topics.answers(peer, to), b"", user, None, False
        elif r < 0.85:   # presence of a fictional site
            yield topics.presence(stranger), handshake(stranger, rng.random() < 0.5), {}, None, False
        elif r < 0.87:   # the honest peer's presence, retained, with a body limit int() refuses
            yield topics.presence(peer), handshake(peer, True), {"ssp-body-limit": POISON}, None, True
        else:            # bulk: a large random payload
            yield topics.requests(to, stranger), rng.randbytes(rng.randrange(32_000, 200_000)), {}, None, False


def test_honest_writes_get_through_a_broker_flood_and_both_nodes_stay_up(broker, tmp_path):
    a, b = nodes = make_nodes(tmp_path, 2)
    homes = {"a": a.home, "b": b.home}
    sites = a.site_id, b.site_id
    for n in nodes:
        n.close()
    procs = {k: start_run(h, broker) for k, h in homes.items()}
    topics = Topics(MESH)
    evil = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"mallory-{uuid.uuid4().hex[:8]}", protocol=paho.MQTTv5)
    evil.connect(broker.host, broker.port)
    evil.loop_start()
    writes_done, sent = threading.Event(), [0]
    flood_error: list[BaseException] = []

    def flood() -> None:
        try:
            msgs = flood_messages(random.Random(4242), *sites, topics)
            while not (writes_done.is_set() and sent[0] >= N_FLOOD):
                info = None
                for _ in range(50):
                    topic, payload, user, resp, retain = next(msgs)
                    info = evil.publish(topic, payload, qos=1 if sent[0] % 2 else 0, retain=retain,
                                        properties=_publish_props(user, os.urandom(16), resp))
                    sent[0] += 1
                info.wait_for_publish(300)   # paho's own buffer stays small; the broker takes the rest
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            flood_error.append(e)

    flooder = threading.Thread(target=flood, daemon=True)
    acked: dict[str, set] = {"a": set(), "b": set()}
    try:
        for k, h in homes.items():
            wait_serving(h, procs[k])
        flooder.start()
        for i in range(WRITES):
            for k, h in homes.items():
                p = run_cli("--home", h, "write", T, "--key", json.dumps({"device": k, "seq": i}),
                            "--set", json.dumps({"temp": i + 0.5}))
                assert p.returncode == 0, (k, i, p.stderr[-2000:])
                acked[k].add((k, i))
                assert all(x.poll() is None for x in procs.values()), "a node died under the flood"
        writes_done.set()
        flooder.join(600)
        assert not flooder.is_alive() and not flood_error, flood_error
        assert sent[0] >= N_FLOOD

        def rows(h) -> set:
            for k, x in procs.items():
                assert x.poll() is None, (k, x.communicate()[1][-3000:])
            p = run_cli("--home", h, "dump")
            assert p.returncode == 0, p.stderr
            return {(r["key"]["device"], r["key"]["seq"]) for r in json.loads(p.stdout).get(T, [])}

        want = acked["a"] | acked["b"]
        wait_until(lambda: rows(homes["a"]) == want and rows(homes["b"]) == want,
                   "every acknowledged write on both nodes")
        dumps = [run_cli("--home", h, "dump").stdout for h in homes.values()]
        assert dumps[0] == dumps[1]
    finally:
        writes_done.set()
        evil.publish(topics.presence(sites[0]), b"", retain=True).wait_for_publish(60)
        evil.publish(topics.presence(sites[1]), b"", retain=True).wait_for_publish(60)
        evil.loop_stop()
        evil.disconnect()
        summaries = {k: stop_run(x) if x.poll() is None else x.communicate() for k, x in procs.items()}
    for k, s in summaries.items():
        assert isinstance(s, dict), (k, s)          # stopped by SIGTERM with exit 0 and its summary
        assert s["refused_bodies"] > 0, (k, s)      # the flood reached it and was refused
