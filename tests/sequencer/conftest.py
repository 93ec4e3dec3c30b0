from __future__ import annotations

import os
import sys

import pytest

# the journal parser written from docs/keystore.md lives beside the bridge tests (bridge_helpers)
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
_BRIDGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bridge")
if _BRIDGE not in sys.path:
    sys.path.insert(0, _BRIDGE)

from agent.sequencer import service


@pytest.fixture
def seq(tmp_path):
    home = tmp_path / "seq"
    service.init(home)
    s = service.Sequencer(home)
    yield s
    s.close()


@pytest.fixture
def softhsm_conf(tmp_path):
    import shutil
    import subprocess
    from bridge_helpers import softhsm_module
    module, util = softhsm_module(), shutil.which("softhsm2-util")
    if module is None or util is None:
        pytest.fail("SoftHSM2 is not installed: run `apt-get install -y softhsm2` (docs/keystore.md, Test set-up)")
    d = tmp_path / "softhsm"
    (d / "tokens").mkdir(parents=True)
    conf = d / "softhsm2.conf"
    conf.write_text(f"directories.tokendir = {d / 'tokens'}\nobjectstore.backend = file\nlog.level = ERROR\n")
    subprocess.run([util, "--init-token", "--free", "--label", "ssp-seq", "--so-pin", "87654321", "--pin", "246810"],
                   check=True, env=dict(os.environ, SOFTHSM2_CONF=str(conf)), capture_output=True)
    return {"kind": "pkcs11", "module": module, "token_label": "ssp-seq", "pin": "246810",
            "env": {"SOFTHSM2_CONF": str(conf)}}


@pytest.fixture
def serial_conf(tmp_path):
    from bridge_helpers import start_emulator
    proc, port = start_emulator(tmp_path)
    yield {"kind": "serial", "port": port, "timeout_s": 5.0}
    proc.terminate()
    proc.wait(10)
