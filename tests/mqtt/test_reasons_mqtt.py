"""Every reason code MQTT can reach (tests/reasons_catalogue.py MQTT_CODES) shows in
`ssp-agent events` under its one name (agent/core/reasons.py): bodies a rogue publishes into a
node's inbox and handshakes on presence topics, against a real mosquitto."""
from __future__ import annotations

import os

from agent.core import reasons as R
from agent.transport.mqtt import MqttLink, MqttSettings, Topics, _publish_props

from ..reasons_catalogue import MQTT_CODES, bad_messages, body, handshake
from ..sync.test_reasons_surface import events_reasons
from .helpers import MESH, make_nodes, runner, step_until


def test_every_mqtt_code_shows_in_events(broker, tmp_path):
    a, b = nodes = make_nodes(tmp_path, 2)
    rb = runner(b, broker, cadence_s=3600, realtime=False)
    rogue_site, stranger, liar = os.urandom(16), os.urandom(16), os.urandom(16)
    rogue = MqttLink(MqttSettings.from_url(broker.url), MESH, rogue_site).start()
    assert rogue.wait_connected(5)
    topics = Topics(MESH)

    def send(payload: bytes, as_: bytes = a.site_id, **user) -> None:
        rogue.publish_raw(topics.requests(b.site_id, as_), payload,
                          _publish_props(user, os.urandom(16), topics.answers(as_, b.site_id)))

    home = b.home
    try:
        sent = {code: msg for code, msg in bad_messages(a.site_id).items()}
        for msg in sent.values():
            send(msg)
        send(b"\x00" * (rb.settings.body_limit_bytes + 1))
        send(body(stranger))                                       # a body naming someone else than its topic
        send(body(a.site_id), **{"ssp-kind": "rt"})                # realtime, b has none
        send(body(a.site_id), **{"ssp-meta": '{"s":0,"e":0,"d":[1],"g":[],"x":0}'})
        send(body(a.site_id), **{"ssp-kind": "sideways"})
        rogue.client.publish(topics.presence(liar), handshake(stranger), qos=1, retain=True)
        rogue.client.publish(topics.presence(stranger), body(stranger), qos=1, retain=True)
        want = set(sent) | {R.TOO_LARGE, R.SENDER_MISMATCH, R.REALTIME_NOT_ESTABLISHED, R.BAD_FRAME_META,
                            R.UNKNOWN_KIND, R.HANDSHAKE_SITE_MISMATCH, R.NOT_A_HANDSHAKE}
        assert want == MQTT_CODES
        assert step_until([rb], lambda: want <= {r for r, _ in rb.rejections} | {
            s["reason"] for s in b.surfaced() if s["kind"] == "refused"}, 20)
    finally:
        for t in (topics.presence(liar), topics.presence(stranger)):
            rogue.client.publish(t, b"", qos=1, retain=True)
        rogue.close()
        rb.close()
        for n in nodes:
            n.close()
    seen = events_reasons(home)
    assert {c: seen.get(c) for c in sorted(MQTT_CODES)} == {
        c: {"presence"} if c in (R.HANDSHAKE_SITE_MISMATCH, R.NOT_A_HANDSHAKE) else {"mqtt_request"}
        for c in sorted(MQTT_CODES)}
