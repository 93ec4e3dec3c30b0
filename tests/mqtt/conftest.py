"""A real mosquitto per test, on a free loopback port (Debian `mosquitto`, /usr/sbin/mosquitto)."""
from __future__ import annotations

import pytest

from agent.transport.broker import Broker, find_mosquitto


@pytest.fixture
def broker(tmp_path):
    if find_mosquitto() is None:
        pytest.fail("mosquitto is not installed (apt-get install mosquitto); the MQTT tests need a real broker")
    b = Broker(workdir=tmp_path / "broker").start()
    yield b
    b.close()


@pytest.fixture(autouse=True)
def _witness_dir(tmp_path_factory, monkeypatch):
    # Nodes mirror their clock ceiling outside their home; keep it inside the test's temp dir
    # (subprocesses inherit it through os.environ).
    monkeypatch.setenv("SSP_AGENT_WITNESS_DIR", str(tmp_path_factory.mktemp("witness")))
