"""Code, tests, tools and benches cite only what the repository holds: the SSP/1 (or SOVM, scope)
§, docs/protocol.md ("§0 Wire format" and on), docs/cli.md, the other docs/ pages. The three
design files the project was started from are not in it, so a reader could not follow a citation
of them. Recorded bench results, test vectors, store fixtures and npm's node_modules are data."""
from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# spelt in two parts so this file does not name them itself
ABSENT = ("wire-profile" + ".md", "cli-contract" + ".md", "architecture" + ".md")
# a file by name, the first two by stem before a §, or docs/ and the third's stem (the stem alone
# is an ordinary word); built from parts so this file does not match
CITATION = re.compile(r"(?<![\w/.-])(?:docs/)?(?:" + "|".join(re.escape(n) for n in ABSENT) + ")"
                      r"|(?<![\w/.-])(?:" + "wire-" + "profile|cli-" + "contract" + r")(?=\s*§)"
                      r"|docs/" + "architecture" + r"\b")
TOPS = ("agent", "firmware_bridge", "tests", "tools", "bench")
SKIP_DIRS = {"node_modules", "vectors", "fixtures", "__pycache__"}   # fixtures: recorded stores, data


def _skipped(rel: Path) -> bool:
    return bool(SKIP_DIRS & set(rel.parts)) or rel.parts[:2] == ("bench", "results")


def citations(text: str) -> list[str]:
    return [m.group(0) for m in CITATION.finditer(text)]


def test_the_scan_sees_a_citation():
    assert citations("as " + ABSENT[0] + " §4 says") == [ABSENT[0]]
    assert citations("(docs/" + ABSENT[2] + " \"Layers\")") == ["docs/" + ABSENT[2]]
    assert citations("(SOVM §22.5, wire-" + "profile §6)") == ["wire-" + "profile"]
    assert citations("(docs/" + "architecture): core") == ["docs/" + "architecture"]
    assert citations("docs/protocol.md §0 and docs/cli.md, for another architecture") == []
    assert _skipped(Path("bench/results/x.json")) and _skipped(Path("tests/vectors/cctv/a.json"))


def test_no_citation_of_a_file_outside_the_repository():
    found = []
    for top in TOPS:
        for d, dirs, files in os.walk(ROOT / top):
            # pruned, not filtered: node_modules alone holds thousands of files
            dirs[:] = sorted(x for x in dirs if not _skipped(Path(d, x).relative_to(ROOT)))
            for name in sorted(files):
                p = Path(d, name)
                try:
                    text = p.read_text()
                except (UnicodeDecodeError, OSError):
                    continue  # binary: no citation
                for i, line in enumerate(text.splitlines(), 1):
                    if citations(line):
                        found.append(f"{p.relative_to(ROOT)}:{i}")
    assert not found, "cites files not in the repository (say the SSP/1 § or the docs/ page): " + ", ".join(found)
