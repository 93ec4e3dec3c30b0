#!/usr/bin/env bash
# An offline wheelhouse: the ssp-agent wheel and every runtime dependency as wheels, so a device
# installs with no network (issue 12 item 1). Test-only packages (pytest, hypothesis) are never in it.
#
#   tools/wheelhouse.sh [--out DIR] [--arch host|aarch64|all] [--python-version X.Y] [--no-pkcs11]
#
# Writes DIR/<arch>-cp<XY>/ (default DIR: dist/wheelhouse, arch: all, python: 3.11 = Raspberry Pi OS
# Bookworm; Trixie has 3.13). `host` is this machine (built with `pip wheel`, so a dependency
# without a published wheel is compiled here once); `aarch64` is 64-bit Raspberry Pi OS, binary
# wheels only (`pip download --platform manylinux2014_aarch64 --only-binary=:all:`). On the device:
#
#   python3 -m venv /opt/ssp-agent
#   /opt/ssp-agent/bin/pip install --no-index --find-links DIR/aarch64-cp311 'ssp-agent[pkcs11]'
#
# (drop [pkcs11] for a software or serial keystore: python-pkcs11 is in the wheelhouse all the same).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=dist/wheelhouse; ARCH=all; PYV=3.11; EXTRA="[pkcs11]"
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --arch) ARCH=$2; shift 2 ;;
    --python-version) PYV=$2; shift 2 ;;
    --no-pkcs11) EXTRA=""; shift ;;
    -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "wheelhouse: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$ARCH" in host|aarch64|all) ;; *) echo "wheelhouse: --arch must be host, aarch64 or all" >&2; exit 2 ;; esac

# The interpreter that builds: the checkout's venv when there is one (tools/setup.sh), else python3.
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
PIP=("$PY" -m pip --disable-pip-version-check -q)
mkdir -p "$OUT"
WHEEL=$(env -u PYTHONPATH "$PY" tools/build_wheel.py --out "$OUT/.build")
TAG="cp${PYV/./}"
filter() { grep -v -E "^WARNING: (Running pip as|Location)" || true; }

if [ "$ARCH" = host ] || [ "$ARCH" = all ]; then
  HV=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
  [ "$HV" = "$PYV" ] || echo "wheelhouse: note: host wheels are for this Python ($HV), not $PYV" >&2
  dir="$OUT/$(uname -m)-cp${HV/./}"
  mkdir -p "$dir"
  "${PIP[@]}" wheel -w "$dir" "$WHEEL$EXTRA" 2>&1 | filter
  echo "wheelhouse: $dir ($(ls "$dir" | wc -l) wheels)"
fi
if [ "$ARCH" = aarch64 ] || [ "$ARCH" = all ]; then
  dir="$OUT/aarch64-$TAG"
  mkdir -p "$dir"
  "${PIP[@]}" download -d "$dir" --platform manylinux2014_aarch64 --only-binary=:all: \
    --python-version "$PYV" --implementation cp "$WHEEL$EXTRA" 2>&1 | filter
  echo "wheelhouse: $dir ($(ls "$dir" | wc -l) wheels)"
fi
rm -rf "$OUT/.build"
