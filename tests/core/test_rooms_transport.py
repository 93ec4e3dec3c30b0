"""Transports move bytes and time: none imports the store or reads a clock (time is passed in,
`agent.timesource.Clock`, as the serial link and aioquic take `now`); the MQTT runner and the
runtime read time only through their injected clock."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CLOCK_MODULES = {"time", "datetime", "agent.clockstate"}
TRANSPORTS = sorted((ROOT / "agent" / "transport").glob("*.py"))
CLOCKED_DRIVERS = [ROOT / "agent" / "runner.py", ROOT / "agent" / "runtime.py"]


def imported(path: Path) -> set[str]:
    """Every module `path` imports (absolute and relative, at module level or in a function),
    `from X import a` as X.a too (a may be a module)."""
    parent = path.relative_to(ROOT).with_suffix("").parts[:-1]
    out: set[str] = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.Import):
            out |= {a.name for a in n.names}
        elif isinstance(n, ast.ImportFrom):
            base = list(parent[:len(parent) - (n.level - 1)]) if n.level else []
            mod = ".".join(base + ([n.module] if n.module else []))
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in n.names}
    return out


def test_the_check_sees_lazy_and_relative_imports(tmp_path):
    lazy = ROOT / "agent" / "transport" / "_probe_lazy.py"
    lazy.write_text("def f():\n    from ..sync import SyncDriver\n")
    try:
        assert "agent.sync" in imported(lazy)                          # lazy, relative
    finally:
        lazy.unlink()
    assert "agent.store.eventlog" in imported(ROOT / "agent" / "runtime.py")


# What a transport may use of the agent beyond the pure core and its own package: time passed in,
# its inbox and outbox spools, the fault and outcome names it reports in. Never the node's side.
TRANSPORT_MAY_IMPORT = {"agent", "agent.timesource", "agent.inbox", "agent.outbox", "agent.faults", "agent.outcomes"}


def test_transports_import_nothing_of_the_node_s_side():
    found = [(p.name, m) for p in TRANSPORTS for m in imported(p)
             if m.startswith("agent") and not m.startswith(("agent.core", "agent.transport"))
             and m not in TRANSPORT_MAY_IMPORT and m.rsplit(".", 1)[0] not in TRANSPORT_MAY_IMPORT - {"agent"}]
    assert not found, found


def test_transports_import_no_store():
    found = [(p.name, m) for p in TRANSPORTS for m in imported(p) if m == "agent.store" or m.startswith("agent.store.")]
    assert not found, found


def test_transports_and_the_runner_read_no_clock():
    found = [(p.name, m) for p in TRANSPORTS + CLOCKED_DRIVERS for m in imported(p)
             if m.split(".")[0] in CLOCK_MODULES or m in CLOCK_MODULES]
    assert not found, found
    for p in TRANSPORTS + CLOCKED_DRIVERS:
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.Name) and n.id in ("now_ms", "monotonic"):
                raise AssertionError(f"{p.name}:{n.lineno} reads a clock ({n.id})")


# The session drivers and their transports, each module one job (the runner's loop, its signed
# acknowledgements, its surfaced rows, its rows in sync_state; the sync driver, its MQTT port,
# mailbox files, sent-body tokens; the exchange, its schedule, its budgets; the MQTT link and its
# settings), none over ~700 lines.
DRIVER_MODULES = ["agent/runner.py", "agent/runtime.py", "agent/sync.py", "agent/sync_port.py",
                  "agent/sync_tokens.py", "agent/mailbox_sync.py", "agent/mqtt_acks.py", "agent/mqtt_config.py",
                  "agent/mqtt_names.py", "agent/mqtt_rows.py", "agent/mqtt_surface.py", "agent/timesource.py",
                  "agent/core/session.py", "agent/core/exchange.py", "agent/core/schedule.py",
                  "agent/core/budget.py", "agent/core/incoming.py", "agent/core/binding.py"]
MAX_LINES = 700


def test_the_session_drivers_and_transports_stay_under_700_lines():
    files = DRIVER_MODULES + [str(p.relative_to(ROOT)) for p in TRANSPORTS]
    long = {f: n for f in files if (n := len((ROOT / f).read_text().splitlines())) > MAX_LINES}
    assert not long, long
