"""`init` and `sequencer init` SIGKILLed the moment the keystore has generated their key, before
the home has recorded anything of it (a power cut at the worst point). Before: the next `init` of
that home failed on "already exists" for ever, since a key cannot be taken back off a token (and
`sequencer init` did not even take up its own software key). Now each records, before asking for
the key, a tag the token stores with it (CKA_ID; firmware_bridge/keytag.py), and the next `init`
of that home takes up the key carrying its tag; a key of that name that is not its own is still
refused. The command killed is the one under test (the installed one in CI), run with its
keystore's generate_key followed by SIGKILL."""
from __future__ import annotations

import json
import subprocess

import pytest

from agent.simpeer import manifest_text, readings_table
from tests.cli_cmd import agent_env, patched_cmd, run_cli

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")

# the command, with every keystore's generate_key killing the process as soon as it returns
KILLED_AFTER_GENERATE = patched_cmd("""
import os, signal
from firmware_bridge import pkcs11_keystore, serial_driver, software
def killing(generate):
    def generate_then_die(self, *a, **k):
        generate(self, *a, **k)
        os.kill(os.getpid(), signal.SIGKILL)
    return generate_then_die
for cls in (pkcs11_keystore.Pkcs11Keystore, serial_driver.SerialKeystore, software.SoftwareKeystore):
    cls.generate_key = killing(cls.generate_key)
""")


def killed_at_key(*args, env: dict | None = None, killed: bool = True) -> subprocess.CompletedProcess:
    """The command with KILLED_AFTER_GENERATE; ``killed``: whether it must have died there (it did
    not when the keystore never made it a key)."""
    p = subprocess.run([*KILLED_AFTER_GENERATE, *map(str, args)],
                       capture_output=True, text=True, env=agent_env(env), timeout=300)
    assert (p.returncode == -9) == killed, (p.returncode, p.stderr[-2000:])
    return p


def _conf(softhsm_conf) -> tuple[dict, dict]:
    return {k: v for k, v in softhsm_conf.items() if k != "env"}, softhsm_conf["env"]


def _manifest(tmp_path):
    mf = tmp_path / "m.toml"
    mf.write_text(manifest_text(MESH, readings_table(retention="telemetry")))
    return mf


def _device(kind: str, request) -> tuple[dict, dict | None]:
    """A device keystore's config and environment: a SoftHSM2 token, or the serial keystore
    emulator over a pty (its process outlives the killed command, as a device would)."""
    if kind == "softhsm":
        return _conf(request.getfixturevalue("softhsm_conf"))
    return request.getfixturevalue("serial_conf"), None


@pytest.mark.parametrize("kind", ["softhsm", "serial"])
def test_node_init_killed_right_after_its_device_key_is_made(tmp_path, kind, request):
    conf, env = _device(kind, request)
    mf, h = _manifest(tmp_path), tmp_path / "h"
    killed_at_key("--home", h, "init", "--manifest", mf, "--keystore", json.dumps(conf), env=env)
    recorded = json.loads((h / "init.incomplete").read_text())["device_key"]
    assert recorded is None or recorded["public_key"] is None     # killed before it knew its key
    p = run_cli("--home", h, "init", "--manifest", mf, "--keystore", json.dumps(conf), env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    pk = json.loads(p.stdout)["public_key"]
    st = run_cli("--home", h, "status", env=env)
    assert st.returncode == 0, st.stderr[-2000:]
    # the node's key is the one the killed init made on the token
    ks = run_cli("--home", h, "keystore", "show", env=env)
    assert ks.returncode == 0, ks.stderr[-2000:]
    assert json.loads(ks.stdout)["event_key"] == {**json.loads(ks.stdout)["event_key"], "public_key": pk,
                                                  "matches_node": True}
    assert not (h / "init.incomplete").exists()
    # another home on the same device: that key is not its own, and the refused init leaves nothing
    p = run_cli("--home", tmp_path / "other", "init", "--manifest", mf, "--keystore", json.dumps(conf), env=env)
    assert p.returncode != 0 and "exists" in p.stderr, (p.returncode, p.stderr[-2000:])
    assert not (tmp_path / "other").exists()


def test_node_init_refuses_a_token_key_it_did_not_make(tmp_path, softhsm_conf):
    """A key of the event key's name made outside this home (here: by an init of another home,
    killed the same way) is refused by this home's init, killed or not."""
    conf, env = _conf(softhsm_conf)
    mf = _manifest(tmp_path)
    killed_at_key("--home", tmp_path / "first", "init", "--manifest", mf, "--keystore", json.dumps(conf), env=env)
    # it never got a key: the token had one
    killed_at_key("--home", tmp_path / "second", "init", "--manifest", mf, "--keystore", json.dumps(conf), env=env,
                  killed=False)
    p = run_cli("--home", tmp_path / "second", "init", "--manifest", mf, "--keystore", json.dumps(conf), env=env)
    assert p.returncode != 0 and "already exists" in p.stderr, (p.returncode, p.stderr[-2000:])
    # the first home still completes with its own
    p = run_cli("--home", tmp_path / "first", "init", "--manifest", mf, "--keystore", json.dumps(conf), env=env)
    assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.parametrize("kind", ["software", "softhsm", "serial"])
def test_sequencer_init_killed_right_after_its_key_is_made(tmp_path, kind, request):
    conf, env = ({"kind": "software"}, None) if kind == "software" else _device(kind, request)
    h = tmp_path / "seq"
    killed_at_key("--home", h, "sequencer", "init", "--keystore", json.dumps(conf), env=env)
    st = run_cli("--home", h, "sequencer", "status", env=env)
    assert st.returncode == 2 and "cut short" in st.stderr, (st.returncode, st.stderr[-2000:])
    p = run_cli("--home", h, "sequencer", "init", "--keystore", json.dumps(conf), env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    key = json.loads(p.stdout)["sequencer_key"]
    st = run_cli("--home", h, "sequencer", "status", env=env)
    assert st.returncode == 0, st.stderr[-2000:]
    assert json.loads(st.stdout)["sequencer_key"] == key
    assert not (h / "init.incomplete").exists()
    if kind != "software":   # another sequencer home on the same device: that key is not its own
        p = run_cli("--home", tmp_path / "other", "sequencer", "init", "--keystore", json.dumps(conf), env=env)
        assert p.returncode != 0 and "exists" in p.stderr, (p.returncode, p.stderr[-2000:])
        assert not (tmp_path / "other" / "init.incomplete").exists()   # not "cut short": refused


def test_sequencer_init_refuses_a_software_key_it_did_not_make(tmp_path):
    """A software keystore directory outside the home that already held the receipt key (another
    home's) is refused, by a first init and after a kill alike."""
    shared = tmp_path / "keys"
    conf = {"kind": "software", "dir": str(shared)}
    assert run_cli("--home", tmp_path / "a", "sequencer", "init", "--keystore", json.dumps(conf)).returncode == 0
    p = run_cli("--home", tmp_path / "b", "sequencer", "init", "--keystore", json.dumps(conf))
    assert p.returncode != 0 and "already exists" in p.stderr, (p.returncode, p.stderr[-2000:])
    p = run_cli("--home", tmp_path / "b", "sequencer", "init", "--keystore", json.dumps(conf))
    assert p.returncode != 0 and "already exists" in p.stderr, (p.returncode, p.stderr[-2000:])


def test_a_sequencer_homes_key_is_never_taken_up_once_its_state_was_made(tmp_path):
    """An init killed after its state was in place but before it removed its key record: the
    record goes at the next open, so a home whose state is later lost (here: deleted) is refused
    by `sequencer init` on that key (a lost state is recovered, §22.6: a fresh state on the same
    key would sign its epochs a second time), not taken up as an unfinished init's."""
    h = tmp_path / "seq"
    p = run_cli("--home", h, "sequencer", "init")
    assert p.returncode == 0, p.stderr[-2000:]
    key = json.loads(p.stdout)["sequencer_key"]
    (h / "init.incomplete").write_text(json.dumps(
        {"kind": "software", "tag": "00" * 16, "existed_before": False, "public_key": key}))
    assert run_cli("--home", h, "sequencer", "status").returncode == 0
    assert not (h / "init.incomplete").exists()
    (h / "sequencer.db").unlink()
    p = run_cli("--home", h, "sequencer", "init")
    assert p.returncode != 0 and "already exists" in p.stderr, (p.returncode, p.stderr[-2000:])


@pytest.mark.parametrize("kind", ["software", "softhsm"])
def test_authority_create_killed_right_after_its_key_is_made(tmp_path, kind, request):
    """`authority create` killed the same way left a directory it then refused ("exists; never
    overwritten") and, on a token, a key no later create could use. Now the same command completes
    it with that key; another directory's create on the same token is still refused."""
    conf, env = ({"kind": "software"}, None) if kind == "software" else _conf(request.getfixturevalue("softhsm_conf"))
    d = tmp_path / "authority"
    killed_at_key("--home", tmp_path / "unused", "authority", "create", "--out", d, "--keystore", json.dumps(conf),
                  env=env)
    shown = run_cli("--home", tmp_path / "unused", "authority", "show", "--authority-key", d, env=env)
    assert shown.returncode == 2 and "cut short" in shown.stderr, (shown.returncode, shown.stderr[-2000:])
    p = run_cli("--home", tmp_path / "unused", "authority", "create", "--out", d, "--keystore", json.dumps(conf),
                env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    card = json.loads((d / "authority.json").read_text())
    assert json.loads(p.stdout)["public_key"] == card["public_key"]
    assert not (d / "authority.incomplete").exists()
    shown = run_cli("--home", tmp_path / "unused", "authority", "show", "--authority-key", d, env=env)
    assert shown.returncode == 0, shown.stderr[-2000:]
    # a complete authority directory is never made again
    p = run_cli("--home", tmp_path / "unused", "authority", "create", "--out", d, "--keystore", json.dumps(conf),
                env=env)
    assert p.returncode == 2 and "never overwritten" in p.stderr, (p.returncode, p.stderr[-2000:])
    if kind == "softhsm":
        p = run_cli("--home", tmp_path / "unused", "authority", "create", "--out", tmp_path / "other",
                    "--keystore", json.dumps(conf), env=env)
        assert p.returncode != 0 and "already exists" in p.stderr, (p.returncode, p.stderr[-2000:])


def test_serial_firmware_without_tags_still_initialises_and_refuses_what_it_cannot_tell(tmp_path):
    """Firmware from before key tags (the emulator's --release 1) answers GENERATE_TAGGED and
    KEY_TAG with "unknown op": init still works there (the key is generated untagged), and a kill
    right after the key is made leaves it refused, as before tags (docs/operations.md)."""
    from bridge_helpers import start_emulator   # tests/bridge, on the path by this directory's conftest
    proc, port = start_emulator(tmp_path, "--release", "1")
    try:
        conf = {"kind": "serial", "port": port, "timeout_s": 5.0}
        mf = _manifest(tmp_path)
        p = run_cli("--home", tmp_path / "plain", "sequencer", "init", "--keystore", json.dumps(conf))
        assert p.returncode == 0, p.stderr[-2000:]
        killed_at_key("--home", tmp_path / "h", "init", "--manifest", mf, "--keystore", json.dumps(conf))
        p = run_cli("--home", tmp_path / "h", "init", "--manifest", mf, "--keystore", json.dumps(conf))
        assert p.returncode != 0 and "exists" in p.stderr, (p.returncode, p.stderr[-2000:])
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.mark.parametrize("damage", ['{"kind": "software", "tag": "not hex", "public_key": null}',
                                    '{"kind": "software", "tag": 7, "existed_before": "yes", "public_key": 5}',
                                    '{"kind": "software"}', '["a", "list"]', '\x00\xff garbage'])
def test_a_damaged_key_record_is_no_record(tmp_path, damage):
    """A key record (HOME/init.incomplete) that is not one an init wrote (a torn write on another
    filesystem, an editor, a hostile hand) counts as no record: `sequencer init` and `authority
    create` complete as a first run would, without a traceback, and take up no key on its word."""
    h = tmp_path / "seq"
    h.mkdir()
    (h / "init.incomplete").write_text(damage)
    p = run_cli("--home", h, "sequencer", "init")
    assert p.returncode == 0 and "Traceback" not in p.stderr, (p.returncode, p.stderr[-2000:])
    d = tmp_path / "authority"
    d.mkdir()
    (d / "authority.incomplete").write_text(damage)
    p = run_cli("--home", tmp_path / "unused", "authority", "create", "--out", d)
    assert p.returncode == 0 and "Traceback" not in p.stderr, (p.returncode, p.stderr[-2000:])
    # and on a damaged record, a key already there is refused, not taken up
    (h / "sequencer.db").unlink()
    (h / "init.incomplete").write_text(damage)
    p = run_cli("--home", h, "sequencer", "init")
    assert p.returncode != 0 and "already exists" in p.stderr and "Traceback" not in p.stderr, p.stderr[-2000:]


def test_a_node_init_with_a_damaged_device_key_record_is_a_fresh_one(tmp_path, softhsm_conf):
    """The node's record of its device key inside init.incomplete, damaged: a fresh record is
    made (the init completes with a new key), never a traceback."""
    conf, env = _conf(softhsm_conf)
    mf, h = _manifest(tmp_path), tmp_path / "h"
    killed_at_key("--home", h, "init", "--manifest", mf, "--keystore", json.dumps(conf), env=env)
    marker = json.loads((h / "init.incomplete").read_text())
    marker["device_key"] = {"kind": "pkcs11", "tag": "zz-not-hex", "public_key": None}
    (h / "init.incomplete").write_text(json.dumps(marker))
    p = run_cli("--home", h, "init", "--manifest", mf, "--keystore", json.dumps(conf), env=env)
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    # the key the killed init made cannot be told from another's any more: refused, as any other
    assert p.returncode != 0 and "already exists" in p.stderr, (p.returncode, p.stderr[-2000:])
