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
    from bridge_helpers import softhsm_token
    return softhsm_token(tmp_path, "ssp-seq")


@pytest.fixture
def serial_conf(tmp_path):
    from bridge_helpers import serial_keystore
    yield from serial_keystore(tmp_path)

