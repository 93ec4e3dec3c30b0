"""Misconfigurations that used to report success are refused with what to do (exit 2):
`sync --once` with no broker given or configured (it started a private mosquitto and synced with
nobody), and a device connecting with another device's broker account under the per-device ACLs
of docs/mqtt.md (the broker accepts the login and silently drops every publish under the
device's own name: `sync --once` exited 0 with nothing delivered and `check` said OK)."""
from __future__ import annotations

import json

from tests.cli_cmd import run_cli

from .test_broker_security import docs_broker, make_pki

MANIFEST = ('mesh_id = "5e5e0000000000000000000000000042"\n[[tables]]\nschema = "app"\nname = "readings"\n'
            'category = "syncable"\nkey = ["device", "seq"]\ncolumns = { device = "text", seq = "integer", '
            'temp = "real" }\n')


def _init(tmp_path, name: str) -> tuple:
    man = tmp_path / "mesh.toml"
    man.write_text(MANIFEST)
    home = tmp_path / name
    p = run_cli("--home", home, "init", "--manifest", man)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    return home, out["site_id"], out["public_key"]


def _no_config(tmp_path) -> dict:
    conf = tmp_path / "agent.toml"
    conf.write_text("")
    return {"SSP_AGENT_CONFIG": str(conf), "SSP_MQTT_BROKER": ""}


def test_sync_once_without_a_broker_is_refused(tmp_path):
    home, _site, _pk = _init(tmp_path, "dev")
    p = run_cli("--home", home, "sync", "--once", "--timeout", "5", env=_no_config(tmp_path))
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "--broker" in p.stderr and "private mosquitto" not in p.stderr, p.stderr
    assert p.stdout == ""


def test_a_device_on_another_devices_broker_account_is_refused(tmp_path):
    d1, s1, pk1 = _init(tmp_path, "d1")
    d2, s2, pk2 = _init(tmp_path, "d2")
    for home, site, pk in ((d1, s2, pk2), (d2, s1, pk1)):
        assert run_cli("--home", home, "peer", "add", "--site-id", site, "--public-key", pk).returncode == 0
    assert run_cli("--home", d2, "write", "app.readings", "--key", '{"device":"d2","seq":1}',
                   "--set", '{"temp":1.0}').returncode == 0
    pki = make_pki(tmp_path / "pki", [])
    pw = {s1: "one-secret", s2: "two-secret"}
    broker = docs_broker(tmp_path, pki, pw)
    url = f"mqtts://127.0.0.1:{broker.port}"
    env = _no_config(tmp_path)

    def sync(home, user):
        return run_cli("--home", home, "sync", "--once", "--timeout", "5", "--broker", url, "--ca-file", pki["ca"],
                       "--username", user, env={**env, "SSP_MQTT_PASSWORD": pw[user]})

    def check(home, user):
        p = run_cli("--home", home, "check", "--json", "--broker", url, "--ca-file", pki["ca"], "--username", user,
                    env={**env, "SSP_MQTT_PASSWORD": pw[user]})
        return p.returncode, {ln["check"]: ln for ln in json.loads(p.stdout)["checks"]}

    try:
        # d2 with d1's account: the broker accepts the login and drops its publishes
        p = sync(d2, s1)
        assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
        assert s1 in p.stderr and s2 in p.stderr and "docs/mqtt.md" in p.stderr, p.stderr
        rc, lines = check(d2, s1)
        assert rc == 4 and lines["broker"]["status"] == "FAIL", lines["broker"]
        assert s2 in lines["broker"]["message"], lines["broker"]
        # with its own account the same device syncs, and check's broker line is OK
        p = sync(d2, s2)
        assert p.returncode == 0, p.stderr
        rc, lines = check(d2, s2)
        assert lines["broker"]["status"] == "OK", lines["broker"]
    finally:
        broker.close()
