"""docs/performance.md's table of current figures, rendered from the benches' result files
(bench/results/*.json, written by `python bench/<bench>.py --record`: bench/_harness.py record).

    python bench/table.py            # rewrite docs/performance.md between the bench-table markers
    python bench/table.py --check    # exit 1 if docs/performance.md differs from the rendering

One compact row per result file: the bench as run, its one human line (figures against the
denominators measured in the same run) and the commit it ran at; and one plot per result file,
docs/plots/<file>.svg (bench/svgplot.py), listed between the bench-plots markers: its ratios with
their min-max ranges, or the fleet's convergence time and gateway CPU per device against the
device count. Neither is typed by hand: tests/test_bench_table.py fails if the table or a plot is
not the rendering of bench/results/. Every other detail of a run stays in its result file."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import svgplot  # noqa: E402  (bench/: the SVG writer)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "performance.md"
BEGIN = "<!-- bench-table:begin -->"
END = "<!-- bench-table:end -->"
PLOTS = ROOT / "docs" / "plots"
PLOTS_BEGIN = "<!-- bench-plots:begin -->"
PLOTS_END = "<!-- bench-plots:end -->"
SCHEMA = 1
# The table's order: the apply path and what builds on it, the links, writes, the device's life,
# then the hostile-peer and at-rest benches; a bench not listed follows, by name.
ORDER = ("apply", "bench_scale", "bench_sync", "bench_mqtt", "bench_syncrate", "bench_serial", "bench_keystore",
         "bench_startup", "bench_sequencer", "bench_idle", "bench_quiet", "bench_lifecycle", "bench_fleet",
         "bench_acks", "bench_flood", "bench_strategies", "bench_atrest", "bench_secure_delete")
# status: "measured" (written by record), "transcribed" (a figure measured before result files
# existed, copied from README's hand-written row with the date it was measured: `source` says
# from where and why it was not re-run), "not_run" (`reason` says why it cannot run here).
STATUSES = ("measured", "transcribed", "not_run")
ROUND_KEYS = ("median", "min", "max", "n")


def _is_number(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)


def validate(r: dict) -> list[str]:
    """What is wrong with one result file (empty: nothing). The keys bench/_harness.py record
    writes; a transcribed or not-run result says where its figures come from, or why there are none."""
    bad = []
    need = {"schema": int, "bench": str, "status": str, "measures": str, "command": str, "date": str,
            "commit": str, "machine": dict, "denominators": dict, "figures": dict, "summary": str}
    for k, t in need.items():
        if not isinstance(r.get(k), t):
            bad.append(f"{k}: missing or not {t.__name__}")
    if bad:
        return bad
    if r["schema"] != SCHEMA:
        bad.append(f"schema {r['schema']} (this renderer reads {SCHEMA})")
    if r["status"] not in STATUSES:
        bad.append(f"status {r['status']!r} not one of {STATUSES}")
    if not r["measures"].strip() or not r["summary"].strip():
        bad.append("measures and summary are non-empty")
    if len(r["date"]) < 10 or r["date"][4] != "-" or r["date"][7] != "-":
        bad.append(f"date {r['date']!r} is not an ISO date")
    for kind in ("figures", "denominators"):
        for name, v in r[kind].items():
            if kind == "figures" and name == "points":
                bad += _bad_points(v)
            elif isinstance(v, dict):
                if tuple(v) != ROUND_KEYS or not all(_is_number(x) for x in v.values()):
                    bad.append(f"{kind} {name}: rounds hold numbers {ROUND_KEYS}")
            elif not _is_number(v):
                bad.append(f"{kind} {name}: {v!r} is not a finite number")
    if r["status"] == "measured":
        la = r.get("load_average")
        if not (isinstance(la, dict) and all(isinstance(la.get(k), list) and len(la[k]) == 3
                                             and all(_is_number(x) for x in la[k]) for k in ("start", "end"))):
            bad.append("load_average: start and end, three numbers each")
        if not r["commit"] or not isinstance(r.get("dirty"), bool):
            bad.append("a measured result names its commit and whether the checkout was dirty")
        for k in ("nproc", "cpu_model", "python", "sqlite"):
            if not r["machine"].get(k):
                bad.append(f"machine.{k} missing")
        if not r["figures"] or not r["denominators"]:
            bad.append("a measured result has figures and the denominators of the same run")
    elif r["status"] == "transcribed":
        if not r.get("source"):
            bad.append("a transcribed result says where its figures come from (source)")
    elif not r.get("reason"):
        bad.append("a result that was not run says why (reason)")
    if "points" in r:
        bad += _bad_points(r["points"])
    return bad


def _bad_points(points) -> list[str]:
    """A curve's points (bench_fleet's): a list of {name: number or rounds}, each with `devices`."""
    if not isinstance(points, list) or not points:
        return ["points: a non-empty list"]
    bad = []
    for i, pt in enumerate(points):
        if not isinstance(pt, dict) or not _is_number(pt.get("devices")):
            bad.append(f"points[{i}]: an object naming its devices")
            continue
        for name, v in pt.items():
            ok = (tuple(v) == ROUND_KEYS and all(_is_number(x) for x in v.values())) if isinstance(v, dict) \
                else _is_number(v)
            if not ok:
                bad.append(f"points[{i}] {name}: a number or rounds {ROUND_KEYS}")
    return bad


def load(results: Path = RESULTS) -> list[dict]:
    """Every result file, in the table's order; an invalid one stops the rendering."""
    out = []
    for p in sorted(results.glob("*.json")):
        r = json.loads(p.read_text())
        bad = validate(r)
        if bad:
            raise SystemExit(f"{p}: " + "; ".join(bad))
        if p.stem.split(".")[0] != r["bench"]:   # <bench>.json, or <bench>.<variant>.json (other sizes)
            raise SystemExit(f"{p}: holds bench {r['bench']!r}")
        r["_file"] = p.stem
        out.append(r)
    rank = {b: i for i, b in enumerate(ORDER)}
    return sorted(out, key=lambda r: (rank.get(r["bench"], len(ORDER)), r["bench"], r["_file"]))


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def row(r: dict) -> str:
    # the command as run (without `python` and `--record`): which sizes this row is
    what = f"[`{label(r)}`](../bench/{r['bench']}.py)"
    if r["status"] == "not_run":
        return f"| {_cell(what)} | not run here: {_cell(r['reason'])} | |"
    if r["status"] == "transcribed":
        code = f"transcribed: {r['source']}"
    else:
        code = f"`{r['commit'][:7]}`{' (uncommitted changes)' if r.get('dirty') else ''}"
    return f"| {_cell(what)} | {_cell(r['summary'])} | {_cell(code)} |"


def render(results: list[dict]) -> str:
    """The text between the markers: one row per result file."""
    lines = ["| bench as run | result (against the denominators of the same run) | code |", "| --- | --- | --- |"]
    lines += [row(r) for r in results]
    return "\n".join(lines) + "\n"


# -- plots -------------------------------------------------------------------------------------

# A figure is a headline ratio when a word of its name says so (ratio_x_y, cpu_bound_..., a
# slowdown); `X_median` with `X_min` and `X_max` beside it is one figure with its range.
RATIO_WORDS = {"ratio", "slowdown", "bound"}


def _rounds(v) -> tuple[float, float, float]:
    """(median, min, max) of a figure: its rounds, or a single number three times."""
    return (v["median"], v["min"], v["max"]) if isinstance(v, dict) else (v, v, v)


def _ratio_rows(figures: dict) -> list[tuple[str, float, float, float]]:
    rows = []
    for name, v in figures.items():
        words = name.split("_")
        if name == "points" or not RATIO_WORDS & set(words) or words[-1] in ("min", "max"):
            continue
        if words[-1] == "median" and isinstance(v, (int, float)):
            base = name[:-len("_median")]
            lo, hi = figures.get(base + "_min", v), figures.get(base + "_max", v)
            v, words = {"median": v, "min": min(lo, v), "max": max(hi, v), "n": 0}, words[:-1]
        text = " ".join(w for w in words if w != "ratio") or name
        rows.append((text, *_rounds(v)))
    return rows


def _derived_rows(r: dict) -> list[tuple[str, float, float, float]]:
    """For a bench that records no ratio: each figure over the denominator whose name ends with the
    same two or more words (`write_cpu_ms` over `python_pass_cpu_ms`)."""
    rows = []
    dens = {k: v for k, v in r["denominators"].items() if not isinstance(v, dict) and v > 0}
    for name, v in r["figures"].items():
        if isinstance(v, dict) or name == "points":
            continue
        words = name.split("_")
        for k in range(1, len(words) - 1):     # the longest common ending first
            suffix = "_".join(words[k:])
            den = next((d for d in dens if d.endswith("_" + suffix)), None)
            if den:
                rows.append((f"{' '.join(words[:k])} / {den[:-len(suffix) - 1].replace('_', ' ')} "
                             f"({suffix.replace('_', ' ')})", *_rounds(v / dens[den])))
                break
    return rows


def fleet_points(r: dict) -> list[dict]:
    """bench_fleet's curve as {devices, convergence_s, gateway_cpu_s_per_device} points: its
    `points` list, or read from the per-size figures (heal_converge_s_<N>_devices,
    heal_gw_cpu_ms_per_device_<N>_devices)."""
    points = r.get("points") or r["figures"].get("points")
    if isinstance(points, list):
        return points
    out = []
    for name, v in r["figures"].items():
        if name.startswith("heal_converge_s_") and name.endswith("_devices"):
            n = name[len("heal_converge_s_"):-len("_devices")]
            cpu = r["figures"].get(f"heal_gw_cpu_ms_per_device_{n}_devices")
            pt = {"devices": int(n), "convergence_s": v}
            if cpu is not None:
                med, lo, hi = _rounds(cpu)
                pt["gateway_cpu_s_per_device"] = {"median": med / 1000, "min": lo / 1000, "max": hi / 1000, "n": 1} \
                    if isinstance(cpu, dict) else cpu / 1000
            out.append(pt)
    return out


def label(r: dict) -> str:
    """The bench as run: its command line without `python` and `--record`."""
    return " ".join(a for a in r["command"].split()[1:] if a != "--record") or f"bench/{r['bench']}.py"


def plot(r: dict) -> str | None:
    """The SVG of one result: the fleet's curves against the device count, or the bench's ratios
    with their ranges (derived from its figures and denominators if it records none); None for a
    result without figures."""
    if r["status"] == "not_run":
        return None
    points = fleet_points(r) if r["bench"] == "bench_fleet" else []
    if points:
        panels = []
        for key, name, scale in (("convergence_s", "convergence after the partition, s", 1),
                                 ("gateway_cpu_s_per_device", "gateway CPU per device, ms", 1000)):
            pts = [(p["devices"], *(x * scale for x in _rounds(p[key]))) for p in points if key in p]
            if pts:
                panels.append((name, pts))
        return svgplot.curves(f"{label(r)}: median and range against the device count", "devices", panels)
    rows = _ratio_rows(r["figures"]) or _derived_rows(r)
    if not any(min(x[1:]) > 0 for x in rows):
        return None
    return svgplot.ranges(f"{label(r)}: ratios (dot: median, bar: range of the rounds)", rows)


def plots(results: list[dict]) -> dict[str, str]:
    """{file name: SVG text} of every result that has a plot."""
    return {f"{r['_file']}.svg": svg for r in results if (svg := plot(r)) is not None}


def render_plots(results: list[dict]) -> str:
    """The text between the plot markers: one image per plot, linked as the document beside the
    plots' directory (docs/performance.md, docs/plots/) reaches it."""
    return "\n".join(f"![{label(r)}](plots/{r['_file']}.svg)\n" for r in results if plot(r) is not None)


def rewrite(doc: str, rendering: str, begin: str = BEGIN, end: str = END) -> str:
    """The document's text with the rendering between the markers (each on a line of its own)."""
    if doc.count(begin) != 1 or doc.count(end) != 1 or doc.index(begin) > doc.index(end):
        raise SystemExit(f"the document needs one {begin} line before one {end} line")
    head, rest = doc.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{rendering}{end}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true",
                    help="exit 1 if the document or a plot differs from the rendering")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the result files' directory")
    ap.add_argument("--doc", type=Path, default=DOC, help="the document holding the table (default docs/performance.md)")
    ap.add_argument("--plots", type=Path, default=PLOTS, help="the plots' directory (default docs/plots)")
    args = ap.parse_args()
    results = load(args.results)
    text = args.doc.read_text()
    new = rewrite(rewrite(text, render(results)), render_plots(results), PLOTS_BEGIN, PLOTS_END)
    svgs = plots(results)
    have = {p.name: p.read_text() for p in sorted(args.plots.glob("*.svg"))} if args.plots.is_dir() else {}
    if args.check:
        stale = sorted(n for n in set(svgs) | set(have) if svgs.get(n) != have.get(n))
        if new != text or stale:
            print(f"{args.doc}: the performance table or plots ({', '.join(stale) or 'the list'}) are not the "
                  f"rendering of {args.results} (run: python bench/table.py)", file=sys.stderr)
            return 1
        return 0
    if new != text:
        args.doc.write_text(new)
        print(f"{args.doc}: table and plot list rewritten from {len(results)} result files")
    args.plots.mkdir(parents=True, exist_ok=True)
    for name in sorted(set(have) - set(svgs)):
        (args.plots / name).unlink()
        print(f"{args.plots / name}: removed (no result file draws it)")
    for name, svg in svgs.items():
        if have.get(name) != svg:
            (args.plots / name).write_text(svg)
            print(f"{args.plots / name}: drawn")
    return 0


if __name__ == "__main__":
    sys.exit(main())
