"""One list of reason codes (agent/core/reasons.py): every refusal of a message from outside in
agent/ names a code from it, and the names a violation had before one list existed are gone."""
from __future__ import annotations

import ast
from pathlib import Path

from agent.core import reasons

ROOT = Path(__file__).resolve().parents[2]

# Calls whose reason-code argument is a literal: (callee name, index of the code argument).
REFUSING_CALLS = {"ProtocolError": 0, "_reject": 1, "_expect": 2, "_down": 0}


def _codes_used():
    for path in (ROOT / "agent").rglob("*.py"):
        if path.parts[-2] == "sequencer":
            continue  # the Commit sequencer is its own service with its own answers (docs/sequencer.md)
        for n in ast.walk(ast.parse(path.read_text())):
            if not isinstance(n, ast.Call):
                continue
            name = n.func.id if isinstance(n.func, ast.Name) else n.func.attr if isinstance(n.func, ast.Attribute) else None
            i = REFUSING_CALLS.get(name)
            if i is None or len(n.args) <= i:
                continue
            arg = n.args[i]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield path.relative_to(ROOT), n.lineno, arg.value
            elif isinstance(arg, ast.IfExp):
                for side in (arg.body, arg.orelse):
                    if isinstance(side, ast.Constant):
                        yield path.relative_to(ROOT), n.lineno, side.value


def test_every_refusal_uses_a_code_from_the_one_list():
    used = list(_codes_used())
    assert len(used) > 30  # the scan sees the boundary parsers, the session and the MQTT runner
    stray = [f"{p}:{line} {code}" for p, line, code in used if code not in reasons.ALL]
    assert not stray, "reason codes not in agent/core/reasons.py: " + ", ".join(stray)


def test_a_violation_has_one_name():
    """The names the session and the MQTT runner gave the same violation (issue 13) appear
    nowhere in agent/ any more, except in the list that records the renaming."""
    old = set(reasons.RENAMED)
    for path in (ROOT / "agent").rglob("*.py"):
        if path.name == "reasons.py":
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                assert n.value not in old, f"{path.relative_to(ROOT)}:{n.lineno} still says {n.value}"
    assert set(reasons.RENAMED.values()) <= reasons.ALL
