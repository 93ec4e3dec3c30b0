"""MQTT acknowledgements (`sovm/ssp-ack-v1`) are signed through the keystore bridge but stored
nowhere: a reopen after they were released neither re-applies them (no `record_dropped` row) nor
keeps them in the signing journal."""
from __future__ import annotations

import os

from agent.core.cose import content_type
from agent.core.records import ACK, AckAnswer, verify_ack
from agent.sync import PortAdapter

from .helpers import mesh, reopen


def test_released_acks_leave_the_journal_and_are_not_recovered(tmp_path):
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
