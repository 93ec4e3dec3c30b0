"""At-rest protection of the retained log (docs/reliability.md "At rest").

A node on a real SoftHSM2 token writes events and imports others (one for a table it lacks: held;
one carrying a column its schema lacks: the value lives only in the log, seed 000 §13.6). Its
store file, WAL and signing journal, grepped raw, hold none of the events' payload bytes and none
of the marker values that appear in no local table; the home reopens with its keystore and serves
the events; with another token in place of its own it fails with one line and exit 1. A store
written before the log was sealed is sealed in place, in batches, resuming after a crash; rows
swapped between events do not open; a data-key rotation re-seals everything and drops the old key."""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess

import pytest

from agent.core import cose
from agent.node import Node
from agent.simpeer import SimPeer, manifest_text, readings_table
from agent.store import atrest, db
from agent.sync import export_mailbox_body, import_mailbox_body
from firmware_bridge.journal import HDR, MAGIC, RELEASED, SEALED, record_at
from tests.atrest_helpers import downgrade_to_clear
from tests.cli_cmd import agent_cmd, agent_env

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")
T = "app.readings"
NOW = 1_764_669_600_000


def _files(home) -> dict[str, bytes]:
    """Every file of the home as it lies on the card (store, WAL, journal, keystore PIN, ...)."""
    out = {}
    for root, _dirs, names in os.walk(home):
        for n in names:
            p = os.path.join(root, n)
            with open(p, "rb") as f:
                out[os.path.relpath(p, home)] = f.read()
    return out


def _leaks(home, needles: dict[str, bytes]) -> list[str]:
    return [f"{what} in {name}" for name, data in _files(home).items() for what, needle in needles.items()
            if needle in data]


def _content(home) -> list[str]:
    conn = sqlite3.connect(f"file:{home / 'store.sqlite'}?mode=ro", uri=True)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


def _payload(raw: bytes) -> bytes:
    return cose.parse_sign1(raw).payload_bytes


def test_softhsm_home_reveals_no_event_payload(tmp_path, softhsm_conf):
    peer = SimPeer(MESH)
    a, _pk = Node.init(tmp_path / "a", manifest_text(MESH, readings_table(), [peer]), softhsm_conf)
    home = tmp_path / "a"
    try:
        # Written: the signed bytes and payloads of local events (the values themselves are in the
        # materialized table, which is the application's clear data by design).
        ids = a.write_many([(T, {"device": "w", "seq": i}, {"temp": 1.5 + i, "note": f"w{i}"}, False) for i in range(20)])
        written = [bytes(r) for (r,) in a.conn.execute(
            "SELECT unseal(event_id, raw) FROM events WHERE event_id IN (%s)" % ",".join("?" * len(ids)), ids)]
        assert len(written) == 20
        # Imported: a value for a column this schema lacks (kept only in the log, §13.6) and an
        # event for a table this node lacks (held, §13.6 row 1).
        ignored = peer.event(T, {"device": "p", "seq": 1}, {"temp": 2.0, "secret": "MARK-IGNORED-7f3a9c"}, (NOW, 0))
        held = peer.event("app.vault", {"id": "v1"}, {"body": "MARK-HELD-41be07"}, (NOW, 1))
        res = import_mailbox_body(a, peer.body([ignored, held]))
        assert res["applied"] == 1 and res.get("held") == 1, res
        assert a.conn.execute("SELECT count(*) FROM held").fetchone()[0] == 1
        # While the node runs (a card pulled from a live device): WAL present.
        a.conn.execute("PRAGMA wal_checkpoint(PASSIVE)")
        needles = {"MARK-IGNORED": b"MARK-IGNORED-7f3a9c", "MARK-HELD": b"MARK-HELD-41be07",
                   "ignored payload": _payload(ignored), "held payload": _payload(held)}
        needles.update({f"written payload {i}": _payload(r) for i, r in enumerate(written)})
        needles.update({f"written event {i}": r for i, r in enumerate(written)})
        assert os.path.exists(home / "store.sqlite-wal")
        assert _leaks(home, needles) == []
    finally:
        a.close()
    assert _leaks(home, needles) == []   # and after a clean close
    # Sanity of the grep: the markers are in the clear bytes the node imported.
    assert b"MARK-IGNORED-7f3a9c" in ignored and b"MARK-HELD-41be07" in held

    # Reopens with its keystore and serves the events (a new peer takes them from a mailbox).
    a = Node.open(home)
    b, pk_b = Node.init(tmp_path / "b", manifest_text(MESH, readings_table(), [peer]), {"kind": "software"})
    try:
        b.add_peer(a.site_id, a.bridge.public_key("events"), None)
        a.add_peer(b.site_id, pk_b, None)
        box = tmp_path / "a-to-b.ssp"
        export_mailbox_body(a, b.site_id, box)
        res = import_mailbox_body(b, box.read_bytes())
        assert res["applied"] == 21, res     # 20 written + the one with the ignored column
        held_back = a.conn.execute("SELECT unseal(event_id, raw) FROM held").fetchone()[0]
        assert bytes(held_back) == held
    finally:
        a.close()
        b.close()

    # Another token in place of this one (same label, same PIN: a replaced keystore): the data key
    # does not open; one line on stderr, exit 1, nothing changed.
    before = _files(home)
    content_before = _content(home)
    conf = softhsm_conf["env"]["SOFTHSM2_CONF"]
    tokens = os.path.join(os.path.dirname(conf), "tokens")
    shutil.rmtree(tokens)
    os.mkdir(tokens)
    subprocess.run(["softhsm2-util", "--init-token", "--free", "--label", softhsm_conf["token_label"],
                    "--so-pin", "87654321", "--pin", softhsm_conf["pin"]], check=True, capture_output=True,
                   env=dict(os.environ, SOFTHSM2_CONF=conf))
    p = subprocess.run([*agent_cmd(), "--home", str(home), "write", T, "--key", '{"device":"x","seq":1}',
                        "--set", '{"temp":1.0}'], capture_output=True, text=True, env=agent_env(), timeout=120)
    assert p.returncode == 1, (p.returncode, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "sealed by its pkcs11 keystore" in lines[0] and "rehydrate" in lines[0], p.stderr
    after = _files(home)
    assert {k: v for k, v in after.items() if not k.startswith("store.sqlite")} == \
        {k: v for k, v in before.items() if not k.startswith("store.sqlite")}
    # the store's content (its file may differ by a checkpoint of what was already committed)
    assert _content(home) == content_before


def _software_node(tmp_path, name="a"):
    peer = SimPeer(MESH)
    node, _ = Node.init(tmp_path / name, manifest_text(MESH, readings_table(), [peer]), {"kind": "software"})
    return node, peer


def test_software_home_without_its_seal_key_fails_with_one_line(tmp_path):
    a, _peer = _software_node(tmp_path)
    a.write(T, {"device": "d", "seq": 1}, {"temp": 1.0})
    a.close()
    os.unlink(tmp_path / "a" / "keystore" / "store-seal.seal")
    p = subprocess.run([*agent_cmd(), "--home", str(tmp_path / "a"), "write", T, "--key", '{"device":"d","seq":2}',
                        "--set", '{"temp":1.0}'], capture_output=True, text=True, env=agent_env(), timeout=120)
    assert p.returncode == 1, p.stderr
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "does not hold the seal key" in lines[0], p.stderr
    # The read verbs read no payload and need no keystore (the materialized tables are clear).
    p = subprocess.run([*agent_cmd(), "--home", str(tmp_path / "a"), "dump"], capture_output=True, text=True,
                       env=agent_env(), timeout=120)
    assert p.returncode == 0, p.stderr


def test_rows_swapped_between_events_do_not_open(tmp_path):
    a, _peer = _software_node(tmp_path)
    a.write_many([(T, {"device": "d", "seq": i}, {"temp": float(i)}, False) for i in range(2)])
    a.close()
    conn = sqlite3.connect(tmp_path / "a" / "store.sqlite")
    (s1, r1), (s2, r2) = conn.execute("SELECT seq, raw FROM events ORDER BY seq").fetchall()
    conn.execute("UPDATE events SET raw=? WHERE seq=?", (r2, s1))
    conn.execute("UPDATE events SET raw=? WHERE seq=?", (r1, s2))
    conn.commit()
    conn.close()
    a = Node.open(tmp_path / "a")
    try:
        with pytest.raises(sqlite3.OperationalError) as ei:
            a.conn.execute("SELECT unseal(event_id, raw) FROM events").fetchall()
        fault = db.storage_fault(ei.value, a.home / "store.sqlite")
        assert fault is not None and "does not open" in str(fault)
    finally:
        a.close()


def test_a_store_written_before_sealing_is_sealed_in_place_and_resumes(tmp_path):
    a, peer = _software_node(tmp_path)
    home = a.home
    ids = a.write_many([(T, {"device": "d", "seq": i}, {"temp": float(i), "note": f"n{i}"}, False) for i in range(50)])
    held = peer.event("app.vault", {"id": "v1"}, {"body": "MARK-HELD-LEGACY"}, (NOW, 1))
    import_mailbox_body(a, peer.body([held]))
    # keep one output in the journal that the log lacks (released before a crash, never applied)
    raws = {bytes(e): bytes(r) for e, r in a.conn.execute("SELECT event_id, unseal(event_id, raw) FROM events")}
    a.close()
    downgrade_to_clear(home)
    conn = sqlite3.connect(home / "store.sqlite")
    assert all(bytes(r)[:1] == b"\xd2" for (r,) in conn.execute("SELECT raw FROM events"))
    conn.close()
    assert _payload(raws[ids[0]]) in (home / "store.sqlite").read_bytes()   # the control: clear before

    # A first open that stops after two batches of ten (a crash mid-job): the job resumes next time.
    conn = db.connect(home / "store.sqlite")
    from agent.store import migrations
    migrations.migrate(conn, home / "store.sqlite")
    assert atrest.pending(conn) == {"events": 0, "held": 0}
    from firmware_bridge import open_keystore
    ks = open_keystore({"kind": "software", "dir": str(home / "keystore")})
    seal = atrest.open_log(conn, ks, bytes(db.get_meta(conn, "site_id")), home, NOW)
    out = atrest.reseal(conn, seal, batch=10, max_batches=2)
    assert out == {"rewritten": 20, "done": False}
    assert atrest.pending(conn)["events"] == 20
    ks.close()
    conn.close()

    a = Node.open(home)
    try:
        assert atrest.pending(a.conn) is None
        rows = a.conn.execute("SELECT event_id, raw, unseal(event_id, raw) FROM events").fetchall()
        assert all(bytes(r)[:1] == b"\x01" for _e, r, _c in rows)
        assert {bytes(e): bytes(c) for e, _r, c in rows} == raws
        assert bytes(a.conn.execute("SELECT unseal(event_id, raw) FROM held").fetchone()[0]) == held
        # a clear value is refused from now on (only this agent writes the log)
        assert not a.log_seal.clear_ok
    finally:
        a.close()
    needles = {"MARK-HELD": b"MARK-HELD-LEGACY", **{f"payload {i}": _payload(r) for i, r in enumerate(raws.values())}}
    assert _leaks(home, needles) == []


def test_rotation_reseals_every_row_and_the_journal_and_drops_the_old_key(tmp_path):
    a, _peer = _software_node(tmp_path)
    home = a.home
    a.write_many([(T, {"device": "d", "seq": i}, {"temp": float(i)}, False) for i in range(30)])
    old = a.log_seal.sealer.current
    new = atrest.rotate(a.conn, a.bridge.keystore, a.site_id, NOW)
    assert new == old + 1
    a.close()
    a = Node.open(home)
    try:
        assert atrest.pending(a.conn) is None
        assert [k for (k,) in a.conn.execute("SELECT key_id FROM atrest_keys")] == [new]
        from firmware_bridge.sealing import key_id_of
        assert {key_id_of(bytes(r)) for (r,) in a.conn.execute("SELECT raw FROM events")} == {new}
        a.write(T, {"device": "d", "seq": 99}, {"temp": 1.0})
        assert a.conn.execute("SELECT count(*) FROM events").fetchone()[0] == 31
    finally:
        a.close()
    data = (home / "sign-journal").read_bytes()
    pos = len(MAGIC)
    while (got := record_at(data, pos, len(data))) is not None:
        assert got[0] != RELEASED
        if got[0] == SEALED:
            body = data[pos + HDR.size + got[2]:pos + HDR.size + got[2] + got[3]]
            assert key_id_of(body) == new
        pos = got[4]
    assert json.loads(json.dumps(atrest.status(sqlite3.connect(home / "store.sqlite"))))["current"] == new


def test_keystore_verbs_show_the_sealing_and_rotate_the_data_key(tmp_path):
    a, _peer = _software_node(tmp_path)
    a.write_many([(T, {"device": "d", "seq": i}, {"temp": float(i)}, False) for i in range(5)])
    a.close()
    run = lambda *v: subprocess.run([*agent_cmd(), "--home", str(tmp_path / "a"), *v], capture_output=True,  # noqa: E731
                                    text=True, env=agent_env(), timeout=120)
    p = run("keystore", "show")
    assert p.returncode == 0, p.stderr
    st = json.loads(p.stdout)["at_rest"]
    assert st["sealed"] and st["current"] == 1 and st["job"] is None
    assert "wrapped" not in p.stdout and "secret" not in p.stdout
    p = run("keystore", "rotate-data-key")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["data_key"] == 2 and out["at_rest"]["job"] is None
    assert [k["key_id"] for k in out["at_rest"]["data_keys"]] == [2]
    a = Node.open(tmp_path / "a")
    try:
        from firmware_bridge.sealing import key_id_of
        assert {key_id_of(bytes(r)) for (r,) in a.conn.execute("SELECT raw FROM events")} == {2}
        assert a.conn.execute("SELECT count(*) FROM events").fetchone()[0] == 5
    finally:
        a.close()
