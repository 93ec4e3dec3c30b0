"""One command (tools/wheelhouse.sh) makes an offline wheelhouse for aarch64 and
this host; a device installs from it with no index at all, and test-only packages are not in it."""
from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _env():
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_wheelhouse_installs_offline(tmp_path):
    out = tmp_path / "wh"
    p = subprocess.run(["bash", str(ROOT / "tools" / "wheelhouse.sh"), "--out", str(out)], capture_output=True,
                       text=True, env=_env(), timeout=900)
    assert p.returncode == 0, p.stderr
    arm = out / "aarch64-cp311"
    names = sorted(w.name for w in arm.glob("*.whl"))
    dists = {re.split(r"-", n)[0].lower() for n in names}
    assert {"ssp_agent", "cbor2", "pynacl", "blake3", "cryptography", "paho_mqtt", "pyserial",
            "python_pkcs11"} <= dists, names
    assert not dists & {"pytest", "hypothesis"}  # test-only packages stay out of a device install
    # binary wheels for 64-bit Raspberry Pi OS only: nothing to compile on the device
    assert all(n.endswith("-none-any.whl") or "aarch64" in n for n in names), names
    pk = next(n for n in names if n.startswith("python_pkcs11-"))
    assert tuple(int(x) for x in pk.split("-")[1].split(".")[:2]) >= (0, 8)
    # this host's wheelhouse installs with no index (as a device without network would)
    host = out / f"{platform.machine()}-cp{sys.version_info[0]}{sys.version_info[1]}"
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = {k: v for k, v in _env().items() if not k.startswith("PIP_")}
    p = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-index", "--isolated",
                        "--find-links", str(host), "ssp-agent[pkcs11]"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stderr
    exe = str(venv / "bin" / "ssp-agent")
    assert subprocess.run([exe, "--version"], capture_output=True, text=True, env=env).stdout.startswith("ssp-agent ")
    from tests.core.helpers import manifest, peers
    mf = tmp_path / "m.toml"
    mf.write_text(manifest(peers(1)))
    p = subprocess.run([exe, "--home", str(tmp_path / "h"), "init", "--manifest", str(mf), "--profile", "pi-zero-2w"],
                       capture_output=True, text=True, env=env, cwd="/")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["site_id"]
