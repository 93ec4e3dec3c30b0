"""A keystore request that cannot be right is refused before anything is made, by both homes that
take one: the node's `init --keystore` and `sequencer init --keystore` (exit 2, one line, no
home left behind). Before: the sequencer had no such check, so `{"kind": 5}` or a config
lacking a field was a keystore fault (exit 1), and a field of the wrong type (`"dir": 7`) was a
traceback from deep in the keystore (exit 1) for either command."""
from __future__ import annotations

import json

import pytest

from agent.simpeer import manifest_text, readings_table
from firmware_bridge.keystore import KeystoreConfigError, check_config
from tests.cli_cmd import run_cli

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")
BAD = [{"kind": 5}, {"kind": "software", "dir": 7}, {"kind": "pkcs11"},
       {"kind": "pkcs11", "module": "/m.so", "token_label": "t"},                     # no PIN
       {"kind": "pkcs11", "module": ["/m.so"], "token_label": "t", "pin": "1"},
       {"kind": "pkcs11", "module": "/m.so", "token_label": "t", "pin": 1234},
       {"kind": "pkcs11", "module": "/m.so", "token_label": "t", "pin": "1", "env": {"A": 1}},
       {"kind": "pkcs11", "module": "/m.so", "token_label": "t", "pin": "1", "timeout_s": "soon"},
       {"kind": "serial", "device": "/dev/null"}, {"kind": "serial", "port": "/dev/x", "baud": "fast"},
       {"kind": "serial", "port": "/dev/x", "baud": 10 ** 30}, {"kind": "serial", "port": "/dev/x", "timeout_s": -1}]


def test_check_config_refuses_what_cannot_be_right():
    assert check_config({"kind": "software"}) == {"kind": "software"}
    assert check_config({"kind": "serial", "port": "/dev/ttyACM0", "baud": 115200})["port"] == "/dev/ttyACM0"
    for bad in BAD + [[], None, "software"]:
        with pytest.raises(KeystoreConfigError):
            check_config(bad)


@pytest.mark.parametrize("bad", BAD[:4] + [BAD[9]])
def test_both_inits_refuse_a_bad_keystore_and_leave_no_home(tmp_path, bad):
    mf = tmp_path / "m.toml"
    mf.write_text(manifest_text(MESH, readings_table(retention="telemetry")))
    for argv, made in ((["init", "--manifest", str(mf)], "store.sqlite"), (["sequencer", "init"], "sequencer.db")):
        h = tmp_path / ("h-" + argv[0])
        p = run_cli("--home", h, *argv, "--keystore", json.dumps(bad))
        assert p.returncode == 2 and "Traceback" not in p.stderr and p.stderr.count("\n") == 1, (argv, bad, p.stderr)
        assert not (h / made).exists()


def test_a_failed_sequencer_init_leaves_no_pin(tmp_path, softhsm_conf):
    """As the node's init (test_init_failure.py): a PKCS#11 `sequencer init` that fails (a wrong
    token label, a wrong PIN) leaves no keystore.pin behind, and the same home initialises once
    the argument is fixed. Before: the PIN stayed in HOME/keystore.pin of the failed home."""
    env = softhsm_conf["env"]
    conf = {k: v for k, v in softhsm_conf.items() if k != "env"}
    h = tmp_path / "seq"
    for bad in ({**conf, "token_label": "no-such-token"}, {**conf, "pin": "000000"}):
        p = run_cli("--home", h, "sequencer", "init", "--keystore", json.dumps(bad), env=env)
        assert p.returncode == 1, (p.returncode, p.stderr)          # the keystore is unavailable: a fault
        assert not (h / "keystore.pin").exists() and not (h / "sequencer.db").exists()
    p = run_cli("--home", h, "sequencer", "init", "--keystore", json.dumps(conf), env=env)
    assert p.returncode == 0, p.stderr
    assert (h / "keystore.pin").exists()
