#!/usr/bin/env bash
# The target platform, emulated: 64-bit Raspberry Pi OS is Debian bookworm on aarch64. Builds (once,
# cached) an arm64 bookworm root with debootstrap, installs the aarch64 wheelhouse offline into a venv
# inside it, and runs the installed command there under qemu-user-static: --version, init with every
# built-in profile, write, a mailbox body exported and imported between two homes, and sync --once
# through a mosquitto on this host. An optional check (root, ~30 min for the first debootstrap, a
# few minutes after); docs/platform.md records its last result.
#
#   sudo tools/aarch64-check.sh [--cache DIR] [--wheelhouse DIR] [--root-only]
#
# --cache: where the arm64 root is kept (default /var/cache/ssp-agent-aarch64);
# --wheelhouse: an existing aarch64-cp311 wheelhouse (default: built by tools/wheelhouse.sh);
# --root-only: build the cached root and stop. Needs debootstrap, qemu-user-static, binfmt-support
# and mosquitto on the host (apt-get install -y debootstrap qemu-user-static binfmt-support mosquitto).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

CACHE=/var/cache/ssp-agent-aarch64; WH=""; ROOT_ONLY=0
MIRROR=${SSP_AARCH64_MIRROR:-http://deb.debian.org/debian}
while [ $# -gt 0 ]; do
  case "$1" in
    --cache) CACHE=$2; shift 2 ;;
    --wheelhouse) WH=$2; shift 2 ;;
    --root-only) ROOT_ONLY=1; shift ;;
    -h|--help) sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "aarch64-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "aarch64-check: needs root (debootstrap, chroot, mounts)" >&2; exit 1; }
for tool in debootstrap update-binfmts mosquitto; do
  command -v "$tool" >/dev/null || { echo "aarch64-check: $tool is missing (see --help)" >&2; exit 1; }
done
ROOT=$CACHE/root
step() { echo "aarch64-check: $*"; }
fail() { echo "aarch64-check: FAIL: $*" >&2; exit 1; }

# qemu-user-static registers qemu-aarch64 with the F flag, so the chroot needs no copy of qemu.
mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
update-binfmts --enable qemu-aarch64 2>/dev/null || true
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || fail "qemu-aarch64 is not registered with binfmt_misc"

# The root: python3.11 as Bookworm ships it; built in two stages and marked complete only at the end,
# so an interrupted build starts again instead of being taken for a root.
if [ ! -e "$CACHE/root.complete" ]; then
  step "building the arm64 bookworm root in $ROOT (about 30 minutes under emulation)"
  rm -rf "$ROOT"; mkdir -p "$ROOT"
  nice -n 19 debootstrap --arch=arm64 --foreign --variant=minbase \
    --include=python3,python3-venv,ca-certificates bookworm "$ROOT" "$MIRROR"
  nice -n 19 chroot "$ROOT" /debootstrap/debootstrap --second-stage
  date -u +%FT%TZ > "$CACHE/root.complete"
fi
step "root $ROOT (built $(cat "$CACHE/root.complete"))"
[ "$ROOT_ONLY" = 1 ] && exit 0
