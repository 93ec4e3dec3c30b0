"""Numbers on the command line out of range are usage errors (exit 2, one line, nothing done).

Before: `sync --once --connect-timeout 1e400` and `sequencer run --connect-timeout 1e400` were an
OverflowError traceback from the socket layer (exit 1); `commits send --timeout nan` (or inf)
waited for ever; `--cadence nan`, `--metrics-interval -1` and `commits send --timeout -1` were
taken; `sequencer receipt --epoch` and `commits status --limit` beyond 64 bits were a traceback
(tests/sequencer/test_hostile_requests.py). Every numeric option now has an argparse type
(agent/cli/args.py)."""
from __future__ import annotations

import pytest

from tests.cli_cmd import run_cli

BAD = [
    ["sync", "--once", "--connect-timeout", "1e400"],
    ["sync", "--once", "--timeout", "nan"],
    ["sync", "--once", "--cadence", "nan"],
    ["sync", "--once", "--cadence", "0"],
    ["sync", "--once", "--metrics-interval", "-1"],
    ["sync", "--once", "--flush-cadence", "inf"],
    ["sync", "--once", "--serial", "/dev/null", "--baud", "100000000000000000000000"],
    ["sequencer", "run", "--broker", "mqtt://127.0.0.1:1", "--connect-timeout", "1e400"],
    ["commits", "send", "--broker", "mqtt://127.0.0.1:1", "--timeout", "nan"],
    ["commits", "send", "--broker", "mqtt://127.0.0.1:1", "--timeout", "-1"],
    ["check", "--timeout", "inf"],
    ["events", "--limit", "-1"],
]


@pytest.fixture(scope="module")
def homes(tmp_path_factory):
    """A node home and a sequencer home, made once: a bad number must be refused with both in
    place (before, with the home there, the command went on and failed deep inside)."""
    from agent.simpeer import manifest_text, readings_table
    d = tmp_path_factory.mktemp("homes")
    mf = d / "m.toml"
    mf.write_text(manifest_text(bytes(16), readings_table(retention="telemetry")))
    assert run_cli("--home", d / "node", "init", "--manifest", mf).returncode == 0
    assert run_cli("--home", d / "seq", "sequencer", "init").returncode == 0
    return d


def _snapshot(home) -> dict:
    return {str(p): p.stat().st_mtime_ns for p in sorted(home.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("argv", BAD, ids=[" ".join(a[:2] + a[-2:]) for a in BAD])
def test_out_of_range_numbers_are_usage_errors(tmp_path, homes, argv):
    home = homes / "seq" if argv[0] == "sequencer" else tmp_path / "member" if argv[0] == "commits" else homes / "node"
    before = _snapshot(home) if home.exists() else None
    p = run_cli("--home", home, *argv, timeout=60)
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stdout == "", (argv, p.returncode, p.stderr[-300:])
    assert "out of range" in p.stderr or "not a number" in p.stderr or "above 0" in p.stderr, p.stderr
    assert (_snapshot(home) if home.exists() else None) == before     # refused before anything was opened or made
