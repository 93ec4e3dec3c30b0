#!/usr/bin/env bash
# An offline wheelhouse: the ssp-agent wheel and every runtime dependency as wheels, so a device
# installs with no network. Test-only packages (pytest, hypothesis) are never in it.
#
#   tools/wheelhouse.sh [--out DIR] [--arch host|aarch64|all] [--python-version X.Y] [--glibc X.Y]
#                       [--no-pkcs11] [--check]
#
# Writes DIR/<arch>-cp<XY>/ (default DIR: dist/wheelhouse, arch: all, python: 3.11 = Raspberry Pi OS
# Bookworm; Trixie has 3.13). `host` is this machine (built with `pip wheel`, so a dependency
# without a published wheel is compiled here once); `aarch64` is 64-bit Raspberry Pi OS, binary
# wheels only, for its glibc (default 2.36 for Bookworm, 2.41 with --python-version 3.13 for
# Trixie): every manylinux tag up to it (pip download --platform manylinux_2_36_aarch64 ... --platform
# manylinux2014_aarch64 --only-binary=:all:). Both sets are pinned to the versions installed where
# this runs (the test suite's .venv) and compared: a set that resolves another version of any
# dependency fails (tools/wheelset.py). --check resolves both sets (binary wheels, no build) into
# DIR and compares them, as the CI test does. On the device:
#
#   python3 -m venv /opt/ssp-agent
#   /opt/ssp-agent/bin/pip install --no-index --find-links DIR/aarch64-cp311 'ssp-agent[pkcs11]'
#
# (drop [pkcs11] for a software or serial keystore: python-pkcs11 is in the wheelhouse all the same).
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=dist/wheelhouse; ARCH=all; PYV=3.11; GLIBC=""; EXTRA="[pkcs11]"; CHECK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT=$2; shift 2 ;;
    --arch) ARCH=$2; shift 2 ;;
    --python-version) PYV=$2; shift 2 ;;
    --glibc) GLIBC=$2; shift 2 ;;
    --no-pkcs11) EXTRA=""; shift ;;
    --check) CHECK=1; ARCH=all; shift ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "wheelhouse: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
case "$ARCH" in host|aarch64|all) ;; *) echo "wheelhouse: --arch must be host, aarch64 or all" >&2; exit 2 ;; esac

# Raspberry Pi OS: Bookworm (Python 3.11) has glibc 2.36, Trixie (3.13) 2.41.
[ -n "$GLIBC" ] || { [ "$PYV" = 3.11 ] && GLIBC=2.36 || GLIBC=2.41; }

# The interpreter that builds: the checkout's venv when there is one (tools/setup.sh), else python3.
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] && PY=.venv/bin/python
PIP=("$PY" -m pip --disable-pip-version-check -q)
mkdir -p "$OUT/.build"
WHEEL=$(env -u PYTHONPATH "$PY" tools/build_wheel.py --out "$OUT/.build")
TAG="cp${PYV/./}"
filter() { grep -v -E "^WARNING: (Running pip as|Location)" || true; }
# The versions the suite ran against (empty where ssp-agent is not installed): both sets take them.
"$PY" tools/wheelset.py pins > "$OUT/.build/pins.txt"
CONSTRAIN=(-c "$OUT/.build/pins.txt")
PLATFORMS=()
for p in $("$PY" tools/wheelset.py platforms aarch64 "$GLIBC"); do PLATFORMS+=(--platform "$p"); done

HV=$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
host_dir="$OUT/$(uname -m)-cp${HV/./}"
arm_dir="$OUT/aarch64-$TAG"
if [ "$ARCH" = host ] || [ "$ARCH" = all ]; then
  [ "$HV" = "$PYV" ] || echo "wheelhouse: note: host wheels are for this Python ($HV), not $PYV" >&2
  mkdir -p "$host_dir"
  if [ "$CHECK" = 1 ]; then
    "${PIP[@]}" download -d "$host_dir" --only-binary=:all: "${CONSTRAIN[@]}" "$WHEEL$EXTRA" 2>&1 | filter
  else
    "${PIP[@]}" wheel -w "$host_dir" "${CONSTRAIN[@]}" "$WHEEL$EXTRA" 2>&1 | filter
  fi
  echo "wheelhouse: $host_dir ($(ls "$host_dir" | wc -l) wheels)"
fi
if [ "$ARCH" = aarch64 ] || [ "$ARCH" = all ]; then
  mkdir -p "$arm_dir"
  if ! "${PIP[@]}" download -d "$arm_dir" "${PLATFORMS[@]}" --only-binary=:all: "${CONSTRAIN[@]}" \
      --python-version "$PYV" --implementation cp "$WHEEL$EXTRA" 2>&1 | filter; then
    echo "wheelhouse: no aarch64 (glibc $GLIBC, Python $PYV) wheel set with the versions in $OUT/.build/pins.txt" >&2
    exit 1
  fi
  echo "wheelhouse: $arm_dir ($(ls "$arm_dir" | wc -l) wheels, manylinux up to glibc $GLIBC)"
fi
# A device must run the versions the suite ran against: the same distributions, the same versions.
if [ "$ARCH" = all ] && [ "$HV" = "$PYV" ] && ! "$PY" tools/wheelset.py compare "$host_dir" "$arm_dir"; then
  echo "wheelhouse: the aarch64 set differs from the host set (above); not a wheelhouse to install" >&2
  exit 1
fi
rm -rf "$OUT/.build"
