"""The suite's scheduling list (tests/conftest.py LONG_FIRST) names files that exist: a renamed
file would silently fall back to collection order and run alone at the end of the suite."""
from __future__ import annotations

from pathlib import Path

from tests.conftest import LONG_FIRST

ROOT = Path(__file__).resolve().parents[1]


def test_long_first_names_files_that_exist():
    missing = [f for f in LONG_FIRST if not (ROOT / f).is_file()]
    assert not missing, f"tests/conftest.py LONG_FIRST names files that do not exist: {missing}"
    assert len(set(LONG_FIRST)) == len(LONG_FIRST)
