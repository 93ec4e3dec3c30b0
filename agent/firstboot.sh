#!/bin/bash
# ssp-agent first boot on Raspberry Pi OS (docs/operations.md "Fleet workflow", 3. Boot).
# `ssp-agent provision flash` puts this script, with the bundle it belongs to, in
# /opt/ssp-agent/bundle/ on the image's root filesystem, and names it in the image's first-boot
# hook (Bookworm: /boot/firmware/firstrun.sh named on cmdline.txt by systemd.run=; Trixie-based
# images: cloud-init user-data runcmd).
#
#   firstboot.sh install [--start]   offline install into the venv /opt/ssp-agent from the bundle's
#                                    wheelhouse; /etc/ssp-agent/ configuration; the enrolment unit
#                                    (ssp-agent-enrol.service) enabled; --start: also start it now
#                                    (cloud-init runs late in a normal boot)
#   firstboot.sh enrol               what the enrolment unit runs: `ssp-agent provision enrol` (init
#                                    inside the keystore, the site_id and public key on the boot
#                                    partition), then the service started
#
# Every attempt, its number and the cause of a failure go to ssp-agent-firstboot.log on the boot
# partition (and to stderr: the console). A failed install exits 1 while attempts are left (the
# Bookworm hook then stays for the next boot; under cloud-init, which runs runcmd once, a unit
# runs it again at the next boot), 3 when it gives up after MAX_TRIES; 0 when installed.
#
# SSP_ROOT (default empty: /) and SSP_BOOT (default /boot/firmware, else /boot) redirect every
# path, so the same script runs against an unpacked image (tests). SSP_PYTHON: the interpreter that
# makes the venv (default /usr/bin/python3, Raspberry Pi OS's own).
set -u
ROOT=${SSP_ROOT:-}
BUNDLE=$(cd "$(dirname "$0")" && pwd)
PREFIX=$ROOT/opt/ssp-agent
if [ -z "${SSP_BOOT:-}" ]; then
  if [ -d "$ROOT/boot/firmware" ]; then SSP_BOOT=$ROOT/boot/firmware; else SSP_BOOT=$ROOT/boot; fi
fi
PY=${SSP_PYTHON:-/usr/bin/python3}
LOG=$SSP_BOOT/ssp-agent-firstboot.log
UNITS=$ROOT/etc/systemd/system
# Boots an install is tried on before the hook gives up: bounded, so a card whose bundle cannot
# install still boots normally (no reboot loop), its reasons on the boot partition.
MAX_TRIES=3

log() { echo "ssp-agent firstboot: $*" >&2; [ -d "$SSP_BOOT" ] && echo "$(date -u +%FT%TZ) $*" >> "$LOG" || true; }

# run WHAT CMD...: CMD's output shown as it comes; on failure WHAT, the exit status and the last
# lines of that output (the cause: pip's, init's) go to the log.
run() {
  local what=$1 out rc line
  shift
  out=$(mktemp)
  "$@" 2>&1 | tee "$out" >&2
  rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then
    log "$what failed (exit $rc):"
    tail -n 12 "$out" | while IFS= read -r line; do log "  $line"; done
  fi
  rm -f "$out"
  return "$rc"
}

# next_try NAME: this attempt's number, kept on the root filesystem across boots
next_try() {
  local f=$PREFIX/$1.tries n
  n=$(cat "$f" 2>/dev/null || true)
  case $n in ''|*[!0-9]*) n=0 ;; esac
  n=$((n + 1))
  mkdir -p "$PREFIX" && echo "$n" > "$f"
  echo "$n"
}

systemd_running() { [ -d "$ROOT/run/systemd/system" ]; }

# retry_unit on|off: the unit that runs the install again at the next boot (cloud-init's runcmd runs once)
retry_unit() {
  local unit=$UNITS/ssp-agent-install.service link=$UNITS/multi-user.target.wants/ssp-agent-install.service
  if [ "$1" = on ]; then
    mkdir -p "$UNITS/multi-user.target.wants"
    cat > "$unit" <<UNIT
# ssp-agent first-boot install, run again at boot until it succeeds or gives up
# (ssp-agent-firstboot.log on the boot partition says why it failed). Removed by firstboot.sh.
[Unit]
Description=ssp-agent first-boot install (again)
After=local-fs.target

[Service]
Type=oneshot
ExecStart=${BUNDLE#"$ROOT"}/firstboot.sh install --start
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=multi-user.target
UNIT
    ln -sfn /etc/systemd/system/ssp-agent-install.service "$link"
  else
    rm -f "$unit" "$link"
  fi
}

install_steps() {
  if [ ! -x "$PREFIX/bin/ssp-agent" ]; then
    run "making the venv $PREFIX with $PY" "$PY" -m venv "$PREFIX" || return 1
    # --no-index: nothing from the network; the wheelhouse is the whole dependency set
    run "installing from $BUNDLE/wheelhouse (pip, offline)" "$PREFIX/bin/python" -m pip install -q \
      --disable-pip-version-check --no-index --find-links "$BUNDLE/wheelhouse" \
      "ssp-agent$(cat "$BUNDLE/extras" 2>/dev/null || true)" || return 1
  fi
  run "provision device-setup" "$PREFIX/bin/ssp-agent" provision device-setup --bundle "$BUNDLE" \
    --root "${ROOT:-/}" --boot "$SSP_BOOT" || return 1
}

# bundle_field EXPR: a value of bundle.json, read with the venv's Python (EXPR on the dict m)
bundle_field() { "$PREFIX/bin/python" -c "import json, sys; m = json.load(open(sys.argv[1])); print($1)" "$BUNDLE/bundle.json" 2>/dev/null; }

stage=${1:-install}
case "$stage" in
  install)
    n=$(next_try install)
    log "install: attempt $n of $MAX_TRIES (offline, from the bundle's wheelhouse into $PREFIX)"
    if install_steps; then
      rm -f "$PREFIX/install.tries"
      retry_unit off
      log "installed $("$PREFIX/bin/ssp-agent" --version 2>&1); enrolment unit enabled"
      if [ "${2:-}" = "--start" ] && systemd_running; then
        systemctl daemon-reload && systemctl start --no-block ssp-agent-enrol.service
      fi
      exit 0
    fi
    if [ "$n" -ge "$MAX_TRIES" ]; then
      retry_unit off
      log "install failed: giving up after $n attempts; the card boots without the agent. The causes are above:" \
          "make a bundle for this image (tools/wheelhouse.sh, provision bundle; provision flash checks it) and flash the card again"
      exit 3
    fi
    [ "${2:-}" = "--start" ] && retry_unit on
    log "install attempt $n of $MAX_TRIES failed: it runs again at the next boot"
    exit 1
    ;;
  enrol)
    n=$(next_try enrol)
    wait=$(bundle_field '"trusted" if m.get("clock_trusted") else int(m.get("wait_clock_s") or 0)' || echo "?")
    if [ "$wait" = trusted ]; then
      log "enrolment attempt $n: the bundle says the clock is trusted (--clock-trusted): no wait for NTP"
    else
      log "enrolment attempt $n: waits up to $wait s for a synchronised clock (NTP: the device needs its network" \
          "and a time server; a device with a real-time clock and no network needs a bundle made with --clock-trusted)"
    fi
    run "enrolment (provision enrol)" "$PREFIX/bin/ssp-agent" provision enrol --bundle "$BUNDLE" \
      --root "${ROOT:-/}" --boot "$SSP_BOOT"
    rc=$?
    if [ "$rc" -ne 0 ]; then
      log "enrolment attempt $n failed: the enrolment unit retries in 60 s, and at every boot, until it succeeds"
      exit "$rc"
    fi
    rm -f "$PREFIX/enrol.tries"
    log "enrolled: see ssp-enrolment.json on the boot partition"
    unit=$(bundle_field '"ssp-agent-sync.timer" if m.get("service") == "timer" else "ssp-agent.service"' \
           || echo ssp-agent.service)
    if systemd_running; then   # the service now, not at the next boot
      run "starting $unit" systemctl daemon-reload && run "starting $unit" systemctl start --no-block "$unit" \
        && log "started $unit"
    else
      log "$unit enabled: it starts at the next boot"
    fi
    ;;
  *) echo "usage: firstboot.sh install [--start] | enrol" >&2; exit 2 ;;
esac
