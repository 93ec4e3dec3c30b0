#!/usr/bin/env bash
# The long randomized trials in full (docs/testing.md "Soaks"): the suite runs a sample of each
# (tests/soak.py); SSP_SOAK=1 runs every draw. Arguments go to pytest (e.g. -n 0). The power-cut
# trial in full is tools/powercut.sh, fuzzing tools/fuzz.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export SSP_SOAK=1
exec .venv/bin/python -m pytest -q -n "${SSP_TEST_WORKERS:-auto}" --dist loadfile \
  tests/sequencer/test_sequencer_crash.py tests/bridge/test_bridge_crash.py tests/sync/test_trust_convergence.py \
  tests/convergence/test_histories.py tests/sync/test_state_machine.py tests/sequencer/test_run_crash.py \
  tests/core/test_convergence_property.py tests/reliability/test_powercut.py "$@"
