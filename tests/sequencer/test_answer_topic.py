"""`sequencer run` answers only on a member's own answer topic (`sovm-member/MEMBER_ID/answers`,
docs/sequencer.md "Serving through the broker"): a request naming any other response topic (the
retained `accepted` topic every member follows, a `discontinuity` topic, anything else) is refused,
acknowledged, counted and surfaced in `sequencer status`, never answered there. Real mosquitto,
real `sequencer run`."""
from __future__ import annotations

import json
import queue
import uuid

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from test_broker_sizes import agent, serving, stop
from test_run_broker import G

CEILING_S = 120   # only catches a hang


def test_a_request_naming_a_topic_not_its_own_gets_no_answer_there(tmp_path, broker):
    seen: "queue.Queue" = queue.Queue()
    rogue = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"mallory-{uuid.uuid4().hex[:8]}",
                        protocol=paho.MQTTv5)
    rogue.on_message = lambda _c, _u, msg: seen.put((msg.topic, bytes(msg.payload), msg.retain))
    rogue.connect(broker.host, broker.port)
    rogue.loop_start()
    own = "sovm-member/mallory/answers"
    foreign = [f"sovm-seq/{G.hex()}/accepted", f"sovm-seq/{G.hex()}/discontinuity/0", "elsewhere/x",
               "sovm-member/+/answers", "sovm-member/alice/answers/more", "sovm-member//answers"]
    with serving(tmp_path, broker.url, broker.port) as (home, proc, member):
        rogue.subscribe([(f"sovm-seq/{G.hex()}/#", 1), ("elsewhere/#", 1), ("sovm-member/#", 1)])
        for i, topic in enumerate(foreign * 3):
            p = Properties(PacketTypes.PUBLISH)
            p.ResponseTopic = topic
            p.CorrelationData = b"%d" % i
            rogue.publish(f"sovm-seq/{G.hex()}/receipt", b"0", qos=1, properties=p).wait_for_publish(CEILING_S)
        # a request on the rogue's own answer topic, sent after them: answered, and the
        # sequencer's answers reach a subscriber in order, so nothing of the earlier ones is left
        p = Properties(PacketTypes.PUBLISH)
        p.ResponseTopic, p.CorrelationData = own, b"own"
        rogue.publish(f"sovm-seq/{G.hex()}/receipt", b"0", qos=1, properties=p).wait_for_publish(CEILING_S)
        got = []
        while True:
            topic, payload, retain = seen.get(timeout=CEILING_S)
            if topic.rsplit("/", 1)[-1] in ("receipt", "register") or topic == member.reply_to:
                continue    # the requests themselves, and the honest member's answers
            got.append(topic)
            if topic == own:
                break
        assert got == [own], got
        assert json.loads(payload) == {"receipt": None, "absent": True, "discontinuity": False}
        # the honest member still has its answers
        assert member.request(f"sovm-seq/{G.hex()}/receipt", b"0") == {"receipt": None, "absent": True,
                                                                        "discontinuity": False}
        st = agent(home, "sequencer", "status")
        assert st.returncode == 0, st.stderr
        refused = [e for e in json.loads(st.stdout)["events"] if e["kind"] == "answer_topic_refused"]
        assert refused and refused[0]["topic"] == foreign[0] and refused[0]["request"] == "receipt", refused
    rogue.loop_stop()
    rogue.disconnect()
    out = proc.stdout.read()
    assert json.loads(out.strip().splitlines()[-1])["answer_topics_refused"] == len(foreign) * 3
    stop(proc)
