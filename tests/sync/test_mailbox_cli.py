"""The mailbox round trip through the CLI between three homes (docs/cli.md `mailbox`,
`policy`), as an operator carrying files between sites would run it."""
from __future__ import annotations

import json
import os
import subprocess

from tests.cli_cmd import agent_cmd, agent_env

from .helpers import MESH, TABLES


def run(*args, env, ok=True):
    p = subprocess.run([*agent_cmd(), *map(str, args)], capture_output=True, text=True, env=agent_env(env))
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def test_mailbox_round_trip_three_homes(tmp_path):
    env = dict(os.environ, SSP_AGENT_WITNESS_DIR=str(tmp_path / "w"))
    man = tmp_path / "m.toml"
    man.write_text(f'mesh_id = "{MESH.hex()}"\n' + TABLES)
    homes = [tmp_path / n for n in ("a", "b", "c")]
    ids = [json.loads(run("--home", h, "init", "--manifest", man, env=env).stdout) for h in homes]
    for h in homes:
        for i in ids:
            if not (h / "identity.json").read_text().count(i["site_id"]):
                run("--home", h, "peer", "add", "--site-id", i["site_id"], "--public-key", i["public_key"], env=env)
    # each home writes its own rows
    for n, h in enumerate(homes):
        for s in range(3):
            run("--home", h, "write", "app.readings", "--key", json.dumps({"device": f"d{n}", "seq": s}),
                "--set", json.dumps({"temp": 20.0 + n + s / 10}), env=env)
    run("--home", homes[0], "write", "app.notes", "--key", '{"id": "x"}', "--set", '{"body": "from a"}', env=env)
    # a -> b, b -> c (relays a's events), c -> a and c -> b: a ring of files
    def carry(src, dst, name):
        f = tmp_path / name
        out = json.loads(run("--home", homes[src], "mailbox", "export", "--peer", ids[dst]["site_id"], "--out", f,
                             env=env).stdout)
        res = json.loads(run("--home", homes[dst], "mailbox", "import", f, env=env).stdout)
        assert res["rejected"] == 0 and res["dropped"] == 0
        return out, res
    out, res = carry(0, 1, "ab.cbor")
    assert out["events"] == 4 and res["applied"] == 4
    out, res = carry(1, 2, "bc.cbor")
    assert res["applied"] == 7  # b's own three and a's four
    carry(2, 0, "ca.cbor")
    carry(2, 1, "cb.cbor")
    carry(0, 1, "ab2.cbor")
    out, _ = carry(1, 0, "ba.cbor")
    dumps = [json.loads(run("--home", h, "dump", env=env).stdout) for h in homes]
    assert dumps[0] == dumps[1] == dumps[2]
    assert len(dumps[0]["app.readings"]) == 9 and len(dumps[0]["app.notes"]) == 1
    logs = [sorted(run("--home", h, "log", env=env).stdout.splitlines()) for h in homes]
    assert {json.loads(x)["event_id"] for x in logs[0]} == {json.loads(x)["event_id"] for x in logs[2]}
    # b's mailbox cursor for a moves only on a's answer, which travels in a's next file to b
    again = json.loads(run("--home", homes[1], "mailbox", "export", "--peer", ids[0]["site_id"], "--out",
                           tmp_path / "ba2.cbor", env=env).stdout)
    assert again["events"] == out["events"] > 0 and again["cursor"] == 0  # not answered yet: offered again
    _, res = carry(0, 1, "ab3.cbor")
    assert res["acknowledged"]["bodies"] == 1  # a's answer to ba.cbor (ba2.cbor was never imported)
    again = json.loads(run("--home", homes[1], "mailbox", "export", "--peer", ids[0]["site_id"], "--out",
                           tmp_path / "ba3.cbor", env=env).stdout)
    assert again["events"] == 0 and again["cursor"] > 0


def test_mailbox_import_malformed_changes_nothing(tmp_path):
    env = dict(os.environ, SSP_AGENT_WITNESS_DIR=str(tmp_path / "w"))
    man = tmp_path / "m.toml"
    man.write_text(f'mesh_id = "{MESH.hex()}"\n' + TABLES)
    run("--home", tmp_path / "a", "init", "--manifest", man, env=env)
    bad = tmp_path / "bad.cbor"
    bad.write_bytes(b"\x82\x01\x02")
    p = run("--home", tmp_path / "a", "mailbox", "import", bad, env=env, ok=False)
    assert p.returncode == 2 and "not_a_map" in p.stderr
    assert run("--home", tmp_path / "a", "log", env=env).stdout == ""


def test_policy_cli(tmp_path):
    env = dict(os.environ, SSP_AGENT_WITNESS_DIR=str(tmp_path / "w"))
    man = tmp_path / "m.toml"
    man.write_text(f'mesh_id = "{MESH.hex()}"\n' + TABLES)
    h = tmp_path / "a"
    run("--home", h, "init", "--manifest", man, env=env)
    p = run("--home", h, "policy", "allow", "--peer", "*", "--table", "*.readings", "--layer", "user", env=env, ok=False)
    assert p.returncode == 2 and "schema wildcard" in p.stderr
    p = run("--home", h, "policy", "allow", "--peer", "*", "--table", "sec.keys", "--layer", "user", env=env, ok=False)
    assert p.returncode == 2 and "never_syncable" in p.stderr
    p = run("--home", h, "policy", "deny", "--peer", "ab" * 16, "--table", "app.*", "--layer", "user", env=env)
    rows = [json.loads(x) for x in run("--home", h, "policy", "list", env=env).stdout.splitlines()]
    assert {"peer": "*", "table": "app.*", "layer": "system", "role": None, "effect": "allow"} in rows  # the default
    assert {"peer": "ab" * 16, "table": "app.*", "layer": "user", "role": None, "effect": "deny"} in rows
