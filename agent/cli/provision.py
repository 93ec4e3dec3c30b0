"""Provisioning and flashing field devices (docs/operations.md "Fleet workflow").

- `provision bundle`: a device's bundle: manifest, profile, keystore choice, broker URL, CA and
  credentials, the packaged systemd units, the offline wheelhouse and the first-boot script.
- `provision flash`: writes a bundle onto a Raspberry Pi OS image file (debugfs into the root
  filesystem, mtools onto the boot partition; no loop device, no mount).
- On the device, from firstboot.sh: `provision device-setup` and `provision enrol` (`init` inside
  the keystore, the service units, and the site_id, public key and broker password hash written
  to the boot partition for the technician).

The device's identity is made on the device, inside its keystore: no key is in the bundle or the
image; the broker account is issued after enrolment from the published password hash."""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import secrets
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from importlib import resources
from pathlib import Path

from .. import infile
from .common import PASSWORD_LIMIT, Refused, json_arg, read_input
from .args import MAX_SECONDS, seconds_arg

BUNDLE_FORMAT = 1
DEVICE_BUNDLE = "/opt/ssp-agent/bundle"      # where the bundle lives on the device's root filesystem
DEVICE_BIN = "/opt/ssp-agent/bin/ssp-agent"  # the venv firstboot.sh makes (what the shipped units name)
DEVICE_HOME = "var/lib/ssp-agent/home"        # the units' SSP_AGENT_HOME (StateDirectory=ssp-agent)
DEVICE_WITNESS = "var/lib/ssp-agent/clock-witness"
ENROL_UNIT = "ssp-agent-enrol.service"
ENROLMENT_FILE = "ssp-enrolment.json"          # on the boot partition: what the technician collects
SERVICE_UNITS = ("ssp-agent.service", "ssp-agent-sync.service", "ssp-agent-sync.timer")
SECRET_FILES = ("mqtt-password", "client.key")
# What the provisioning verbs read, each bounded (agent/infile.py), far above any real one.
BUNDLE_JSON_LIMIT = 1024 * 1024           # bundle.json (a real one is about 1 KB)
UNIT_LIMIT = 64 * 1024                    # a systemd unit
CREDENTIAL_LIMIT = 1024 * 1024            # a CA bundle, a client certificate or key
CMDLINE_LIMIT = 64 * 1024                 # the boot partition's cmdline.txt (the kernel takes a few KB)
BOOT_TEXT_LIMIT = 1024 * 1024             # its user-data, meta-data, firstrun.sh
# The bundle's files a device copies to /etc/ssp-agent (device-setup), with their limits (text ones
# must be UTF-8); the mqtt section of bundle.json names the credential files by these names only.
CONF_FILES = {"manifest.toml": infile.TEXT_LIMIT, "profile.toml": infile.TEXT_LIMIT, "ca.pem": CREDENTIAL_LIMIT,
              "client.pem": CREDENTIAL_LIMIT, "client.key": CREDENTIAL_LIMIT, "mqtt-password": PASSWORD_LIMIT}
TEXT_FILES = ("manifest.toml", "profile.toml", "mqtt-password")
MQTT_FILES = {"ca_file": "ca.pem", "cert_file": "client.pem", "key_file": "client.key", "password_file": "mqtt-password"}
UNIT_NAME = re.compile(r"[A-Za-z0-9_@-][A-Za-z0-9_@.-]{0,99}\.(service|timer)")
PROFILE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")   # a built-in profile (a name with a dot is a path)
FIRSTRUN_ARGS = ("systemd.run=/boot/firmware/firstrun.sh systemd.run_success_action=reboot "
                 "systemd.unit=kernel-command-line.target")

ENROL_UNIT_TEXT = f"""# ssp-agent first-boot enrolment (docs/operations.md "Fleet workflow"): creates the node's
# identity inside its keystore once the network and the clock are up, then writes the site_id and
# public key to the boot partition, then starts the service. Enabled by firstboot.sh install;
# disables itself when done.
[Unit]
Description=ssp-agent enrolment (first boot)
Wants=network-online.target
After=time-set.target network-online.target
ConditionPathExists=!/{DEVICE_HOME}/store.sqlite

[Service]
Type=oneshot
ExecStart={DEVICE_BUNDLE}/firstboot.sh enrol
# init waits for a trustworthy clock (NTP; docs/apply.md "Clocks without an RTC"): retried until it comes.
# Each attempt says on the console, and in ssp-agent-firstboot.log on the boot partition, what it
# waits for and why it failed; once enrolled it starts the service.
Restart=on-failure
RestartSec=60
TimeoutStartSec=30min
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=multi-user.target
"""


def register(sub, mailbox_sub) -> None:
    s = sub.add_parser("provision", help="provisioning bundles and Raspberry Pi OS images (docs/operations.md)")
    ps = s.add_subparsers(dest="provision_verb", metavar="ACTION")
    ps.required = True
    a = ps.add_parser("bundle", help="make a provisioning bundle for a device")
    a.add_argument("--out", required=True, help="the bundle directory to create (must not exist)")
    a.add_argument("--manifest", required=True, help="the mesh's provisioning manifest (TOML)")
    a.add_argument("--profile", default="pi-3-4", help="device profile (built-in name or .toml file)")
    a.add_argument("--keystore", help='keystore JSON for init on the device, e.g. {"kind":"pkcs11",...}; '
                                      "default: the profile's (a software keystore in the home)")
    a.add_argument("--wheelhouse", required=True,
                   help="the device's wheelhouse directory (tools/wheelhouse.sh; e.g. dist/wheelhouse/aarch64-cp311)")
    a.add_argument("--extras", default="", help='extras to install, e.g. "pkcs11"')
    a.add_argument("--broker", help="broker URL, e.g. mqtts://gateway.example:8883")
    a.add_argument("--ca-file", help="CA bundle the device verifies the broker with (copied)")
    a.add_argument("--username", help="a shared broker user name (default: each device's site_id, with a "
                                      "password the device makes; only its hash leaves the device)")
    a.add_argument("--password-file", help="the shared user name's password (copied; needs --username)")
    a.add_argument("--cert-file", help="client certificate (copied)")
    a.add_argument("--key-file", help="client key (copied, 0600)")
    a.add_argument("--secure-binding", action=argparse.BooleanOptionalAction, default=None,
                   help="devices run with the secure binding (docs/mqtt.md \"Authenticated or not\"): only when "
                        "the broker enforces per-device accounts and ACLs; default: on with per-device accounts "
                        "(no --username), off with a shared account")
    a.add_argument("--service", choices=["run", "timer"], default="run",
                   help="always-on `run` (ssp-agent.service) or wake-sync-sleep (ssp-agent-sync.timer)")
    a.add_argument("--clock-trusted", action="store_true", help="the device has a real-time clock: init does "
                   "not wait for NTP (docs/apply.md \"Clocks without an RTC\")")
    a.add_argument("--wait-clock", type=seconds_arg, default=600, help="seconds init waits for NTP per attempt")
    a.set_defaults(fn=cmd_bundle, home_optional=True)

    a = ps.add_parser("flash", help="write a bundle onto a Raspberry Pi OS image file (boot + root partitions)")
    a.add_argument("--image", required=True, help="the .img file (MBR: FAT boot partition, ext4 root)")
    a.add_argument("--bundle", required=True, help="the bundle directory made by `provision bundle`")
    a.add_argument("--hook", choices=["auto", "firstrun", "cloud-init"], default="auto",
                   help="first-boot hook: firstrun.sh on cmdline.txt (Bookworm) or cloud-init user-data "
                        "(Trixie-based); auto: cloud-init when the boot partition has user-data or meta-data")
    a.set_defaults(fn=cmd_flash, home_optional=True)

    a = ps.add_parser("device-setup", help="(on the device, run by firstboot.sh) /etc/ssp-agent and the enrolment unit")
    a.add_argument("--bundle", required=True, help="the bundle directory (/opt/ssp-agent/bundle on a device)")
    a.add_argument("--root", default="/", help="the device's root directory; every path written is under it")
    a.add_argument("--boot", help="the boot partition (default: ROOT/boot/firmware)")
    a.set_defaults(fn=cmd_device_setup, home_optional=True)

    a = ps.add_parser("enrol", help="(on the device, run by the enrolment unit) init, units, the enrolment file")
    a.add_argument("--bundle", required=True, help="the bundle directory (/opt/ssp-agent/bundle on a device)")
    a.add_argument("--root", default="/", help="the device's root directory; every path written is under it")
    a.add_argument("--boot", help="the boot partition (default: ROOT/boot/firmware)")
    a.set_defaults(fn=cmd_enrol, home_optional=True)


# ---------------------------------------------------------------- bundle (technician's machine)
def cmd_bundle(args) -> int:
    from .common import EXIT_OK, emit, version
    from ..profile import ProfileError, load_profile
    out = Path(args.out)
    if out.exists():
        raise Refused(f"{out} exists; a bundle is written into a new directory")
    manifest_text = _read_text(Path(args.manifest), infile.TEXT_LIMIT, "manifest")
    _manifest(manifest_text, f"manifest {args.manifest}")
    profile_text = None
    if Path(args.profile).suffix:   # a profile file (load_profile's rule: a name with a suffix is a path)
        profile_text = _read_text(Path(args.profile), infile.TEXT_LIMIT, "profile")
        prof = _profile(profile_text, args.profile)
    else:
        try:
            prof = load_profile(args.profile)
        except ProfileError as e:
            raise Refused(str(e)) from None
    keystore = None
    if args.keystore:
        keystore = json_arg(args.keystore, "--keystore")
        if not isinstance(keystore, dict) or "kind" not in keystore:
            raise Refused('--keystore must be a JSON object with a "kind"')
        _check_keystore(keystore, "--keystore")
    _check_broker(args.broker, "--broker")
    _check_username(args.username, "--username")
    if not re.fullmatch(r"[A-Za-z0-9_.,-]*", args.extras):   # firstboot.sh hands it to pip: ssp-agent[EXTRAS]
        raise Refused(f'--extras must be extra names separated by commas, e.g. "pkcs11", got {args.extras!r}'[:300])
    if args.password_file and not args.username:
        raise Refused("--password-file is a shared account's password: give --username too (without both, each "
                      "device makes its own password for the user name = its site_id)")
    if bool(args.cert_file) != bool(args.key_file):
        raise Refused("--cert-file and --key-file go together")
    # The documented broker (docs/mqtt.md) gives each device its own account (user name = site_id)
    # and ACLs pinning its topics: that is what makes the binding authenticated. A shared account
    # cannot be pinned per device, so it defaults to off.
    secure = (not args.username) if args.secure_binding is None else args.secure_binding
    wh = Path(args.wheelhouse)
    wheels = sorted(wh.glob("*.whl")) if wh.is_dir() else []
    if not any(w.name.startswith("ssp_agent-") for w in wheels):
        raise Refused(f"{wh} holds no ssp_agent wheel: build the wheelhouse with tools/wheelhouse.sh "
                      "(--arch aarch64 for Raspberry Pi OS) and give its directory")
    for w in wheels:
        if not w.is_file() or re.search(r"\s", w.name):
            raise Refused(f"{w}: a wheelhouse holds regular files named without spaces (tools/wheelhouse.sh)")
    files = {}
    for flag, name in (("ca_file", "ca.pem"), ("password_file", "mqtt-password"),
                       ("cert_file", "client.pem"), ("key_file", "client.key")):
        src = getattr(args, flag)
        if src:
            what = f"--{flag.replace('_', '-')}"
            if name in TEXT_FILES:
                files[name] = _read_text(Path(src), CONF_FILES[name], what).encode()
            else:
                files[name] = read_input(Path(src), CONF_FILES[name], what)

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "wheelhouse").mkdir(parents=True)
    for w in wheels:
        shutil.copy2(w, tmp / "wheelhouse" / w.name)
    (tmp / "manifest.toml").write_text(manifest_text)
    for name, data in files.items():
        _write(tmp / name, data, 0o600 if name in SECRET_FILES else 0o644)
    units = []
    (tmp / "systemd").mkdir()
    for name in SERVICE_UNITS:   # the units shipped in the package (agent/systemd/), when present
        try:
            text = resources.files("agent").joinpath("systemd", name).read_text()
        except (FileNotFoundError, OSError):
            continue
        (tmp / "systemd" / name).write_text(text)
        units.append(name)
    (tmp / "systemd" / ENROL_UNIT).write_text(ENROL_UNIT_TEXT)
    fb = tmp / "firstboot.sh"
    fb.write_bytes(resources.files("agent").joinpath("firstboot.sh").read_bytes())
    os.chmod(fb, 0o755)
    if args.extras:
        (tmp / "extras").write_text(f"[{args.extras}]")
    meta = {"format": BUNDLE_FORMAT, "created_ms": time.time_ns() // 1_000_000, "agent_version": version(),
            "profile": prof.name if args.profile in (None, prof.name) else args.profile,
            "keystore": keystore, "service": args.service, "clock_trusted": bool(args.clock_trusted),
            "wait_clock_s": args.wait_clock, "units": units,
            "mqtt": {"broker": args.broker, "username": args.username,
                     "device_password": not args.username, "secure_binding": secure,
                     "ca_file": "ca.pem" if "ca.pem" in files else None,
                     "cert_file": "client.pem" if "client.pem" in files else None,
                     "key_file": "client.key" if "client.key" in files else None,
                     "password_file": "mqtt-password" if "mqtt-password" in files else None},
            "wheels": [w.name for w in wheels]}
    if profile_text is not None:   # a profile file travels with the bundle
        (tmp / "profile.toml").write_text(profile_text)
        meta["profile"] = "profile.toml"
    (tmp / "bundle.json").write_text(json.dumps(meta, indent=2) + "\n")
    os.chmod(tmp, 0o700)
    os.replace(tmp, out)
    emit({"bundle": str(out), "wheels": len(wheels), "units": units, "service": args.service,
          "broker": args.broker, "device_password": not args.username, "secure_binding": secure})
    return EXIT_OK


# ---------------------------------------------------------------- flash (technician's machine)
def _run(cmd: list[str], what: str, input: bytes | None = None) -> subprocess.CompletedProcess:
    from .common import Fault
    try:
        p = subprocess.run(cmd, capture_output=True, input=input, timeout=600)
    except FileNotFoundError:
        raise Fault(f"{what}: {cmd[0]} is not installed (Debian: apt-get install mtools e2fsprogs fdisk)") from None
    if p.returncode != 0:
        raise Fault(f"{what}: {' '.join(cmd[:3])}... failed: {p.stderr.decode(errors='replace').strip()[:300]}")
    return p


def image_partitions(image: Path) -> tuple[int, int]:
    """Byte offsets of the boot (FAT) and root (Linux) partitions of a Raspberry Pi OS image."""
    p = subprocess.run(["sfdisk", "--json", str(image)], capture_output=True, text=True)
    if p.returncode != 0:
        raise Refused(f"{image}: no partition table sfdisk can read ({p.stderr.strip()[:200]})")
    try:
        table = json.loads(p.stdout)["partitiontable"]
        sector = int(table.get("sectorsize", 512))
        parts = [q for q in table.get("partitions", []) if isinstance(q.get("type"), str) and isinstance(q.get("start"), int)]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise Refused(f"{image}: no partition table sfdisk can read") from None
    fat = [q for q in parts if q["type"].lower() in ("b", "c", "e", "ef") or "ebd0a0a2" in q["type"].lower()]
    lin = [q for q in parts if q["type"].lower() in ("83",) or "0fc63daf" in q["type"].lower()]
    if not fat or not lin:
        raise Refused(f"{image}: not a Raspberry Pi OS layout (a FAT boot partition and a Linux root partition)")
    return fat[0]["start"] * sector, lin[0]["start"] * sector


class Fat:
    """The boot partition, through mtools (no mount, no loop device)."""

    def __init__(self, image: Path, offset: int) -> None:
        self.spec = f"{image}@@{offset}"

    def read(self, name: str, limit: int = BOOT_TEXT_LIMIT) -> bytes | None:
        """The file's bytes (None when it is not there); more than `limit` is a refusal, and no more
        than limit + 1 bytes are taken from mtype."""
        try:
            p = subprocess.Popen(["mtype", "-i", self.spec, f"::{name}"], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL)
        except FileNotFoundError:
            from .common import Fault
            raise Fault("mtype is not installed (Debian: apt-get install mtools e2fsprogs fdisk)") from None
        with p:
            data = p.stdout.read(limit + 1)
            if len(data) > limit:
                p.kill()
                p.wait()
                raise Refused(f"the image's boot partition's {name} is too large: more than {limit} bytes")
            rc = p.wait()
        return data if rc == 0 else None

    def read_text(self, name: str, limit: int = BOOT_TEXT_LIMIT) -> str | None:
        """As read, as UTF-8 text (anything else is a refusal: InputRefused, exit 2)."""
        data = self.read(name, limit)
        return None if data is None else infile.decode_text(data, f"the image's boot partition's {name}")

    def write(self, name: str, data: bytes) -> None:
        with tempfile.NamedTemporaryFile() as f:
            f.write(data)
            f.flush()
            _run(["mcopy", "-o", "-i", self.spec, f.name, f"::{name}"], f"writing {name} to the boot partition")

    def rename(self, old: str, new: str) -> None:
        _run(["mren", "-i", self.spec, f"::{old}", f"::{new}"], f"renaming {old} on the boot partition")


class Ext4:
    """The root filesystem, through debugfs (e2fsprogs; `IMAGE?offset=N`)."""

    def __init__(self, image: Path, offset: int) -> None:
        self.dev = f"{image}?offset={offset}"

    def apply(self, commands: list[str]) -> None:
        with tempfile.NamedTemporaryFile("w", suffix=".debugfs") as f:
            f.write("\n".join(commands) + "\n")
            f.flush()
            _run(["debugfs", "-w", "-f", f.name, self.dev], "writing the root filesystem")

    def cat(self, path: str) -> bytes | None:
        p = subprocess.run(["debugfs", "-R", f"cat {path}", self.dev], capture_output=True)
        return p.stdout if p.returncode == 0 and p.stdout else None

    def link(self, path: str) -> str | None:
        """A symbolic link's target (None: not a link, or not there)."""
        p = subprocess.run(["debugfs", "-R", f"stat {path}", self.dev], capture_output=True, text=True,
                           errors="replace")
        m = re.search(r'link dest: "([^"]*)"', p.stdout)
        return m.group(1) if m else None

    def names(self, path: str) -> list[str]:
        """The names in a directory (empty when it is not there)."""
        p = subprocess.run(["debugfs", "-R", f"ls -p {path}", self.dev], capture_output=True, text=True,
                           errors="replace")
        return [f.split("/")[5] for f in p.stdout.splitlines() if f.count("/") >= 6]


ELF_MACHINES = {0x3E: "x86_64", 0xB7: "aarch64", 0x28: "armv7l", 0xF3: "riscv64"}   # e_machine: pip's arch name


def image_platform(root: Ext4) -> tuple[tuple[int, int], str, tuple[int, int] | None]:
    """The image's Python (X, Y), its architecture (from the interpreter's ELF header) and its glibc
    (from dpkg's record of libc6; None when the image has none): what the first boot installs with."""
    target = root.link("/usr/bin/python3")
    pythons = [n for n in root.names("/usr/lib") if re.fullmatch(r"python3\.\d+", n)]
    name = target.rsplit("/", 1)[-1] if target else (pythons[0] if len(pythons) == 1 else None)
    m = re.fullmatch(r"python(\d)\.(\d+)", name or "")
    if m is None:
        raise Refused("the image has no /usr/bin/python3 naming its Python version (firstboot.sh makes the "
                      "agent's venv with it): not a Raspberry Pi OS image?")
    version = (int(m[1]), int(m[2]))
    elf = root.cat(f"/usr/bin/{name}") or b""
    if len(elf) < 20 or elf[:4] != b"\x7fELF":
        raise Refused(f"the image's /usr/bin/{name} is not an ELF executable: not a Raspberry Pi OS image?")
    machine = int.from_bytes(elf[18:20], "little" if elf[5] == 1 else "big")
    arch = ELF_MACHINES.get(machine, f"elf-machine-{machine:#x}")
    glibc = None
    status = (root.cat("/var/lib/dpkg/status") or b"").decode("utf-8", "replace")
    g = re.search(r"^Package: libc6\n(?:[^\n]+\n)*?Version: (\d+)\.(\d+)", status, re.M)
    if g:
        glibc = (int(g[1]), int(g[2]))
    return version, arch, glibc


def check_wheels(bundle: Path, version: tuple[int, int], arch: str, glibc: tuple[int, int] | None) -> None:
    """Every wheel in the bundle installs on the image (its Python, architecture and glibc), or a refusal
    naming those that do not and the wheelhouse to build instead."""
    from ..wheeltags import fits
    bad = sorted(w.name for w in (bundle / "wheelhouse").glob("*.whl") if not fits(w.name, version, arch, glibc))
    if bad:
        py = f"{version[0]}.{version[1]}"
        libc = f", glibc {glibc[0]}.{glibc[1]}" if glibc else ""
        how = f"--arch aarch64 --python-version {py}" if arch == "aarch64" else f"for {arch} and Python {py}"
        raise Refused(f"{bundle}: {len(bad)} wheel(s) of its wheelhouse do not install on this image (Python {py}, "
                      f"{arch}{libc}): {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}. Build a wheelhouse "
                      f"for it (tools/wheelhouse.sh {how}) and make the bundle again"[:1200])


def _bundle_commands(bundle: Path, dest: str) -> list[str]:
    """debugfs commands that copy the bundle to `dest`, owned by root; secrets 0600, the tree 0700."""
    cmds = []
    parts = dest.strip("/").split("/")
    for i in range(1, len(parts) + 1):
        d = "/" + "/".join(parts[:i])
        cmds.append(f"mkdir {d}")
    cmds += [f"sif {dest} mode 040700", f"sif {dest} uid 0", f"sif {dest} gid 0"]
    for src in sorted(bundle.rglob("*")):
        rel = src.relative_to(bundle).as_posix()
        if re.search(r"\s", rel):
            continue   # debugfs takes no quoted names; a bundle has none
        target = f"{dest}/{rel}"
        if src.is_dir():
            cmds += [f"mkdir {target}", f"sif {target} mode 040755"]
            continue
        mode = 0o100600 if src.name in SECRET_FILES else 0o100755 if os.access(src, os.X_OK) else 0o100644
        cmds += [f"rm {target}", f"write {src} {target}", f"sif {target} mode 0{mode:o}",
                 f"sif {target} uid 0", f"sif {target} gid 0"]
    return cmds


FIRSTRUN_SH = """#!/bin/bash
# ssp-agent first boot (Bookworm): run by systemd.run= on cmdline.txt. It installs the agent offline
# and enables the enrolment unit; the enrolment runs in the next, normal boot. A failed install
# leaves this hook in place for the next boot (firstboot.sh bounds the attempts and writes each
# cause to ssp-agent-firstboot.log here); installed, or given up, it removes itself.
set +e
BOOT=${SSP_BOOT:-/boot/firmware}; [ -d "$BOOT" ] || BOOT=/boot
SELF=$(cat "$0")
# on the device, what happens is shown on the console (tests redirect the root: SSP_ROOT)
if [ -z "${SSP_ROOT:-}" ] && [ -w /dev/console ]; then exec >/dev/console 2>&1; fi
if [ -f "$BOOT/ssp-firstrun-previous.sh" ]; then   # Raspberry Pi Imager's own settings, run once
  bash "$BOOT/ssp-firstrun-previous.sh"
  mv -f "$BOOT/ssp-firstrun-previous.sh" "$BOOT/ssp-firstrun-previous.done"
fi
FIRSTBOOT=${SSP_ROOT:-}@BUNDLE@/firstboot.sh
if [ -x "$FIRSTBOOT" ]; then
  "$FIRSTBOOT" install
  rc=$?
else
  echo "$(date -u +%FT%TZ) no executable $FIRSTBOOT on the root filesystem: flash the image again" >> "$BOOT/ssp-agent-firstboot.log"
  rc=3
fi
if [ "$rc" -eq 1 ]; then
  # attempts left: this hook runs again at the next boot (put back if Imager's script removed it)
  [ -f "$BOOT/firstrun.sh" ] || printf '%s\n' "$SELF" > "$BOOT/firstrun.sh"
  if ! grep -q 'systemd.run=' "$BOOT/cmdline.txt"; then
    sed -i '1 s| systemd.unit=kernel-command-line.target||g; 1 s|$| @ARGS@|' "$BOOT/cmdline.txt"
  fi
else
  rm -f "$BOOT/firstrun.sh" "$BOOT/ssp-firstrun-previous.sh" "$BOOT/ssp-firstrun-previous.done"
  sed -i 's| systemd.run[^ ]*||g; s| systemd.unit=kernel-command-line.target||g' "$BOOT/cmdline.txt"
fi
exit 0
""".replace("@BUNDLE@", DEVICE_BUNDLE).replace("@ARGS@", FIRSTRUN_ARGS)

RUNCMD = ["bash", f"{DEVICE_BUNDLE}/firstboot.sh", "install", "--start"]


def _yaml():
    """PyYAML, needed only to edit an image's cloud-init user-data (the `provision` extra)."""
    try:
        import yaml
    except ImportError:
        from .common import Fault
        raise Fault("editing the image's cloud-init user-data needs PyYAML: pip install 'ssp-agent[provision]' "
                    "(or give --hook firstrun for a Bookworm image)") from None
    return yaml


def add_runcmd(user_data: str | None) -> str:
    """cloud-init user-data with our runcmd entry first, parsed and written back as YAML: every
    setting of the image's kept (its comments other than the header are not), its own runcmd
    entries after ours. A file that is not a YAML #cloud-config mapping is refused."""
    if not user_data or not user_data.strip():
        return f"#cloud-config\nruncmd:\n- [{', '.join(RUNCMD)}]\n"
    lines = user_data.splitlines()
    if not lines[0].rstrip().startswith("#cloud-config"):
        raise Refused("the image's user-data is not a #cloud-config file (its first line is "
                      f"{lines[0][:60]!r}); give --hook firstrun, or make it a cloud-config")
    yaml = _yaml()
    try:
        doc = yaml.safe_load(user_data)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise Refused(f"the image's user-data is not valid YAML{at} ({getattr(e, 'problem', None) or e}); "
                      "cloud-init would ignore it too: fix it (or write it again with Raspberry Pi Imager)") from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise Refused(f"the image's user-data must be a cloud-config mapping, not a {type(doc).__name__}")
    runcmd = doc.get("runcmd")
    if runcmd is None:   # `runcmd:` with nothing (or only a comment) after it
        runcmd = []
    if not isinstance(runcmd, list):
        raise Refused(f"the image's user-data: runcmd must be a list of commands, got {runcmd!r}"[:300])
    if RUNCMD in runcmd:
        return user_data
    doc["runcmd"] = [RUNCMD] + runcmd
    header = []
    for line in lines:   # "#cloud-config" and the comment lines under it (Imager's "generated by")
        if not line.startswith("#"):
            break
        header.append(line)

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, v):   # a multi-line value (apt conf, write_files content) stays a block
        return dumper.represent_scalar("tag:yaml.org,2002:str", v, style="|" if "\n" in v else None)
    Dumper.add_representer(str, text)

    def seq(dumper, v):    # a command as [bash, x, y] (Imager's and cloud-init's docs' form); mappings as blocks
        flat = all(isinstance(x, (str, int, float, bool, type(None))) and not (isinstance(x, str) and "\n" in x)
                   for x in v)
        return dumper.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=flat and bool(v))
    Dumper.add_representer(list, seq)
    out = "\n".join(header) + "\n" + yaml.dump(doc, Dumper=Dumper, sort_keys=False, default_flow_style=False,
                                               allow_unicode=True, width=1 << 16)
    if yaml.safe_load(out) != doc:   # what cloud-init will read is exactly what was meant
        from .common import Fault
        raise Fault("the image's user-data could not be written back unchanged (please report this file)")
    return out


def cmd_flash(args) -> int:
    """The bundle and the image's boot files are checked, and the new boot files made, before the
    image is written: a refusal leaves the image as it was."""
    from .common import EXIT_OK, emit
    image, bundle = Path(args.image), Path(args.bundle)
    check_bundle(bundle, flash=True)
    if not image.is_file():
        if image.exists():   # a card's device file, a directory: partitions are edited in an image file
            raise Refused(f"{image} is not an image file (a device or a directory): prepare the image file, "
                          "then write it to the card")
        raise Refused(f"{image}: no such image file")
    boot_off, root_off = image_partitions(image)
    fat, root = Fat(image, boot_off), Ext4(image, root_off)
    cmdline = fat.read_text("cmdline.txt", CMDLINE_LIMIT)
    if cmdline is None:
        raise Refused(f"{image}: the boot partition has no cmdline.txt (not a Raspberry Pi OS image?)")
    user_data = fat.read_text("user-data") if args.hook != "firstrun" else None   # --hook firstrun leaves it alone
    hook = args.hook
    if hook == "auto":
        hook = "cloud-init" if (user_data is not None or fat.read("meta-data") is not None) else "firstrun"
    # what the first boot installs with: a wheelhouse for another Python or architecture is refused here
    check_wheels(bundle, *image_platform(root))
    writes: list = []          # (name, bytes) for the boot partition, and renames, in order
    if hook == "cloud-init":
        writes.append(("user-data", add_runcmd(user_data).encode()))
    else:
        cmdline = cmdline.strip()
        prev = fat.read("firstrun.sh")
        if prev is not None and b"ssp-agent first boot" not in prev:
            writes.append(("rename", "firstrun.sh", "ssp-firstrun-previous.sh"))   # Imager's own settings still run first
        writes.append(("firstrun.sh", FIRSTRUN_SH.encode()))
        if "systemd.run=" not in cmdline:
            cmdline = f"{cmdline} {FIRSTRUN_ARGS}"
        writes.append(("cmdline.txt", (cmdline + "\n").encode()))
    root.apply(_bundle_commands(bundle, DEVICE_BUNDLE))
    for w in writes:
        if w[0] == "rename":
            fat.rename(w[1], w[2])
        else:
            fat.write(w[0], w[1])
    emit({"image": str(image), "hook": hook, "boot_offset": boot_off, "root_offset": root_off,
          "bundle": DEVICE_BUNDLE, "collect": f"{ENROLMENT_FILE} on the boot partition after first boot"})
    return EXIT_OK


# ---------------------------------------------------------------- on the device
def _under(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def _boot(args) -> Path:
    """--boot, else the boot partition under --root (never the host's own when --root is given)."""
    return Path(args.boot) if args.boot else _under(Path(args.root), "/boot/firmware")


def _write(path: Path, data: str | bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _enable(root: Path, unit: str, target: str) -> None:
    wants = root / "etc/systemd/system" / f"{target}.wants"
    wants.mkdir(parents=True, exist_ok=True)
    link = wants / unit
    if not link.is_symlink():
        link.symlink_to(f"/etc/systemd/system/{unit}")


def _disable(root: Path, unit: str, target: str) -> None:
    (root / "etc/systemd/system" / f"{target}.wants" / unit).unlink(missing_ok=True)


# ---------------------------------------------------------------- reading and checking inputs
def _read_text(path: Path, limit: int, what: str) -> str:
    return read_input(path, limit, what, text=True)


def _manifest(text: str, origin: str) -> None:
    """The manifest parses (what init does with it), or a refusal naming it."""
    from ..core.schema import ManifestError, parse_manifest
    try:
        parse_manifest(text)
    except ManifestError as e:   # every wrong shape and depth (core/schema.py): anything else is a bug
        raise Refused(f"{origin}: {e}"[:500]) from None


def _profile(text: str, origin: str):
    from ..profile import ProfileError, parse_profile
    try:
        return parse_profile(text, origin)
    except ProfileError as e:    # every wrong shape, depth and number (profile.py): anything else is a bug
        raise Refused(f"{e}"[:500] if origin in str(e) else f"{origin}: {e}"[:500]) from None


def _check_broker(v, what: str) -> None:
    if v is None:
        return
    if not isinstance(v, str) or not re.fullmatch(r"mqtts?://[^\s\x00-\x1f\x7f]{1,1000}", v):
        raise Refused(f"{what} must be a broker URL mqtt://HOST:PORT or mqtts://HOST:PORT, got {v!r}"[:300])


def _check_username(v, what: str) -> None:
    """A broker user name: it ends up in agent.toml and in a mosquitto password_file line (`user:hash`)."""
    if v is None:
        return
    if not isinstance(v, str) or not re.fullmatch(r"[^:\s\x00-\x1f\x7f]{1,256}", v):
        raise Refused(f"{what} must be a user name (1..256 characters, no ':', space or control character), got {v!r}"[:300])


def _check_keystore(v, what: str) -> None:
    """A keystore choice: null (the profile's) or a config init takes; never a PIN (a bundle is copied around)."""
    from firmware_bridge.keystore import KeystoreConfigError, check_config
    if v is None:
        return
    if isinstance(v, dict) and "pin" in v:
        raise Refused(f"{what} must not carry a PIN: a bundle is copied around; give pin_file, a path on the device")
    try:
        check_config(v)
    except KeystoreConfigError as e:
        raise Refused(f"{what}: {e}"[:300]) from None


def check_bundle(path: Path, flash: bool = False) -> tuple[dict, dict[str, bytes]]:
    """The one check of a provisioning bundle, before any verb writes anything: bundle.json field by
    field (type and range; unknown fields are ignored) and the files the verbs read from it
    (regular files within their limits, text UTF-8, the manifest and a profile file parsing).
    Returns bundle.json and those files' contents (what is written is what was checked). `flash`:
    also what the image's first boot needs (firstboot.sh, an ssp_agent wheel) and nothing in the
    bundle but regular files and directories. Anything wrong is a refusal (exit 2) naming it."""
    if not path.is_dir():
        raise Refused(f"{path} is not a provisioning bundle (no such directory; make one with `provision bundle`)")
    bj = path / "bundle.json"
    if not bj.exists() and not bj.is_symlink():
        raise Refused(f"{path} is not a provisioning bundle (no bundle.json; make one with `provision bundle`)")
    meta = json_arg(_read_text(bj, BUNDLE_JSON_LIMIT, "bundle.json"), f"{bj}")
    if not isinstance(meta, dict):
        raise Refused(f"{bj} must hold a JSON object, not {type(meta).__name__}")

    def bad(field: str, why: str):
        raise Refused(f"{bj}: {field} {why}, got {meta_repr(field)}"[:400])

    def meta_repr(field: str) -> str:
        v = meta
        for k in field.split("."):
            v = v.get(k) if isinstance(v, dict) else None
        return repr(v)

    fmt = meta.get("format")
    if type(fmt) is not int or fmt != BUNDLE_FORMAT:
        raise Refused(f"{path}: bundle format {fmt!r} is not {BUNDLE_FORMAT}; make it with this version"[:300])
    if meta.get("service") not in ("run", "timer"):
        bad("service", 'must be "run" or "timer"')
    if "clock_trusted" in meta and not isinstance(meta["clock_trusted"], bool):
        bad("clock_trusted", "must be true or false")
    w = meta.get("wait_clock_s", 0)
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and 0 <= w <= MAX_SECONDS):
        bad("wait_clock_s", f"must be a number of seconds 0..{MAX_SECONDS}")
    profile = meta.get("profile")
    if profile is not None and not (isinstance(profile, str) and (profile == "profile.toml" or PROFILE_NAME.fullmatch(profile))):
        bad("profile", 'must be a built-in profile name or "profile.toml"')
    _check_keystore(meta.get("keystore"), f"{bj}: keystore")
    units = meta.get("units", [])
    if not isinstance(units, list) or len(units) > 16 or \
            not all(isinstance(u, str) and UNIT_NAME.fullmatch(u) for u in units):
        bad("units", "must be a list of systemd unit names (NAME.service, NAME.timer)")
    wheels = meta.get("wheels", [])
    if not isinstance(wheels, list) or not all(isinstance(x, str) for x in wheels):
        bad("wheels", "must be a list of file names")
    if "agent_version" in meta and not isinstance(meta["agent_version"], (str, type(None))):
        bad("agent_version", "must be a string")
    c = meta.get("created_ms", 0)
    if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < 2 ** 63:
        bad("created_ms", "must be a time in milliseconds")
    mq = meta.get("mqtt")
    if mq is None:
        mq = {}
    elif not isinstance(mq, dict):
        bad("mqtt", "must be an object")
    _check_broker(mq.get("broker"), f"{bj}: mqtt.broker")
    _check_username(mq.get("username"), f"{bj}: mqtt.username")
    for k in ("device_password", "secure_binding"):
        if k in mq and not isinstance(mq[k], bool):
            bad(f"mqtt.{k}", "must be true or false")
    for k, name in MQTT_FILES.items():
        v = mq.get(k)
        if v is not None and v != name:
            bad(f"mqtt.{k}", f'must be null or "{name}" (the bundle\'s file)')
        if v is not None and not (path / name).exists():
            raise Refused(f"{bj}: mqtt.{k} names {name}, which is not in the bundle")

    # The files: read once, bounded, checked; what the verbs write or use is these bytes.
    files: dict[str, bytes] = {}
    for name, limit in CONF_FILES.items():
        f = path / name
        if not f.exists() and not f.is_symlink():
            continue
        if name in TEXT_FILES:
            files[name] = _read_text(f, limit, f"the bundle's {name}").encode()
        else:
            files[name] = read_input(f, limit, f"the bundle's {name}")
    if "manifest.toml" not in files:
        raise Refused(f"{path}: the bundle has no manifest.toml")
    _manifest(files["manifest.toml"].decode(), f"{path / 'manifest.toml'}")
    if profile == "profile.toml":
        if "profile.toml" not in files:
            raise Refused(f"{bj}: profile names profile.toml, which is not in the bundle")
        _profile(files["profile.toml"].decode(), f"{path / 'profile.toml'}")
    unit = path / "systemd" / ENROL_UNIT
    files[f"systemd/{ENROL_UNIT}"] = _read_text(unit, UNIT_LIMIT, "the bundle's enrolment unit").encode()
    if flash:
        fb = path / "firstboot.sh"
        if not fb.is_file() or not os.access(fb, os.X_OK):
            raise Refused(f"{path}: the bundle has no executable firstboot.sh (make it with `provision bundle`)")
        if not any(w.name.startswith("ssp_agent-") and w.is_file() for w in (path / "wheelhouse").glob("*.whl")):
            raise Refused(f"{path}: the bundle's wheelhouse holds no ssp_agent wheel (make it with `provision bundle`)")
        for d, dirs, names in os.walk(path):
            for n in dirs + names:
                m = os.lstat(os.path.join(d, n)).st_mode
                if not (stat.S_ISREG(m) or stat.S_ISDIR(m)):
                    raise Refused(f"{os.path.join(d, n)}: a bundle holds only regular files and directories")
    return meta, files


def cmd_device_setup(args) -> int:
    """/etc/ssp-agent (the manifest, CA, credentials) and the enrolment unit, enabled. The whole
    bundle is checked first: a bad one is refused with nothing written."""
    from .common import EXIT_OK, emit
    bundle, root = Path(args.bundle), Path(args.root)
    meta, files = check_bundle(bundle)
    conf = root / "etc/ssp-agent"
    conf.mkdir(parents=True, exist_ok=True)
    written = []
    for name in CONF_FILES:
        if name in files:
            _write(conf / name, files[name], 0o600 if name in SECRET_FILES else 0o644)
            written.append(str(conf / name))
    _write(root / "etc/systemd/system" / ENROL_UNIT, files[f"systemd/{ENROL_UNIT}"], 0o644)
    _enable(root, ENROL_UNIT, "multi-user.target")
    emit({"written": written, "enabled": ENROL_UNIT, "service": meta["service"]})
    return EXIT_OK


def mosquitto_password_line(username: str, password: str) -> str:
    """mosquitto_passwd's password_file line for this account ($7$: PBKDF2-HMAC-SHA512)."""
    from ..transport.broker import password_hash
    return f"{username}:{password_hash(password)}"


def cmd_enrol(args) -> int:
    """init (the key is made inside the keystore and never leaves it), the broker password (made
    here; only its hash is published), the service units, and the enrolment file on the boot partition.
    The bundle, and what device-setup put in /etc/ssp-agent, are checked before anything is made."""
    from .common import EXIT_OK, emit, version
    from ..node import Node
    bundle, root, boot = Path(args.bundle), Path(args.root), _boot(args)
    meta, files = check_bundle(bundle)
    conf = root / "etc/ssp-agent"
    home = _under(root, DEVICE_HOME)
    mq = meta.get("mqtt") or {}
    pw_path = conf / "mqtt-password"
    pw_text = _read_text(pw_path, PASSWORD_LIMIT, "mqtt-password") if pw_path.exists() or pw_path.is_symlink() else None
    init = None
    if not (home / Node.STORE_FILE).exists():
        mpath = conf / "manifest.toml"
        if mpath.exists() or mpath.is_symlink():   # device-setup's copy, as an operator may have edited it
            manifest = _read_text(mpath, infile.TEXT_LIMIT, "manifest")
            _manifest(manifest, str(mpath))
        else:
            manifest = files["manifest.toml"].decode()
        profile = meta.get("profile")
        if profile == "profile.toml":
            ppath = conf / "profile.toml"
            if ppath.exists() or ppath.is_symlink():
                profile = _profile(_read_text(ppath, infile.TEXT_LIMIT, "profile"), str(ppath))
            else:
                profile = _profile(files["profile.toml"].decode(), str(bundle / "profile.toml"))
        init = (manifest, profile)
    # the units' witness directory under --root, whatever the caller's environment says: --root
    # confines every write
    os.environ["SSP_AGENT_WITNESS_DIR"] = str(_under(root, DEVICE_WITNESS))
    # A device without an RTC must not take its identity's first reading of time from a clock
    # nobody vouches for: enrolment waits (retried by its unit) for a synchronised clock.
    os.environ.setdefault("SSP_AGENT_CLOCK_STRICT", "1")
    if init is not None:
        node, _pk = Node.init(home, init[0], meta.get("keystore"), init[1],
                              clock_trusted=bool(meta.get("clock_trusted")),
                              wait_clock_s=float(meta.get("wait_clock_s") or 0))
        node.close()
    with Node.open(home, read_only=True) as node:
        st = node.status()
    site = st["site_id"]
    username = mq.get("username") or site
    pw_line = None
    if mq.get("device_password"):
        if pw_text is None or not pw_text.strip():
            pw_text = secrets.token_urlsafe(24) + "\n"
            _write(pw_path, pw_text, 0o600)
        pw_line = mosquitto_password_line(username, pw_text.strip())
    units = _install_units(meta, root, conf, username)
    _disable(root, ENROL_UNIT, "multi-user.target")
    card = {"site_id": site, "public_key": st["public_key"], "mesh_id": st["mesh_id"],
            "hostname": socket.gethostname(), "agent_version": version(), "profile": st["profile"],
            "keystore": (meta.get("keystore") or {}).get("kind", "the profile's"),
            "enrolled_ms": time.time_ns() // 1_000_000,
            "mqtt": {"broker": mq.get("broker"), "username": username, "password_file_line": pw_line},
            "vouch": (f"ssp-agent --home GATEWAY_HOME record issue-vouch --subject {site} "
                      f"--public-key {st['public_key']} --authority-key AUTHORITY_DIR"),
            "peer_add": f"ssp-agent --home GATEWAY_HOME peer add --site-id {site} --public-key {st['public_key']}",
            "units": units}
    boot.mkdir(parents=True, exist_ok=True)
    (boot / ENROLMENT_FILE).write_text(json.dumps(card, indent=2) + "\n")
    emit(card)
    return EXIT_OK


def _install_units(meta: dict, root: Path, conf: Path, username: str) -> list[str]:
    """The service units through `service install` when this version has it, else the bundle's
    copies; then the chosen one enabled (always-on run, or the sync timer)."""
    mq = meta.get("mqtt") or {}
    if not (conf / "mqtt-password").exists():
        _write(conf / "mqtt-password", "", 0o600)
    units = list(meta.get("units") or [])
    try:
        from . import service  # noqa: F401
        argv = ["service", "install", "--root", str(root), "--bin", DEVICE_BIN]
        if meta.get("clock_trusted"):   # the service trusts the clock as this enrolment's init did
            argv += ["--clock-trusted"]
        if not (conf / "agent.toml").exists():   # written once; an enrolment run again keeps an edited one
            argv += ["--username", username]
            if mq.get("broker"):
                argv += ["--broker", mq["broker"]]
            for k, flag in (("ca_file", "--ca-file"), ("cert_file", "--cert-file"), ("key_file", "--key-file")):
                if mq.get(k):
                    argv += [flag, f"/etc/ssp-agent/{mq[k]}"]
            if mq.get("secure_binding"):   # absent in a bundle.json that predates it: off (fail closed)
                argv += ["--secure-binding"]
        from .. import cli
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            rc = cli.dispatch(cli.build_parser().parse_args(argv))
        if rc != 0:
            raise cli.Fault(f"installing the service units failed: {err.getvalue().strip()}")
    except ImportError:
        bundle_units = Path(DEVICE_BUNDLE) if root == Path("/") else _under(root, DEVICE_BUNDLE)
        for name in units:
            src = bundle_units / "systemd" / name
            if src.is_file():
                _write(root / "etc/systemd/system" / name, _read_text(src, UNIT_LIMIT, "unit"), 0o644)
    if meta.get("service") == "timer":
        _enable(root, "ssp-agent-sync.timer", "timers.target")
        return ["ssp-agent-sync.timer"]
    _enable(root, "ssp-agent.service", "multi-user.target")
    return ["ssp-agent.service"]
