"""`--against REV` (bench/_harness.py parse_args, against): a bench runs as a same-run A/B of this
checkout and REV checked out in a temporary git worktree, each tree's own bench script in child
processes with the same arguments, and prints every figure of both sides with the ratio this / REV.
Only the output's shape is asserted, never a figure; the temporary worktree is gone afterwards."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _git(*a: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True)


pytestmark = pytest.mark.skipif(_git("rev-parse", "HEAD").returncode != 0, reason="not a git checkout")


def _run(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), SSP_BENCH_RESULTS=str(tmp_path / "results"),
               SSP_AGENT_WITNESS_DIR=str(tmp_path / "witness"))
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)


def _worktrees() -> set[str]:
    return {line for line in _git("worktree", "list", "--porcelain").stdout.splitlines() if line.startswith("worktree ")}


def test_a_bench_against_head_prints_both_sides_and_their_ratio(tmp_path):
    before = _worktrees()
    p = _run(tmp_path, "bench/bench_sync.py", "--events", "200", "--against", "HEAD", "--against-rounds", "2", "--record")
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    head = _git("rev-parse", "--short=7", "HEAD").stdout.strip()
    assert f"bench/bench_sync.py --events 200: this checkout against HEAD ({head}), 2 round(s) each" in out, out
    # the rounds alternate, the order swapped every round
    assert [ln for ln in out.splitlines() if ln.startswith("--against: round")] == [
        "--against: round 1, this checkout ...", "--against: round 1, HEAD ...",
        "--against: round 2, HEAD ...", "--against: round 2, this checkout ..."]
    rows = {ln.split()[1]: ln for ln in out.splitlines() if ln.startswith(("figure ", "denominator "))}
    for name in ("ratio_sync_apply_only", "sync_events_per_s", "apply_only_events_per_s", "events"):
        assert name in rows, out
        # this: median (min-max), REV: median (min-max), this / REV: median (min-max)
        assert rows[name].count("(") == 3 and rows[name].count("-") >= 3, rows[name]
    assert rows["events"].split()[-2:] == ["1.000", "(1.000-1.000)"]
    # an A/B is printed, never recorded; the temporary worktree is removed
    assert "nothing recorded" in out and not (tmp_path / "results").exists()
    assert _worktrees() == before


def test_against_a_revision_that_does_not_exist_fails_with_the_reason(tmp_path):
    env_tmp = tmp_path / "tmp"
    env_tmp.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT), TMPDIR=str(env_tmp))
    p = subprocess.run([sys.executable, "bench/bench_sync.py", "--events", "50", "--against", "no-such-revision-x"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode != 0 and "--against no-such-revision-x: cannot check it out" in p.stderr
    assert list(env_tmp.iterdir()) == []      # nothing left behind


def test_the_sequencer_against_head_prints_the_ratio_per_case(tmp_path):
    p = _run(tmp_path, "bench/bench_sequencer.py", "--quick", "--no-pkcs11", "--rounds", "1", "--cases", "64:0",
             "--against", "HEAD")
    assert p.returncode == 0, p.stderr[-3000:]
    for k in ("software_64_this_ratio", "software_64_other_ratio", "software_64_this/REV_ratio"):
        assert k in p.stdout, p.stdout
