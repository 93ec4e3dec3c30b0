#!/usr/bin/env bash
# The main job: set up on a fresh machine (tools/setup.sh: .venv/ with the package, mosquitto) and run
# the demo mesh: three nodes as separate processes syncing through a private mosquitto on a loopback port.
# (The store-and-forward mailbox demo: .venv/bin/python tools/demo_mailbox.py)
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
export SSP_AGENT_WITNESS_DIR="${SSP_AGENT_WITNESS_DIR:-$(mktemp -d)/witness}"
exec .venv/bin/python tools/demo.py "$@"
