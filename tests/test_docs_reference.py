"""README.md and docs/ are reference, not a diary: README stays short, the docs stay within a
budget, no document carries history markers (session names, measurement history, tracker numbers)
or cites a file that is not in the repository, and every relative link points at a file that exists."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))
FILES = [ROOT / "README.md"] + DOCS
README_MAX = 12 * 1024
DOCS_MAX = 250_000   # the 250 KB (decimal): the reference for every command, format and job

# What a diary says and reference does not (matched case-insensitively).
MARKERS = [
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|this|last|previous|earlier)"
    r" session\b",
    r"\bbefore this change\b",
    r"\bthe code before\b",
    r"\bRecorded 20\d\d-",
    r"\bissue \d+",
    r"\bload average",
    # specification files outside the repository: the docs cite the SSP/1 section instead
    r"wire-profile\.md", r"cli-contract\.md", r"architecture\.md", r"\.\./shared",
]
_MARKER = re.compile("|".join(f"(?:{m})" for m in MARKERS), re.I)
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_DOC_SPAN = re.compile(r"`((?:docs/)?[\w-]+\.md)`")


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def markers(text: str) -> list[str]:
    """Every history marker in `text`, with its line number."""
    return [f"{i}: {m.group(0)!r}" for i, line in enumerate(text.splitlines(), 1) for m in _MARKER.finditer(line)]


def broken_links(path: Path, text: str) -> list[str]:
    """Relative links ([text](path)) and code spans naming a document (`docs/x.md`) that point at
    no file; a link resolves against the document's own directory, a span against the root's or
    the document's."""
    bad = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        if not (path.parent / target.split("#", 1)[0]).exists():
            bad.append(target)
    for name in _DOC_SPAN.findall(text):
        if not ((ROOT / name).exists() or (path.parent / name).exists()):
            bad.append(name)
    return bad


def test_readme_is_short():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX, f"README.md is {size} bytes; at most {README_MAX}: move reference into docs/"


def test_docs_fit_their_budget():
    size = sum(len(p.read_bytes()) for p in DOCS)
    assert size <= DOCS_MAX, f"docs/ holds {size} bytes; at most {DOCS_MAX}"


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_no_history_markers(path):
    found = markers(path.read_text())
    assert not found, f"{_rel(path)} reads as history, not reference: {found}"


@pytest.mark.parametrize("path", FILES, ids=_rel)
def test_relative_links_point_at_files(path):
    bad = broken_links(path, path.read_text())
    assert not bad, f"{_rel(path)} links to files that do not exist: {bad}"


def test_the_checks_can_fail(tmp_path):
    assert markers("The sixth session measured it.\nok\nRecorded 2026-12-03, load average 1.2")
    # the tracker reference and the absent file spelt in two parts: the code scans would flag them
    assert markers("see issue " + "40") and markers("as wire-profile" + ".md §4 says")
    assert markers("before this change")
    assert not markers("The session driver (SSP/1 §4) resumes a session after a restart.")
    (tmp_path / "a.md").write_text("x")
    doc = tmp_path / "b.md"
    assert broken_links(doc, "[a](a.md) [web](https://example.org) [here](#x)") == []
    assert broken_links(doc, "[gone](gone.md#part) and `docs/gone.md`") == ["gone.md#part", "docs/gone.md"]


# A cited section: `docs/x.md "Heading"` (also `x.md "Heading"`), in code, tests, tools and the docs.
_CITED = re.compile(r'\b([\w-]+\.md)"? "([^"\n]{3,80})"')
_CITING = ("agent", "firmware_bridge", "tests", "tools", "bench", "docs")


def anchors(text: str) -> list[str]:
    """What a citation may name in a document: its headings and its bold labels (`**Label.**`)."""
    heads = [m.group(1).strip() for m in re.finditer(r"^#+\s+(.+)$", text, flags=re.M)]
    return heads + [b.strip(" .:") for b in re.findall(r"\*\*([^*\n]+)\*\*", text)]


def unresolved(text: str, docs: dict[str, list[str]]) -> list[str]:
    """Citations of a section of one of `docs` ({file name: anchors}) that name none of its anchors
    (a heading that starts with or contains the cited words counts)."""
    bad = []
    for i, line in enumerate(text.splitlines(), 1):
        for name, cited in _CITED.findall(line):
            if name in docs and not any(cited.lower() in a.lower() for a in docs[name]):
                bad.append(f"{i}: {name} \"{cited}\"")
    return bad


def test_every_cited_section_exists():
    docs = {p.name: anchors(p.read_text()) for p in FILES}
    bad = []
    for top in _CITING:
        for p in sorted((ROOT / top).rglob("*")):
            rel = p.relative_to(ROOT).parts
            if p.suffix not in (".py", ".md", ".sh") or "node_modules" in rel or rel[:2] == ("bench", "results"):
                continue
            bad += [f"{_rel(p)}:{b}" for b in unresolved(p.read_text(errors="replace"), docs)]
    assert not bad, "sections cited that the document does not have: " + "; ".join(bad)


def test_a_missing_section_is_found():
    docs = {"x.md": anchors("# Title\n## Full disk\n**Files handed to the CLI** are read...\n")}
    assert unresolved('see docs/x.md "Full disk" and x.md "Files handed to the CLI"', docs) == []
    assert unresolved('see docs/x.md "On a small ext4 partition"', docs) == ['1: x.md "On a small ext4 partition"']
