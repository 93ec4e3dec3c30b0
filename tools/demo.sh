#!/usr/bin/env bash
# The main job: set up on a fresh machine and run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export SSP_AGENT_WITNESS_DIR="${SSP_AGENT_WITNESS_DIR:-$(mktemp -d)/witness}"
exec ${PYTHON:-python3} tools/demo_mailbox.py "$@"
