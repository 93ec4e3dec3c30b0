"""docs/performance.md's table of current figures, rendered from the benches' result files
(bench/results/*.json, written by `python bench/<bench>.py --record`: bench/_harness.py record).

    python bench/table.py            # rewrite docs/performance.md between the bench-table markers
    python bench/table.py --check    # exit 1 if docs/performance.md differs from the rendering

One compact row per result file: the bench as run, its one human line (figures against the
denominators measured in the same run) and the commit it ran at. A figure in the table is never
typed by hand: tests/test_bench_table.py fails if the table is not the rendering of bench/results/.
Every other detail of a run (date, machine, load, each named figure) stays in its result file."""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "performance.md"
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


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def row(r: dict) -> str:
    script = f"bench/{r['bench']}.py"
    # the command as run (without `python` and `--record`): which sizes this row is
    label = " ".join(a for a in r["command"].split()[1:] if a != "--record") or script
    what = f"[`{label}`](../{script})"
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


def rewrite(doc: str, rendering: str) -> str:
    """The document's text with the rendering between the markers (each on a line of its own)."""
    if doc.count(BEGIN) != 1 or doc.count(END) != 1 or doc.index(BEGIN) > doc.index(END):
        raise SystemExit(f"the document needs one {BEGIN} line before one {END} line")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{rendering}{END}{tail}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if the document differs from the rendering")
    ap.add_argument("--results", type=Path, default=RESULTS, help="the result files' directory")
    ap.add_argument("--doc", type=Path, default=DOC, help="the document holding the table (default docs/performance.md)")
    args = ap.parse_args()
    text = args.doc.read_text()
    new = rewrite(text, render(load(args.results)))
    if args.check:
        if new != text:
            print(f"{args.doc}: the performance table is not the rendering of {args.results} "
                  f"(run: python bench/table.py)", file=sys.stderr)
            return 1
        return 0
    if new != text:
        args.doc.write_text(new)
        print(f"{args.doc}: table rewritten from {len(load(args.results))} result files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
