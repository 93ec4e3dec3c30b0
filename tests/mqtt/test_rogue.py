"""A rogue client with broker access publishes garbage, oversized bodies, replays, forged events
and forged answers into a node's inbox: each is refused or dropped with its reason, and the
node's exchanges with honest peers keep flowing."""
from __future__ import annotations

import os
import time

import nacl.signing

from agent.core.codec import encode
from agent.simpeer import SimPeer
from agent.transport.mqtt import MqttLink, MqttSettings, Topics, _publish_props, wait_for

from tests.hostile.poison import DEEP_META, MIXED_KEY_BODY, shared_events_body, watermark_body

from .helpers import MESH, T, event_ids, make_nodes, runner, step_until, write
from tests.waiting import HANG_S


def test_rogue_inbox_traffic(broker, tmp_path):
    a, b = nodes = make_nodes(tmp_path, 2)
    ra = runner(a, broker, cadence_s=3600)
    rb = runner(b, broker, cadence_s=3600, realtime=False)
    rogue_site = os.urandom(16)
    rogue = MqttLink(MqttSettings.from_url(broker.url), MESH, rogue_site).start()
    assert rogue.wait_connected(5)
    topics = Topics(MESH)

    def send(payload: bytes, as_: bytes = rogue_site, **user) -> None:
        # Without broker ACLs the topic's sender segment is whatever the publisher writes.
        rogue.publish_raw(topics.requests(b.site_id, as_), payload,
                          _publish_props(user, os.urandom(16), topics.answers(as_, b.site_id)))

    try:
        # an honest exchange first, to replay it later
        e1 = write(a, 1, "honest")
        ra.batch_cycle()
        assert step_until([ra, rb], lambda: e1 in event_ids(b), 10)
        honest_body = SimPeer(MESH, site_id=a.site_id).body([a.conn.execute("SELECT unseal(event_id, raw) FROM events").fetchone()[0]])

        send(b"\xff\x00garbage")  # not CBOR
        send(encode([1, 2, 3]))  # CBOR, not a map
        send(encode({"ssp_version": 2, "from_site_id": "00" * 16}))  # unknown version
        send(b"\x00" * (rb.settings.body_limit_bytes + 1))  # oversized
        send(honest_body)  # a's body published under the rogue's name
        send(honest_body, as_=a.site_id)  # a replay, under a's name
        stranger = SimPeer(MESH)  # validly signed by a key nobody trusts
        forged = stranger.event(T, {"device": "evil", "seq": 1}, {"temp": 666.0}, (int(time.time() * 1000), 0))
        impostor = SimPeer(MESH, site_id=a.site_id, key=nacl.signing.SigningKey.generate())  # a's kid, wrong key
        forged2 = impostor.event(T, {"device": "evil", "seq": 2}, {"temp": 667.0}, (int(time.time() * 1000), 0))
        send(stranger.body([forged, forged2]), as_=stranger.site_id)
        send(honest_body, as_=a.site_id, **{"ssp-kind": "rt"})  # unsolicited, b has no realtime
        send(honest_body, as_=a.site_id, **{"ssp-meta": "{not json"})
        # Poison that crashed the node (RecursionError, TypeError, OverflowError on a
        # secure binding) and a retained poison presence every node receives at every start
        send(honest_body, as_=a.site_id, **{"ssp-meta": DEEP_META})
        send(MIXED_KEY_BODY, as_=a.site_id)
        send(watermark_body(a.site_id), as_=a.site_id)
        send(shared_events_body(2000, 1024), as_=a.site_id)
        rogue.client.publish(topics.presence(rogue_site), MIXED_KEY_BODY, qos=1, retain=True)
        # forged answers into a's inbox: unknown correlation, ignored (a's cursor cannot be moved)
        for _ in range(3):
            rogue.publish_raw(topics.answers(a.site_id, b.site_id), b"",
                              _publish_props({"ssp-status": "ok", "ssp-processed": "999999"}, os.urandom(16)))

        answers = []
        deadline = time.monotonic() + HANG_S
        while len(answers) < 5 and time.monotonic() < deadline:
            ra.step(0.01)
            rb.step(0.01)
            m = wait_for(rogue.inbound, "ans", 0.05)
            if m is not None:
                answers.append(m.props)
        expected = {"malformed_cbor", "not_a_map", "unknown_ssp_version", "too_large", "sender_mismatch",
                    "realtime_not_established", "bad_frame_meta", "bad_members"}

        def seen() -> bool:       # every refusal below is in (11 rejections, a refused presence)
            got = [r for r, _ in rb.rejections]
            return (expected <= set(got) and got.count("bad_frame_meta") == 2 and got.count("malformed_cbor") == 3
                    and rb.stats["refused_presence"] >= 1 and rb.stats["event:unknown_kid"] == 1
                    and rb.stats["event:bad_signature"] == 1 and rb.stats["duplicate"] >= 1)
        step_until([ra, rb], seen, 5)
        reasons = [r for r, _ in rb.rejections]
        assert expected <= set(reasons), reasons
        assert reasons.count("bad_frame_meta") == 2 and reasons.count("malformed_cbor") == 3
        assert rb.stats["refused_presence"] >= 1 and rogue_site not in rb.caps
        assert rb.stats["event:unknown_kid"] == 1 and rb.stats["event:bad_signature"] == 1
        assert rb.stats["duplicate"] >= 1  # the replay was absorbed
        assert {p.get("ssp-reason") for p in answers if p.get("ssp-status") == "rejected"} >= {
            "malformed_cbor", "too_large", "sender_mismatch"}
        surfaced = {s["reason"] for s in b.surfaced()}
        assert {"unknown_kid", "bad_signature"} <= surfaced
        assert not any(k["device"] == "evil" for k in (r["key"] for r in b.dump()[T]))
        assert ra.stats["unknown_answers"] >= 3 and ra.sync.cursor(b.site_id) <= a.conn.execute(
            "SELECT max(seq) FROM events").fetchone()[0]
        # honest exchanges keep flowing
        e2 = write(a, 2, "honest")
        e3 = write(b, 3, "honest")
        ra.batch_cycle(); rb.batch_cycle()
        assert step_until([ra, rb], lambda: e2 in event_ids(b) and e3 in event_ids(a), 10)
        assert a.dump() == b.dump()
    finally:
        rogue.close()
        ra.close(); rb.close()
        for n in nodes:
            n.close()


class _Forger:
    """A client that reads a node's inbox topics (no broker ACLs) and answers every body it sees
    first, with the real correlation data: `ssp-status: rejected, ssp-reason: too_large`, or
    (`ok=True`) `ssp-status: ok` with every event counted as processed."""

    def __init__(self, broker, watch: str, answerer: bytes, ok: bool = False) -> None:
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion
        self.forged = 0
        self.active = True
        self.answerer = answerer
        self.ok = ok
        self.c = paho.Client(CallbackAPIVersion.VERSION2, client_id="forger-" + os.urandom(4).hex(),
                             protocol=paho.MQTTv5)
        self.c.on_message = self._on_message
        self.c.connect(broker.host, broker.port)
        self.c.subscribe(watch, qos=1)
        self.c.loop_start()

    def _on_message(self, client, userdata, msg) -> None:
        p = msg.properties
        if not self.active or not getattr(p, "ResponseTopic", None):
            return
        self.forged += 1
        user = dict(getattr(p, "UserProperty", None) or [])
        if self.ok:
            n = user.get("ssp-count", "0")
            answer = {"ssp-from": self.answerer.hex(), "ssp-status": "ok", "ssp-processed": n, "ssp-count": n,
                      "ssp-start": user.get("ssp-start", ""), "ssp-end": user.get("ssp-end", ""),
                      "ssp-applied": n, "ssp-duplicate": "0", "ssp-dropped": "0", "ssp-rejected": "0"}
        else:
            answer = {"ssp-from": self.answerer.hex(), "ssp-status": "rejected", "ssp-reason": "too_large"}
        client.publish(p.ResponseTopic, b"", qos=1, properties=_publish_props(answer, p.CorrelationData))

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def test_forged_too_large_answers_cannot_shrink_bodies_for_good(broker, tmp_path):
    """Forged `too_large` answers halved a sender's body limit down to 1 KiB for
    good. Now a reduction is provisional (PeerLimit): once the forger stops, the limit probes
    back up to the link's maximum, and the events flow meanwhile."""
    a, b = nodes = make_nodes(tmp_path, 2)
    rb = runner(b, broker, cadence_s=3600, realtime=False)
    rb.close()  # b is away: its broker session queues bodies for it, and only the forger answers
    ra = runner(a, broker, cadence_s=0.1, realtime=False)
    ra.cfg.limit_probe_s, ra.cfg.limit_probe_max_s = 0.2, 0.8  # (unknown to the code before the fix)
    forger = _Forger(broker, Topics(MESH).requests(b.site_id, a.site_id), b.site_id)
    try:
        for i in range(40):
            write(a, i, "w")
        top = ra.link.max_payload()
        assert step_until([ra], lambda: ra._limit(b.site_id) == 1024, 20), ra.stats  # the forger got there
        forger.active = False
        rb = runner(b, broker, cadence_s=3600, realtime=False)
        assert step_until([ra, rb], lambda: event_ids(a) <= event_ids(b), 20)
        assert step_until([ra, rb], lambda: ra._limit(b.site_id) == top, 30), (ra.peer_limit, ra.stats)
        assert forger.forged >= 8 and ra.stats["body_limit_recovered"] >= 1
        assert a.dump() == b.dump()
    finally:
        forger.close()
        ra.close(); rb.close()
        for n in nodes:
            n.close()


def test_forged_ok_answers_do_not_move_the_cursor(broker, tmp_path):
    """Without broker ACLs a client that reads B's inbox answers A's bodies
    first with `ok` and the real correlation data. B never had a session, so the broker dropped
    the bodies: before the fix A's cursor moved past events B never got, and B never got them
    (until a rehydration). Now the cursor moves only on an answer carrying an acknowledgement
    record signed by B (docs/protocol.md §5 "Acknowledgements on MQTT"): the forgeries are counted
    and ignored, and once B is there it gets everything."""
    a, b = nodes = make_nodes(tmp_path, 2)
    ra = runner(a, broker, cadence_s=0.1, answer_timeout_s=0.5, realtime=False)
    rb = None
    forger = _Forger(broker, Topics(MESH).requests(b.site_id, a.site_id), b.site_id, ok=True)
    try:
        for i in range(30):
            write(a, i, "w")
        # B is away: A sends its window once (quiet links, docs/mqtt.md) and an unproven answer is
        # no evidence that B is there, so each forgery is of a body A sent once.
        step_until([ra], lambda: ra.stats["answers_unproven"] >= 1 or ra.sync.cursor(b.site_id) > 0, 20)
        for _ in range(50):
            ra.step(0.01)
        assert ra.sync.cursor(b.site_id) == 0, (ra.sync.cursor(b.site_id), ra.stats)
        assert ra.stats["answers_unproven"] >= 1 and ra.stats["events_acknowledged"] == 0
        forger.active = False
        rb = runner(b, broker, cadence_s=3600, realtime=False)
        assert step_until([ra, rb], lambda: event_ids(a) <= event_ids(b), 20), (ra.stats, ra.sync.cursor(b.site_id))
        top = a.conn.execute("SELECT max(seq) FROM events").fetchone()[0]
        assert step_until([ra, rb], lambda: ra.sync.cursor(b.site_id) == top, 10), ra.stats
        assert a.dump() == b.dump()
    finally:
        forger.close()
        ra.close()
        if rb is not None:
            rb.close()
        for n in nodes:
            n.close()


def test_replayed_acks_move_nothing_and_the_peers_own_answer_still_counts(broker, tmp_path):
    """A reader of both inbox directions captures B's genuine answer (with its signed
    acknowledgement of one body) and replays it, first, as the answer to every later body. The
    record names another body's hash: each replay is counted and ignored, the body stays pending,
    and B's own answer, arriving after the replay, moves the cursor."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion
    a, b = nodes = make_nodes(tmp_path, 2)
    ra = runner(a, broker, cadence_s=0.2, answer_timeout_s=5.0, realtime=False)
    rb = runner(b, broker, cadence_s=3600, realtime=False)
    topics = Topics(MESH)
    state = {"captured": None, "active": False, "replayed": 0}

    def on_message(client, userdata, msg):
        p = msg.properties
        if msg.topic == topics.answers(a.site_id, b.site_id):
            if state["captured"] is None and msg.payload:
                state["captured"] = msg.payload  # B's first genuine answer
            return
        if state["active"] and getattr(p, "ResponseTopic", None):
            state["replayed"] += 1
            n = dict(p.UserProperty).get("ssp-count", "0")
            client.publish(p.ResponseTopic, state["captured"], qos=1, properties=_publish_props(
                {"ssp-from": b.site_id.hex(), "ssp-status": "ok", "ssp-processed": n, "ssp-count": n},
                p.CorrelationData))

    c = paho.Client(CallbackAPIVersion.VERSION2, client_id="replayer", protocol=paho.MQTTv5)
    c.on_message = on_message
    c.connect(broker.host, broker.port)
    c.subscribe([(topics.answers(a.site_id, b.site_id), 1), (topics.requests(b.site_id, a.site_id), 1)])
    c.loop_start()
    try:
        e1 = write(a, 0, "first")
        ra.batch_cycle()
        assert step_until([ra, rb], lambda: e1 in event_ids(b) and state["captured"] is not None
                          and ra.sync.cursor(b.site_id) >= 1, 10), ra.stats
        state["active"] = True
        for i in range(1, 25):
            write(a, i, "w")
        top = a.conn.execute("SELECT max(seq) FROM events").fetchone()[0]
        assert step_until([ra, rb], lambda: ra.sync.cursor(b.site_id) == top, 20), (ra.stats, rb.stats)
        assert state["replayed"] >= 1 and ra.stats["answers_unproven"] >= 1, (state, ra.stats)
        assert event_ids(a) <= event_ids(b) and a.dump() == b.dump()
        assert rb.stats["acks_signed"] >= 1 and ra.stats["unknown_answers"] == 0
    finally:
        c.loop_stop()
        c.disconnect()
        ra.close(); rb.close()
        for n in nodes:
            n.close()
