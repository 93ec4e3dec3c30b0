"""Bounded storage for what peers send, enforced by the store: the surfaced
record keeps its newest `surfaced_limit` rows in every process and counts what it evicts; records
from other issuers stop being stored at `records_limit` / `records_limit_bytes`, refused with a
surfaced reason and counted; nothing in force is evicted (docs/apply.md "Bounds")."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

import agent.node as node_mod
from agent.core import events as ev, records as rec
from agent.node import Node
from agent.simpeer import SimPeer, manifest_text, readings_table
from agent.store import db
from agent.sync import SyncDriver
from tests.cli_cmd import agent_cmd, agent_env

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")
NOW = 1_790_000_000_000
ROOT = Path(__file__).resolve().parents[2]


def garbage(n: int, tag: int) -> list[bytes]:
    return [b"\xff" + tag.to_bytes(4, "big") + i.to_bytes(4, "big") for i in range(n)]


def test_surfaced_bound_holds_across_short_lived_nodes(tmp_path, monkeypatch):
    """Before: the cap was a per-Node counter that pruned every 1 000th write, so short imports
    (a fresh Node each, as every CLI process opens) never pruned: 150 imports left 179 850 rows.
    Here 30 opens of 40 drops each, with the cap at 50 both ways: the store keeps the newest 50
    and counts 1 150 evicted. (Real processes: test_profile_sets_the_bounds_and_status_shows_them.)"""
    node, _ = Node.init(tmp_path / "n", manifest_text(MESH, readings_table()))
    with db.transaction(node.conn):
        db.set_meta(node.conn, "surfaced_limit", 50)
    node.close()
    monkeypatch.setattr(node_mod, "SURFACED_LIMIT", 50, raising=False)   # the old per-process cap, alike
    for k in range(30):
        n = Node.open(tmp_path / "n")
        n.apply_batch(garbage(40, k), NOW)
        n.close()
    n = Node.open(tmp_path / "n", read_only=True)
    try:
        assert n.conn.execute("SELECT count(*) FROM surfaced").fetchone()[0] == 50
        assert n.status()["bounds"]["surfaced"] == {"rows": 50, "limit": 50, "evicted": 1150}
        newest = (garbage(40, 28) + garbage(40, 29))[-50:]      # the oldest were evicted, the newest kept
        assert [e["event_id"] for e in n.surfaced(100)] == [ev.event_id(g).hex() for g in newest]
    finally:
        n.close()


def _auth_node(tmp_path, **meta):
    auth = SimPeer(MESH)
    text = f'authorities = ["{auth.site_id.hex()}"]\n' + manifest_text(MESH, readings_table(), [auth])
    node, _ = Node.init(tmp_path / "n", text)
    with db.transaction(node.conn):
        for k, v in meta.items():
            db.set_meta(node.conn, k, v)
    return node, auth


def vouch(auth: SimPeer, subject: bytes, key: bytes) -> bytes:
    return rec.build_record("vouch", auth.site_id, MESH, subject, key, 0, None,
                            lambda tbs: auth.key.sign(tbs).signature)


def test_records_over_the_bound_are_refused_surfaced_and_counted(tmp_path):
    """Eight vouches (each a chain head in force) against a bound of five: five stored, three
    refused with reason `record_limit`, counted in status; the five in force stay in force and
    re-delivery of a held one is `known`, not refused. Before: all eight stored, no bound."""
    node, auth = _auth_node(tmp_path, records_limit=5)
    subjects = [SimPeer(MESH) for _ in range(8)]
    raws = [vouch(auth, s.site_id, s.public_key) for s in subjects]
    try:
        drv = SyncDriver(node)
        out = drv.apply_records(raws, NOW)
        assert (out["stored"], out["refused"]) == (5, 3), out
        assert all(s.site_id in node.keyring for s in subjects[:5])
        assert not any(s.site_id in node.keyring for s in subjects[5:])
        b = node.status()["bounds"]["records"]
        assert (b["held"], b["limit"], b["refused"]) == (5, 5, 3)
        refused = [e for e in node.surfaced(100) if e["kind"] == "record_refused"]
        assert len(refused) == 3 and {e["reason"] for e in refused} == {"record_limit"}
        assert {e["detail"]["record_hash"] for e in refused} == {rec.record_hash(r).hex() for r in raws[5:]}
        out = drv.apply_records(raws[:5], NOW)
        assert (out["known"], out["refused"]) == (5, 0)
    finally:
        node.close()
    # the bound is the store's: a new process sees the same room (none)
    node = Node.open(tmp_path / "n")
    try:
        out = SyncDriver(node).apply_records(raws[5:6], NOW)
        assert out["refused"] == 1 and node.status()["bounds"]["records"]["refused"] == 4
    finally:
        node.close()


def test_record_bytes_bound(tmp_path):
    node, auth = _auth_node(tmp_path)
    raws = [vouch(auth, SimPeer(MESH).site_id, os.urandom(32)) for _ in range(6)]
    with db.transaction(node.conn):
        db.set_meta(node.conn, "records_limit_bytes", sum(len(r) for r in raws[:4]))
    try:
        out = SyncDriver(node).apply_records(raws, NOW)
        assert (out["stored"], out["refused"]) == (4, 2)
        assert node.status()["bounds"]["records"]["held_bytes"] == sum(len(r) for r in raws[:4])
    finally:
        node.close()


def test_dropped_records_count_towards_the_surfaced_bound(tmp_path):
    """A dropped record stores only its surfaced row; those rows are bounded like every other
    (before: record drops were surfaced without any bound)."""
    node, auth = _auth_node(tmp_path, surfaced_limit=20)
    mallory = SimPeer(MESH)
    bad = [vouch(mallory, SimPeer(MESH).site_id, os.urandom(32)) for _ in range(100)]   # not an authority
    try:
        out = SyncDriver(node).apply_records(bad, NOW)
        assert out["dropped"] == 100
        assert node.conn.execute("SELECT count(*) FROM surfaced WHERE kind='record_dropped'").fetchone()[0] == 20
        assert node.status()["bounds"]["surfaced"] == {"rows": 20, "limit": 20, "evicted": 80}
    finally:
        node.close()


def test_profile_sets_the_bounds_and_status_shows_them(tmp_path):
    """Through the CLI: a profile with `[store] surfaced_limit`; three short `mailbox import`s of
    80 garbage events each leave 100 rows and 140 counted evictions."""
    prof = tmp_path / "tiny.toml"
    prof.write_text('name = "tiny"\n[store]\ndisk_budget_mb = 10\nsurfaced_limit = 100\nrecords_limit = 7\n'
                    'records_limit_mb = 0.5\n')
    mf = tmp_path / "m.toml"
    peer = SimPeer(MESH)
    mf.write_text(manifest_text(MESH, readings_table(), [peer]))
    home = tmp_path / "h"

    def cli(*args):
        return subprocess.run([*agent_cmd(), "--home", str(home), *map(str, args)], capture_output=True, text=True,
                              env=agent_env({"PYTHONPATH": str(ROOT)}), cwd=str(ROOT), timeout=120)
    assert cli("init", "--manifest", mf, "--profile", prof).returncode == 0
    for k in range(3):
        box = tmp_path / f"in{k}.ssp"
        box.write_bytes(peer.body(garbage(80, k)))
        p = cli("mailbox", "import", box)
        assert p.returncode == 0 and json.loads(p.stdout)["dropped"] == 80, p.stderr
    bounds = json.loads(cli("status").stdout)["bounds"]
    assert bounds["surfaced"] == {"rows": 100, "limit": 100, "evicted": 140}
    assert (bounds["records"]["limit"], bounds["records"]["limit_bytes"]) == (7, 2**19)
