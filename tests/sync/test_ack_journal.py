"""MQTT acknowledgements (`sovm/ssp-ack-v1`) are signed through the keystore bridge but stored
nowhere: a reopen after they were released neither re-applies them (no `record_dropped` row) nor
keeps them in the signing journal."""
from __future__ import annotations

import os

from agent.core.cose import content_type
from agent.core.records import ACK, AckAnswer, verify_ack
from agent.sync_port import PortAdapter

from .helpers import mesh, reopen


def test_released_acks_leave_the_journal_and_are_not_recovered(tmp_path, monkeypatch):
    import agent.produce
    # compaction on open runs past this size or after a recovery (docs/keystore.md): here, always
    monkeypatch.setattr(agent.produce, "JOURNAL_OPEN_COMPACT_BYTES", 0)
    a, b = mesh(tmp_path, 2)
    pa = PortAdapter(a)
    raws = [pa.sign_ack(b.site_id, [AckAnswer(os.urandom(32), 1, 2, (1,))]) for _ in range(3)]
    ack = verify_ack(raws[0], a.mesh_id, b.keyring.get)  # b verifies it under a's key
    assert ack.issuer == a.site_id and ack.subject == b.site_id
    assert sum(content_type(r) == ACK for _i, r in a.bridge.iter_released()) == 3
    a = reopen(a)  # as after a crash right after the release: recovery and compaction run
    assert not any(content_type(r) == ACK for _i, r in a.bridge.iter_released())
    assert not [s for s in a.surfaced() if s["kind"] == "record_dropped"]
    for n in (a, b):
        n.close()


def test_an_answer_stuffed_with_acknowledgements_costs_a_few_checks(tmp_path):
    """Runner._proof looks at MAX_ACKS_LOOKED_AT acknowledgement records per answer: a forged
    answer carrying hundreds costs no more signature checks than that, and moves nothing."""
    from agent.core.messages import SyncBody, emit_body
    from agent.core.records import record_hash
    from agent.runner import MAX_ACKS_LOOKED_AT, Runner, RunConfig, _Pending
    from agent.transport.mqtt import MqttSettings
    a, b = mesh(tmp_path, 2)
    r = Runner(a, MqttSettings(host="127.0.0.1", port=1), RunConfig(realtime=False))
    body = b"the body a sent"
    p = _Pending(b.site_id, "batch", 0, 1, [1], 0.0, 0, False, None, len(body), record_hash(body))
    junk = [PortAdapter(b).sign_ack(a.site_id, [AckAnswer(os.urandom(32), 1, 1, ())]) for _ in range(3)]
    stuffed = emit_body(SyncBody(b.site_id, (0, 0), (), tuple(junk * 100), ()))
    assert r._proof(p, stuffed) is None
    assert sum(v for k, v in r.stats.items() if k.startswith("ack_")) == 0  # valid, other bodies
    genuine = PortAdapter(b).sign_ack(a.site_id, [AckAnswer(record_hash(body), 1, 1, ())])
    assert r._proof(p, emit_body(SyncBody(b.site_id, (0, 0), (), tuple(junk * 100) + (genuine,), ()))) is None
    assert r._proof(p, emit_body(SyncBody(b.site_id, (0, 0), (), (genuine,), ()))) is not None
    tampered = bytearray(junk[0])
    tampered[-1] ^= 1
    r._proof(p, emit_body(SyncBody(b.site_id, (0, 0), (), (bytes(tampered),) * 200, ())))
    assert r.stats["ack_refused:bad_signature"] == MAX_ACKS_LOOKED_AT
    for n in (a, b):
        n.close()
