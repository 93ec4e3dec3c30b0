#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs (tools/setup.sh: .venv/), builds
# the wheel, installs it into a clean venv (not editable, runtime deps, [pkcs11] and [provision]) and runs
# pytest with SSP_AGENT_CMD naming that installed `ssp-agent`, so every CLI-level test drives the
# command a device gets (tests/cli_cmd.py). Unit tests import the checkout (pytest pythonpath).
# Arguments go to pytest. SSP_AGENT_CMD already set: that command is tested instead (no wheel).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup.sh
VPY=.venv/bin/python

if [ -z "${SSP_AGENT_CMD:-}" ]; then
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/ssp-agent-wheel.XXXXXX")
  trap 'rm -rf "$WORK"' EXIT
  echo "test: building the wheel and installing it into a clean venv ($WORK/venv)"
  "$VPY" tools/build_wheel.py --out "$WORK/dist" >/dev/null
  "$VPY" -m venv "$WORK/venv"
  WHEEL=$(ls "$WORK"/dist/ssp_agent-*.whl)
  # the installed command must not see this checkout
  if ! env -u PYTHONPATH "$WORK/venv/bin/python" -m pip install -q --disable-pip-version-check "$WHEEL[pkcs11,provision]" \
      >"$WORK/pip.log" 2>&1; then
    cat "$WORK/pip.log" >&2
    echo "test: the wheel did not install into a clean venv" >&2
    exit 1
  fi
  export SSP_AGENT_CMD="$WORK/venv/bin/ssp-agent"
  "$SSP_AGENT_CMD" --version
fi
# One worker a core, one test file a worker (pytest-xdist, --dist loadfile): the suite waits on
# fsyncs, brokers and subprocesses more than on the CPU, so 2 cores take about half the time of one
# process (measured: 1112 s -> 569 s, 1151 tests). SSP_TEST_WORKERS=0 runs it in one process;
# later arguments win (e.g. tools/test.sh -n 0 -k name).
"$VPY" -m pytest -q -n "${SSP_TEST_WORKERS:-auto}" --dist loadfile "$@"
