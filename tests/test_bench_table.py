"""docs/performance.md's table is the rendering of the benches' result files, never figures typed by hand; the
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


DOC = ROOT / "docs" / "performance.md"


def _check(doc: Path, results: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TABLE), "--check", "--doc", str(doc), "--results", str(results)],
                          capture_output=True, text=True, timeout=60)


def test_the_performance_table_is_the_rendering_of_bench_results():
    t = _table()
    doc = DOC.read_text()
    assert doc.count(t.BEGIN) == 1 and doc.count(t.END) == 1, "docs/performance.md has no bench-table markers"
    shown = doc.split(t.BEGIN, 1)[1].split(t.END, 1)[0]
    assert shown == "\n" + t.render(t.load()), \
        "docs/performance.md's table is not the rendering of bench/results/: run `python bench/table.py`"
    assert _check(DOC, t.RESULTS).returncode == 0


def test_check_fails_on_a_figure_edited_by_hand_and_on_a_result_not_rendered(tmp_path):
    t = _table()
    doc, results = tmp_path / "performance.md", tmp_path / "results"
    shutil.copytree(t.RESULTS, results)
    text = DOC.read_text()
    doc.write_text(text)
    assert _check(doc, results).returncode == 0
    # a figure typed over in the table (the first figure of the first result changed)
    table = text.split(t.BEGIN, 1)[1].split(t.END, 1)[0]
    result = table.splitlines()[3].split(" | ")[1]
    i = table.index(result) + next(k for k, c in enumerate(result) if c.isdigit())
    digit = table[i]
    assert digit.isdigit(), table[i - 10:i + 10]
    edited = table[:i] + str((int(digit) + 1) % 10) + table[i + 1:]
    doc.write_text(text.replace(table, edited))
    p = _check(doc, results)
    assert p.returncode == 1 and "python bench/table.py" in p.stderr
    # a result file added (or re-recorded) without rendering
    doc.write_text(text)
    r = json.loads(next(iter(sorted(results.glob("*.json")))).read_text())
    r["bench"] = "bench_new"
    (results / "bench_new.json").write_text(json.dumps(r))
    assert _check(doc, results).returncode == 1


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
    # the rendering shows it: one row for the bench, with its line (figures against the same
    # run's denominators) and the commit it ran at; the rest stays in the result file
    row = t.render(t.load(results)).splitlines()[2]
    assert row.startswith("| [`bench/bench_sync.py --events 300`](../bench/bench_sync.py)") and r["summary"] in row
    assert f"`{r['commit'][:7]}`" in row


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


# The plots are generated files, checked byte for byte against bench/results/ above; they are not
# prose a reader has to read, so they sit outside docs/'s 250 KiB text budget
# (tests/test_docs_reference.py) with a budget of their own: a plot is a few KB, never an image dump.
PLOTS_MAX = 96 * 1024
PLOT_MAX = 8 * 1024


def _svgplot():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import svgplot
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return svgplot


def test_the_plots_are_the_rendering_of_bench_results_and_listed_on_the_page():
    t = _table()
    results = t.load()
    drawn = t.plots(results)
    on_disk = {p.name: p.read_text() for p in sorted(t.PLOTS.glob("*.svg"))}
    assert on_disk == drawn, "docs/plots/ is not the rendering of bench/results/: run `python bench/table.py`"
    # one plot per measured or transcribed result, each shown on the page
    assert set(drawn) == {f"{r['_file']}.svg" for r in results if r["status"] != "not_run"}
    doc = DOC.read_text()
    shown = doc.split(t.PLOTS_BEGIN, 1)[1].split(t.PLOTS_END, 1)[0]
    assert shown == "\n" + t.render_plots(results)
    assert all(f"(plots/{name})" in shown for name in drawn)


def test_the_plots_fit_their_budget():
    sizes = {p.name: len(p.read_bytes()) for p in (ROOT / "docs" / "plots").glob("*.svg")}
    assert sizes and max(sizes.values()) <= PLOT_MAX, sizes
    assert sum(sizes.values()) <= PLOTS_MAX, f"docs/plots holds {sum(sizes.values())} bytes; at most {PLOTS_MAX}"


def test_check_fails_on_a_plot_edited_removed_or_left_over(tmp_path):
    t = _table()
    doc, results, plots = tmp_path / "docs" / "performance.md", tmp_path / "results", tmp_path / "docs" / "plots"
    doc.parent.mkdir()
    shutil.copytree(t.RESULTS, results)
    shutil.copytree(t.PLOTS, plots)
    text = DOC.read_text()
    doc.write_text(text)

    def check():
        return subprocess.run([sys.executable, str(TABLE), "--check", "--doc", str(doc), "--results", str(results),
                               "--plots", str(plots)], capture_output=True, text=True, timeout=60)
    assert check().returncode == 0
    apply_svg = plots / "apply.svg"
    original = apply_svg.read_text()
    apply_svg.write_text(original.replace("</svg>", "<!-- by hand --></svg>"))
    assert check().returncode == 1
    apply_svg.unlink()
    assert check().returncode == 1
    apply_svg.write_text(original)
    (plots / "gone.svg").write_text(original)
    assert check().returncode == 1
    # rendering puts every plot back and removes the one no result draws
    p = subprocess.run([sys.executable, str(TABLE), "--doc", str(doc), "--results", str(results), "--plots", str(plots)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and not (plots / "gone.svg").exists() and check().returncode == 0


def test_the_svg_writer_is_deterministic_and_well_formed():
    import xml.etree.ElementTree as ET
    s = _svgplot()
    rows = [("apply / raw verify", 0.55, 0.49, 0.56), ("once", 1.07, 1.07, 1.07), ("a <b> & c", 8.3, 2.0, 12.0)]
    svg = s.ranges("ratios", rows)
    assert svg == s.ranges("ratios", list(rows))
    root = ET.fromstring(svg)
    assert root.tag.endswith("svg")
    texts = [e.text for e in root.iter() if e.tag.endswith("text")]
    assert "a <b> & c" in texts and "0.55" in texts and "8.3" in texts
    # a range is a bar, a single measurement only a dot; the reference line at 1.0 is dashed
    assert svg.count('stroke-width="3"') == 2 and svg.count("<circle") == 3 and "stroke-dasharray" in svg
    curve = s.curves("fleet", "devices", [("convergence, s", [(25, 0.6, 0.6, 0.6), (400, 8.0, 7.0, 9.5)])])
    ET.fromstring(curve)
    assert "<polyline" in curve and curve.count("<circle") == 2
    assert s.num(-0.04) == "0" and s.num(12.25) == "12.2" and s.num(3.0) == "3"
    assert s._log_ticks(0.48, 1.04) == [0.2, 0.5, 1.0, 2.0]
    assert s._lin_ticks(20.8) == [0, 5.0, 10.0, 15.0, 20.0, 25.0]
    with pytest.raises(ValueError):
        s.ranges("nothing", [("zero", 0.0, 0.0, 0.0)])


def test_the_fleet_plot_reads_points_and_the_per_size_figures_alike():
    """bench_fleet.json carries its curve as `points` ({devices, convergence_s,
    gateway_cpu_s_per_device}, numbers or rounds) or as per-size figures: one plot either way."""
    t = _table()
    r = json.loads((t.RESULTS / "bench_fleet.json").read_text())
    r["_file"] = "bench_fleet"
    figures_only = {k: v for k, v in r.items() if k != "points"}
    figures_only["figures"] = {k: v for k, v in r["figures"].items() if k != "points"}
    figures_only["figures"].update({"heal_converge_s_25_devices": 0.6, "heal_gw_cpu_ms_per_device_25_devices": 7.0,
                                    "heal_converge_s_50_devices": 1.8, "heal_gw_cpu_ms_per_device_50_devices": 9.0})
    pts = t.fleet_points(figures_only)
    assert {"devices": 25, "convergence_s": 0.6, "gateway_cpu_s_per_device": 0.007} in pts
    with_points = dict(r, points=[{"devices": 25, "convergence_s": {"median": 0.6, "min": 0.5, "max": 0.7, "n": 3},
                                   "gateway_cpu_s_per_device": 0.007},
                                  {"devices": 400, "convergence_s": {"median": 9.0, "min": 8.0, "max": 11.0, "n": 3},
                                   "gateway_cpu_s_per_device": 0.01}])
    assert t.validate(with_points) == []
    svg = t.plot(with_points)
    assert "<polyline" in svg and ">400<" in svg and 'stroke-width="3"' in svg
    assert t.validate(dict(r, points=[{"convergence_s": 1.0}]))          # a point without its devices
    assert t.validate(dict(r, points=[{"devices": 25, "convergence_s": "slow"}]))


def test_record_writes_a_curve_the_renderer_accepts(tmp_path, monkeypatch):
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import _harness
    finally:
        sys.path.remove(str(ROOT / "bench"))
    monkeypatch.setattr(_harness, "RECORD", True)
    monkeypatch.setattr(_harness, "RESULTS", tmp_path)
    # record() names what the bench measures from its __main__'s docstring: a bench's, not the
    # test runner's (which differs between pytest and an xdist worker)
    import types
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("bench_fleet", "Fleet convergence curve."))
    pts = [{"devices": n, "convergence_s": _harness.of_rounds([n / 40, n / 30]), "gateway_cpu_s_per_device": 0.01}
           for n in (25, 50)]
    path = _harness.record({"x": 1.0}, {"devices_max": 50}, "a line", bench="bench_fleet", points=pts)
    r = json.loads(path.read_text())
    assert r["points"][1]["devices"] == 50 and r["points"][1]["convergence_s"]["n"] == 2
    assert _table().validate(r) == []
    with pytest.raises(ValueError):
        _harness.record({"x": 1.0}, {}, "a line", bench="bench_fleet", points=[{"devices": 25, "convergence_s": "slow"}])
