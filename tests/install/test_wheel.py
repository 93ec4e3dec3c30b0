"""The agent installed from its wheel into a clean (non-editable) venv works:
`--version` prints the version and `init` with the default profile succeeds, because the
profiles ship inside the package. tools/test.sh builds and installs the wheel once and sets
SSP_AGENT_CMD; run alone, this test builds and installs one itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.cli_cmd import installed, installed_python

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


@pytest.fixture(scope="module")
def wheel_cmd(tmp_path_factory):
    """(ssp-agent command, venv python) of an install from the built wheel, never this checkout."""
    if installed():
        from tests.cli_cmd import agent_cmd
        return agent_cmd(), installed_python()
    base = tmp_path_factory.mktemp("wheel")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, str(ROOT / "tools" / "build_wheel.py"), "--out", str(base / "dist")],
                   check=True, env=env, capture_output=True, timeout=600)
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    wheel = next((base / "dist").glob("ssp_agent-*.whl"))
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", str(wheel)], check=True, env=env,
                   capture_output=True, timeout=600)
    return [str(venv / "bin" / "ssp-agent")], str(venv / "bin" / "python")


def _env():
    # the installed package, never a checkout on PYTHONPATH
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _run(cmd, *args, cwd=None):
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=_env(), cwd=cwd, timeout=120)


def test_installed_package_is_not_the_checkout(wheel_cmd):
    _, py = wheel_cmd
    p = subprocess.run([py, "-c", "import agent; print(agent.__file__)"], capture_output=True, text=True,
                       env=_env(), cwd="/", check=True)
    assert "site-packages" in p.stdout and not p.stdout.startswith(str(ROOT)), p.stdout


def test_installed_sequencer_signs_pipelined_batches_in_its_signing_process(wheel_cmd, tmp_path):
    """The installed package's own sequencer, a batch large enough for the software keystore's
    P-256 signing process (firmware_bridge/sign_worker.py, started with `python -m` from the
    installed package): every Commit accepted, every receipt verifying, the process used."""
    _, py = wheel_cmd
    script = f"""
import os
from agent.sequencer import receipts, service
from agent.sequencer.framing import encode_private_message
home = {str(tmp_path / "seq")!r}
service.init(home)
with service.Sequencer(home) as seq:
    gs = [b"wheel-group-%04d" % i for i in range(200)]
    for g in gs:
        seq.register(g, 0)
    answers = seq.submit_many([encode_private_message(g, 0) for g in gs])
    assert all(isinstance(a, service.Accepted) for a in answers), answers[:2]
    for a in answers:
        receipts.verify_receipt(a.receipt, seq.public_key)
    w = seq.bridge.keystore._workers["receipts"]
    assert w._proc is not None and not w.dead and w._proc.pid != os.getpid()
    print("ok", w._proc.pid)
"""
    p = subprocess.run([py, "-c", script], capture_output=True, text=True, env=_env(), cwd="/", timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("ok"), p.stdout + p.stderr


def test_version(wheel_cmd):
    cmd, _ = wheel_cmd
    p = _run(cmd, "--version")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"ssp-agent {VERSION}"


def test_init_with_default_profile(wheel_cmd, tmp_path):
    from tests.core.helpers import manifest, peers
    cmd, _ = wheel_cmd
    mf = tmp_path / "m.toml"
    mf.write_text(manifest(peers(1)))
    p = _run(cmd, "--home", str(tmp_path / "h"), "init", "--manifest", str(mf), cwd="/")
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["site_id"]) == 32
    st = _run(cmd, "--home", str(tmp_path / "h"), "status", cwd="/")
    assert st.returncode == 0 and json.loads(st.stdout)["profile"] == "pi-3-4", st.stderr
    # every built-in profile is in the package
    for name in ("pi-zero-2w", "pi-5-cm4", "gateway"):
        p = _run(cmd, "--home", str(tmp_path / name), "init", "--manifest", str(mf), "--profile", name, cwd="/")
        assert p.returncode == 0, (name, p.stderr)


def test_installed_wheel_has_the_systemd_units(wheel_cmd, tmp_path):
    """The units are package data; `service install` from the wheel names the
    installed command in ExecStart=."""
    cmd, _ = wheel_cmd
    p = _run(cmd, "service", "install", "--root", str(tmp_path / "root"), "--bin", cmd[0])
    assert p.returncode == 0, p.stderr
    unit = (tmp_path / "root/etc/systemd/system/ssp-agent.service").read_text()
    assert f"ExecStart={cmd[0]} run" in unit and "WatchdogSec=" in unit
    assert (tmp_path / "root/etc/systemd/system/ssp-agent-sync.timer").exists()
