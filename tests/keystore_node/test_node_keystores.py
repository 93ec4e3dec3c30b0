"""A node initialised on each of the three keystores produces events through the signing bridge;
a second node (software keystore) applies them after a mailbox import, signatures verified
(docs/keystore.md). `ssp-agent keystore show` names the keystore and key, never secrets."""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from agent.sync import export_mailbox_body, import_mailbox_body
from agent.core import cose
from agent import nodeclock
from agent.node import EVENT_KEY, Node
from agent.simpeer import manifest_text, readings_table
from firmware_bridge import EventIdentity, Status
from tests.cli_cmd import agent_cmd, agent_env

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")
T = "app.readings"
MANIFEST = manifest_text(MESH, readings_table(retention="telemetry"))


def _round_trip(tmp_path, ks_conf):
    a, pk_a = Node.init(tmp_path / "a", MANIFEST, ks_conf)
    b, pk_b = Node.init(tmp_path / "b", MANIFEST, {"kind": "software"})
    try:
        a.add_peer(b.site_id, pk_b, None)
        b.add_peer(a.site_id, pk_a, None)
        assert a.bridge.keystore.public_key(EVENT_KEY) == pk_a
        ids = a.write_many([(T, {"device": "d1", "seq": i}, {"temp": 20.0 + i}, False) for i in range(12)])
        ids.append(a.write(T, {"device": "d1", "seq": 3}, None, delete=True))
        ids.append(a.write(T, {"device": "d2", "seq": 0}, {"temp": -4.5}))
        # every event went through the bridge: its journal holds the exact bytes the log holds
        logged = {bytes(e): bytes(r) for e, r in a.conn.execute("SELECT event_id, unseal(event_id, raw) FROM events")}
        assert set(logged) == set(ids)
        for raw in logged.values():
            s1 = cose.parse_sign1(raw)
            assert cose.verify_ed25519(pk_a, s1.sig_structure(MESH), s1.signature)
        box = tmp_path / "a-to-b.ssp"
        export_mailbox_body(a, b.site_id, box)
        res = import_mailbox_body(b, box.read_bytes())
        assert res.get("applied") == len(ids), res
        assert b.dump()[T] == a.dump()[T]
        assert {bytes(e): bytes(r) for e, r in b.conn.execute(
            "SELECT event_id, unseal(event_id, raw) FROM events WHERE site_id=?", (a.site_id,))} == logged
        # compaction: the log holds them all, so the journal drops them and keeps a floor
        stats = a.compact_journal()
        assert stats["entries_kept"] == 0 and a.bridge.journal_stats()["entries"] == 0
        hi = a.bridge.max_event_hlc(a.site_id)
        assert a.bridge.status(EventIdentity(a.site_id, *hi)) is Status.OUTCOME_UNKNOWN  # spent
        a.write(T, {"device": "d3", "seq": 0}, {"temp": 1.0})   # and writing goes on above the floor
        assert nodeclock.max_own_hlc(a.state) > hi
    finally:
        a.close()
        b.close()
    a = Node.open(tmp_path / "a")  # reopen on the same keystore: same key, nothing to recover
    try:
        assert a.bridge.keystore.public_key(EVENT_KEY) == pk_a
        assert a.conn.execute("SELECT count(*) FROM events").fetchone()[0] == len(ids) + 1
        a.write(T, {"device": "d3", "seq": 1}, {"temp": 2.0})
    finally:
        a.close()
    return tmp_path / "a"


def test_node_on_software_keystore(tmp_path):
    _round_trip(tmp_path, {"kind": "software"})


def test_node_on_pkcs11_softhsm2(tmp_path, softhsm_conf):
    home = _round_trip(tmp_path, softhsm_conf)
    out = _show(home)
    assert out["keystore"]["kind"] == "pkcs11" and out["keystore"]["token_label"] == softhsm_conf["token_label"]
    assert out["keystore"]["keys"] and out["event_key"]["matches_node"] is True
    assert f"\"{softhsm_conf['pin']}\"" not in json.dumps(out)  # as a value (digits may occur in numbers)
    # The PIN is kept out of the store (which gets copied and backed up): a 0600 file instead.
    import os
    import sqlite3
    import stat
    store = sqlite3.connect(str(home / "store.sqlite"))
    dump = "\n".join(str(r) for r in store.execute("SELECT * FROM meta"))
    store.close()
    assert softhsm_conf["pin"] not in dump and "pin_file" in dump
    assert stat.S_IMODE(os.stat(home / "keystore.pin").st_mode) == 0o600


def test_node_on_serial_emulator(tmp_path, serial_conf):
    home = _round_trip(tmp_path, serial_conf)
    out = _show(home)
    assert out["keystore"]["kind"] == "serial" and out["keystore"]["device_id"]
    assert out["event_key"] == {**out["event_key"], "name": "events", "algorithm": "ed25519", "matches_node": True}


def _show(home, ok=True):
    p = subprocess.run([*agent_cmd(), "--home", str(home), "keystore", "show"],
                       capture_output=True, text=True, env=agent_env())
    assert (p.returncode == 0) == ok, p.stderr
    return json.loads(p.stdout) if ok else p


def test_keystore_show_software_and_cli_init(tmp_path):
    man = tmp_path / "m.toml"
    man.write_text(MANIFEST)
    kdir = tmp_path / "keys"
    p = subprocess.run([*agent_cmd(), "--home", str(tmp_path / "n"), "init", "--manifest",
                        str(man), "--keystore", json.dumps({"kind": "software", "dir": str(kdir)})],
                       capture_output=True, text=True, env=agent_env())
    assert p.returncode == 0, p.stderr
    init = json.loads(p.stdout)
    out = _show(tmp_path / "n")
    assert out["site_id"] == init["site_id"] and out["event_key"]["public_key"] == init["public_key"]
    assert out["keystore"] == {"kind": "software", "dir": str(kdir), "keys": {"events": "ed25519"}}
    assert out["journal"]["entries"] == 0 and out["journal"]["path"].endswith("sign-journal")
    # the wrong key file in place of the node's key: refused loudly (exit 1), nothing signed
    os.rename(kdir / "events.key", kdir / "old.key")
    from firmware_bridge import open_keystore
    open_keystore({"kind": "software", "dir": str(kdir)}).generate_key("events", "ed25519")
    p = _show(tmp_path / "n", ok=False)
    assert p.returncode == 1 and "not the key this node was initialised with" in p.stderr


def test_released_but_unapplied_events_are_applied_on_open(tmp_path, monkeypatch):
    """A crash between the bridge's release and the apply: the next open applies the journal's
    outputs through the one apply path (origin local), byte for byte, then compacts."""
    a, _ = Node.init(tmp_path / "a", MANIFEST, {"kind": "software"})
    a.write(T, {"device": "d", "seq": 0}, {"temp": 1.0})
    released: list = []
    real = a.bridge.release_many

    def release_then_crash(items):
        outs = real(items)
        released.extend(outs)
        raise KeyboardInterrupt("crash between release and apply")
    monkeypatch.setattr(a.bridge, "release_many", release_then_crash)
    with pytest.raises(KeyboardInterrupt):
        a.write_many([(T, {"device": "d", "seq": i}, {"temp": float(i)}, False) for i in range(1, 6)])
    monkeypatch.undo()
    assert a.conn.execute("SELECT count(*) FROM events").fetchone()[0] == 1
    a.close()
    a = Node.open(tmp_path / "a")
    try:
        rows = a.conn.execute("SELECT unseal(event_id, raw), origin FROM events ORDER BY seq").fetchall()
        assert [bytes(r[0]) for r in rows[1:]] == released and {r[1] for r in rows} == {"local"}
        assert len(a.dump()[T]) == 6
        assert a.bridge.journal_stats()["entries"] == 0        # compacted after recovery
        a.write(T, {"device": "d", "seq": 9}, {"temp": 9.0})    # the clock resumed above them
    finally:
        a.close()


def test_released_but_unstored_records_are_stored_on_open(tmp_path, monkeypatch):
    """A crash between releasing a control record (this node is an authority) and storing it:
    the next open stores it from the journal, so the next record of that chain extends it
    instead of forking it."""
    from agent.store import sync_state as st
    from agent.sync import SyncDriver, issue_record, resolve_chains
    a, pk = Node.init(tmp_path / "a", MANIFEST, {"kind": "software"})
    a.conn.execute("INSERT OR REPLACE INTO meta VALUES ('authorities', ?)", (json.dumps([a.site_id.hex()]),))
    a.authorities = {a.site_id}
    subject = bytes(range(16))

    def crash(self, raws, now):
        raise KeyboardInterrupt("crash between release and store")
    monkeypatch.setattr(SyncDriver, "apply_records", crash)
    with pytest.raises(KeyboardInterrupt):
        issue_record(a, "role", subject, "reader")
    monkeypatch.undo()
    st.ensure_schema(a.conn)
    assert st.records(a.conn) == []
    a.close()
    a = Node.open(tmp_path / "a")
    try:
        chain = resolve_chains(st.records(a.conn))[("role", subject)]
        assert chain.head.value == "reader"
        _raw, info = issue_record(a, "role", subject, "writer")
        assert info["generation"] == 1
        chain = resolve_chains(st.records(a.conn))[("role", subject)]
        assert not chain.forked and chain.head.value == "writer"
    finally:
        a.close()


def test_journal_compacts_past_its_threshold_and_in_eviction(tmp_path, monkeypatch):
    import agent.produce as node_mod
    monkeypatch.setattr(node_mod, "JOURNAL_COMPACT_BYTES", 20_000)
    a, _ = Node.init(tmp_path / "a", MANIFEST, {"kind": "software"})
    try:
        for k in range(40):
            a.write_many([(T, {"device": "d", "seq": k * 10 + i}, {"temp": 1.0}, False) for i in range(10)])
        st = a.bridge.journal_stats()
        assert st["compactions"] >= 3 and st["bytes"] < 20_000 + 10 * 400 and st["entries"] < 120
        assert os.path.getsize(tmp_path / "a" / "sign-journal") == st["bytes"]
        rep = a.run_eviction()
        assert rep["journal"]["entries_kept"] == 0
    finally:
        a.close()


def test_authority_on_a_pkcs11_token(tmp_path, softhsm_conf):
    """`authority create --keystore` on SoftHSM2: the authority key is generated on the token, the
    PIN goes to a 0600 file (never the card), and records are signed through the token's bridge."""
    import stat
    from agent import authority as auth_mod
    from agent.sync import issue_record
    card = auth_mod.create(tmp_path / "auth", softhsm_conf)
    text = (tmp_path / "auth" / "authority.json").read_text()
    assert softhsm_conf["pin"] not in text and card["keystore"]["kind"] == "pkcs11"
    assert stat.S_IMODE(os.stat(tmp_path / "auth" / "keystore.pin").st_mode) == 0o600
    man = MANIFEST.replace("\n", f'\nauthorities = ["{card["site_id"]}"]\n[[peers]]\nsite_id = "{card["site_id"]}"\n'
                                 f'public_key = "{card["public_key"]}"\n', 1)
    gw, _ = Node.init(tmp_path / "gw", man, {"kind": "software"})
    try:
        with auth_mod.Authority(tmp_path / "auth") as a:
            raw, info = issue_record(gw, "role", bytes(16), "reader", authority=a)
            assert a.released() == [raw] and info["issuer"] == card["site_id"]
            s1 = cose.parse_sign1(raw)   # the token's signature over the record (issue_record stored it too)
            assert cose.verify_ed25519(bytes.fromhex(card["public_key"]), s1.sig_structure(gw.mesh_id), s1.signature)
    finally:
        gw.close()
