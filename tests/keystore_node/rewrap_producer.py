"""Runs the `keystore rewrap` verb's handler in a real process that a test kills at a named point
of the re-wrap (SSP_CRASH=point:hit; agent/store/atrest.py `_crash_point`). Like the other crash
producers it runs this checkout's code, because the kill point is patched in here; what the test
then checks (the home reopening, the verb run again) goes through the installed command
(tests/cli_cmd.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.store import atrest  # noqa: E402
from tests.crashpoint import hook_from_env  # noqa: E402

atrest._CRASH_HOOK = hook_from_env("SSP_CRASH")
from agent import cli  # noqa: E402
from agent.cli.keystore import cmd_keystore_rewrap  # noqa: E402

args = cli.build_parser().parse_args(sys.argv[1:])
assert args.fn is cmd_keystore_rewrap, "this producer runs `keystore rewrap` only"
sys.exit(cmd_keystore_rewrap(args))
