"""Fixtures for node-on-keystore tests: a SoftHSM2 token in a temporary directory and the serial
keystore emulator over a pty, both reused from tests/bridge's helpers."""
import os
import sys

import pytest

_BRIDGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bridge")
if _BRIDGE not in sys.path:
    sys.path.insert(0, _BRIDGE)

from bridge_helpers import serial_keystore, softhsm_token  # noqa: E402

SO_PIN, PIN, LABEL = "87654321", "246810", "ssp-node"


@pytest.fixture
def softhsm_conf(tmp_path):
    return softhsm_token(tmp_path, LABEL, SO_PIN, PIN)


@pytest.fixture
def serial_conf(tmp_path):
    yield from serial_keystore(tmp_path)
