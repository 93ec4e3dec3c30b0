"""A standalone authority (agent/authority.py): a directory with a keystore and a signing journal;
records are signed through its bridge (persist-before-release), never with a raw secret, and a
record released before a crash is stored before the next one, so its chain does not fork."""
from __future__ import annotations

import json

import pytest

from agent import authority as auth_mod
from agent.core import records as rec
from agent.core.cose import assemble
from agent.node import Node, NodeError
from agent.store import sync_state as st
from agent.sync import issue_record, resolve_chains
from tests.cli_cmd import agent_cmd, agent_env

from ..sync.helpers import NOW, TABLES, manifest


def _mesh_with(tmp_path, card):
    text = manifest(TABLES).replace("\n", f'\nauthorities = ["{card["site_id"]}"]\n'
                                    f'[[peers]]\nsite_id = "{card["site_id"]}"\npublic_key = "{card["public_key"]}"\n', 1)
    return Node.init(tmp_path / "gw", text)[0]


def test_create_makes_a_keystore_directory_without_secrets(tmp_path):
    d = tmp_path / "auth"
    card = auth_mod.create(d)
    assert card["format"] == "ssp-authority-v2" and card["keystore"]["kind"] == "software"
    assert sorted(p.name for p in d.iterdir()) == ["authority.json", "keystore"]
    assert (d.stat().st_mode & 0o777) == 0o700
    keyfiles = list((d / "keystore").iterdir())
    assert keyfiles and all((f.stat().st_mode & 0o077) == 0 for f in keyfiles)
    assert "secret" not in (d / "authority.json").read_text()
    assert card["keystore"]["dir"] == "keystore"     # relative: the directory can move
    with pytest.raises(auth_mod.AuthorityError, match="never overwritten"):
        auth_mod.create(d)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"kind": "ssp-authority-key-v1", "site_id": "00" * 16, "public_key": "00" * 32,
                               "secret_key": "00" * 32}))
    with pytest.raises(auth_mod.AuthorityError, match="raw secret"):
        auth_mod.Authority(old)
    with pytest.raises(auth_mod.AuthorityError, match="not an authority directory"):
        auth_mod.Authority(tmp_path)


def test_records_are_released_through_the_journal(tmp_path):
    card = auth_mod.create(tmp_path / "auth")
    gw = _mesh_with(tmp_path, card)
    sub = Node.init(tmp_path / "dev", manifest(TABLES))[0]
    with auth_mod.Authority(tmp_path / "auth") as a:
        raw, info = issue_record(gw, "vouch", sub.site_id, sub.keyring[sub.site_id][0], now=NOW, authority=a)
        assert a.released() == [raw]          # the exact bytes, durable in the authority's journal
        assert info["issuer"] == card["site_id"] and info["generation"] == 0
    assert st.has_record(gw.conn, rec.record_hash(raw))
    # the journal is exclusive: a second process cannot sign as this authority at the same time
    with auth_mod.Authority(tmp_path / "auth"):
        with pytest.raises(auth_mod.AuthorityError):
            auth_mod.Authority(tmp_path / "auth")


def test_a_record_released_before_a_crash_is_stored_first_and_the_chain_does_not_fork(tmp_path):
    card = auth_mod.create(tmp_path / "auth")
    gw = _mesh_with(tmp_path, card)
    subject = bytes(range(16))
    st.ensure_schema(gw.conn)
    with auth_mod.Authority(tmp_path / "auth") as a:
        # released, then the process died before the node stored it: only the journal has it
        protected, payload, tbs = rec.to_be_signed("role", a.site_id, gw.mesh_id, subject, "reader", 0, None)
        lost = a.sign(tbs, lambda sig: assemble(protected, payload, sig), NOW)
        assert not st.has_record(gw.conn, rec.record_hash(lost))
    with auth_mod.Authority(tmp_path / "auth") as a:
        raw, info = issue_record(gw, "role", subject, "writer", now=NOW + 1, authority=a)
    assert st.has_record(gw.conn, rec.record_hash(lost))      # stored before the new one
    assert info["generation"] == 1 and info["previous_record_hash"] == rec.record_hash(lost).hex()
    chain = resolve_chains(st.records(gw.conn))[("role", subject)]
    assert not chain.forked and chain.head.record_hash == rec.record_hash(raw)


def test_a_node_that_does_not_list_the_authority_refuses(tmp_path):
    auth_mod.create(tmp_path / "auth")
    gw = Node.init(tmp_path / "gw", manifest(TABLES))[0]
    with auth_mod.Authority(tmp_path / "auth") as a:
        with pytest.raises(NodeError, match="not a mesh authority"):
            issue_record(gw, "role", bytes(16), "reader", now=NOW, authority=a)
        assert a.released() == []                              # nothing signed


def test_the_directory_can_move(tmp_path):
    card = auth_mod.create(tmp_path / "auth")
    (tmp_path / "stick").mkdir()
    (tmp_path / "auth").rename(tmp_path / "stick" / "auth")
    gw = _mesh_with(tmp_path, card)
    with auth_mod.Authority(tmp_path / "stick" / "auth") as a:
        raw, info = issue_record(gw, "role", bytes(16), "reader", now=NOW, authority=a)
        assert a.released() == [raw] and info["issuer"] == card["site_id"]


def test_authority_show_through_the_cli(tmp_path):
    import subprocess
    card = auth_mod.create(tmp_path / "auth")
    gw = _mesh_with(tmp_path, card)
    with auth_mod.Authority(tmp_path / "auth") as a:
        issue_record(gw, "role", bytes(16), "reader", now=NOW, authority=a)
        issue_record(gw, "vouch", bytes(range(16)), bytes(32), now=NOW, authority=a)
    gw.close()
    p = subprocess.run([*agent_cmd(), "authority", "show", "--authority-key",
                        str(tmp_path / "auth")], capture_output=True, text=True, env=agent_env())
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["site_id"] == card["site_id"] and out["public_key"] == card["public_key"]
    assert out["records_released"] == 2 and out["by_kind"] == {"role": 1, "vouch": 1}
    assert out["keystore"]["kind"] == "software" and "secret" not in p.stdout
    p = subprocess.run([*agent_cmd(), "authority", "show", "--authority-key",
                        str(tmp_path / "nothing")], capture_output=True, text=True, env=agent_env())
    assert p.returncode == 2 and "not an authority directory" in p.stderr
