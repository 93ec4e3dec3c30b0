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
    """The names the session and the MQTT runner gave the same violation appear
    nowhere in agent/ any more, except in the list that records the renaming."""
    old = set(reasons.RENAMED)
    for path in (ROOT / "agent").rglob("*.py"):
        if path.name == "reasons.py":
            continue
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Constant) and isinstance(n.value, str):
                assert n.value not in old, f"{path.relative_to(ROOT)}:{n.lineno} still says {n.value}"
    assert set(reasons.RENAMED.values()) <= reasons.ALL


def _outcome_reason_literals():
    """String literals an apply outcome's reason is made of or compared with, in agent/: the second
    argument of `Outcome(...)`, and an outcome reason on either side of a comparison with `x.reason`."""
    for path in (ROOT / "agent").rglob("*.py"):
        if path.parts[-2] == "sequencer" or path.name == "reasons.py":
            continue  # the sequencer's own Outcome is another class (agent/sequencer/answers.py)
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "Outcome" and len(n.args) > 1:
                sides = [n.args[1]]
            elif isinstance(n, ast.Compare) and any(isinstance(s, ast.Attribute) and s.attr == "reason"
                                                     for s in [n.left, *n.comparators]):
                sides = [n.left, *n.comparators]
            else:
                continue
            for s in sides:
                if isinstance(s, ast.Constant) and isinstance(s.value, str) and \
                        (isinstance(n, ast.Call) or s.value in reasons.OUTCOME_REASONS):
                    yield f"{path.relative_to(ROOT)}:{n.lineno} {s.value!r}"


def test_apply_outcome_reasons_come_from_the_one_list():
    """What applying an event came to (§12, §13.6) is named by agent/core/reasons.py, never spelled
    out where an outcome is made or read."""
    assert reasons.APPLIED in reasons.OUTCOME_REASONS and reasons.NOT_BYTES in reasons.OUTCOME_REASONS
    assert not (reasons.OUTCOME_REASONS - {reasons.NOT_BYTES}) & reasons.ALL   # refusals of messages are apart
    stray = list(_outcome_reason_literals())
    assert not stray, "apply outcome reasons spelled out: " + ", ".join(stray)


def test_the_sequencer_member_reads_the_sequencers_codes_by_name():
    """The Commit sequencer's refusal codes are one list, in agent/sequencer/core.py (its own
    service: docs/sequencer.md); the member side that reads its answers names them from there."""
    from agent.sequencer import core
    codes = {getattr(core, n) for n in ("STALE_EPOCH", "FUTURE_EPOCH", "NOT_COMMIT", "UNPARSEABLE", "FAILED_CLOSED",
                                        "MIGRATED", "EPOCH_OUT_OF_RANGE", "DISK_FULL", "GROUP_LIMIT", "GROUP_RETIRED",
                                        "STATE_BEHIND")}
    for name in ("client.py", "answers.py", "commit_queue.py"):
        path = ROOT / "agent" / "sequencer" / name
        spelled = [f"{n.lineno} {n.value!r}" for n in ast.walk(ast.parse(path.read_text()))
                   if isinstance(n, ast.Constant) and n.value in codes]
        assert not spelled, f"{path.relative_to(ROOT)} spells the sequencer's codes: {spelled}"
