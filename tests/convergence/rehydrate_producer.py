"""Starts a rehydration in a real process that a test kills at a named point (SSP_CRASH=point:hit)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent import rehydrate  # noqa: E402
from agent.node import Node  # noqa: E402
from tests.crashpoint import hook_from_env  # noqa: E402

rehydrate._CRASH_HOOK = hook_from_env("SSP_CRASH")
with Node.open(Path(sys.argv[1])) as node:
    rehydrate.start(node, None)
print("started")
