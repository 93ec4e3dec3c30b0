"""README.md and docs/cli.md stay true to the command: every verb and sub-verb the parser defines
(agent/cli/: the parser and the verb modules that register theirs) is named in README's verb table
and in docs/cli.md's reference, and every document README's "Documentation" list names exists (and
every document in docs/ is in that list)."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

from agent.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
CLI_DOC = (ROOT / "docs" / "cli.md").read_text()


def _verbs(p: argparse.ArgumentParser, prefix: tuple[str, ...] = ()):
    """(verb,), (verb, sub-verb), ... for every sub-parser the command defines, at any depth."""
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                yield prefix + (name,)
                yield from _verbs(sp, prefix + (name,))


def _table_spans() -> list[str]:
    """The code spans of the verb table's first column (the rows `| `verb ...` | what it does |`),
    with the table's escaped pipes unescaped."""
    start = README.index("| verb | what it does |")
    spans = []
    for line in README[start:].splitlines()[2:]:
        if not line.startswith("|"):
            break
        first = re.split(r"(?<!\\)\|", line)[1]
        spans += [s.replace("\\|", "|").strip() for s in re.findall(r"`([^`]+)`", first)]
    return spans


def _documented(path: tuple[str, ...], spans: list[str]) -> bool:
    """A verb is documented by a span that starts with it; a sub-verb (or deeper) by a span that
    starts with its verb and names it as a word further on (`peer add ...`, `policy (allow|deny)`,
    `sequencer init|register|...`): not as part of a flag (`rehydrate --status`)."""
    verb, rest = path[0], path[1:]
    for s in spans:
        words = s.split(None, 1)
        if not words or words[0] != verb:
            continue
        tail = words[1] if len(words) > 1 else ""
        if all(re.search(rf"(?<![\w-]){re.escape(w)}(?![\w-])", tail) for w in rest):
            return True
    return False


def test_every_verb_and_sub_verb_is_in_the_readme_verb_table():
    spans = _table_spans()
    assert spans, "README.md has no verb table"
    missing = [" ".join(v) for v in _verbs(build_parser()) if not _documented(v, spans)]
    assert not missing, f"verbs the CLI defines that README.md's verb table does not name: {missing}"


def _cli_doc_spans() -> list[str]:
    """The code spans that a bullet of docs/cli.md's "Verbs" section opens with: those before the
    bullet's first ": " outside a code span (`- `peer add ...`, `peer list`: what they do`)."""
    section = CLI_DOC.split("\n## Verbs\n", 1)[1].split("\n## ", 1)[0]
    spans = []
    for item in re.split(r"^- ", section, flags=re.M)[1:]:
        parts = item.split("`")
        head = []
        for i, part in enumerate(parts):
            if i % 2 == 0 and ": " in part:
                head.append(part.split(": ", 1)[0])
                break
            head.append(part)
        spans += [p for i, p in enumerate(head) if i % 2 == 1]
    return spans


def test_every_verb_and_sub_verb_is_in_the_cli_reference():
    spans = _cli_doc_spans()
    assert spans, "docs/cli.md has no verb list"
    missing = [" ".join(v) for v in _verbs(build_parser()) if not _documented(v, spans)]
    assert not missing, f"verbs the CLI defines that docs/cli.md's Verbs section does not name: {missing}"


def test_the_matcher_sees_a_missing_sub_verb():
    # the check above can fail: a sub-verb named nowhere, and one only as a flag, are not documented
    spans = ["peer add --site-id S", "rehydrate --from PEER", "rehydrate --status", "policy (allow|deny) --peer S"]
    assert _documented(("peer", "add"), spans) and _documented(("policy", "deny"), spans)
    assert not _documented(("peer", "list"), spans)
    assert not _documented(("rehydrate", "status"), spans)
    assert not _documented(("init",), spans)


def _documentation_list() -> list[str]:
    section = README.split("\n## Documentation\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^- `([^`]+)`", section, flags=re.M)


def test_every_doc_in_the_readme_documentation_list_exists():
    docs = _documentation_list()
    assert docs, "README.md's Documentation list names no document"
    missing = [d for d in docs if not (ROOT / d).is_file()]
    assert not missing, f"README.md's Documentation list names documents that do not exist: {missing}"


def test_every_doc_in_docs_is_in_the_readme_documentation_list():
    listed = set(_documentation_list())
    unlisted = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md")
                      if p.relative_to(ROOT).as_posix() not in listed)
    assert not unlisted, f"documents in docs/ that README.md's Documentation list does not name: {unlisted}"
