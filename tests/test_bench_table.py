"""README's Performance table is the rendering of the benches' result files ("the
README's performance table is regenerated from the benches"), never figures typed by hand; the
result files hold what bench/_harness.py record writes; every bench has a result (or says why not).
Figures are never asserted: the benches measure, the table only shows what they recorded."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "bench" / "table.py"


def _table():
    spec = importlib.util.spec_from_file_location("bench_table", TABLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check(readme: Path, results: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TABLE), "--check", "--readme", str(readme), "--results", str(results)],
                          capture_output=True, text=True, timeout=60)


def test_readme_table_is_the_rendering_of_bench_results():
    t = _table()
    readme = (ROOT / "README.md").read_text()
    assert readme.count(t.BEGIN) == 1 and readme.count(t.END) == 1, "README has no bench-table markers"
    shown = readme.split(t.BEGIN, 1)[1].split(t.END, 1)[0]
    assert shown == "\n" + t.render(t.load()), \
        "README's Performance table is not the rendering of bench/results/: run `python bench/table.py`"
    assert _check(ROOT / "README.md", t.RESULTS).returncode == 0


def test_check_fails_on_a_figure_edited_by_hand_and_on_a_result_not_rendered(tmp_path):
    t = _table()
    readme, results = tmp_path / "README.md", tmp_path / "results"
    shutil.copytree(t.RESULTS, results)
    text = (ROOT / "README.md").read_text()
    readme.write_text(text)
    assert _check(readme, results).returncode == 0
    # a figure typed over in the table (one bold figure's first digit changed)
    table = text.split(t.BEGIN, 1)[1].split(t.END, 1)[0]
    i = table.index("**") + 2
    digit = table[i]
    assert digit.isdigit(), table[i - 10:i + 10]
    edited = table[:i] + str((int(digit) + 1) % 10) + table[i + 1:]
    readme.write_text(text.replace(table, edited))
    p = _check(readme, results)
    assert p.returncode == 1 and "python bench/table.py" in p.stderr
    # a result file added (or re-recorded) without rendering
    readme.write_text(text)
    r = json.loads(next(iter(sorted(results.glob("*.json")))).read_text())
    r["bench"] = "bench_new"
    (results / "bench_new.json").write_text(json.dumps(r))
    assert _check(readme, results).returncode == 1


def test_every_bench_has_a_valid_result_file():
    """Skip none silently: each bench in bench/ has a result, measured, transcribed with its
    source, or not run with the reason; every file holds what the schema asks."""
    t = _table()
    benches = {p.stem for p in (ROOT / "bench").glob("*.py")
               if p.stem == "apply" or p.stem.startswith("bench_")}
    files = sorted(t.RESULTS.glob("*.json"))
    for p in files:
        assert t.validate(json.loads(p.read_text())) == [], p
    recorded = {p.stem.split(".")[0] for p in files}
    assert benches - recorded == set(), "benches with no result file (record one, or a not_run file saying why)"


def test_validate_names_what_a_result_lacks():
    t = _table()
    good = json.loads((ROOT / "bench" / "results" / "bench_mqtt.json").read_text())
    assert t.validate(good) == []
    for key in ("load_average", "commit", "denominators", "summary", "machine"):
        bad = dict(good)
        del bad[key]
        assert t.validate(bad), key
    assert t.validate(dict(good, figures={"x": "fast"}))
    assert t.validate(dict(good, figures={"x": {"median": 1.0}}))
    assert t.validate(dict(good, status="transcribed"))        # no source
    assert t.validate(dict(good, status="not_run"))            # no reason


def test_a_recorded_run_writes_the_schema_and_an_unrecorded_one_nothing(tmp_path):
    """bench/_harness.py record, end to end: a tiny bench_sync run with --record writes
    $SSP_BENCH_RESULTS/bench_sync.json that the renderer accepts; without --record, nothing."""
    t = _table()
    results = tmp_path / "results"
    env = dict(os.environ, PYTHONPATH=str(ROOT), SSP_BENCH_RESULTS=str(results),
               SSP_AGENT_WITNESS_DIR=str(tmp_path / "witness"))
    argv = [sys.executable, "bench/bench_sync.py", "--events", "300"]
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    assert not results.exists()
    p = subprocess.run(argv + ["--record"], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads((results / "bench_sync.json").read_text())
    assert t.validate(r) == []
    assert r["bench"] == "bench_sync" and r["status"] == "measured"
    assert r["command"] == "python bench/bench_sync.py --events 300 --record"
    assert r["parameters"]["events"] == 300 and r["denominators"]["events"] == 300
    assert {"sync_events_per_s", "ratio_sync_apply_only"} <= set(r["figures"])
    assert "apply_only_events_per_s" in r["denominators"]
    assert r["measures"].startswith("Sync benchmark") and r["summary"]
    # the rendering shows it: one row for the bench, with its figures and its denominators
    row = t.render(t.load(results)).splitlines()[2]
    assert row.startswith("| [`bench/bench_sync.py --events 300`](bench/bench_sync.py)") and "ratio_sync_apply_only **" in row
    assert "apply_only_events_per_s **" in row and "load average" in row


def test_record_refuses_what_is_not_a_number():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import _harness
    finally:
        sys.path.remove(str(ROOT / "bench"))
    with pytest.raises(ValueError):
        _harness.record({"rate": "fast"}, {}, "a line")
    with pytest.raises(ValueError):
        _harness.record({"rate": float("inf")}, {}, "a line")
    with pytest.raises(ValueError):
        _harness.record({"rate": {"median": 1.0}}, {}, "a line")
    with pytest.raises(ValueError):
        _harness.record({"rate": 1.0}, {}, "  ")
    assert _harness.of_rounds([3, 1, 2]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
