"""The one way tests get the `ssp-agent` command.

`SSP_AGENT_CMD` (set by tools/test.sh to the `ssp-agent` installed from the built wheel into a
clean venv) names the command; unset, it is this checkout's CLI under the
running interpreter. Every CLI-level test uses `agent_cmd()` and `agent_env()` so that CI runs
them against the installed command, not the checkout."""
from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path


def agent_cmd() -> list[str]:
    v = os.environ.get("SSP_AGENT_CMD", "").strip()
    return shlex.split(v) if v else [sys.executable, "-m", "agent.cli"]


def installed() -> bool:
    """True when the tests drive an installed command (not this checkout)."""
    return bool(os.environ.get("SSP_AGENT_CMD", "").strip())


def agent_env(extra: dict | None = None) -> dict:
    """The environment for the command. An installed command must import the installed package,
    so a PYTHONPATH pointing at a checkout is dropped for it."""
    env = {**os.environ, **(extra or {})}
    if installed():
        env.pop("PYTHONPATH", None)
    return env


def installed_python() -> str | None:
    """The interpreter of the venv the installed command lives in (its bin/ directory)."""
    if not installed():
        return None
    exe = Path(agent_cmd()[0])
    py = exe.parent / "python"
    return str(py) if py.exists() else None


def patched_cmd(preamble: str) -> list[str]:
    """The command's own package and `main` under the interpreter it is installed with, after
    ``preamble`` (Python run first in that process: a crash point a test puts in, e.g. a SIGKILL
    right after a keystore call). Arguments follow it as for `agent_cmd()`."""
    code = f"{preamble}\nimport sys\nfrom agent.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    return [installed_python() or sys.executable, "-c", code]


def run_cli(*args, env: dict | None = None, timeout: float = 300, **kw):
    """Run the command once; a CompletedProcess with text output."""
    import subprocess
    return subprocess.run([*agent_cmd(), *map(str, args)], capture_output=True, text=True, env=agent_env(env),
                          timeout=timeout, **kw)


def main(argv: list[str]) -> int:
    """`agent.cli.main` as a subprocess of the command under test: its output goes to this
    process's stdout/stderr (so capsys and redirect_stdout see it), its exit status is returned."""
    p = run_cli(*argv)
    sys.stdout.write(p.stdout)
    sys.stderr.write(p.stderr)
    return p.returncode
