"""Runs `ssp-agent ARGS...` (the keystore verbs) in a real process that a test kills at a named
point of the re-wrap (SSP_CRASH=point:hit; agent/store/atrest.py `_crash_point`)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.store import atrest  # noqa: E402
from tests.crashpoint import hook_from_env  # noqa: E402

atrest._CRASH_HOOK = hook_from_env("SSP_CRASH")
from agent.cli import main  # noqa: E402

sys.exit(main(sys.argv[1:]))
