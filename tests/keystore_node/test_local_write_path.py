"""Local writes: `Node.write_many` applies the events it just built and released
through the one apply path without parsing, verifying and decoding them again, and the journal's
compaction knows they are logged without reading them back. What must not change: an event signed
under a key that is not this node's keyring key is never stored (the apply path's check still
decides), and what the log holds is byte for byte what a full apply of the same bytes gives."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from agent.core import cose
from agent.node import EVENT_KEY, Node, NodeError
from agent.simpeer import manifest_text, readings_table
from firmware_bridge import software
from tests.cli_cmd import agent_cmd, agent_env

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
        raws = [bytes(r) for (r,) in a.conn.execute("SELECT unseal(event_id, raw) FROM events ORDER BY seq")]
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


@pytest.mark.skipif(shutil.which("strace") is None, reason="counts the calls with strace")
def test_a_cli_write_makes_only_the_fsyncs_the_release_order_needs(tmp_path):
    """docs/keystore.md "fsyncs of one local write": a `write` in its own process, after an earlier
    one left its released event in the journal, makes two journal fsyncs (intent, released), one
    witness fdatasync, and SQLite's own; the journal is not rewritten on open for that one entry
    (it was, for every write: two fsyncs more), and the evidence reading rides in a commit the
    write makes anyway."""
    env = agent_env({"SSP_AGENT_CLOCK_TRUSTED": "1", "SSP_AGENT_WITNESS_DIR": str(tmp_path / "witness")})
    man = tmp_path / "m.toml"
    man.write_text(MANIFEST)
    home = tmp_path / "h"
    subprocess.run(agent_cmd() + ["--home", str(home), "init", "--manifest", str(man)], env=env, check=True,
                   capture_output=True)
    calls = []
    for seq in (1, 2):
        trace = tmp_path / f"trace{seq}"
        subprocess.run(["strace", "-f", "-qq", "-y", "-e", "trace=fsync,fdatasync", "-o", str(trace), *agent_cmd(),
                        "--home", str(home), "write", T, "--key", json.dumps({"device": "d", "seq": seq}),
                        "--set", '{"temp": 1.5}'], env=env, check=True, capture_output=True)
        calls = [line.split("<", 1)[1].split(">", 1)[0] for line in trace.read_text().splitlines() if "sync(" in line]
    journal = str(home / "sign-journal")
    assert calls.count(journal) == 2, calls
    assert not any(c.endswith(".compact") for c in calls), calls
    assert sum(1 for c in calls if "witness" in c) == 1, calls
    assert all(c.startswith(str(home)) or "witness" in c for c in calls), calls


def test_a_batch_over_existing_rows_equals_one_write_at_a_time(tmp_path):
    """`write_many` reads its rows ahead in one query and writes each once (agent/store/rows.py
    `prefetch`, `defer`): updates of rows written before, rows written twice in one batch,
    deletes and a resurrection give the rows that one `write` per event gives."""
    a, _ = Node.init(tmp_path / "a", MANIFEST, {"kind": "software"})
    b, _ = Node.init(tmp_path / "b", MANIFEST, {"kind": "software"})
    try:
        first = _writes(30)
        batch = _writes(40, 10) + [(T, {"device": "d1", "seq": 15}, None, True),
                                   (T, {"device": "d1", "seq": 15}, {"temp": 1.5}, False),
                                   (T, {"device": "d2", "seq": 16}, {"note": None}, False),
                                   (T, {"device": "d3", "seq": 17}, None, True)]
        a.write_many(first)
        a.write_many(batch)
        for w in first + batch:
            b.write(w[0], w[1], w[2], delete=w[3])
        assert a.dump() == b.dump()
        keys = {(r["key"]["device"], r["key"]["seq"]) for r in a.dump()[T]}
        assert ("d3", 17) not in keys and ("d0", 17) in keys and len(keys) == 30 + 40 - 1
        assert [r["values"] for r in a.dump()[T] if r["key"] == {"device": "d1", "seq": 15}] == [{"temp": 1.5, "note": None}]
    finally:
        a.close()
        b.close()



@pytest.mark.parametrize("n", [5, 200])
def test_the_witness_follows_the_intents_and_precedes_the_log(tmp_path, monkeypatch, n):
    """The clock witness is written once every intent of the group is durable (never above what
    the journal intended) and before any event of it is in the log, whether it is written after
    the signing (small groups) or beside it while the group is signed (large ones)."""
    a, _ = Node.init(tmp_path / "a", MANIFEST, {"kind": "software"})
    seen = []
    real = a.witness.advance

    def advance(hlc):
        if a.witness.value is None or hlc > a.witness.value:   # written (else covered: a no-op)
            seen.append((hlc, a.bridge.max_event_hlc(a.site_id),
                         a.conn.execute("SELECT count(*) FROM events").fetchone()[0]))
        return real(hlc)
    monkeypatch.setattr(a.witness, "advance", advance)
    try:
        a.write_many(_writes(n))
        (hlc, intended, logged), = seen
        assert hlc == intended == a.clock.current() and logged == 0
        assert a.conn.execute("SELECT count(*) FROM events").fetchone()[0] == n
    finally:
        a.close()
