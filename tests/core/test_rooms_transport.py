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
    assert "agent.sync" in imported(ROOT / "agent" / "transport" / "serial.py")   # lazy, relative
    assert "agent.store.eventlog" in imported(ROOT / "agent" / "runtime.py")


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
