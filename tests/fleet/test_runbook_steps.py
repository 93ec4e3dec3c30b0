"""docs/operations.md "Fleet rehearsal" and tests/fleet/test_rehearsal.py are the same steps: this
fails when a step is added, removed, renumbered or retitled in the doc without the test following
(or the reverse), and when the rehearsal stops running one of them."""
from __future__ import annotations

import ast
from pathlib import Path

from .runbook import doc_steps

# The rehearsal's steps, in the doc's order (number, title as in docs/operations.md).
STEPS = [
    (1, "An authority, once per mesh (replacement §0)"),
    (2, "The mesh manifest names it, under authorities and [[peers]]"),
    (3, "The gateway's node"),
    (4, "The devices' manifest: the mesh's, naming the gateway as a peer too"),
    (5, "The gateway vouched by the authority, so devices trust it"),
    (6, "The gateway's broker account"),
    (7, "The gateway's service, for the rest of the rehearsal"),
    (8, "A device: init (fleet §3, replacement §2)"),
    (9, "Its broker password, made on the device; only the hash leaves it"),
    (10, "Vouch for it on the live gateway (fleet §5, replacement §3)"),
    (11, "Issue its broker account: append the hash line, reload mosquitto"),
    (12, "A reading written on the device between wakes"),
    (13, "A wake of the device"),
    (14, "Every node of the healthy fleet is OK (fleet §6)"),
    (15, "A device died: the retirement cutoff (replacement §1, on the live gateway)"),
    (16, "Vouch for the new device, retire the old one (replacement §3, on the live gateway)"),
    (17, "Rehydrate the new device from the gateway (replacement §4)"),
    (18, "How far rehydration is, on the new device and on the live gateway"),
    (19, "The new device holds every row the gateway holds (replacement §4 \"Check\")"),
]

REHEARSAL = Path(__file__).with_name("test_rehearsal.py")


def _steps_the_rehearsal_runs() -> list[int]:
    """The step numbers test_rehearsal.py hands to `rb.run(N, ...)` / `rb.start(N, ...)`."""
    out = []
    for node in sorted((n for n in ast.walk(ast.parse(REHEARSAL.read_text())) if hasattr(n, "lineno")),
                       key=lambda n: (n.lineno, n.col_offset)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ("run", "start")
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "rb"
                and node.args and isinstance(node.args[0], ast.Constant)):
            out.append(node.args[0].value)
    return out


def test_the_doc_and_the_test_list_the_same_steps():
    assert [(n, t) for n, t, _b in doc_steps()] == STEPS


def test_the_steps_are_numbered_in_order():
    assert [n for n, _t in STEPS] == list(range(1, len(STEPS) + 1))


def test_the_rehearsal_runs_every_step():
    """Every step is run by the rehearsal (which also asserts, as it runs, that it first runs
    them in the doc's order)."""
    ran = _steps_the_rehearsal_runs()
    assert set(ran) == {n for n, _t in STEPS}, sorted(set(ran) ^ {n for n, _t in STEPS})


def test_a_changed_doc_is_caught():
    """The comparison sees a retitled step and a step without its block."""
    from .runbook import DOCS
    text = DOCS.read_text()
    assert [(n, t) for n, t, _b in doc_steps(text.replace("### Step 3. The gateway's node", "### Step 3. Gw"))] != STEPS
    broken = text.replace("### Step 6. The gateway's broker account\n\n```sh", "### Step 6. The gateway's broker account\n\n```")
    try:
        doc_steps(broken)
    except AssertionError as e:
        assert "step 6" in str(e)
    else:
        raise AssertionError("a step without its sh block went unnoticed")
