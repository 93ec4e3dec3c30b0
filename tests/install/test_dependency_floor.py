"""The bounds in pyproject.toml say what the code needs (docs/platform.md "Dependencies"): the agent
installed from its wheel with every runtime dependency at the lowest version its bounds allow syncs.
A device whose wheelhouse resolves an older release than the host's (aarch64 wheels are published
later, or under other platform tags) gets such a floor; a bound below what the code calls made every
body a `malformed_cbor` refusal there."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def floors() -> dict[str, str]:
    """Each runtime dependency's lower bound (`name>=X`); a dependency without one fails here."""
    out = {}
    for spec in PYPROJECT["project"]["dependencies"]:
        m = re.match(r"^([A-Za-z0-9_.-]+)\s*(.*)$", spec)
        name, bounds = m.group(1), m.group(2)
        low = re.search(r">=\s*([0-9][0-9A-Za-z.]*)", bounds)
        assert low, f"{spec}: every runtime dependency needs a lower bound the code is tested at"
        out[name] = low.group(1)
    return out


def _env() -> dict:
    # the floor venv's own package and pip settings of this machine, never this checkout
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@pytest.fixture(scope="module")
def floor_cmd(tmp_path_factory):
    """`ssp-agent` from the built wheel in a venv whose runtime dependencies are their floors."""
    base = tmp_path_factory.mktemp("floor")
    subprocess.run([sys.executable, str(ROOT / "tools" / "build_wheel.py"), "--out", str(base / "dist")],
                   check=True, env=_env(), capture_output=True, timeout=600)
    wheel = next((base / "dist").glob("ssp_agent-*.whl"))
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pins = [f"{n}=={v}" for n, v in floors().items()]
    p = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--only-binary=:all:",
                        str(wheel), *pins], capture_output=True, text=True, env=_env(), timeout=900)
    assert p.returncode == 0, p.stderr
    got = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list", "--format=json"], check=True,
                         capture_output=True, text=True, env=_env()).stdout
    have = {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(got)}
    for n, v in floors().items():
        assert Version(have[n.lower().replace("_", "-")]) == Version(v), (n, have)
    return str(venv / "bin" / "ssp-agent")


def _run(exe, *args, ok=True):
    p = subprocess.run([exe, *map(str, args)], capture_output=True, text=True, env=_env(), cwd="/", timeout=300)
    if ok:
        assert p.returncode == 0, (args, p.stdout, p.stderr)
    return p


def _two_homes(exe, tmp_path):
    from tests.sync.helpers import manifest
    man = tmp_path / "m.toml"
    man.write_text(manifest())
    homes = [tmp_path / "a", tmp_path / "b"]
    ids = [json.loads(_run(exe, "--home", h, "init", "--manifest", man).stdout) for h in homes]
    for h, other in ((homes[0], ids[1]), (homes[1], ids[0])):
        _run(exe, "--home", h, "peer", "add", "--site-id", other["site_id"], "--public-key", other["public_key"])
    return homes, ids


def test_mailbox_body_between_two_homes_at_the_dependency_floor(floor_cmd, tmp_path, monkeypatch):
    monkeypatch.setenv("SSP_AGENT_WITNESS_DIR", str(tmp_path / "w"))
    (a, b), ids = _two_homes(floor_cmd, tmp_path)
    _run(floor_cmd, "--home", a, "write", "app.readings", "--key", '{"device": "d", "seq": 1}',
         "--set", '{"temp": 20.5}')
    body = tmp_path / "ab.cbor"
    out = json.loads(_run(floor_cmd, "--home", a, "mailbox", "export", "--peer", ids[1]["site_id"],
                          "--out", body).stdout)
    assert out["events"] == 1
    p = _run(floor_cmd, "--home", b, "mailbox", "import", body, ok=False)
    assert p.returncode == 0, p.stderr
    res = json.loads(p.stdout)
    assert res["applied"] == 1 and res["rejected"] == 0, res
    assert json.loads(_run(floor_cmd, "--home", b, "dump").stdout)["app.readings"]


def test_sync_once_through_a_broker_at_the_dependency_floor(floor_cmd, broker, tmp_path, monkeypatch):
    monkeypatch.setenv("SSP_AGENT_WITNESS_DIR", str(tmp_path / "w"))
    (a, b), _ = _two_homes(floor_cmd, tmp_path)
    _run(floor_cmd, "--home", a, "write", "app.readings", "--key", '{"device": "d", "seq": 1}',
         "--set", '{"temp": 20.5}')
    _run(floor_cmd, "--home", b, "sync", "--broker", broker.url, "--once", "--timeout", "5")  # b's session
    _run(floor_cmd, "--home", a, "sync", "--broker", broker.url, "--once", "--timeout", "2")  # a's body waits
    p = _run(floor_cmd, "--home", b, "sync", "--broker", broker.url, "--once", "--timeout", "5", ok=False)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["applied"] == 1 and out["refused_bodies"] == 0, out
