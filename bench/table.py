"""README's Performance table, rendered from the benches' result files (bench/results/*.json,
written by `python bench/<bench>.py --record`: bench/_harness.py record).

    python bench/table.py            # rewrite README.md between the bench-table markers
    python bench/table.py --check    # exit 1 if README.md differs from the rendering

One row per result file: what the bench measures (its docstring's first sentence, as recorded),
its one human line, the figures and the denominators measured in the same run as named numbers
(median and range where the bench runs rounds), and when, on what load and at which commit it
ran. A figure in the table is therefore never typed by hand: tests/test_bench_table.py fails if
README's table is not the rendering of bench/results/. The history of the figures, same-run A/B
comparisons and the limits found are in docs/performance.md."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
BEGIN = "<!-- bench-table:begin -->"
END = "<!-- bench-table:end -->"
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
            if isinstance(v, dict):
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


def num(x) -> str:
    """A number as the table prints it: thousands grouped by a space, three significant digits
    below 100."""
    if isinstance(x, int) or (abs(x) >= 100 and float(x).is_integer()) or abs(x) >= 1000:
        s = f"{round(x):,}".replace(",", " ")
        return s if abs(x) >= 10_000 else s.replace(" ", "")
    if abs(x) >= 100:
        return f"{x:.0f}"
    return f"{x:.3g}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"


def value(v) -> str:
    if isinstance(v, dict):
        return f"**{num(v['median'])}** ({num(v['min'])}–{num(v['max'])}, {v['n']} rounds)" if v["n"] > 1 \
            else f"**{num(v['median'])}** (1 round)"
    return f"**{num(v)}**"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def row(r: dict) -> str:
    script = f"bench/{r['bench']}.py"
    # the command as run (without `python` and `--record`): which sizes this row is
    label = " ".join(a for a in r["command"].split()[1:] if a != "--record") or script
    what = f"[`{label}`]({script}): {r['measures']}"
    if r["status"] == "not_run":
        return f"| {_cell(what)} | not run here: {_cell(r['reason'])} | {_cell(r['date'][:10])} |"
    figures = "; ".join(f"{k} {value(v)}" for k, v in r["figures"].items())
    denominators = "; ".join(f"{k} {value(v)}" for k, v in r["denominators"].items())
    result = f"{r['summary']}. Figures: {figures}." + (f" Same run's denominators: {denominators}." if denominators else "")
    if r["status"] == "transcribed":
        when = f"{r['date'][:10]}, transcribed: {r['source']}"
    else:
        la = r["load_average"]
        m = r["machine"]
        when = (f"{r['date'][:10]} {r['date'][11:16]} UTC, {num(r.get('duration_s', 0))} s; load average "
                f"{la['start'][0]:.2f} → {la['end'][0]:.2f} (1 min) on {m['nproc']} CPUs; "
                f"code at `{r['commit'][:7]}`{' (with uncommitted changes)' if r.get('dirty') else ''}")
    return f"| {_cell(what)} | {_cell(result)} | {_cell(when)} |"


def render(results: list[dict]) -> str:
    """The text between the markers: the table (one row per result file) and where its history is."""
    lines = ["| benchmark as run: what it measures | result (the bench's line; figures; the denominators measured in the "
             "same run) | measured: when, load, code |", "| --- | --- | --- |"]
    lines += [row(r) for r in results]
    return "\n".join(lines) + "\n"


def rewrite(readme: str, rendering: str) -> str:
    """README's text with the rendering between the markers (each on a line of its own)."""
    if readme.count(BEGIN) != 1 or readme.count(END) != 1 or readme.index(BEGIN) > readme.index(END):
        raise SystemExit(f"README needs one {BEGIN} line before one {END} line")
    head, rest = readme.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{rendering}{END}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if the README differs from the rendering")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the result files' directory")
    ap.add_argument("--readme", type=Path, default=README)
    args = ap.parse_args()
    text = args.readme.read_text()
    new = rewrite(text, render(load(args.results)))
    if args.check:
        if new != text:
            print(f"{args.readme}: the Performance table is not the rendering of {args.results} "
                  f"(run: python bench/table.py)", file=sys.stderr)
            return 1
        return 0
    if new != text:
        args.readme.write_text(new)
        print(f"{args.readme}: table rewritten from {len(load(args.results))} result files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
