"""tests/bridge helpers (bridge_helpers, crash_harness, ...) are plain modules beside the tests;
make them importable whatever pytest's import mode (the project uses --import-mode=importlib)."""
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
