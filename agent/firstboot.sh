#!/bin/bash
# ssp-agent first boot on Raspberry Pi OS (issue 12 item 7; docs/operations.md "Fleet workflow").
# `ssp-agent provision flash` puts this script, with the bundle it belongs to, in
# /opt/ssp-agent/bundle/ on the image's root filesystem, and names it in the image's first-boot
# hook (Bookworm: /boot/firmware/firstrun.sh named on cmdline.txt by systemd.run=; Trixie-based
# images: cloud-init user-data runcmd).
#
#   firstboot.sh install [--start]   offline install into the venv /opt/ssp-agent from the bundle's
#                                    wheelhouse; /etc/ssp-agent/ configuration; the enrolment unit
#                                    (ssp-agent-enrol.service) enabled; --start: also start it now
#                                    (cloud-init runs late in a normal boot)
#   firstboot.sh enrol               what the enrolment unit runs once the network and clock are
#                                    up: `ssp-agent provision enrol` (init inside the keystore, then
#                                    the site_id and public key on the boot partition)
#
# SSP_ROOT (default empty: /) and SSP_BOOT (default /boot/firmware, else /boot) redirect every
# path, so the same script runs against an unpacked image (tests). SSP_PYTHON: the interpreter that
# makes the venv (default /usr/bin/python3, Raspberry Pi OS's own).
set -eu
ROOT=${SSP_ROOT:-}
BUNDLE=$(cd "$(dirname "$0")" && pwd)
PREFIX=$ROOT/opt/ssp-agent
if [ -z "${SSP_BOOT:-}" ]; then
  if [ -d "$ROOT/boot/firmware" ]; then SSP_BOOT=$ROOT/boot/firmware; else SSP_BOOT=$ROOT/boot; fi
fi
PY=${SSP_PYTHON:-/usr/bin/python3}
log() { echo "ssp-agent firstboot: $*" >&2; [ -d "$SSP_BOOT" ] && echo "$(date -u +%FT%TZ) $*" >> "$SSP_BOOT/ssp-agent-firstboot.log" || true; }

stage=${1:-install}
case "$stage" in
  install)
    if [ ! -x "$PREFIX/bin/ssp-agent" ]; then
      log "installing into $PREFIX from $BUNDLE/wheelhouse (offline)"
      "$PY" -m venv "$PREFIX"
      # --no-index: nothing from the network; the wheelhouse is the whole dependency set
      "$PREFIX/bin/python" -m pip install -q --disable-pip-version-check --no-index \
        --find-links "$BUNDLE/wheelhouse" "ssp-agent$(cat "$BUNDLE/extras" 2>/dev/null || true)"
    fi
    "$PREFIX/bin/ssp-agent" provision device-setup --bundle "$BUNDLE" --root "${ROOT:-/}" --boot "$SSP_BOOT"
    log "installed $("$PREFIX/bin/ssp-agent" --version); enrolment unit enabled"
    if [ "${2:-}" = "--start" ] && [ -z "$ROOT" ] && [ -d /run/systemd/system ]; then
      systemctl daemon-reload && systemctl start --no-block ssp-agent-enrol.service
    fi
    ;;
  enrol)
    "$PREFIX/bin/ssp-agent" provision enrol --bundle "$BUNDLE" --root "${ROOT:-/}" --boot "$SSP_BOOT"
    log "enrolled: see ssp-enrolment.json on the boot partition"
    ;;
  *) echo "usage: firstboot.sh install [--start] | enrol" >&2; exit 2 ;;
esac
