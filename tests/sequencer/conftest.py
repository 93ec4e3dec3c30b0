from __future__ import annotations

import os
import sys

import pytest

# the journal parser written from docs/keystore.md lives beside the bridge tests (bridge_helpers)
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
