"""The MQTT tests: a real mosquitto per test (the `broker` fixture of tests/conftest.py)."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _witness_dir(tmp_path_factory, monkeypatch):
    # Nodes mirror their clock ceiling outside their home; keep it inside the test's temp dir
    # (subprocesses inherit it through os.environ).
    monkeypatch.setenv("SSP_AGENT_WITNESS_DIR", str(tmp_path_factory.mktemp("witness")))
