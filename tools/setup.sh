#!/usr/bin/env bash
# Installs everything ssp-agent and its tests need on a fresh Debian / Raspberry Pi OS (64-bit)
# machine: the Python package with its test extras, and the real components the tests start
# (mosquitto, SoftHSM2, socat). Idempotent; run as root or with sudo available.
set -euo pipefail
cd "$(dirname "$0")/.."

need_apt=()
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need_apt+=(mosquitto)
command -v softhsm2-util >/dev/null 2>&1 || need_apt+=(softhsm2)
command -v socat >/dev/null 2>&1 || need_apt+=(socat)
if [ ${#need_apt[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "setup: installing Debian packages: ${need_apt[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi
# Debian's mosquitto package may start a system broker on 1883; ours use private ports, so leave it.

PY=${PYTHON:-python3}
echo "setup: installing ssp-agent (editable) with test extras"
$PY -m pip install -q --disable-pip-version-check -e ".[test]" 2>&1 | grep -v -E "^WARNING: (Running pip as|Location)" || true
$PY -c "import agent, firmware_bridge, cbor2, nacl, blake3, paho.mqtt, serial" \
  || { echo "setup: the Python dependencies did not install" >&2; exit 1; }
