#!/usr/bin/env bash
# Long fuzzing runs of every boundary (CI runs the short Hypothesis version in
# tests/hostile/test_fuzz.py). Usage: tools/fuzz.sh [SECONDS_PER_TARGET] [TARGET ...]
#
# With atheris (installed here if pip can): one coverage-guided libFuzzer run per target, corpus
# in build/fuzz/corpus/TARGET seeded from the tests, findings written as build/fuzz/crash-*.
# Without atheris (it ships wheels for CPython x86_64/aarch64 Linux only): falls back to a long
# Hypothesis run of tests/hostile/test_fuzz.py (SSP_FUZZ_SCALE examples per target, default 100x)
# and says so (SSP_FUZZ_NO_ATHERIS=1 chooses that run).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
SECS="${1:-600}"; shift || true
TARGETS=("$@")
[ ${#TARGETS[@]} -eq 0 ] && TARGETS=(codec message presence meta number frame envelope event_payload record_payload serial apply records mailbox session_meta mqtt mls_framing receipt evidence lost)
OUT=build/fuzz
mkdir -p "$OUT"
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python  # tools/setup.sh's venv, when there is one

if [ -z "${SSP_FUZZ_NO_ATHERIS:-}" ] && ! "$PY" -c "import atheris" 2>/dev/null; then
  "$PY" -m pip install --quiet atheris 2>/dev/null || true
fi
if [ -n "${SSP_FUZZ_NO_ATHERIS:-}" ] || ! "$PY" -c "import atheris" 2>/dev/null; then
  echo "tools/fuzz.sh: atheris is not available here: falling back to a long Hypothesis run" \
       "(SSP_FUZZ_SCALE=${SSP_FUZZ_SCALE:-100})" >&2
  exec env SSP_FUZZ_SCALE="${SSP_FUZZ_SCALE:-100}" "$PY" -m pytest -q -p no:cacheprovider -W ignore \
       tests/hostile/test_fuzz.py
fi

"$PY" -m tests.hostile.seed_corpus "$OUT/corpus" 200 || exit 1
status=0
for t in "${TARGETS[@]}"; do
  echo "== $t (${SECS} s)"
  mkdir -p "$OUT/corpus/$t"
  # -rss_limit_mb and -timeout back the targets' own per-input bounds
  "$PY" tools/fuzz_atheris.py "$t" "$OUT/corpus/$t" -max_total_time="$SECS" -timeout=20 \
      -rss_limit_mb=2048 -artifact_prefix="$OUT/crash-$t-" -print_final_stats=1 >"$OUT/$t.log" 2>&1
  rc=$?
  grep -E "^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)" "$OUT/$t.log" | sed 's/^/   /'
  if [ $rc -ne 0 ]; then
    echo "   FINDING in $t (exit $rc; $OUT/$t.log, input in $OUT/crash-$t-*):"
    grep -E "Finding|Error|Traceback" "$OUT/$t.log" | head -5 | sed 's/^/     /'
    status=1
  fi
done
exit $status
