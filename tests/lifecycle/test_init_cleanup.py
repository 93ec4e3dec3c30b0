"""A failed `init` leaves nothing it made (probe r01): one that failed after making the store and
the keystore left a home that `init` refused ("already holds a node") and `status` crashed on.
Failures are injected at each step after the first file is made."""
from __future__ import annotations

import os
import sqlite3

import pytest

import agent.home as node_mod
from agent.node import Node
from agent.simpeer import manifest_text, readings_table

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")
TEXT = manifest_text(MESH, readings_table())


def _boom(*a, **k):
    raise sqlite3.OperationalError("injected")


STEPS = [("rowstore.create_table", lambda m: m.setattr(node_mod.rowstore, "create_table", _boom)),
         ("identity file", lambda m: m.setattr(node_mod, "write_identity_file", _boom)),
         ("claim", lambda m: m.setattr(node_mod.ident, "claim_home", _boom)),
         ("open", lambda m: m.setattr(Node, "open", classmethod(_boom)))]


@pytest.mark.parametrize("step", [s for s, _ in STEPS])
@pytest.mark.parametrize("existed", [False, True])
def test_a_failed_init_leaves_the_home_as_it_was(tmp_path, step, existed):
    h = tmp_path / "h"
    if existed:
        h.mkdir()
        (h / "README").write_text("the operator's own file\n")
    with pytest.MonkeyPatch.context() as m:
        dict(STEPS)[step](m)
        with pytest.raises(sqlite3.OperationalError):
            Node.init(h, TEXT, {"kind": "software"})
    if existed:
        assert sorted(os.listdir(h)) == ["README"]
    else:
        assert not h.exists()
    node, _ = Node.init(h, TEXT, {"kind": "software"})   # the same home initialises
    node.close()
    with Node.open(h, read_only=True) as n:
        assert n.status()


def test_a_failed_init_removes_the_key_it_made_in_an_outside_keystore(tmp_path):
    keys = tmp_path / "keys"
    keys.mkdir()
    (keys / "other.key").write_text("not ours\n")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(node_mod.rowstore, "create_table", _boom)
        with pytest.raises(sqlite3.OperationalError):
            Node.init(tmp_path / "h", TEXT, {"kind": "software", "dir": str(keys)})
    assert sorted(os.listdir(keys)) == ["other.key"]
    node, _ = Node.init(tmp_path / "h", TEXT, {"kind": "software", "dir": str(keys)})
    node.close()
