"""Local writes (issue 15 item 4): `Node.write_many` applies the events it just built and released
through the one apply path without parsing, verifying and decoding them again, and the journal's
compaction knows they are logged without reading them back. What must not change: an event signed
under a key that is not this node's keyring key is never stored (the apply path's check still
decides), and what the log holds is byte for byte what a full apply of the same bytes gives."""
from __future__ import annotations

import pytest

from agent.core import cose
from agent.node import EVENT_KEY, Node, NodeError
from agent.simpeer import manifest_text, readings_table
from firmware_bridge import software

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")
T = "app.readings"
MANIFEST = manifest_text(MESH, readings_table())


def _writes(n, base=0):
    return [(T, {"device": f"d{i % 7}", "seq": base + i}, {"temp": 20.0 + i, "note": "n" * (i % 30)}, False)
            for i in range(n)]


def test_write_many_verifies_no_signature_of_its_own_events(tmp_path, monkeypatch):
    a, _ = Node.init(tmp_path / "a", MANIFEST, {"kind": "software"})
    calls = []
    real = cose.verify_ed25519
    monkeypatch.setattr(cose, "verify_ed25519", lambda *x: calls.append(1) or real(*x))
    try:
        ids = a.write_many(_writes(200))
        ids += a.write_many(_writes(10, 1000))
        assert len(set(ids)) == 210 and calls == []
    finally:
        a.close()


def test_local_events_equal_a_full_apply_of_the_same_bytes(tmp_path):
    """A second node applies a's log through the full path (parse, verify, decode): the same
    rows, and a's log holds exactly the bytes it released."""
    a, pk = Node.init(tmp_path / "a", MANIFEST, {"kind": "software"})
    b, _ = Node.init(tmp_path / "b", MANIFEST, {"kind": "software"})
    try:
        b.add_peer(a.site_id, pk, None)
        a.write_many(_writes(150))
        a.write(T, {"device": "d1", "seq": 1}, None, delete=True)
        raws = [bytes(r) for (r,) in a.conn.execute("SELECT raw FROM events ORDER BY seq")]
        out = b.apply_batch(raws)
        assert {o.reason for o in out} == {"applied"}
        assert a.dump() == b.dump()
    finally:
        a.close()
        b.close()


def test_a_keystore_key_that_is_not_the_keyring_key_stores_nothing(tmp_path, monkeypatch):
    """The keystore signs with another key (a swapped key file, a wrong token): the events do not
    verify under the node's keyring key, so the write fails and the log stays as it was."""
    a, _ = Node.init(tmp_path / "a", MANIFEST, {"kind": "software"})
    try:
        a.write(T, {"device": "d", "seq": 0}, {"temp": 1.0})
        other = software.SoftwareKeystore(str(tmp_path / "other-keys"))
        other.generate_key(EVENT_KEY, "ed25519")
        monkeypatch.setattr(a.bridge, "_ks", other)
        monkeypatch.setattr(a.bridge, "_pub", {})
        with pytest.raises(NodeError, match="bad_signature"):
            a.write_many(_writes(100, 10))
        with pytest.raises(NodeError, match="bad_signature"):
            a.write(T, {"device": "d", "seq": 1}, {"temp": 1.0})
        assert a.conn.execute("SELECT count(*) FROM events").fetchone()[0] == 1
    finally:
        monkeypatch.undo()
        a.close()


def test_compaction_after_write_many_reads_no_released_output_back(tmp_path, monkeypatch):
    a, _ = Node.init(tmp_path / "a", MANIFEST, {"kind": "software"})
    try:
        a.write_many(_writes(300))
        reads = []
        real = a.bridge._journal.read_released
        monkeypatch.setattr(a.bridge._journal, "read_released", lambda i: reads.append(i) or real(i))
        stats = a.compact_journal()
        assert stats["events_dropped"] == 300 and stats["entries_kept"] == 0 and reads == []
    finally:
        monkeypatch.undo()
        a.close()
