"""`ssp-agent --home DIR sequencer ...` exactly as docs/cli.md "Sequencer" and docs/sequencer.md say, driven as
subprocesses (real SQLite, real software keystore, real concurrent processes)."""
from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor

from agent.sequencer import receipts
from agent.sequencer.framing import CT_PROPOSAL, encode_private_message
from tests.cli_cmd import agent_cmd, agent_env

G = "d4" * 16


def run(home, *args, check=None):
    p = subprocess.run([*agent_cmd(), "--home", str(home), "sequencer", *args],
                       capture_output=True, text=True, env=agent_env())
    if check is not None:
        assert p.returncode == check, (p.returncode, p.stdout, p.stderr)
    return p


def out(p):
    return json.loads(p.stdout)


def write(tmp_path, name, data):
    f = tmp_path / name
    f.write_bytes(data)
    return str(f)


def test_sequencer_verbs_end_to_end(tmp_path):
    home = tmp_path / "seq"
    key = out(run(home, "init", check=0))["sequencer_key"]
    assert len(key) == 66 and key[:2] in ("02", "03")
    assert "already holds a sequencer" in run(home, "init", check=2).stderr
    run(home, "register", "--group", G, "--epoch", "3", check=0)
    run(home, "register", "--group", G, "--epoch", "3", check=2)
    a = out(run(home, "submit", write(tmp_path, "a", encode_private_message(bytes.fromhex(G), 3, ciphertext=b"a")),
                check=0))
    assert set(a) == {"accepted", "group", "epoch", "receipt"} and a["accepted"] is True
    assert (a["group"], a["epoch"]) == (G, 3)
    r = receipts.verify_receipt(bytes.fromhex(a["receipt"]), bytes.fromhex(key))
    assert (r.group_id.hex(), r.epoch, r.previous_receipt_hash) == (G, 3, None)
    b = out(run(home, "submit", write(tmp_path, "b", encode_private_message(bytes.fromhex(G), 3, ciphertext=b"b")),
                check=2))
    assert b == {"accepted": False, "reason": "stale_epoch", "group": G, "current_epoch": 4, "head": a["receipt"]}
    p = out(run(home, "submit", write(tmp_path, "p", encode_private_message(bytes.fromhex(G), 4, CT_PROPOSAL)),
                check=2))
    assert p["reason"] == "not_commit" and p["current_epoch"] == 4
    u = out(run(home, "submit", write(tmp_path, "u", b"\x00\x01\x00\x02\xff"), check=2))
    assert u["reason"] == "unparseable" and u["group"] is None
    # bootstrap: a group never seen is initialised by its first Commit
    other = "e5" * 8
    n = out(run(home, "submit", write(tmp_path, "n", encode_private_message(bytes.fromhex(other), 9)), check=0))
    assert n["epoch"] == 9
    assert out(run(home, "receipt", "--group", G, "--epoch", "3", check=0)) == {"receipt": a["receipt"]}
    assert out(run(home, "receipt", "--group", G, "--epoch", "4", check=0)) == \
        {"receipt": None, "absent": True, "discontinuity": False}
    st = out(run(home, "status", check=0))
    assert st["sequencer_key"] == key
    groups = {g["group"]: g for g in st["groups"]}
    assert groups[G]["current_epoch"] == 4 and groups[G]["head"]["epoch"] == 3
    assert groups[G]["head"]["receipt_hash"] == receipts.receipt_hash(bytes.fromhex(a["receipt"])).hex()
    assert groups[other]["origin"] == "bootstrap" and groups[G]["discontinuities"] == []
    assert st["layout_version"] == 3 and st["held"] == []
    assert st["journal"]["entries"] >= 2 and st["journal"]["bytes"] > 8   # the signing journal (compaction)


def test_concurrent_commits_from_several_processes_exactly_one_accepted(tmp_path):
    """Eight members submit competing Commits for one epoch at once, each its own process:
    exactly one is accepted; every other is told to rebuild on the winner's receipt."""
    home = tmp_path / "seq"
    run(home, "init", check=0)
    run(home, "register", "--group", G, "--epoch", "0", check=0)
    files = [write(tmp_path, f"m{i}", encode_private_message(bytes.fromhex(G), 0, ciphertext=b"member%d" % i))
             for i in range(8)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda f: run(home, "submit", f), files))
    won = [out(p) for p in results if p.returncode == 0]
    lost = [out(p) for p in results if p.returncode == 2]
    assert len(won) == 1 and len(lost) == 7
    for ans in lost:
        assert ans["reason"] == "stale_epoch" and ans["current_epoch"] == 1 and ans["head"] == won[0]["receipt"]
    assert out(run(home, "receipt", "--group", G, "--epoch", "0", check=0))["receipt"] == won[0]["receipt"]


def test_open_on_a_missing_home_is_refused(tmp_path):
    assert run(tmp_path / "nothing", "status").returncode == 2


import pytest  # noqa: E402


@pytest.mark.parametrize("kind", ["softhsm", "serial"])
def test_sequencer_on_protected_keystores(tmp_path, kind, request):
    """The receipt key generated inside a SoftHSM2 token / the serial keystore device; receipts
    signed there (randomised ES256) verify; the PIN never reaches the state database."""
    conf = request.getfixturevalue("softhsm_conf" if kind == "softhsm" else "serial_conf")
    home = tmp_path / "seq"
    key = bytes.fromhex(out(run(home, "init", "--keystore", json.dumps(conf), check=0))["sequencer_key"])
    run(home, "register", "--group", G, "--epoch", "0", check=0)
    prev = None
    for e in range(3):
        a = out(run(home, "submit", write(tmp_path, f"m{e}", encode_private_message(bytes.fromhex(G), e)), check=0))
        r = receipts.verify_receipt(bytes.fromhex(a["receipt"]), key)
        assert r.previous_receipt_hash == prev
        prev = r.receipt_hash
    assert b"246810" not in (home / "sequencer.db").read_bytes()
    assert out(run(home, "status", check=0))["keystore"]["kind"] == ("pkcs11" if kind == "softhsm" else "serial")
