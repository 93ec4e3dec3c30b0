#!/usr/bin/env bash
# Installs everything ssp-agent and its tests need on a fresh Debian / Raspberry Pi OS (64-bit)
# machine: a virtual environment in the checkout (.venv/, because Debian's system Python refuses
# `pip install`, PEP 668) holding the package (editable) with its test extras, and the real
# components the tests start (mosquitto, SoftHSM2, socat, libfaketime, the image tools of
# `flash`: sfdisk, mkfs.vfat, mtools, e2fsprogs). Idempotent; run as root or with sudo
# available. Everything else (tools/test.sh, tools/demo.sh) uses .venv/bin/python.
# PYTHON picks the interpreter the venv is made from (default python3, 3.11 or later).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${SSP_AGENT_VENV:-.venv}

need_apt=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need_apt+=(mosquitto)
command -v softhsm2-util >/dev/null 2>&1 || need_apt+=(softhsm2)
command -v socat >/dev/null 2>&1 || need_apt+=(socat)
# libfaketime for the clock tests (a bad boot clock, tests/lifecycle, tests/mqtt); the image
# tools `ssp-agent flash` drives (tests/provision): without them those tests were skipped
command -v faketime >/dev/null 2>&1 || need_apt+=(faketime)
have() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]; }
have sfdisk || need_apt+=(fdisk)
have mkfs.vfat || need_apt+=(dosfstools)
{ have mcopy && have mtype; } || need_apt+=(mtools)
{ have mkfs.ext4 && have debugfs; } || need_apt+=(e2fsprogs)
# a clustered MQTT v5 broker for tests/mqtt/test_cluster_*.py (two ejabberd nodes on loopback)
have ejabberdctl || need_apt+=(ejabberd)
# Node 20+ and npm for the ts-mls members of the sequencer tests (tests/sequencer/ts_mls)
{ have node && have npm; } || need_apt+=(nodejs npm)
# Debian splits venv's pip bootstrap (ensurepip) into python3-venv.
if [ ! -x "$VENV/bin/python" ] && ! $PY -c "import venv, ensurepip" >/dev/null 2>&1; then
  need_apt+=(python3-venv)
fi
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "setup: installing Debian packages: ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
# Debian's mosquitto package may start a system broker on 1883; ours use private ports, so leave it.

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating the virtual environment $VENV"
  $PY -m venv "$VENV"
fi
VPY="$VENV/bin/python"
echo "setup: installing ssp-agent (editable, into $VENV) with test extras"
if ! "$VPY" -m pip install -q --disable-pip-version-check -e ".[test]" >"$VENV/setup-pip.log" 2>&1; then
  cat "$VENV/setup-pip.log" >&2
  echo "setup: pip could not install ssp-agent into $VENV" >&2
  exit 1
fi
# ts-mls at the versions its package-lock.json pins (test-only; never part of a device install)
if ! npm ci --prefix tests/sequencer/ts_mls --no-audit --no-fund --silent >"$VENV/setup-npm.log" 2>&1; then
  cat "$VENV/setup-npm.log" >&2
  echo "setup: npm could not install tests/sequencer/ts_mls" >&2
  exit 1
fi
"$VPY" -c "import agent, firmware_bridge, cbor2, nacl, blake3, paho.mqtt, serial, pytest, xdist" \
  || { echo "setup: the Python dependencies did not install into $VENV" >&2; exit 1; }
