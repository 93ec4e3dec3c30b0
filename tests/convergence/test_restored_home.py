"""A home restored from an older copy lost events it had applied, while its peers' cursors are
past them: the node detects it (the applied count mirrored beside its clock witness, outside the
home) and asks every peer to offer its history again, keeping its horizons (agent/rehydrate.py)."""
from __future__ import annotations

import shutil

from agent.node import Node
from agent.sync import SyncDriver

from ..sync.helpers import NOW, T, TABLES, mesh, sync


def _from(node, site):
    return sum(1 for e in node.log_entries() if e["site_id"] == site.hex())


def test_a_restored_receiver_gets_back_what_it_lost(tmp_path):
    s, r = mesh(tmp_path, 2, TABLES)
    for i in range(3):
        s.write(T, {"device": "s", "seq": i}, {"temp": 1.0}, now=NOW + i)
    sync(SyncDriver(s), SyncDriver(r), NOW + 10, cycles=2)
    home = r.home
    r.close()
    shutil.copytree(home, tmp_path / "copy")
    r = Node.open(home)
    for i in range(3, 9):
        s.write(T, {"device": "s", "seq": i}, {"temp": 2.0}, now=NOW + 20 + i)
    sync(SyncDriver(s), SyncDriver(r), NOW + 40, cycles=2)
    assert _from(r, s.site_id) == 9
    r.close()
    shutil.rmtree(home)
    shutil.copytree(tmp_path / "copy", home)
    r = Node.open(home)       # detects the loss and asks its peers again
    assert _from(r, s.site_id) == 3
    assert any(e["kind"] == "restored_home" for e in r.surfaced())
    sync(SyncDriver(r), SyncDriver(s), NOW + 60, cycles=3)
    assert _from(r, s.site_id) == 9
    assert r.dump() == s.dump()
    s.close()
    r.close()


def test_an_ordinary_restart_asks_for_nothing(tmp_path):
    s, r = mesh(tmp_path, 2, TABLES)
    s.write(T, {"device": "s", "seq": 0}, {"temp": 1.0}, now=NOW)
    sync(SyncDriver(s), SyncDriver(r), NOW + 10, cycles=2)
    home = r.home
    r.close()
    r = Node.open(home)
    assert not any(e["kind"] == "restored_home" for e in r.surfaced())
    assert r.conn.execute("SELECT count(*) FROM rehydrate_records").fetchone()[0] == 0
    s.close()
    r.close()
