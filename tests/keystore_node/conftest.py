"""Fixtures for node-on-keystore tests: a SoftHSM2 token in a temporary directory and the serial
keystore emulator over a pty, both reused from tests/bridge's helpers."""
import os
import shutil
import subprocess
import sys

import pytest

_BRIDGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bridge")
if _BRIDGE not in sys.path:
    sys.path.insert(0, _BRIDGE)

from bridge_helpers import softhsm_module, start_emulator  # noqa: E402

SO_PIN, PIN, LABEL = "87654321", "246810", "ssp-node"


@pytest.fixture
def softhsm_conf(tmp_path):
    module = softhsm_module()
    util = shutil.which("softhsm2-util")
    if module is None or util is None:
        pytest.fail("SoftHSM2 is not installed: run `apt-get install -y softhsm2` (docs/keystore.md, Test set-up)")
    d = tmp_path / "softhsm"
    (d / "tokens").mkdir(parents=True)
    conf = d / "softhsm2.conf"
    conf.write_text(f"directories.tokendir = {d / 'tokens'}\nobjectstore.backend = file\nlog.level = ERROR\n")
    subprocess.run([util, "--init-token", "--free", "--label", LABEL, "--so-pin", SO_PIN, "--pin", PIN],
                   check=True, env=dict(os.environ, SOFTHSM2_CONF=str(conf)), capture_output=True)
    return {"kind": "pkcs11", "module": module, "token_label": LABEL, "pin": PIN,
            "env": {"SOFTHSM2_CONF": str(conf)}}


@pytest.fixture
def serial_conf(tmp_path):
    proc, port = start_emulator(tmp_path)
    yield {"kind": "serial", "port": port, "timeout_s": 5.0}
    proc.terminate()
    proc.wait(10)
