"""Rough edges a technician hits, each through the command under test
(tests/cli_cmd.py): a relative --home, peer keyring management, a hint for integers in real
columns, exit 2 for an unknown keystore kind, a typo'd retention class refused."""
from __future__ import annotations

import json
import shutil
import sqlite3

from tests.cli_cmd import run_cli

from .helpers import TABLES, manifest, peers


def _init(tmp_path, home, *extra, cwd=None, tables=TABLES, check=0):
    mf = tmp_path / "m.toml"
    mf.write_text(manifest(peers(1), tables=tables))
    p = run_cli("--home", home, "init", "--manifest", mf, *extra, cwd=cwd)
    assert p.returncode == check, (p.returncode, p.stderr)
    return p


def test_a_relative_home_works_from_another_directory(tmp_path):
    """init with --home given relative to where it ran; the node is then used from elsewhere (a
    systemd unit, cron) by its absolute path, and from a moved copy of the directory tree."""
    work = tmp_path / "work"
    work.mkdir()
    _init(tmp_path, "node", cwd=work)
    home = work / "node"
    with sqlite3.connect(home / "store.sqlite") as c:
        ks = json.loads(c.execute("SELECT value FROM meta WHERE key='keystore'").fetchone()[0])
    assert ks["dir"] == "keystore", ks  # inside the home: stored relative to it, so the home can move
    p = run_cli("--home", home, "write", "app.readings", "--key", '{"device": "d", "seq": 1}',
                "--set", '{"temp": 1.5}', cwd="/")
    assert p.returncode == 0, p.stderr
    # and a relative --keystore dir is stored absolute too
    _init(tmp_path, "n2", "--keystore", '{"kind": "software", "dir": "keys2"}', cwd=work)
    p = run_cli("--home", work / "n2", "write", "app.readings", "--key", '{"device": "d", "seq": 1}',
                "--set", '{"temp": 1.5}', cwd="/")
    assert p.returncode == 0, p.stderr


def test_peer_add_refuses_to_replace_a_known_key_without_replace(tmp_path):
    h = tmp_path / "h"
    _init(tmp_path, h)
    site = "ab" * 16
    k1, k2 = "01" * 32, "02" * 32
    assert run_cli("--home", h, "peer", "add", "--site-id", site, "--public-key", k1).returncode == 0
    # the same key again: nothing to replace, fine
    assert run_cli("--home", h, "peer", "add", "--site-id", site, "--public-key", k1).returncode == 0
    p = run_cli("--home", h, "peer", "add", "--site-id", site, "--public-key", k2)
    assert p.returncode == 2 and "--replace" in p.stderr, (p.returncode, p.stderr)
    peers_ = {e["site_id"]: e for e in json.loads(run_cli("--home", h, "peer", "list").stdout)}
    assert peers_[site]["public_key"] == k1
    p = run_cli("--home", h, "peer", "add", "--site-id", site, "--public-key", k2, "--replace")
    assert p.returncode == 0, p.stderr
    peers_ = {e["site_id"]: e for e in json.loads(run_cli("--home", h, "peer", "list").stdout)}
    assert peers_[site]["public_key"] == k2 and peers_[site]["source"] == "operator"


def test_peer_list_and_remove(tmp_path):
    h = tmp_path / "h"
    info = json.loads(_init(tmp_path, h).stdout)
    listed = json.loads(run_cli("--home", h, "peer", "list").stdout)
    by_site = {e["site_id"]: e for e in listed}
    assert by_site[info["site_id"]]["source"] == "self"
    manifest_peer = next(s for s, e in by_site.items() if e["source"] == "manifest")
    site = "cd" * 16
    assert run_cli("--home", h, "peer", "add", "--site-id", site, "--public-key", "03" * 32,
                   "--retired-after", "1764669600000.0").returncode == 0
    e = {e["site_id"]: e for e in json.loads(run_cli("--home", h, "peer", "list").stdout)}[site]
    assert e["retired_after"] == "1764669600000.0"
    p = run_cli("--home", h, "peer", "remove", "--site-id", site)
    assert p.returncode == 0 and json.loads(p.stdout)["removed"] == site, p.stderr
    assert site not in {e["site_id"] for e in json.loads(run_cli("--home", h, "peer", "list").stdout)}
    # refusals: an unknown peer, the node itself
    p = run_cli("--home", h, "peer", "remove", "--site-id", site)
    assert p.returncode == 2 and "not in the keyring" in p.stderr, p.stderr
    p = run_cli("--home", h, "peer", "remove", "--site-id", info["site_id"])
    assert p.returncode == 2 and "own" in p.stderr, p.stderr
    assert run_cli("--home", h, "peer", "remove", "--site-id", manifest_peer).returncode == 0


def test_an_integer_for_a_real_column_is_refused_with_a_hint(tmp_path):
    h = tmp_path / "h"
    _init(tmp_path, h)
    p = run_cli("--home", h, "write", "app.readings", "--key", '{"device": "d", "seq": 1}', "--set", '{"temp": 20}')
    assert p.returncode == 2, p.stderr
    assert "20.0" in p.stderr, p.stderr  # the hint: write it as a real
    assert run_cli("--home", h, "write", "app.readings", "--key", '{"device": "d", "seq": 1}',
                   "--set", '{"temp": 20.0}').returncode == 0


def test_an_unknown_keystore_kind_is_refused_with_exit_2(tmp_path):
    p = _init(tmp_path, tmp_path / "h", "--keystore", '{"kind": "tpm"}', check=2)
    assert "software" in p.stderr and "pkcs11" in p.stderr
    assert not (tmp_path / "h" / "store.sqlite").exists()


def test_a_typod_retention_class_is_refused(tmp_path):
    bad = TABLES.replace('retention = "telemetry"', 'retention = "telemtry"')
    p = _init(tmp_path, tmp_path / "h", tables=bad, check=2)
    assert "telemtry" in p.stderr and "telemetry" in p.stderr, p.stderr
    assert not (tmp_path / "h" / "store.sqlite").exists()
    # a profile that keeps everything (the gateway: no horizons) has nothing to check against
    _init(tmp_path, tmp_path / "gw", "--profile", "gateway", tables=bad)
    # `table create` checks it against the node's profile too
    h = tmp_path / "h2"
    _init(tmp_path, h)
    spec = {"schema": "app", "name": "t2", "category": "syncable", "retention": "recrods", "key": ["id"],
            "columns": {"id": "text"}}
    p = run_cli("--home", h, "table", "create", "--spec", json.dumps(spec))
    assert p.returncode == 2 and "recrods" in p.stderr, p.stderr




def test_a_copied_home_is_refused_and_a_moved_home_follows(tmp_path):
    """`cp -a` of a live home would sign as the original's site_id from two places (HLC reuse,
    §13.5): refused (exit 2) while the original holds the node. A moved home (the original gone)
    just works, and then the old place's copy is the one refused."""
    h = tmp_path / "h"
    _init(tmp_path, h)
    w = ("write", "app.readings", "--key", '{"device": "d", "seq": 1}', "--set", '{"temp": 1.5}')
    assert run_cli("--home", h, *w).returncode == 0
    shutil.copytree(h, tmp_path / "copy", symlinks=True)
    p = run_cli("--home", tmp_path / "copy", *w)
    assert p.returncode == 2 and "copy" in p.stderr and str(h) in p.stderr, (p.returncode, p.stderr)
    assert run_cli("--home", tmp_path / "copy", "dump").returncode == 0  # reading a copy is harmless
    # moved: the original is gone, the node follows its home
    shutil.rmtree(tmp_path / "copy")
    h.rename(tmp_path / "moved")
    assert run_cli("--home", tmp_path / "moved", *w).returncode == 0
    shutil.copytree(tmp_path / "moved", h, symlinks=True)  # a stale copy back at the old place
    p = run_cli("--home", h, *w)
    assert p.returncode == 2 and str(tmp_path / "moved") in p.stderr, p.stderr
