"""A PKCS#11 `init` that fails (wrong token label, wrong PIN) leaves no
keystore.pin behind, and no half-made node: the technician can fix the argument and run it again."""
from __future__ import annotations

import json

from agent.simpeer import manifest_text, readings_table
from tests.cli_cmd import run_cli

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")


def test_failed_pkcs11_init_leaves_no_pin(tmp_path, softhsm_conf):
    mf = tmp_path / "m.toml"
    mf.write_text(manifest_text(MESH, readings_table(retention="telemetry")))
    env = softhsm_conf["env"]
    base = {k: v for k, v in softhsm_conf.items() if k != "env"}
    h = tmp_path / "h"
    for bad in ({**base, "token_label": "no-such-token"}, {**base, "pin": "000000"}):
        p = run_cli("--home", h, "init", "--manifest", mf, "--keystore", json.dumps(bad), env=env)
        assert p.returncode == 1, (p.returncode, p.stderr)  # the keystore is unavailable: a fault
        assert not (h / "keystore.pin").exists()
        assert not (h / "store.sqlite").exists() and not (h / "identity.json").exists()
    # fixed: the same home initialises
    p = run_cli("--home", h, "init", "--manifest", mf, "--keystore", json.dumps(base), env=env)
    assert p.returncode == 0, p.stderr
    assert (h / "keystore.pin").exists()


def _open_store_files(home) -> list[str]:
    import os
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(home / "store.sqlite")):
            out.append(target)
    return out


def test_init_closes_its_own_store_connection(tmp_path):
    """Node.init made the store on a connection it never closed (held by the process until a
    garbage collection): after the node's close the process still had the store and its WAL open,
    so no other process's close was the last one and the WAL, with every page version in it, stayed
    on the card (found by the re-wrap test: an old wrapped data key lingered in store.sqlite-wal)."""
    import pytest
    if not __import__("os").path.isdir("/proc/self/fd"):
        pytest.skip("needs /proc")
    from agent.node import Node
    node, _ = Node.init(tmp_path / "h", manifest_text(MESH, readings_table()), {"kind": "software"})
    node.close()
    assert _open_store_files(tmp_path / "h") == []


def test_an_init_cut_short_after_its_token_key_is_made_is_completed_by_the_next(tmp_path, softhsm_conf, monkeypatch):
    """A token keeps the key an init made even when that init then fails or is killed (there is no
    taking a key back off a token): the next init on the same token failed with KeyExists for
    ever. Now the key an unfinished init made (its public key is in HOME/init.incomplete) is
    taken up again by the next init of that home; any other key of that name is still refused."""
    import pytest
    from agent import home as home_mod
    from agent.node import Node
    for k, v in softhsm_conf["env"].items():
        if k.startswith("SOFTHSM"):
            monkeypatch.setenv(k, v)
    conf = {k: v for k, v in softhsm_conf.items() if k != "env"}
    manifest = manifest_text(MESH, readings_table())
    h = tmp_path / "h"

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")
    with monkeypatch.context() as m:
        m.setattr(home_mod, "make_store", lambda *a, **k: full_disk())
        with pytest.raises(OSError):
            Node.init(h, manifest, dict(conf))
    node, pk = Node.init(h, manifest, dict(conf))
    try:
        assert node.keyring[node.site_id][0] == pk     # the node signs with the key the first init made
    finally:
        node.close()
    # another home on the same token: its key is this node's, never taken up
    with pytest.raises(Exception, match="already exists"):
        Node.init(tmp_path / "other", manifest, dict(conf))
