"""Provisioning and flashing field devices (issue 12 item 7; docs/operations.md "Fleet workflow").

- `ssp-agent provision bundle --out DIR ...`: a provisioning bundle for a device: the manifest, the
  profile and keystore choice, broker URL, CA and credentials, the systemd units shipped in the
  package (agent/systemd/), the offline wheelhouse (tools/wheelhouse.sh) and the first-boot script.
- `ssp-agent provision flash --image IMG --bundle DIR`: writes the bundle onto a Raspberry Pi OS
  image file: the bundle into the root filesystem (/opt/ssp-agent/bundle, debugfs) and the first-boot
  hook onto the boot FAT partition (mtools): firstrun.sh named on cmdline.txt by systemd.run=
  (Bookworm) or a cloud-init user-data runcmd (Trixie-based images). No loop device, no mount.
- On the device (run by firstboot.sh from the installed venv): `provision device-setup` (the
  /etc/ssp-agent files and the enrolment unit) and `provision enrol` (`init` inside the keystore,
  the service units, and the site_id, public key and broker password hash written to the boot
  partition for the technician).

The device's identity is made on the device, inside its keystore: no key is in the bundle or the
image. Broker credentials name the site_id, which exists only after first boot: by default the
device makes its own broker password and publishes only its hash (mosquitto's password_file line
for user name = site_id), so the broker account is issued after enrolment without touching the
image again.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from importlib import resources
from pathlib import Path

from .cliargs import seconds_arg

BUNDLE_FORMAT = 1
DEVICE_BUNDLE = "/opt/ssp-agent/bundle"      # where the bundle lives on the device's root filesystem
DEVICE_BIN = "/opt/ssp-agent/bin/ssp-agent"  # the venv firstboot.sh makes (what the shipped units name)
DEVICE_HOME = "var/lib/ssp-agent/home"        # the units' SSP_AGENT_HOME (StateDirectory=ssp-agent)
DEVICE_WITNESS = "var/lib/ssp-agent/clock-witness"
ENROL_UNIT = "ssp-agent-enrol.service"
ENROLMENT_FILE = "ssp-enrolment.json"          # on the boot partition: what the technician collects
SERVICE_UNITS = ("ssp-agent.service", "ssp-agent-sync.service", "ssp-agent-sync.timer")
SECRET_FILES = ("mqtt-password", "client.key")
FIRSTRUN_ARGS = ("systemd.run=/boot/firmware/firstrun.sh systemd.run_success_action=reboot "
                 "systemd.unit=kernel-command-line.target")

ENROL_UNIT_TEXT = f"""# ssp-agent first-boot enrolment (docs/operations.md "Fleet workflow"): creates the node's
# identity inside its keystore once the network and the clock are up, then writes the site_id and
# public key to the boot partition. Enabled by firstboot.sh install; disables itself when done.
[Unit]
Description=ssp-agent enrolment (first boot)
Wants=network-online.target
After=time-set.target network-online.target
ConditionPathExists=!/{DEVICE_HOME}/store.sqlite

[Service]
Type=oneshot
ExecStart={DEVICE_BUNDLE}/firstboot.sh enrol
# init waits for a trustworthy clock (NTP; docs/apply.md "Clocks without an RTC"): retried until it comes
Restart=on-failure
RestartSec=60
TimeoutStartSec=30min
StandardOutput=journal
StandardError=journal

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
    a.add_argument("--service", choices=["run", "timer"], default="run",
                   help="always-on `run` (ssp-agent.service) or wake-sync-sleep (ssp-agent-sync.timer)")
    a.add_argument("--clock-trusted", action="store_true", help="the device has a real-time clock: init does "
                   "not wait for NTP (docs/apply.md \"Clocks without an RTC\")")
    a.add_argument("--wait-clock", type=seconds_arg, default=600, help="seconds init waits for NTP per attempt")
    a.set_defaults(fn=cmd_bundle, home_optional=True)

    a = ps.add_parser("flash", help="write a bundle onto a Raspberry Pi OS image file (boot + root partitions)")
    a.add_argument("--image", required=True, help="the .img file (MBR: FAT boot partition, ext4 root)")
    a.add_argument("--bundle", required=True)
    a.add_argument("--hook", choices=["auto", "firstrun", "cloud-init"], default="auto",
                   help="first-boot hook: firstrun.sh on cmdline.txt (Bookworm) or cloud-init user-data "
                        "(Trixie-based); auto: cloud-init when the boot partition has user-data or meta-data")
    a.set_defaults(fn=cmd_flash, home_optional=True)

    a = ps.add_parser("device-setup", help="(on the device, run by firstboot.sh) /etc/ssp-agent and the enrolment unit")
    a.add_argument("--bundle", required=True)
    a.add_argument("--root", default="/")
    a.add_argument("--boot", default="/boot/firmware")
    a.set_defaults(fn=cmd_device_setup, home_optional=True)

    a = ps.add_parser("enrol", help="(on the device, run by the enrolment unit) init, units, the enrolment file")
    a.add_argument("--bundle", required=True)
    a.add_argument("--root", default="/")
    a.add_argument("--boot", default="/boot/firmware")
    a.set_defaults(fn=cmd_enrol, home_optional=True)


# ---------------------------------------------------------------- bundle (technician's machine)
def cmd_bundle(args) -> int:
    from .cli import EXIT_OK, Refused, emit, version
    from .core.schema import ManifestError, parse_manifest
    from .profile import ProfileError, load_profile
    out = Path(args.out)
    if out.exists():
        raise Refused(f"{out} exists; a bundle is written into a new directory")
    try:
        manifest_text = Path(args.manifest).read_text()
        parse_manifest(manifest_text)
    except OSError as e:
        raise Refused(f"cannot read manifest {args.manifest}: {e.strerror}") from None
    except ManifestError as e:
        raise Refused(f"manifest {args.manifest}: {e}") from None
    try:
        prof = load_profile(args.profile)
    except ProfileError as e:
        raise Refused(str(e)) from None
    keystore = None
    if args.keystore:
        try:
            keystore = json.loads(args.keystore)
        except json.JSONDecodeError as e:
            raise Refused(f"--keystore is not valid JSON: {e}") from None
        if not isinstance(keystore, dict) or "kind" not in keystore:
            raise Refused('--keystore must be a JSON object with a "kind"')
        if "pin" in keystore:
            raise Refused("--keystore must not carry a PIN: a bundle is copied around; give pin_file, a path on the device")
    if args.password_file and not args.username:
        raise Refused("--password-file is a shared account's password: give --username too (without both, each "
                      "device makes its own password for the user name = its site_id)")
    if bool(args.cert_file) != bool(args.key_file):
        raise Refused("--cert-file and --key-file go together")
    wh = Path(args.wheelhouse)
    wheels = sorted(wh.glob("*.whl")) if wh.is_dir() else []
    if not any(w.name.startswith("ssp_agent-") for w in wheels):
        raise Refused(f"{wh} holds no ssp_agent wheel: build the wheelhouse with tools/wheelhouse.sh "
                      "(--arch aarch64 for Raspberry Pi OS) and give its directory")
    files = {}
    for flag, name in (("ca_file", "ca.pem"), ("password_file", "mqtt-password"),
                       ("cert_file", "client.pem"), ("key_file", "client.key")):
        src = getattr(args, flag)
        if src:
            if not Path(src).is_file():
                raise Refused(f"--{flag.replace('_', '-')} {src}: no such file")
            files[name] = src

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "wheelhouse").mkdir(parents=True)
    for w in wheels:
        shutil.copy2(w, tmp / "wheelhouse" / w.name)
    (tmp / "manifest.toml").write_text(manifest_text)
    for name, src in files.items():
        shutil.copyfile(src, tmp / name)
        os.chmod(tmp / name, 0o600 if name in SECRET_FILES else 0o644)
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
                     "device_password": not args.username,
                     "ca_file": "ca.pem" if "ca.pem" in files else None,
                     "cert_file": "client.pem" if "client.pem" in files else None,
                     "key_file": "client.key" if "client.key" in files else None,
                     "password_file": "mqtt-password" if "mqtt-password" in files else None},
            "wheels": [w.name for w in wheels]}
    if Path(args.profile).suffix == ".toml":   # a profile file travels with the bundle
        shutil.copyfile(args.profile, tmp / "profile.toml")
        meta["profile"] = "profile.toml"
    (tmp / "bundle.json").write_text(json.dumps(meta, indent=2) + "\n")
    os.chmod(tmp, 0o700)
    os.replace(tmp, out)
    emit({"bundle": str(out), "wheels": len(wheels), "units": units, "service": args.service,
          "broker": args.broker, "device_password": not args.username})
    return EXIT_OK


# ---------------------------------------------------------------- flash (technician's machine)
def _run(cmd: list[str], what: str, input: bytes | None = None) -> subprocess.CompletedProcess:
    from .cli import Fault
    try:
        p = subprocess.run(cmd, capture_output=True, input=input, timeout=600)
    except FileNotFoundError:
        raise Fault(f"{what}: {cmd[0]} is not installed (Debian: apt-get install mtools e2fsprogs fdisk)") from None
    if p.returncode != 0:
        raise Fault(f"{what}: {' '.join(cmd[:3])}... failed: {p.stderr.decode(errors='replace').strip()[:300]}")
    return p


def image_partitions(image: Path) -> tuple[int, int]:
    """Byte offsets of the boot (FAT) and root (Linux) partitions of a Raspberry Pi OS image."""
    from .cli import Refused
    p = subprocess.run(["sfdisk", "--json", str(image)], capture_output=True, text=True)
    if p.returncode != 0:
        raise Refused(f"{image}: no partition table sfdisk can read ({p.stderr.strip()[:200]})")
    table = json.loads(p.stdout)["partitiontable"]
    sector = table.get("sectorsize", 512)
    parts = table.get("partitions", [])
    fat = [q for q in parts if q.get("type", "").lower() in ("b", "c", "e", "ef")
           or "ebd0a0a2" in q.get("type", "").lower()]
    lin = [q for q in parts if q.get("type", "").lower() in ("83",) or "0fc63daf" in q.get("type", "").lower()]
    if not fat or not lin:
        raise Refused(f"{image}: not a Raspberry Pi OS layout (a FAT boot partition and a Linux root partition)")
    return fat[0]["start"] * sector, lin[0]["start"] * sector


class Fat:
    """The boot partition, through mtools (no mount, no loop device)."""

    def __init__(self, image: Path, offset: int) -> None:
        self.spec = f"{image}@@{offset}"

    def read(self, name: str) -> bytes | None:
        p = subprocess.run(["mtype", "-i", self.spec, f"::{name}"], capture_output=True)
        return p.stdout if p.returncode == 0 else None

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


FIRSTRUN_SH = f"""#!/bin/bash
# ssp-agent first boot (Bookworm): run once by systemd.run= on cmdline.txt, then removed. It installs
# the agent offline and enables the enrolment unit; the enrolment runs in the next, normal boot.
set +e
BOOT=/boot/firmware; [ -d $BOOT ] || BOOT=/boot
if [ -f $BOOT/ssp-firstrun-previous.sh ]; then bash $BOOT/ssp-firstrun-previous.sh; fi
{DEVICE_BUNDLE}/firstboot.sh install
rm -f $BOOT/firstrun.sh $BOOT/ssp-firstrun-previous.sh
sed -i 's| systemd.run[^ ]*||g; s| systemd.unit=kernel-command-line.target||g' $BOOT/cmdline.txt
exit 0
"""

RUNCMD = f"  - [bash, {DEVICE_BUNDLE}/firstboot.sh, install, --start]"


def add_runcmd(user_data: str | None) -> str:
    """cloud-init user-data with our runcmd entry added (first in an existing runcmd list)."""
    if not user_data:
        return f"#cloud-config\nruncmd:\n{RUNCMD}\n"
    if RUNCMD in user_data:
        return user_data
    lines = user_data.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^runcmd:\s*$", line):
            lines.insert(i + 1, RUNCMD)
            return "\n".join(lines) + "\n"
    return user_data.rstrip("\n") + f"\nruncmd:\n{RUNCMD}\n"


def cmd_flash(args) -> int:
    from .cli import EXIT_OK, Refused, emit
    image, bundle = Path(args.image), Path(args.bundle)
    if not (bundle / "bundle.json").is_file():
        raise Refused(f"{bundle} is not a provisioning bundle (no bundle.json; make one with `provision bundle`)")
    if not image.is_file():
        raise Refused(f"{image}: no such image file")
    boot_off, root_off = image_partitions(image)
    fat, root = Fat(image, boot_off), Ext4(image, root_off)
    if fat.read("cmdline.txt") is None:
        raise Refused(f"{image}: the boot partition has no cmdline.txt (not a Raspberry Pi OS image?)")
    root.apply(_bundle_commands(bundle, DEVICE_BUNDLE))
    hook = args.hook
    if hook == "auto":
        hook = "cloud-init" if (fat.read("user-data") is not None or fat.read("meta-data") is not None) else "firstrun"
    if hook == "cloud-init":
        ud = fat.read("user-data")
        fat.write("user-data", add_runcmd(ud.decode() if ud is not None else None).encode())
    else:
        cmdline = fat.read("cmdline.txt").decode().strip()
        prev = fat.read("firstrun.sh")
        if prev is not None and b"ssp-agent first boot" not in prev:
            fat.rename("firstrun.sh", "ssp-firstrun-previous.sh")   # Imager's own settings still run first
        fat.write("firstrun.sh", FIRSTRUN_SH.encode())
        if "systemd.run=" not in cmdline:
            cmdline = f"{cmdline} {FIRSTRUN_ARGS}"
        fat.write("cmdline.txt", (cmdline + "\n").encode())
    emit({"image": str(image), "hook": hook, "boot_offset": boot_off, "root_offset": root_off,
          "bundle": DEVICE_BUNDLE, "collect": f"{ENROLMENT_FILE} on the boot partition after first boot"})
    return EXIT_OK


# ---------------------------------------------------------------- on the device
def _under(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


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


def _load_bundle(path: Path) -> dict:
    from .cli import Refused
    try:
        meta = json.loads((path / "bundle.json").read_text())
    except (OSError, ValueError) as e:
        raise Refused(f"{path}: not a provisioning bundle ({e})") from None
    if meta.get("format") != BUNDLE_FORMAT:
        raise Refused(f"{path}: bundle format {meta.get('format')} is not {BUNDLE_FORMAT}; make it with this version")
    return meta


def cmd_device_setup(args) -> int:
    """/etc/ssp-agent (the manifest, CA, credentials) and the enrolment unit, enabled."""
    from .cli import EXIT_OK, emit
    bundle, root = Path(args.bundle), Path(args.root)
    meta = _load_bundle(bundle)
    conf = root / "etc/ssp-agent"
    conf.mkdir(parents=True, exist_ok=True)
    written = []
    for name in ("manifest.toml", "profile.toml", "ca.pem", "client.pem", "client.key", "mqtt-password"):
        if (bundle / name).is_file():
            _write(conf / name, (bundle / name).read_bytes(), 0o600 if name in SECRET_FILES else 0o644)
            written.append(str(conf / name))
    _write(root / "etc/systemd/system" / ENROL_UNIT, (bundle / "systemd" / ENROL_UNIT).read_text(), 0o644)
    _enable(root, ENROL_UNIT, "multi-user.target")
    emit({"written": written, "enabled": ENROL_UNIT, "service": meta["service"]})
    return EXIT_OK


def mosquitto_password_line(username: str, password: str) -> str:
    """mosquitto_passwd's password_file line for this account ($7$: PBKDF2-HMAC-SHA512)."""
    from .transport.broker import password_hash
    return f"{username}:{password_hash(password)}"


def cmd_enrol(args) -> int:
    """init (the key is made inside the keystore and never leaves it), the broker password (made
    here; only its hash is published), the service units, and the enrolment file on the boot partition."""
    from .cli import EXIT_OK, emit, version
    from .node import Node
    bundle, root, boot = Path(args.bundle), Path(args.root), Path(args.boot)
    meta = _load_bundle(bundle)
    conf = root / "etc/ssp-agent"
    home = _under(root, DEVICE_HOME)
    os.environ.setdefault("SSP_AGENT_WITNESS_DIR", str(_under(root, DEVICE_WITNESS)))
    # A device without an RTC must not take its identity's first reading of time from a clock
    # nobody vouches for: enrolment waits (retried by its unit) for a synchronised clock.
    os.environ.setdefault("SSP_AGENT_CLOCK_STRICT", "1")
    if not (home / Node.STORE_FILE).exists():
        manifest = (conf / "manifest.toml").read_text() if (conf / "manifest.toml").exists() \
            else (bundle / "manifest.toml").read_text()
        profile = meta.get("profile")
        if profile == "profile.toml":
            profile = str(conf / "profile.toml") if (conf / "profile.toml").exists() else str(bundle / "profile.toml")
        node, _pk = Node.init(home, manifest, meta.get("keystore"), profile,
                              clock_trusted=bool(meta.get("clock_trusted")),
                              wait_clock_s=float(meta.get("wait_clock_s") or 0))
        node.close()
    with Node.open(home, read_only=True) as node:
        st = node.status()
    site = st["site_id"]
    mq = meta.get("mqtt") or {}
    username = mq.get("username") or site
    pw_line = None
    pw_path = conf / "mqtt-password"
    if mq.get("device_password"):
        if not pw_path.exists() or not pw_path.read_text().strip():
            _write(pw_path, secrets.token_urlsafe(24) + "\n", 0o600)
        pw_line = mosquitto_password_line(username, pw_path.read_text().strip())
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
        from . import cli_service  # noqa: F401
        argv = ["service", "install", "--root", str(root), "--bin", DEVICE_BIN]
        if not (conf / "agent.toml").exists():   # written once; an enrolment run again keeps an edited one
            argv += ["--username", username]
            if mq.get("broker"):
                argv += ["--broker", mq["broker"]]
            for k, flag in (("ca_file", "--ca-file"), ("cert_file", "--cert-file"), ("key_file", "--key-file")):
                if mq.get(k):
                    argv += [flag, f"/etc/ssp-agent/{mq[k]}"]
        from . import cli
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
                _write(root / "etc/systemd/system" / name, src.read_text(), 0o644)
    if meta.get("service") == "timer":
        _enable(root, "ssp-agent-sync.timer", "timers.target")
        return ["ssp-agent-sync.timer"]
    _enable(root, "ssp-agent.service", "multi-user.target")
    return ["ssp-agent.service"]
