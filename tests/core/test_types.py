"""mypy over the pure core and the keystore bridge, with pyproject.toml's [tool.mypy] settings:
every def annotated, every body checked (the layers everything else stands on)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _mypy(cwd: Path, cache: Path, *args: str) -> subprocess.CompletedProcess:
    # the project's own configuration, a cache of this test's own (a cold run takes seconds)
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                           "--cache-dir", str(cache), "--no-error-summary", *args],
                          cwd=cwd, capture_output=True, text=True)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("mypy-cache")   # shared: the standard library's stubs are read once


def test_core_and_firmware_bridge_type_check(cache):
    r = _mypy(ROOT, cache)   # the files: [tool.mypy] files
    assert "No module named mypy" not in r.stderr, "mypy is a test dependency: pip install -e '.[test]'"
    assert r.returncode == 0, f"mypy (pyproject.toml [tool.mypy]) found:\n{r.stdout}{r.stderr}"


def test_the_settings_refuse_an_untyped_def(tmp_path, cache):
    """The check itself: under the same settings an unannotated def is an error."""
    (tmp_path / "scratch.py").write_text("def f(x):\n    return x\n")
    r = _mypy(tmp_path, cache, "scratch.py")
    assert r.returncode == 1 and "[no-untyped-def]" in r.stdout, r.stdout + r.stderr
