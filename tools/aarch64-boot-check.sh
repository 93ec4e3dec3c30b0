#!/usr/bin/env bash
# The target platform, emulated, booted: a Pi-shaped image (MBR: a FAT boot partition mounted at
# /boot/firmware, an ext4 root) made from the arm64 bookworm root of tools/aarch64-check.sh plus
# Debian's linux-image-arm64 and systemd, flashed with `ssp-agent provision flash` (a bundle made
# from the aarch64 wheelhouse), then booted under qemu-system-aarch64 (-M virt, cortex-a53, 1 GiB,
# TCG, no network) as many times as the first boot takes:
#   boot 1: Bookworm's firstrun.sh hook through systemd.run= (as Raspberry Pi Imager's) installs
#           offline, enables the enrolment unit, removes itself, reboots;
#   boot 2+: the enrolment unit enrols and starts ssp-agent.service; a oneshot added to this test
#           image only (ssp-boot-check.service) records `systemctl is-active ssp-agent` and does a
#           `write` through the running agent's control socket, on the boot partition, then powers off.
# The kernel command line of each boot is the image's cmdline.txt, as the Pi's firmware reads it.
# Checked from outside after power-off (the root mounted read-only on a loop device, the boot
# partition read with mtools): the enrolment file, the unit active under DynamicUser, the write
# applied by the service. An optional check, not run by CI (root; minutes once the roots are
# cached, ~30 min more to make the bootable root); docs/platform.md records its last result.
#
#   sudo tools/aarch64-boot-check.sh [--base DIR] [--cache DIR] [--work DIR] [--wheelhouse DIR]
#                                    [--boot-timeout MIN] [--boots N]
#
# --base: tools/aarch64-check.sh's cache (default /var/cache/ssp-agent-aarch64; only read: its
# root is copied); --cache: where the root with kernel and systemd is kept (default
# /var/cache/ssp-agent-aarch64-boot); --work: the image, bundle and serial console logs (default
# /var/tmp/ssp-agent-boot-check, emptied first); --wheelhouse: an existing aarch64-cp311 wheelhouse
# (default: built by tools/wheelhouse.sh --arch aarch64); --boot-timeout: minutes one boot may take
# before it is taken for a hang (default 60); --boots: at most this many boots (default 4).
# Needs on the host: qemu-system-arm qemu-user-static binfmt-support dosfstools mtools e2fsprogs fdisk.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD

BASE=/var/cache/ssp-agent-aarch64; CACHE=/var/cache/ssp-agent-aarch64-boot; WORK=/var/tmp/ssp-agent-boot-check
WH=""; BOOT_TIMEOUT=60; MAX_BOOTS=4
while [ $# -gt 0 ]; do
  case "$1" in
    --base) BASE=$2; shift 2 ;;
    --cache) CACHE=$2; shift 2 ;;
    --work) WORK=$2; shift 2 ;;
    --wheelhouse) WH=$2; shift 2 ;;
    --boot-timeout) BOOT_TIMEOUT=$2; shift 2 ;;
    --boots) MAX_BOOTS=$2; shift 2 ;;
    -h|--help) sed -n '2,27p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "aarch64-boot-check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "aarch64-boot-check: needs root (chroot, loop devices, mounts)" >&2; exit 1; }
for tool in qemu-system-aarch64 update-binfmts sfdisk losetup mkfs.vfat mkfs.ext4 mtype; do
  command -v "$tool" >/dev/null || { echo "aarch64-boot-check: $tool is missing (see --help)" >&2; exit 1; }
done
step() { echo "aarch64-boot-check: $(date -u +%T) $*"; }
fail() { echo "aarch64-boot-check: FAIL: $*" >&2; exit 1; }
START=$(date +%s)

MOUNTS=()
IMG=""
cleanup() {
  for ((i=${#MOUNTS[@]}-1; i>=0; i--)); do umount -R "${MOUNTS[$i]}" 2>/dev/null || umount -lR "${MOUNTS[$i]}" 2>/dev/null || true; done
  MOUNTS=()
  # every loop device over the image (attach runs in command substitutions: no list survives them)
  if [ -n "$IMG" ] && [ -e "$IMG" ]; then
    for l in $(losetup -n -O NAME -j "$IMG"); do losetup -d "$l" 2>/dev/null || true; done
  fi
}
trap cleanup EXIT

mountpoint -q /proc/sys/fs/binfmt_misc || mount -t binfmt_misc binfmt_misc /proc/sys/fs/binfmt_misc
update-binfmts --enable qemu-aarch64 2>/dev/null || true
[ -e /proc/sys/fs/binfmt_misc/qemu-aarch64 ] || fail "qemu-aarch64 is not registered with binfmt_misc"

# The bootable root: tools/aarch64-check.sh's (minbase bookworm, python3, python3-venv) copied, then
# what a Raspberry Pi OS image boots with that minbase lacks: systemd as init, udev (the fstab's
# devices), and a kernel with its initramfs (Debian's linux-image-arm64 for QEMU's virt board in
# place of the Pi's). Installed under qemu-user, marked complete only at the end.
[ -e "$BASE/root.complete" ] || fail "no arm64 root in $BASE: run tools/aarch64-check.sh --root-only first"
KROOT=$CACHE/root
if [ ! -e "$CACHE/root.complete" ]; then
  step "copying $BASE/root to $KROOT and installing linux-image-arm64 and systemd in it (qemu-user)"
  rm -rf "$KROOT"; mkdir -p "$CACHE"
  cp -a "$BASE/root" "$KROOT"
  cp /etc/resolv.conf "$KROOT/etc/resolv.conf"
  mount -t proc proc "$KROOT/proc"; MOUNTS+=("$KROOT/proc")
  mount --rbind /dev "$KROOT/dev"; MOUNTS+=("$KROOT/dev")
  mount --rbind /sys "$KROOT/sys"; MOUNTS+=("$KROOT/sys")
  # the kernel last: its initramfs is then made once (made under emulation it takes ~25 minutes;
  # installed together, udev's trigger makes it a second time)
  nice -n 10 chroot "$KROOT" /usr/bin/env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive \
    LANG=C.UTF-8 sh -c 'apt-get update && apt-get install -y --no-install-recommends systemd systemd-sysv udev \
      kmod initramfs-tools && apt-get install -y --no-install-recommends linux-image-arm64 && apt-get clean'
  rm -rf "$KROOT/etc/resolv.conf" "$KROOT/opt/ssp-agent" "$KROOT/opt/wheelhouse" "$KROOT/var/tmp/ssp-check"
  cleanup
  ls "$KROOT"/boot/vmlinuz-* "$KROOT"/boot/initrd.img-* >/dev/null || fail "no kernel or initrd in $KROOT/boot"
  date -u +%FT%TZ > "$CACHE/root.complete"
fi
step "bootable root $KROOT (made $(cat "$CACHE/root.complete"))"

IMG=$WORK/pi.img
cleanup   # a previous run's loop devices, if one was killed
rm -rf "$WORK"; mkdir -p "$WORK"
# The wheelhouse a Pi installs from, and the CLI of this checkout on the host (the technician's side).
if [ -z "$WH" ]; then
  step "building the aarch64 wheelhouse (tools/wheelhouse.sh --arch aarch64)"
  bash tools/wheelhouse.sh --arch aarch64 --out "$WORK/wheelhouse" > "$WORK/wheelhouse.log" 2>&1 \
    || { tail -20 "$WORK/wheelhouse.log" >&2; fail "tools/wheelhouse.sh --arch aarch64"; }
  WH=$WORK/wheelhouse/aarch64-cp311
fi
[ -n "$(ls "$WH"/ssp_agent-*.whl 2>/dev/null)" ] || fail "$WH holds no ssp_agent wheel"
HOSTPY=python3
[ -x .venv/bin/python ] && HOSTPY=.venv/bin/python
[ -x .venv/bin/ssp-agent ] || fail "no .venv/bin/ssp-agent in $REPO: run tools/setup.sh"
host_agent() { .venv/bin/ssp-agent "$@"; }

# A manifest with the demo's tables (agent.simpeer, as the tests use); a bundle for a device with a
# clock it may trust (QEMU's virt board has an RTC and the guest has no network for NTP) and a broker
# it cannot reach (`run` keeps retrying, as a device whose broker account is not issued yet does).
"$HOSTPY" - "$WORK/m.toml" <<'PY'
import sys
sys.path.insert(0, ".")
from agent.simpeer import NOTES_TABLE, manifest_text, readings_table
open(sys.argv[1], "w").write(manifest_text(bytes.fromhex("5e5e00000000000000000000000000aa"), readings_table() + NOTES_TABLE))
PY
host_agent provision bundle --out "$WORK/bundle" --manifest "$WORK/m.toml" --profile pi-zero-2w \
  --wheelhouse "$WH" --broker mqtt://127.0.0.1:1883 --clock-trusted > "$WORK/bundle.json.out" \
  || fail "provision bundle"
step "bundle: $(cat "$WORK/bundle.json.out")"

# The image, laid out as Raspberry Pi OS's: MBR with disk identifier, p1 FAT32 (256 MiB, the boot
# partition at /boot/firmware), p2 ext4 root; fstab and cmdline.txt by PARTUUID, as Pi OS writes them.
DISKID=5e5e0001
BOOT_START=8192; BOOT_SECTORS=524288; ROOT_START=$((BOOT_START + BOOT_SECTORS))
truncate -s 3G "$IMG"
sfdisk -q "$IMG" <<EOF
label: dos
label-id: 0x$DISKID
start=$BOOT_START, size=$BOOT_SECTORS, type=c
start=$ROOT_START, type=83
EOF
ROOT_SECTORS=$(( $(stat -c %s "$IMG") / 512 - ROOT_START ))
# attach PART (1 boot, 2 root) [ro]: a loop device over that partition of the image
attach() {
  local off size ro=""
  if [ "$1" = 1 ]; then off=$((BOOT_START * 512)); size=$((BOOT_SECTORS * 512)); else off=$((ROOT_START * 512)); size=$((ROOT_SECTORS * 512)); fi
  [ "${2:-}" = ro ] && ro=-r
  losetup $ro -f --show -o "$off" --sizelimit "$size" "$IMG"
}
step "making the image $IMG"
BOOTDEV=$(attach 1); ROOTDEV=$(attach 2)
mkfs.vfat -F 32 -n BOOTFS "$BOOTDEV" >/dev/null
mkfs.ext4 -q -L rootfs "$ROOTDEV"
MNT=$WORK/mnt; mkdir -p "$MNT"
mount "$ROOTDEV" "$MNT"; MOUNTS+=("$MNT")
cp -a "$KROOT"/. "$MNT"/
# nothing of tools/aarch64-check.sh's runs (its venv would make firstboot.sh skip the install)
rm -rf "$MNT/etc/resolv.conf" "$MNT/opt/ssp-agent" "$MNT/opt/wheelhouse" "$MNT/var/tmp/ssp-check"
mkdir -p "$MNT/boot/firmware"
# the FAT partition through mtools (a container's kernel may have no vfat to mount)
FATSPEC="$IMG@@$((BOOT_START * 512))"
fat_put() { printf '%s' "$2" > "$WORK/fat-file"; mcopy -o -i "$FATSPEC" "$WORK/fat-file" "::$1"; rm -f "$WORK/fat-file"; }
cat > "$MNT/etc/fstab" <<EOF
proc                  /proc           proc    defaults          0       0
PARTUUID=$DISKID-01  /boot/firmware  vfat    defaults          0       2
PARTUUID=$DISKID-02  /               ext4    defaults,noatime  0       1
EOF
echo raspberrypi > "$MNT/etc/hostname"
: > "$MNT/etc/machine-id"
# the Pi's boot partition: config.txt (read by the Pi's firmware, not QEMU) and cmdline.txt (the
# kernel's command line: here for QEMU's virt board, the serial console on its PL011)
fat_put config.txt "$(printf '# emulated Raspberry Pi (tools/aarch64-boot-check.sh): QEMU reads cmdline.txt only\narm_64bit=1\n')
"
fat_put cmdline.txt "console=ttyAMA0 root=PARTUUID=$DISKID-02 rootfstype=ext4 fsck.repair=yes rootwait
"

# This test image only: a oneshot that, in every normal boot, waits for the enrolment to have
# started the service, records what the technician would see, writes through the control socket,
# and powers the board off (the host then checks, and boots again if the service was not up yet).
cat > "$MNT/usr/local/sbin/ssp-boot-check" <<'GUEST'
#!/bin/bash
B=/boot/firmware/ssp-boot-check; H=/var/lib/ssp-agent/home; A=/opt/ssp-agent/bin/ssp-agent
mkdir -p "$B"
n=$(( $(cat /var/lib/ssp-boot-check.boots 2>/dev/null || echo 0) + 1 )); echo "$n" > /var/lib/ssp-boot-check.boots
OUT=$B/boot-$n.txt
say() { echo "ssp-boot-check: $*" > /dev/console; echo "$*" >> "$OUT"; }
say "boot $n (normal boot $n): $(date -u +%FT%TZ)"
# up to 45 minutes for the enrolment unit to enrol and start the service; 2 minutes of "enrolled,
# enrolment unit done, service not running" end the wait early (then it is recorded as such)
idle=0
for _ in $(seq 540); do
  if [ "$(systemctl is-active ssp-agent.service)" = active ] && [ -S "$H/control.sock" ]; then break; fi
  e=$(systemctl is-active ssp-agent-enrol.service)
  if [ -f /boot/firmware/ssp-enrolment.json ] && [ "$e" != activating ] && [ "$e" != active ]; then
    idle=$((idle + 1)); [ "$idle" -ge 24 ] && break
  fi
  sleep 5
done
say "is-active: $(systemctl is-active ssp-agent.service)"
say "is-enabled: $(systemctl is-enabled ssp-agent.service 2>&1)"
say "enrol-unit: $(systemctl is-active ssp-agent-enrol.service) $(systemctl is-enabled ssp-agent-enrol.service 2>&1)"
systemctl show ssp-agent.service -p ActiveState -p SubState -p DynamicUser -p MainPID -p NRestarts >> "$OUT"
pid=$(systemctl show ssp-agent.service -p MainPID --value)
if [ "${pid:-0}" != 0 ] && [ -d "/proc/$pid" ]; then
  say "main-uid: $(stat -c %u "/proc/$pid") $(stat -c %U "/proc/$pid")"
fi
if [ "$(systemctl is-active ssp-agent.service)" = active ]; then
  say "listening: $(/opt/ssp-agent/bin/python -c 'import sys; from pathlib import Path; from agent.control import listening; print(listening(Path(sys.argv[1])))' "$H")"
  SSP_AGENT_HOME=$H "$A" write app.readings --key "{\"device\": \"qemu\", \"seq\": $n}" --set '{"temp": 20.5}' \
    > "$B/write-$n.json" 2> "$B/write-$n.err"
  say "write-exit: $?"
  SSP_AGENT_HOME=$H "$A" dump > "$B/dump-$n.json" 2>> "$B/write-$n.err"
  say "dump-exit: $?"
  SSP_AGENT_HOME=$H "$A" status > "$B/status-$n.json" 2>> "$B/write-$n.err"
  # a write the CLI had done itself, as root, would have left root-owned files in the service's home
  say "root-owned-in-home: $(find "$H" -uid 0 | wc -l)"
fi
journalctl -b --no-pager -u ssp-agent.service -u ssp-agent-enrol.service > "$B/journal-$n.txt" 2>&1
say "done; powering off"
sync
systemctl --no-block poweroff
GUEST
chmod 755 "$MNT/usr/local/sbin/ssp-boot-check"
cat > "$MNT/etc/systemd/system/ssp-boot-check.service" <<'UNIT'
# tools/aarch64-boot-check.sh's test image only: records the service's state, writes through its
# control socket, powers off.
[Unit]
Description=aarch64-boot-check: the service's state and a write through its control socket
# not After=multi-user.target: the target is ordered after what it wants, this unit included
After=ssp-agent-enrol.service ssp-agent.service

[Service]
Type=oneshot
ExecStart=/usr/local/sbin/ssp-boot-check
TimeoutStartSec=infinity
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=multi-user.target
UNIT
mkdir -p "$MNT/etc/systemd/system/multi-user.target.wants"
ln -sfn /etc/systemd/system/ssp-boot-check.service "$MNT/etc/systemd/system/multi-user.target.wants/ssp-boot-check.service"
KERNEL=$(ls "$MNT"/boot/vmlinuz-* | sort -V | tail -1); INITRD=$(ls "$MNT"/boot/initrd.img-* | sort -V | tail -1)
cp "$KERNEL" "$WORK/vmlinuz"; cp "$INITRD" "$WORK/initrd.img"
step "root: $(du -sh --exclude=./boot/firmware "$MNT" | cut -f1); kernel $(basename "$KERNEL")"
cleanup

# The technician's step: provision flash (mtools and debugfs on the image file, no mount).
host_agent provision flash --image "$IMG" --bundle "$WORK/bundle" > "$WORK/flash.out" || fail "provision flash"
step "flash: $(cat "$WORK/flash.out")"

# mount_ro: the root partition read-only on $MNT (a loop device); the boot partition's files copied
# to $FW (mtools, reading only)
FW=$WORK/bootfs
mount_ro() {
  ROOTDEV=$(attach 2 ro)
  mount -o ro,noload "$ROOTDEV" "$MNT"; MOUNTS+=("$MNT")
  rm -rf "$FW"; mkdir -p "$FW"
  mcopy -s -n -i "$FATSPEC" '::*' "$FW/"
}
marker() { grep -h "^$1: " "$FW/ssp-boot-check/boot-$2.txt" 2>/dev/null | tail -1 | cut -d' ' -f2-; }

passed=0; normal=0
for boot in $(seq "$MAX_BOOTS"); do
  append=$(mtype -i "$IMG@@$((BOOT_START * 512))" ::cmdline.txt | head -1)
  step "boot $boot: cmdline.txt: $append"
  LOG=$WORK/console-$boot.log
  t0=$(date +%s)
  set +e
  nice -n 10 timeout "$((BOOT_TIMEOUT * 60))" qemu-system-aarch64 -M virt -cpu cortex-a53 -smp 2 -m 1024 \
    -nographic -nic none -no-reboot -accel tcg \
    -kernel "$WORK/vmlinuz" -initrd "$WORK/initrd.img" -append "$append" \
    -drive "file=$IMG,format=raw,if=virtio" -device virtio-rng-pci < /dev/null > "$LOG" 2>&1
  rc=$?
  set -e
  step "boot $boot: qemu exited $rc after $(( ($(date +%s) - t0) / 60 )) min (console: $LOG)"
  [ "$rc" = 124 ] && { tail -30 "$LOG" >&2; fail "boot $boot did not end within $BOOT_TIMEOUT min (a hang?)"; }
  [ "$rc" = 0 ] || { tail -30 "$LOG" >&2; fail "qemu-system-aarch64 exited $rc"; }
  mount_ro
  [ -f "$FW/ssp-agent-firstboot.log" ] && step "ssp-agent-firstboot.log: $(tail -3 "$FW/ssp-agent-firstboot.log" | tr '\n' '|')"
  if [ -f "$FW/ssp-boot-check/boot-$((normal + 1)).txt" ]; then
    normal=$((normal + 1))
    step "normal boot $normal: $(tr '\n' '|' < "$FW/ssp-boot-check/boot-$normal.txt")"
    if [ "$(marker is-active $normal)" = active ] && [ "$(marker write-exit $normal)" = 0 ]; then
      passed=1; cleanup; break
    fi
  fi
  cleanup
done
[ "$passed" = 1 ] || fail "after $boot boots the service was not active with a write through its socket (logs in $WORK)"

# The checks, from outside, on the powered-off image.
mount_ro
cp -a "$FW/ssp-boot-check" "$FW/ssp-agent-firstboot.log" "$WORK/" 2>/dev/null || true
[ ! -e "$FW/firstrun.sh" ] || fail "firstrun.sh is still on the boot partition"
! grep -q 'systemd.run=' "$FW/cmdline.txt" || fail "cmdline.txt still names the firstrun hook: $(cat "$FW/cmdline.txt")"
[ -f "$FW/ssp-enrolment.json" ] || fail "no ssp-enrolment.json on the boot partition"
cp "$FW/ssp-enrolment.json" "$WORK/"
site=$("$HOSTPY" -c 'import json,sys; d=json.load(open(sys.argv[1])); assert len(d["site_id"]) == 32 and d["public_key"]; print(d["site_id"])' \
  "$FW/ssp-enrolment.json") || fail "ssp-enrolment.json lacks a site_id and public key: $(cat "$FW/ssp-enrolment.json")"
[ "$(marker is-enabled $normal)" = enabled ] || fail "ssp-agent.service is not enabled: $(marker is-enabled $normal)"
grep -qx 'DynamicUser=yes' "$FW/ssp-boot-check/boot-$normal.txt" || fail "ssp-agent.service is not under DynamicUser"
uid=$(marker main-uid $normal | cut -d' ' -f1)
# systemd's dynamic users are allocated from 61184..65519
[ -n "$uid" ] && [ "$uid" -ge 61184 ] && [ "$uid" -le 65519 ] || fail "the service's process runs as uid '$uid', not a dynamic user"
[ "$(marker listening $normal)" = True ] || fail "the control socket did not accept a connection"
[ "$(marker root-owned-in-home $normal)" = 0 ] || fail "the write left root-owned files in the home: it did not go through the socket"
"$HOSTPY" - "$FW/ssp-boot-check/write-$normal.json" "$FW/ssp-boot-check/dump-$normal.json" "$normal" <<'PY' || fail "the write is not in the service's dump"
import json, sys
w = open(sys.argv[1]).read().strip()          # the event id the write made
rows = json.load(open(sys.argv[2]))["app.readings"]
assert len(w) == 64 and {"key": {"device": "qemu", "seq": int(sys.argv[3])}, "values": {"temp": 20.5}} in rows, (w, rows)
PY
step "enrolled as $site; ssp-agent.service $(marker is-active $normal) as uid $(marker main-uid $normal)" \
     "(DynamicUser); write through the control socket: $(cat "$FW/ssp-boot-check/write-$normal.json" | head -c 300)"
cleanup
echo "aarch64-boot-check: PASS ($(date -u +%FT%TZ)): $boot boots, $(( ($(date +%s) - START) / 60 )) min:" \
     "firstrun install, enrolment file, ssp-agent.service active under DynamicUser, write through the control socket"
