#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs, then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
exec ${PYTHON:-python3} -m pytest -q "$@"
