"""A PIN expected in an environment variable that is not set is a local fault (exit 1, as every
keystore fault), not a refusal (exit 2): the unit's `RestartPreventExitStatus=2` would then never
retry a service started before its environment was complete (docs/keystore.md)."""
from __future__ import annotations

import json

from agent.simpeer import manifest_text, readings_table
from tests.cli_cmd import run_cli

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")


def test_a_missing_pin_variable_is_a_fault_not_a_refusal(tmp_path, softhsm_conf):
    conf = {k: v for k, v in softhsm_conf.items() if k not in ("pin", "env")}
    conf["pin_env"] = "SSP_TEST_TOKEN_PIN"
    env = {**softhsm_conf["env"], "SSP_TEST_TOKEN_PIN": softhsm_conf["pin"]}
    m = tmp_path / "m.toml"
    m.write_text(manifest_text(MESH, readings_table()))
    home = tmp_path / "h"
    p = run_cli("--home", home, "init", "--manifest", m, "--keystore", json.dumps(conf), env=env)
    assert p.returncode == 0, p.stderr
    write = ("--home", home, "write", "app.readings", "--key", '{"device": "d", "seq": 1}', "--set", '{"temp": 1.0}')
    assert run_cli(*write, env=env).returncode == 0
    env.pop("SSP_TEST_TOKEN_PIN")
    p = run_cli(*write, env=env)
    assert p.returncode == 1, (p.returncode, p.stderr)
    assert "SSP_TEST_TOKEN_PIN" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr
