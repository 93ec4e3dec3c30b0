import pytest


@pytest.fixture(autouse=True)
def _witness_dir(tmp_path_factory, monkeypatch):
    # Nodes keep their clock witness outside their home; keep it inside the test's temp dir.
    monkeypatch.setenv("SSP_AGENT_WITNESS_DIR", str(tmp_path_factory.mktemp("witness")))
