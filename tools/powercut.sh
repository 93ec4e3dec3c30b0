#!/usr/bin/env bash
# Power loss at every sync point, in full (docs/reliability.md). CI runs a sample
# (tests/reliability/test_powercut.py); this runs every sync point, every combination of unsynced
# writes kept there (up to 64 per point), 1000 random cut points and 1000 with torn writes, then the
# negative controls (skipped fsyncs, which must be caught). Needs gcc (the LD_PRELOAD shim is built
# from tests/reliability/powercut_shim.c). Arguments go to `python -m tests.reliability.powercut`
# (--help); exit 1 on any finding, or a negative control not caught.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" -m tests.reliability.powercut --controls "$@"
