"""Start-up of the short-lived verbs: a verb imports what it uses. `write` and
the read verbs never load cryptography (P-256 only), paho (MQTT only), pyserial, or the modules of
other verbs; `sync --broker --once` loads paho but not cryptography. Checked in a fresh
interpreter by the modules it holds after the verb ran (never by time)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from agent import cli
from agent.simpeer import manifest_text, readings_table
from tests.cli_cmd import agent_cmd, agent_env, installed, installed_python

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")
ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
NEVER_FOR_WRITE = ("cryptography", "paho", "serial", "pkcs11", "importlib.metadata", "agent.cli.provision",
                   "agent.cli.health", "agent.cli.sequencer", "agent.cli.service", "agent.runner", "agent.sync",
                   "agent.transport.mqtt")


def _modules_after(argv: list[str], env: dict, cwd) -> tuple[int, set[str]]:
    # the command's own interpreter (the installed one under SSP_AGENT_CMD), running its main
    code = ("import json, sys\nimport agent.cli\nrc = agent.cli.main(sys.argv[1:])\n"
            "sys.stderr.write('\\nMODULES ' + json.dumps(sorted(sys.modules)) + '\\n')\nsys.exit(rc)\n")
    p = subprocess.run([installed_python() or sys.executable, "-c", code, *argv], capture_output=True, text=True,
                       env=env, cwd=cwd, timeout=120)   # `-c` puts the cwd first on sys.path: not ROOT
    line = [ln for ln in p.stderr.splitlines() if ln.startswith("MODULES ")]
    assert line, p.stderr[-2000:]
    return p.returncode, set(json.loads(line[-1][len("MODULES "):]))


def _loaded(mods: set[str], names) -> list[str]:
    return sorted(m for m in mods for n in names if m == n or m.startswith(n + "."))


@pytest.fixture
def home(tmp_path):
    extra = {"SSP_AGENT_CLOCK_TRUSTED": "1", "SSP_AGENT_WITNESS_DIR": str(tmp_path / "witness")}
    if not installed():
        extra["PYTHONPATH"] = ROOT
    env = agent_env(extra)
    man = tmp_path / "m.toml"
    man.write_text(manifest_text(MESH, readings_table()))
    subprocess.run(agent_cmd() + ["--home", str(tmp_path / "a"), "init", "--manifest", str(man)],
                   env=env, check=True, capture_output=True, cwd=ROOT)
    return tmp_path / "a", env, tmp_path


def test_write_and_the_read_verbs_load_no_p256_mqtt_or_other_verbs(home):
    h, env, cwd = home
    rc, mods = _modules_after(["--home", str(h), "write", "app.readings", "--key", '{"device": "d", "seq": 1}',
                               "--set", '{"temp": 1.5}'], env, cwd)
    assert rc == 0 and "agent.node" in mods
    assert _loaded(mods, NEVER_FOR_WRITE) == []
    for verb in (["status"], ["dump"]):
        rc, mods = _modules_after(["--home", str(h), *verb], env, cwd)
        assert rc == 0 and _loaded(mods, NEVER_FOR_WRITE) == []


def test_sync_once_loads_paho_but_not_cryptography(home, tmp_path):
    h, env, cwd = home
    # no broker there: the verb still sets up its MQTT link (and exits 1, unreachable)
    rc, mods = _modules_after(["--home", str(h), "sync", "--broker", "mqtt://127.0.0.1:9", "--once",
                               "--connect-timeout", "0.5"], env, cwd)
    assert rc == 1 and "paho.mqtt.client" in mods
    assert _loaded(mods, ("cryptography", "serial", "pkcs11", "agent.cli.provision", "agent.cli.sequencer")) == []


def test_the_verb_table_names_the_module_that_registers_each_verb():
    """`main` builds only the registering module's part of the parser for a known verb: the
    table must say which module that is, for every verb a module registers."""
    registered = {}
    for mod in sorted(set(cli.VERB_MODULES.values())):
        p = argparse.ArgumentParser()
        sub = p.add_subparsers(dest="verb")
        mailbox = argparse.ArgumentParser().add_subparsers()
        __import__(mod, fromlist=["register"]).register(sub, mailbox)
        registered.update({v: mod for v in sub.choices})
        if mailbox.choices:
            registered["mailbox"] = mod
    # a verb missing here still works (the whole parser is built for it) but starts slower:
    # add it to agent.cli.VERB_MODULES
    assert registered == cli.VERB_MODULES, "agent.cli.VERB_MODULES must name every registered verb's module"
    full = cli.build_parser()
    verbs = set(full._subparsers._group_actions[0].choices)
    assert verbs == set(cli.VERB_MODULES) | cli.CORE_VERBS


@pytest.mark.parametrize("argv,verb", [
    (["--home", "h", "write", "t"], "write"), (["--home=h", "-v", "sync", "--once"], "sync"),
    (["-v", "dump"], "dump"), (["--help"], None), (["--version"], None), (["--ho", "h", "write"], None), ([], None)])
def test_the_verb_is_read_only_past_global_options_known_exactly(argv, verb):
    assert cli.verb_of(argv) == verb


def test_a_verb_module_that_fails_to_import_is_not_dropped_silently(monkeypatch):
    """A verb module that cannot be imported used to vanish from the CLI without a word (its verbs
    then answered "invalid choice"): the import error must surface."""
    import sys

    from agent import cli
    monkeypatch.setitem(sys.modules, "agent.cli.health", None)  # import of it raises ImportError
    try:
        cli.build_parser()
    except ImportError:
        return
    raise AssertionError("build_parser dropped agent.cli.health without a word")
