"""A member replaying one body over and over on the default (non-secure) binding, asking for a
signed acknowledgement each time (docs/reliability.md "Hostile-peer
strategies"): each replay cost the receiver a fresh Ed25519 signature and its journal fsyncs
(persist-before-release), so a cheap replay bought expensive work. Now a body whose exact bytes
were already acknowledged to that sender, with the same outcome, is answered with the record
already released (docs/protocol.md §5: it states exactly what is true of those bytes)."""
from __future__ import annotations

import os
import time

from agent.core.records import record_hash as body_hash
from agent.core.messages import parse_body
from agent.core.records import is_ack, verify_ack
from agent.simpeer import SimPeer
from agent.transport.mqtt import MqttLink, MqttSettings, Topics, _publish_props, wait_for

from .helpers import MESH, event_ids, make_nodes, runner, step_until, write
from tests.waiting import HANG_S

REPLAYS = 6


def test_a_replayed_body_costs_no_new_signature(broker, tmp_path):
    a, b = make_nodes(tmp_path, 2)
    rb = runner(b, broker, cadence_s=3600, realtime=False)
    # M: a member (a's name, in b's keyring) with broker access, no runner of its own.
    m = MqttLink(MqttSettings.from_url(broker.url), MESH, a.site_id).start()
    assert m.wait_connected(5)
    topics = Topics(MESH)
    e1 = write(a, 1, "old")
    body = SimPeer(MESH, site_id=a.site_id).body(
        [a.conn.execute("SELECT unseal(event_id, raw) FROM events").fetchone()[0]])

    def publish_and_answer(payload: bytes):
        m.publish_raw(topics.requests(b.site_id, a.site_id), payload,
                      _publish_props({"ssp-ack": "1"}, os.urandom(16), topics.answers(a.site_id, b.site_id)))
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline:
            rb.step(0.01)  # one pump per body: nothing is grouped with another replay
            got = wait_for(m.inbound, "ans", 0.05)
            if got is not None:
                return got
        raise AssertionError(f"no answer {rb.stats}")

    def proof(ans, payload: bytes):
        """The answer's acknowledgement record for `payload`, verified as the sender does."""
        for raw in parse_body(ans.payload).records:
            if is_ack(raw):
                ack = verify_ack(raw, MESH, lambda kid: a.keyring.get(kid))
                assert ack.issuer == b.site_id and ack.subject == a.site_id
                return ack.answer_for(body_hash(payload)), bytes(raw)
        raise AssertionError("the answer carries no acknowledgement")

    try:
        records = []
        for i in range(REPLAYS):
            if i == 1:
                fsyncs = b.bridge.journal_stats()["fsyncs"]  # the first answer's signature is made
            ans = publish_and_answer(body)
            assert ans.props["ssp-status"] == "ok" and ans.props["ssp-processed"] == "1", ans.props
            answered, raw = proof(ans, body)
            assert answered is not None and (answered.processed, answered.count, answered.rejected) == (1, 1, ())
            records.append(raw)
        assert e1 in event_ids(b) and rb.stats["duplicate"] == REPLAYS - 1, rb.stats
        # One signature for the body, whatever the number of replays (was one per replay).
        assert rb.stats["acks_signed"] == 1, rb.stats
        assert rb.stats["acks_reserved"] == REPLAYS - 1, rb.stats
        assert len(set(records)) == 1
        # ... and no journal work for the replays (persist-before-release: two fsyncs a signature).
        assert b.bridge.journal_stats()["fsyncs"] == fsyncs, b.bridge.journal_stats()
        # A body with other bytes is acknowledged afresh: a kept record names only its own body.
        e2 = write(a, 2, "new")
        body2 = SimPeer(MESH, site_id=a.site_id).body(
            [r[0] for r in a.conn.execute("SELECT unseal(event_id, raw) FROM events ORDER BY seq")])
        ans = publish_and_answer(body2)
        answered, raw = proof(ans, body2)
        assert answered is not None and answered.count == 2 and answered.processed == 2
        assert raw not in records and rb.stats["acks_signed"] == 2, rb.stats
        assert step_until([rb], lambda: e2 in event_ids(b), 5)
    finally:
        m.close()
        rb.close()
