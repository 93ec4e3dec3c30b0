"""All SQL lives in agent/store/: a guard that fails when SQL
statement text appears in a module outside it.

SQL is recognised in string literals (f-string parts included, docstrings excluded) by the shape
of a statement: SELECT ... FROM, INSERT INTO, UPDATE x SET, DELETE FROM, CREATE/DROP/ALTER, PRAGMA.
`KNOWN_DEBT` lists the modules that still hold SQL from before the rule was enforced, with the
number of statements each held when this guard was written: a count may only go down (lower it
when you move statements into agent/store/), and a module not listed may hold none."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SQL = re.compile(r"\b(SELECT\b[\s\S]*\bFROM|INSERT\s+(OR\s+\w+\s+)?INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM|"
                 r"REPLACE\s+INTO|CREATE\s+(TABLE|INDEX|TRIGGER|VIEW|UNIQUE)|DROP\s+(TABLE|INDEX)|ALTER\s+TABLE|"
                 r"PRAGMA\s+\w+)\b")
# the node's store; the sequencer service's own, a member's Commit queue's, and the versioned
# layouts of the sequencer's files (its state and the queue), which may not import agent/store/; and
# the opener both share, which gives a file's WAL index real blocks before SQLite maps it
STORES = ("agent/store/", "agent/sequencer/store.py", "agent/sequencer/queue_store.py",
          "agent/sequencer/layout.py", "agent/walindex.py")

# Still to move (each of these is a module's own piece of work). Empty: a
# module outside STORES may hold no SQL at all.
KNOWN_DEBT: dict[str, int] = {}


def sql_statements(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs and SQL.search(n.value)]


def test_sql_lives_in_agent_store():
    over = {}
    for f in sorted((ROOT / "agent").rglob("*.py")):
        rel = f.relative_to(ROOT).as_posix()
        if rel.startswith(STORES):
            continue
        found = sql_statements(f)
        if len(found) > KNOWN_DEBT.get(rel, 0):
            over[rel] = [f"line {ln}: {text[:60]!r}" for ln, text in found]
    assert not over, f"SQL outside agent/store/ (move it into the store module it belongs to): {over}"


def test_the_guard_sees_sql():
    """The recogniser itself: statements are found, prose and docstrings are not."""
    assert SQL.search("SELECT coalesce(max(seq), 0) FROM events")
    assert SQL.search("INSERT OR IGNORE INTO held VALUES (?)")
    assert SQL.search("DELETE FROM meta WHERE key=?")
    assert SQL.search("UPDATE tables SET horizon_p=0")
    assert not SQL.search("select the peers to update from the set")
    assert not SQL.search("the cursor is updated")
