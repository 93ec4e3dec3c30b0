"""The mailbox path as a link (docs/protocol.md §6): a refused import changes nothing, an export
that cannot be written whole fails and moves nothing, and the cursor moves only on the peer's
answer (a signed `sovm/ssp-mailbox-ack-v1` record in the peer's next file, §14.1)."""
from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
from pathlib import Path

import cbor2
import pytest

from tests.cli_cmd import agent_cmd, agent_env

from .helpers import MESH, TABLES


def cli(*args, env, ok=True):
    p = subprocess.run([*agent_cmd(), *map(str, args)], capture_output=True, text=True, env=agent_env(env))
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def snapshot(home: Path) -> dict:
    """Everything a home holds: the store's full SQL dump (schema, every table, meta, policy rows)
    and the bytes of every other file (journal, identity), SQLite's WAL/SHM aside."""
    out = {}
    with sqlite3.connect(f"file:{home}/store.sqlite?mode=ro", uri=True) as c:
        out["store"] = list(c.iterdump())
    for p in sorted(home.rglob("*")):
        if p.is_file() and not p.name.startswith("store.sqlite"):
            out[str(p.relative_to(home))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ, SSP_AGENT_WITNESS_DIR=str(tmp_path / "w"))
    man = tmp_path / "m.toml"
    man.write_text(f'mesh_id = "{MESH.hex()}"\n' + TABLES)
    e["_MAN"] = str(man)
    return e


def init(home: Path, env) -> dict:
    return json.loads(cli("--home", home, "init", "--manifest", env["_MAN"], env=env).stdout)


def _good_body(tmp_path, env, home: Path) -> bytes:
    """A well-formed mailbox body from another home of the same mesh, whose key `home` trusts."""
    src = tmp_path / "src"
    ident = init(src, env)
    cli("--home", home, "peer", "add", "--site-id", ident["site_id"], "--public-key", ident["public_key"], env=env)
    cli("--home", src, "write", "app.readings", "--key", '{"device": "s", "seq": 1}', "--set", '{"temp": 1.5}', env=env)
    f = tmp_path / "good.cbor"
    cli("--home", src, "mailbox", "export", "--peer", "ab" * 16, "--out", f, env=env)
    return f.read_bytes()


@pytest.mark.parametrize("case", ["not_a_map", "trailing_bytes", "version_2", "events_not_bytes"])
def test_a_refused_import_changes_nothing_in_a_fresh_home(tmp_path, env, case):
    """Issue 10: a refused `mailbox import` created the sync tables and the default policy rows
    before the strict parser refused the body. The refusal must come before any write."""
    home = tmp_path / "a"
    init(home, env)
    good = _good_body(tmp_path, env, home)
    body = cbor2.loads(good)
    data = {"not_a_map": b"\x82\x01\x02", "trailing_bytes": good + b"\x00",
            "version_2": cbor2.dumps({**body, "ssp_version": 2}),
            "events_not_bytes": cbor2.dumps({**body, "events": [1]})}[case]
    before = snapshot(home)
    bad = tmp_path / "bad.cbor"
    bad.write_bytes(data)
    p = cli("--home", home, "mailbox", "import", bad, env=env, ok=False)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "nothing was changed" in p.stderr
    assert snapshot(home) == before
    # the same home then imports a good body normally
    ok = tmp_path / "ok.cbor"
    ok.write_bytes(good)
    assert json.loads(cli("--home", home, "mailbox", "import", ok, env=env).stdout)["applied"] == 1


@pytest.fixture
def small_fs(tmp_path):
    """A real, small filesystem (a tmpfs of 32 KiB), like a nearly full USB stick."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "stick"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _mailbox_state(home: Path, peer: bytes) -> tuple:
    with sqlite3.connect(f"file:{home}/store.sqlite?mode=ro", uri=True) as c:
        names = {n for (n,) in c.execute("SELECT name FROM sqlite_master")}
        cur = c.execute("SELECT live, bf_next FROM sync_cursors WHERE peer=? AND path='mailbox'", (peer,)).fetchall() \
            if "sync_cursors" in names else []
        rec = c.execute("SELECT count(*) FROM records_delivered WHERE peer=? AND path='mailbox'", (peer,)).fetchone()[0] \
            if "records_delivered" in names else 0
        sent = c.execute("SELECT count(*) FROM sent_bodies WHERE peer=? AND path='mailbox'", (peer,)).fetchone()[0] \
            if "sent_bodies" in names else 0
    return cur, rec, sent


def test_export_onto_a_full_filesystem_fails_and_moves_nothing(tmp_path, env, small_fs):
    """Issue 10 item 8: an export onto a full USB stick wrote a truncated file, exited 0 and moved
    the cursor. It must exit 1 with one line, leave no file, and move nothing."""
    from agent.node import Node
    homes = [tmp_path / "a", tmp_path / "b"]
    ids = [init(h, env) for h in homes]
    cli("--home", homes[0], "peer", "add", "--site-id", ids[1]["site_id"], "--public-key", ids[1]["public_key"], env=env)
    a = Node.open(homes[0])
    for i in range(300):  # ~100 KiB of events: more than the stick holds
        a.write("app.readings", {"device": "a", "seq": i}, {"temp": float(i), "note": "x" * 100})
    a.close()
    peer = bytes.fromhex(ids[1]["site_id"])
    before = _mailbox_state(homes[0], peer)
    out = small_fs / "to-b.cbor"
    p = cli("--home", homes[0], "mailbox", "export", "--peer", ids[1]["site_id"], "--out", out, env=env, ok=False)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "No space left" in p.stderr, p.stderr
    assert list(small_fs.iterdir()) == []  # neither a truncated file nor a temporary
    after = _mailbox_state(homes[0], peer)
    assert after == before == ([], 0, 0)
    # written elsewhere, the same export works and the peer takes in all 300 events
    ok = tmp_path / "to-b.cbor"
    assert json.loads(cli("--home", homes[0], "mailbox", "export", "--peer", ids[1]["site_id"], "--out", ok,
                          env=env).stdout)["events"] == 300
    cli("--home", homes[1], "peer", "add", "--site-id", ids[0]["site_id"], "--public-key", ids[0]["public_key"], env=env)
    assert json.loads(cli("--home", homes[1], "mailbox", "import", ok, env=env).stdout)["applied"] == 300
