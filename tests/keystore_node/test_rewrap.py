"""`ssp-agent keystore rewrap --to JSON` (docs/reliability.md "At rest"): the
data keys of a home's sealed log are sealed again by another keystore's seal key, here a real
SoftHSM2 token taking over from the software keystore. Afterwards the log opens with the token
only (the software keystore's seal key file is deleted, the old wrapped keys are nowhere in the
home's files), the raw files hold no payload marker, and a re-wrap killed at either side of its
one commit is harmless (before: the home opens as it was) or completed by running it again."""
from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from agent.node import Node
from agent.simpeer import SimPeer, manifest_text, readings_table
from agent.store import atrest
from agent.sync import import_mailbox_body
from tests.cli_cmd import agent_cmd, agent_env
from tests.keystore_node.test_atrest import _leaks

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")
T = "app.readings"
NOW = 1_764_669_600_000
ROOT = Path(__file__).resolve().parents[2]
PRODUCER = Path(__file__).with_name("rewrap_producer.py")
MARKERS = {"MARK-IGNORED": b"MARK-IGNORED-5d1e88", "MARK-HELD": b"MARK-HELD-90ac13"}


def _cli(home, *args, env=None):
    return subprocess.run([*agent_cmd(), "--home", str(home), *args], capture_output=True, text=True,
                          env=agent_env(env), timeout=120)


def _software_home(tmp_path) -> tuple[Path, list[bytes]]:
    """A software home that wrote 10 events and holds values found in no local table (§13.6)."""
    peer = SimPeer(MESH)
    node, _ = Node.init(tmp_path / "a", manifest_text(MESH, readings_table(), [peer]), {"kind": "software"})
    try:
        node.write_many([(T, {"device": "w", "seq": i}, {"temp": 1.5 + i}, False) for i in range(10)])
        ignored = peer.event(T, {"device": "p", "seq": 1}, {"temp": 2.0, "secret": "MARK-IGNORED-5d1e88"}, (NOW, 0))
        held = peer.event("app.vault", {"id": "v1"}, {"body": "MARK-HELD-90ac13"}, (NOW, 1))
        assert import_mailbox_body(node, peer.body([ignored, held]))["applied"] == 1
        wrapped = [bytes(w) for (w,) in node.conn.execute("SELECT wrapped FROM atrest_keys")]
    finally:
        node.close()
    return node.home, wrapped


def _token_json(conf: dict) -> str:
    return json.dumps(conf)


def _token_env(conf: dict) -> dict:
    return dict(conf.get("env") or {})


def _reinit_token(conf: dict) -> None:
    """Another token in place of this one (same label and PIN, no seal key)."""
    sconf = conf["env"]["SOFTHSM2_CONF"]
    tokens = os.path.join(os.path.dirname(sconf), "tokens")
    shutil.rmtree(tokens)
    os.mkdir(tokens)
    subprocess.run(["softhsm2-util", "--init-token", "--free", "--label", conf["token_label"],
                    "--so-pin", "87654321", "--pin", conf["pin"]], check=True, capture_output=True,
                   env=dict(os.environ, SOFTHSM2_CONF=sconf))


def _opens_and_reads(home) -> int:
    """A writing open, one write, every sealed value read back: the count of events."""
    p = _cli(home, "write", T, "--key", json.dumps({"device": "after", "seq": 1}), "--set", '{"temp": 9.5}')
    assert p.returncode == 0, p.stderr
    with Node.open(home) as node:
        raws = node.conn.execute("SELECT unseal(event_id, raw) FROM events").fetchall()
        held = node.conn.execute("SELECT unseal(event_id, raw) FROM held").fetchall()
    assert held and all(r is not None for (r,) in raws + held)
    return len(raws)


def _seal_key_file(home) -> Path:
    return Path(home) / "keystore" / "store-seal.seal"


def _assert_moved(home, old_wrapped: list[bytes], softhsm_conf) -> None:
    """Sealed by the token only: the software seal key is gone, the old wrapped keys are in no file,
    the raw files hold no marker; with another token in place the home does not open."""
    assert not _seal_key_file(home).exists()
    needles = dict(MARKERS)
    needles.update({f"old wrapped data key {i}": w for i, w in enumerate(old_wrapped)})
    needles["token PIN"] = softhsm_conf["pin"].encode()
    leaks = [x for x in _leaks(home, needles) if not x.startswith("token PIN in seal-keystore")]
    assert leaks == []
    st = json.loads(_cli(home, "keystore", "show").stdout)["at_rest"]
    assert st["seal_keystore"]["kind"] == "pkcs11" and st["rewrap"] is None, st


def test_rewrap_moves_the_seal_from_the_software_keystore_to_a_softhsm_token(tmp_path, softhsm_conf):
    home, old_wrapped = _software_home(tmp_path)
    before = _opens_and_reads(home)
    p = _cli(home, "keystore", "rewrap", "--to", _token_json(softhsm_conf))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["rewrapped"] == 1 and out["seal_keystore"]["kind"] == "pkcs11", out
    assert out["old_seal_key"] == "deleted", out
    _assert_moved(home, old_wrapped, softhsm_conf)
    assert _opens_and_reads(home) == before + 1
    # a rotation now wraps the new data key with the token
    p = _cli(home, "keystore", "rotate-data-key")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["at_rest"]["data_keys"][0]["key_id"] == 2
    assert _opens_and_reads(home) == before + 2
    # the token is what opens it: another token in its place, and the writing open stops
    _reinit_token(softhsm_conf)
    p = _cli(home, "write", T, "--key", '{"device": "x", "seq": 1}', "--set", '{"temp": 1.0}')
    assert p.returncode == 1, (p.returncode, p.stderr)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "sealed by its pkcs11 keystore" in lines[0], p.stderr
    assert _cli(home, "dump").returncode == 0       # the read verbs read no sealed value


def test_rewrap_refuses_the_keystore_that_already_seals_the_log(tmp_path):
    home, _ = _software_home(tmp_path)
    p = _cli(home, "keystore", "rewrap", "--to", json.dumps({"kind": "software", "dir": str(home / "keystore")}))
    assert p.returncode == 2 and "already" in p.stderr, (p.returncode, p.stderr)
    p = _cli(home, "keystore", "rewrap", "--to", '{"kind": "pkcs11"}')
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert _seal_key_file(home).exists()


@pytest.mark.parametrize("point", ["rewrap-wrapped", "rewrap-committed"])
def test_an_interrupted_rewrap_is_harmless_and_completes_when_run_again(tmp_path, softhsm_conf, point):
    """Killed after the token sealed the data keys but before the store's one commit: the home is
    as it was (opens with the software keystore). Killed after the commit, before the old seal key
    is deleted: the home opens with the token; running the verb again deletes it."""
    home, old_wrapped = _software_home(tmp_path)
    env = agent_env({"PYTHONPATH": str(ROOT), "SSP_CRASH": f"{point}:1"})
    p = subprocess.run([sys.executable, str(PRODUCER), "--home", str(home), "keystore", "rewrap", "--to",
                        _token_json(softhsm_conf)], capture_output=True, text=True, env=env, cwd=str(ROOT),
                       timeout=120)
    assert p.returncode == -9, (p.returncode, p.stderr)
    conn = sqlite3.connect(home / "store.sqlite")
    sealed_by = atrest.status(conn)
    conn.close()
    if point == "rewrap-wrapped":
        assert _seal_key_file(home).exists() and sealed_by.get("seal_keystore") is None, sealed_by
    else:
        assert sealed_by["seal_keystore"]["kind"] == "pkcs11" and sealed_by["rewrap"] is not None, sealed_by
    n = _opens_and_reads(home)                    # either way the home opens and reads every value
    p = _cli(home, "keystore", "rewrap", "--to", _token_json(softhsm_conf))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["old_seal_key"] == "deleted"
    _assert_moved(home, old_wrapped, softhsm_conf)
    assert _opens_and_reads(home) == n + 1


def test_a_rewrap_to_another_keystore_first_finishes_an_interrupted_one(tmp_path, softhsm_conf):
    """Killed after its commit, a re-wrap leaves the previous keystore's seal key to destroy; a
    re-wrap to yet another keystore must not forget that (it recorded only its own predecessor, so
    the software seal key file stayed on the card for good)."""
    home, old_wrapped = _software_home(tmp_path)
    env = agent_env({"PYTHONPATH": str(ROOT), "SSP_CRASH": "rewrap-committed:1"})
    p = subprocess.run([sys.executable, str(PRODUCER), "--home", str(home), "keystore", "rewrap", "--to",
                        _token_json(softhsm_conf)], capture_output=True, text=True, env=env, cwd=str(ROOT),
                       timeout=120)
    assert p.returncode == -9, (p.returncode, p.stderr)
    elsewhere = tmp_path / "other-keystore"
    p = _cli(home, "keystore", "rewrap", "--to", json.dumps({"kind": "software", "dir": str(elsewhere)}))
    assert p.returncode == 0, p.stderr
    assert not _seal_key_file(home).exists()              # the first re-wrap's predecessor: destroyed
    assert (elsewhere / "store-seal.seal").exists()
    st = json.loads(_cli(home, "keystore", "show").stdout)["at_rest"]
    assert st["seal_keystore"] == {"kind": "software", "dir": str(elsewhere)} and st["rewrap"] is None, st
    _opens_and_reads(home)
