"""Every CLI-level test gets the command from tests/cli_cmd.py, so that CI runs it
against the `ssp-agent` installed from the wheel; a test that spawns the checkout's CLI itself
would pass while the installed command is broken."""
from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
BYPASS = re.compile(r'"-m",\s*"agent\.cli"|which\("ssp-agent"\)|from agent\.cli import main')


def test_no_test_spawns_the_cli_around_tests_cli_cmd():
    offenders = [f"{p.relative_to(TESTS)}:{n}" for p in sorted(TESTS.rglob("*.py")) if p.name != "cli_cmd.py"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if BYPASS.search(line)]
    assert not offenders, f"use tests.cli_cmd (agent_cmd/agent_env/run_cli/main) instead: {offenders}"
