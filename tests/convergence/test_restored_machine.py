"""A whole machine restored from a snapshot: the home and the clock witness outside it come back
together, taken while the node ran. Nothing on the machine remembers what it issued after the
snapshot; the in-home ceiling still bounds every HLC issued inside its window, even one the clock
reached by observing a peer ahead of the wall clock (§12 step 5, §13.5; docs/apply.md)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from agent.node import Node
from agent.sync import SyncDriver

from ..sync.helpers import NOW, T, TABLES, mesh, sync


def _own(node, site):
    return {tuple(map(int, e["hlc"].split("."))) for e in node.log_entries() if e["site_id"] == site.hex()}


def test_a_restored_home_and_witness_reissue_no_hlc_a_peer_holds(tmp_path):
    witness = Path(os.environ["SSP_AGENT_WITNESS_DIR"])
    p, r = mesh(tmp_path, 2, TABLES)
    r.write(T, {"device": "r", "seq": 0}, {"temp": 1.0}, now=NOW)   # persists a ceiling NOW + window
    # the snapshot, taken while the node runs: its home and its witness, as they are on disk
    shutil.copytree(r.home, tmp_path / "home-copy")
    shutil.copytree(witness, tmp_path / "witness-copy")
    # the peer's clock runs 5 s ahead (inside the skew bound); r observes it and writes above it
    p.write(T, {"device": "p", "seq": 0}, {"temp": 1.0}, now=NOW + 5_000)
    sync(SyncDriver(p), SyncDriver(r), NOW + 1, cycles=2)
    for i in range(1, 4):
        r.write(T, {"device": "r", "seq": i}, {"temp": 2.0}, now=NOW + 2)
    sync(SyncDriver(r), SyncDriver(p), NOW + 3, cycles=2)
    issued = _own(p, r.site_id)                 # what the peer holds of r's
    assert max(issued)[0] == NOW + 5_000, issued   # r's clock ran ahead of its wall clock
    home = r.home
    r.close()
    for src, dst in ((tmp_path / "home-copy", home), (tmp_path / "witness-copy", witness)):
        shutil.rmtree(dst)
        shutil.copytree(src, dst)
    r = Node.open(home)
    for i in range(10, 16):   # the wall clock reaches what the lost run issued
        r.write(T, {"device": "r", "seq": i}, {"temp": 3.0}, now=NOW + 5_000)
    new = _own(r, r.site_id) - {(NOW, 0)}
    r.close()
    p.close()
    assert not new & issued, sorted(new & issued)
    assert min(new) > max(issued)
