"""The CLI contract (docs/cli.md) driven as a subprocess."""
from __future__ import annotations

import json
import subprocess

import pytest


from tests.cli_cmd import agent_cmd, agent_env

from .helpers import NOW, T, manifest, peers


def run(home, *args, env=None, check=None):
    p = subprocess.run([*agent_cmd(), "--home", str(home), *args],
                       capture_output=True, text=True, env=agent_env(env))
    if check is not None:
        assert p.returncode == check, (p.returncode, p.stdout, p.stderr)
    return p


@pytest.fixture
def home(tmp_path):
    ps = peers(2)
    mf = tmp_path / "manifest.toml"
    mf.write_text(manifest(ps))
    h = tmp_path / "home"
    out = run(h, "init", "--manifest", str(mf), check=0)
    info = json.loads(out.stdout)
    assert len(info["site_id"]) == 32 and len(info["public_key"]) == 64
    return h, ps, mf, info


def test_init_refuses_existing_home(home):
    h, _, mf, _ = home
    p = run(h, "init", "--manifest", str(mf), check=2)
    assert "already holds a node" in p.stderr


def test_init_refuses_bad_manifest(tmp_path):
    mf = tmp_path / "m.toml"
    mf.write_text('mesh_id = "xyz"\n')
    p = run(tmp_path / "h", "init", "--manifest", str(mf), check=2)
    assert "mesh_id" in p.stderr


def test_write_dump_log(home):
    h, _, _, info = home
    eid = run(h, "write", T, "--key", '{"device":"d1","seq":1}', "--set", '{"temp":20.5,"raw":{"$bytes":"00ff"}}',
              check=0).stdout.strip()
    assert len(eid) == 64
    run(h, "write", T, "--key", '{"device":"d1","seq":2}', "--set", '{"note":null}', check=0)
    dump = json.loads(run(h, "dump", check=0).stdout)
    assert dump[T] == [{"key": {"device": "d1", "seq": 1}, "values": {"temp": 20.5, "raw": {"$bytes": "00ff"}}},
                       {"key": {"device": "d1", "seq": 2}, "values": {"note": None}}]
    lines = [json.loads(x) for x in run(h, "log", check=0).stdout.splitlines()]
    assert [x["event_id"] for x in lines][0] == eid
    assert set(lines[0]) == {"event_id", "site_id", "hlc", "table", "operation", "row_key"}
    assert lines[0]["site_id"] == info["site_id"] and lines[0]["operation"] == "upsert"
    run(h, "write", T, "--key", '{"device":"d1","seq":2}', "--delete", check=0)
    assert len(json.loads(run(h, "dump", check=0).stdout)[T]) == 1


def test_write_refusals(home):
    h, _, _, _ = home
    assert "no value column" in run(h, "write", T, "--key", '{"device":"d1","seq":1}', "--set", '{"x":1}', check=2).stderr
    run(h, "write", T, "--key", '{"device":"d1"}', "--set", '{"temp":1.0}', check=2)
    run(h, "write", T, "--key", '{"device":"d1","seq":1}', "--set", '{"temp":true}', check=2)
    run(h, "write", "sec.keys", "--key", '{"id":"k"}', "--set", '{"secret":{"$bytes":"00"}}', check=2)


def test_purge_fails_closed(home):
    h, _, _, _ = home
    run(h, "write", T, "--key", '{"device":"d1","seq":1}', "--set", '{"temp":1.0}', check=0)
    p = run(h, "purge", T, check=2)
    assert "not available" in p.stderr
    assert len(json.loads(run(h, "dump", check=0).stdout)[T]) == 1  # not silently soft-deleted


def test_mailbox_import_counts(home, tmp_path):
    h, (a, b), _, _ = home
    evs = [a.event(T, {"device": "a", "seq": 1}, {"temp": 1.0}, (NOW, 0)),
           a.event(T, {"device": "a", "seq": 1}, {"temp": 1.0}, (NOW, 0)),  # duplicate
           b.event("app.missing", {"id": 1}, {"v": 1}, (NOW, 0)),          # held
           b.event(T, {"device": "b", "seq": 1}, {"temp": 2.0}, (4_000_000_000_000, 0)),  # rejected: far future
           b.sign_payload(b"\xa0", kid=a.site_id)]                            # dropped
    f = tmp_path / "body.cbor"
    f.write_bytes(a.body(evs))
    out = json.loads(run(h, "mailbox", "import", str(f), check=0).stdout)
    assert {k: out[k] for k in ("applied", "duplicate", "dropped", "rejected", "held")} == \
        {"applied": 1, "duplicate": 1, "dropped": 1, "rejected": 1, "held": 1}
    assert [e["status"] for e in out["events"]] == ["duplicate", "held", "rejected", "dropped"]  # detail beyond counts


@pytest.mark.parametrize("data", [
    b"not cbor at all \xff",
    bytes.fromhex("80"),  # an array, not a map
    None,  # a valid body with trailing bytes (built below)
    "missing_records",
    "version_2",
    "events_not_bytes",
])
def test_mailbox_import_malformed_changes_nothing(home, tmp_path, data):
    h, (a, _), _, _ = home
    ev = a.event(T, {"device": "a", "seq": 1}, {"temp": 1.0}, (NOW, 0))
    import cbor2
    good = cbor2.loads(a.body([ev]))
    if data is None:
        data = a.body([ev]) + b"\x00"
    elif data == "missing_records":
        del good["records"]
        data = cbor2.dumps(good)
    elif data == "version_2":
        good["ssp_version"] = 2
        data = cbor2.dumps(good)
    elif data == "events_not_bytes":
        good["events"] = [1]
        data = cbor2.dumps(good)
    before = run(h, "dump", check=0).stdout
    f = tmp_path / "bad.cbor"
    f.write_bytes(data)
    p = run(h, "mailbox", "import", str(f), check=2)
    assert p.stderr.count("\n") == 1 and "nothing was changed" in p.stderr
    assert run(h, "dump", check=0).stdout == before
    assert run(h, "log", check=0).stdout == ""


def test_evict_raises_and_refuses_lowering(home):
    h, _, _, _ = home
    run(h, "evict", T, "--horizon", f"{NOW}.5", check=0)
    p = run(h, "evict", T, "--horizon", f"{NOW}.4", check=2)
    assert "never move back" in p.stderr
    run(h, "evict", T, "--horizon", "garbage", check=2)


def test_peer_add(home):
    h, _, _, info = home
    c = peers(1)[0]
    run(h, "peer", "add", "--site-id", c.site_id.hex(), "--public-key", c.public_key.hex(), check=0)
    run(h, "peer", "add", "--site-id", info["site_id"], "--public-key", c.public_key.hex(), check=2)
    run(h, "peer", "add", "--site-id", c.site_id.hex(), "--public-key", "zz", check=2)


def test_home_copied_to_another_machine_is_refused(home):
    h, _, _, _ = home
    p = run(h, "dump", env={"SSP_AGENT_MACHINE_ID": "some-other-device"}, check=2)
    assert "two devices" in p.stderr
    run(h, "identity", "rebind", "--confirm-original-destroyed", env={"SSP_AGENT_MACHINE_ID": "some-other-device"},
        check=0)
    run(h, "dump", env={"SSP_AGENT_MACHINE_ID": "some-other-device"}, check=0)


def test_help_is_readable():
    p = subprocess.run([*agent_cmd(), "--help"], capture_output=True, text=True, env=agent_env())
    assert p.returncode == 0 and "mailbox" in p.stdout and "Exit status" in p.stdout


def test_refusals_from_every_verb_module_exit_2(home, tmp_path):
    """Verbs live in several modules (agent/cli/sync.py, mqtt.py, keystore.py); a refusal in any of them is
    exit 2 with one line on stderr, also when run as `python -m agent.cli`."""
    h, _, _, _ = home
    cases = [("record", "issue-role", "--subject", "zz", "--role", "r"),                       # agent/cli/sync.py
             ("authority", "show", "--authority-key", str(tmp_path / "none")),                 # agent/cli/sync.py
             ("policy", "allow", "--peer", "*", "--table", "nope", "--layer", "user"),          # agent/cli/sync.py
             ("sync", "--broker", "ftp://x", "--once")]                                         # agent/cli/mqtt.py
    for args in cases:
        p = run(h, *args)
        assert p.returncode == 2, (args, p.returncode, p.stderr)
        assert p.stderr.startswith("ssp-agent: ") and "Traceback" not in p.stderr, (args, p.stderr)
