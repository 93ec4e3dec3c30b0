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

# The wheelhouse a Pi installs from (tools/wheelhouse.sh --arch aarch64: binary wheels only, the
# versions the suite ran against), copied into the root; the venv is made afresh on every run.
if [ -z "$WH" ]; then
  step "building the aarch64 wheelhouse (tools/wheelhouse.sh --arch aarch64)"
  rm -rf "$CACHE/wheelhouse"
  bash tools/wheelhouse.sh --arch aarch64 --out "$CACHE/wheelhouse"
  WH=$CACHE/wheelhouse/aarch64-cp311
fi
[ -n "$(ls "$WH"/ssp_agent-*.whl 2>/dev/null)" ] || fail "$WH holds no ssp_agent wheel"

MOUNTS=()
WORK=""
BROKER_PID=""
cleanup() {
  [ -n "$BROKER_PID" ] && kill "$BROKER_PID" 2>/dev/null || true
  for ((i=${#MOUNTS[@]}-1; i>=0; i--)); do umount -l "${MOUNTS[$i]}" 2>/dev/null || true; done
  [ -n "$WORK" ] && rm -rf "$WORK"
}
trap cleanup EXIT
for m in proc sys dev; do
  mkdir -p "$ROOT/$m"
  case $m in
    proc) mount -t proc proc "$ROOT/proc" ;;
    sys) mount --rbind /sys "$ROOT/sys" ;;
    dev) mount --rbind /dev "$ROOT/dev" ;;
  esac
  MOUNTS+=("$ROOT/$m")
done
WORK=$ROOT/var/tmp/ssp-check
rm -rf "$WORK" "$ROOT/opt/wheelhouse" "$ROOT/opt/ssp-agent"
mkdir -p "$WORK" "$ROOT/opt/wheelhouse"
cp "$WH"/*.whl "$ROOT/opt/wheelhouse/"
IN=/var/tmp/ssp-check   # $WORK as the root sees it

# Everything below runs on aarch64 binaries (qemu-aarch64 through binfmt_misc), the network
# namespace shared with this host. The clock is declared trusted: the root has no time service.
arm() { chroot "$ROOT" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root LANG=C.UTF-8 \
          SSP_AGENT_CLOCK_TRUSTED=1 SSP_AGENT_WITNESS_DIR=$IN/witness "$@"; }
agent() { arm /opt/ssp-agent/bin/ssp-agent "$@"; }
json() { python3 -c "import json,sys; d=json.load(sys.stdin); print(eval(sys.argv[1], {}, {'d': d}))" "$1"; }

[ "$(arm uname -m)" = aarch64 ] || fail "the root does not run as aarch64 ($(arm uname -m))"
step "python: $(arm python3 --version) on $(arm uname -m), glibc $(arm ldd --version | head -1 | awk '{print $NF}')"
arm python3 -m venv /opt/ssp-agent
arm /opt/ssp-agent/bin/pip install -q --no-index --find-links /opt/wheelhouse 'ssp-agent[pkcs11]' \
  || fail "the offline install from the aarch64 wheelhouse failed"
step "installed offline: $(arm /opt/ssp-agent/bin/pip list --format=freeze | tr '\n' ' ')"
agent --version | grep -q '^ssp-agent ' || fail "--version"
step "$(agent --version)"

# A manifest with the demo's tables (agent.simpeer, as the tests use), written by this checkout.
HOSTPY=python3
[ -x .venv/bin/python ] && HOSTPY=.venv/bin/python
"$HOSTPY" - "$WORK/m.toml" <<'PY'
import sys
sys.path.insert(0, ".")
from agent.simpeer import NOTES_TABLE, manifest_text, readings_table
open(sys.argv[1], "w").write(manifest_text(bytes.fromhex("5e5e00000000000000000000000000aa"), readings_table() + NOTES_TABLE))
PY

PROFILES=$(arm /opt/ssp-agent/bin/python -c \
  "import importlib.resources as r; print(' '.join(sorted(p.name[:-5] for p in r.files('agent').joinpath('profiles').iterdir() if p.name.endswith('.toml'))))")
[ -n "$PROFILES" ] || fail "no built-in profiles in the installed package"
for p in $PROFILES; do
  out=$(agent --home "$IN/home-$p" init --manifest "$IN/m.toml" --profile "$p") || fail "init --profile $p"
  [ "$(echo "$out" | json 'len(d["site_id"])')" = 32 ] || fail "init --profile $p: $out"
  step "init --profile $p: site $(echo "$out" | json 'd["site_id"]')"
done

# Two homes that trust each other: a write, a mailbox body one way, an import the other.
A=$IN/home-gateway; B=$IN/home-pi-zero-2w
ida=$(agent --home "$A" status | json 'd["site_id"]'); pka=$(agent --home "$A" status | json 'd["public_key"]')
idb=$(agent --home "$B" status | json 'd["site_id"]'); pkb=$(agent --home "$B" status | json 'd["public_key"]')
agent --home "$A" peer add --site-id "$idb" --public-key "$pkb" >/dev/null || fail "peer add (A)"
agent --home "$B" peer add --site-id "$ida" --public-key "$pka" >/dev/null || fail "peer add (B)"
agent --home "$A" write app.readings --key '{"device": "arm", "seq": 1}' --set '{"temp": 21.5}' >/dev/null \
  || fail "write"
agent --home "$A" mailbox export --peer "$idb" --out "$IN/a-to-b.cbor" >/dev/null || fail "mailbox export"
res=$(agent --home "$B" mailbox import "$IN/a-to-b.cbor") || fail "mailbox import: $res"
[ "$(echo "$res" | json 'd["applied"]')" = 1 ] || fail "mailbox import applied nothing: $res"
step "write, mailbox export and import: $res"

# sync --once through a mosquitto on this host (the chroot shares the host's loopback).
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
mkdir -p "$CACHE/broker"
printf 'listener %s 127.0.0.1\nallow_anonymous true\npersistence false\nuser root\n' "$PORT" > "$CACHE/broker/m.conf"
mosquitto -c "$CACHE/broker/m.conf" >"$CACHE/broker/log" 2>&1 &
BROKER_PID=$!
for _ in $(seq 100); do python3 -c "import socket,sys; socket.create_connection(('127.0.0.1', $PORT), 1)" 2>/dev/null && break; sleep 0.2; done
URL=mqtt://127.0.0.1:$PORT
agent --home "$B" sync --broker "$URL" --once --timeout 10 >/dev/null || fail "sync --once (B, its session)"
agent --home "$A" write app.readings --key '{"device": "arm", "seq": 2}' --set '{"temp": 22.5}' >/dev/null \
  || fail "write (2)"
agent --home "$A" sync --broker "$URL" --once --timeout 5 >/dev/null || fail "sync --once (A)"
res=$(agent --home "$B" sync --broker "$URL" --once --timeout 20) || fail "sync --once (B): $res"
[ "$(echo "$res" | json 'd["applied"] >= 1 and d["refused_bodies"] == 0')" = True ] \
  || fail "sync --once through mosquitto applied nothing: $res"
rows=$(agent --home "$B" dump | json 'len(d["app.readings"])')
[ "$rows" = 2 ] || fail "B holds $rows rows, not 2"
step "sync --once through mosquitto at $URL: applied $(echo "$res" | json 'd["applied"]'), B holds $rows rows"
echo "aarch64-check: PASS ($(date -u +%FT%TZ)): --version, init with $PROFILES, write, mailbox, sync --once"
