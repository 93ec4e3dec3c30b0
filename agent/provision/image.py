"""Writing a bundle onto a Raspberry Pi OS image file (docs/operations.md "Fleet workflow", 2. Flash):
debugfs into the root filesystem, mtools onto the boot partition (no loop device, no mount), and
the first-boot hook, firstrun.sh on cmdline.txt (Bookworm) or a runcmd entry in cloud-init's
user-data (Trixie-based). Everything is checked, and the new boot files made, before the image is
written: a refusal leaves it as it was."""
from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from pathlib import Path

from .. import infile
from .bundle import DEVICE_BUNDLE, ENROLMENT_FILE, SECRET_FILES, check_bundle
from .files import ProvisionFault, ProvisionRefused

CMDLINE_LIMIT = 64 * 1024                 # the boot partition's cmdline.txt (the kernel takes a few KB)
BOOT_TEXT_LIMIT = 1024 * 1024             # its user-data, meta-data, firstrun.sh
FIRSTRUN_ARGS = ("systemd.run=/boot/firmware/firstrun.sh systemd.run_success_action=reboot "
                 "systemd.unit=kernel-command-line.target")


def _run(cmd: list[str], what: str, input: bytes | None = None) -> subprocess.CompletedProcess:
    try:
        p = subprocess.run(cmd, capture_output=True, input=input, timeout=600)
    except FileNotFoundError:
        raise ProvisionFault(f"{what}: {cmd[0]} is not installed (Debian: apt-get install mtools e2fsprogs fdisk)") from None
    if p.returncode != 0:
        raise ProvisionFault(f"{what}: {' '.join(cmd[:3])}... failed: {p.stderr.decode(errors='replace').strip()[:300]}")
    return p


def image_partitions(image: Path) -> tuple[int, int]:
    """Byte offsets of the boot (FAT) and root (Linux) partitions of a Raspberry Pi OS image."""
    p = subprocess.run(["sfdisk", "--json", str(image)], capture_output=True, text=True)
    if p.returncode != 0:
        raise ProvisionRefused(f"{image}: no partition table sfdisk can read ({p.stderr.strip()[:200]})")
    try:
        table = json.loads(p.stdout)["partitiontable"]
        sector = int(table.get("sectorsize", 512))
        parts = [q for q in table.get("partitions", []) if isinstance(q.get("type"), str) and isinstance(q.get("start"), int)]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ProvisionRefused(f"{image}: no partition table sfdisk can read") from None
    fat = [q for q in parts if q["type"].lower() in ("b", "c", "e", "ef") or "ebd0a0a2" in q["type"].lower()]
    lin = [q for q in parts if q["type"].lower() in ("83",) or "0fc63daf" in q["type"].lower()]
    if not fat or not lin:
        raise ProvisionRefused(f"{image}: not a Raspberry Pi OS layout (a FAT boot partition and a Linux root partition)")
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
            raise ProvisionFault("mtype is not installed (Debian: apt-get install mtools e2fsprogs fdisk)") from None
        with p:
            data = p.stdout.read(limit + 1)
            if len(data) > limit:
                p.kill()
                p.wait()
                raise ProvisionRefused(f"the image's boot partition's {name} is too large: more than {limit} bytes")
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
        raise ProvisionRefused("the image has no /usr/bin/python3 naming its Python version (firstboot.sh makes the "
                               "agent's venv with it): not a Raspberry Pi OS image?")
    version = (int(m[1]), int(m[2]))
    elf = root.cat(f"/usr/bin/{name}") or b""
    if len(elf) < 20 or elf[:4] != b"\x7fELF":
        raise ProvisionRefused(f"the image's /usr/bin/{name} is not an ELF executable: not a Raspberry Pi OS image?")
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
        raise ProvisionRefused(f"{bundle}: {len(bad)} wheel(s) of its wheelhouse do not install on this image (Python {py}, "
                               f"{arch}{libc}): {', '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}. Build a wheelhouse "
                               f"for it (tools/wheelhouse.sh {how}) and make the bundle again"[:1200])


def bundle_commands(bundle: Path, dest: str) -> list[str]:
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
        raise ProvisionFault("editing the image's cloud-init user-data needs PyYAML: pip install 'ssp-agent[provision]' "
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
        raise ProvisionRefused("the image's user-data is not a #cloud-config file (its first line is "
                               f"{lines[0][:60]!r}); give --hook firstrun, or make it a cloud-config")
    yaml = _yaml()
    try:
        doc = yaml.safe_load(user_data)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where is not None else ""
        raise ProvisionRefused(f"the image's user-data is not valid YAML{at} ({getattr(e, 'problem', None) or e}); "
                               "cloud-init would ignore it too: fix it (or write it again with Raspberry Pi Imager)") from None
    doc = {} if doc is None else doc
    if not isinstance(doc, dict):
        raise ProvisionRefused(f"the image's user-data must be a cloud-config mapping, not a {type(doc).__name__}")
    runcmd = doc.get("runcmd")
    if runcmd is None:   # `runcmd:` with nothing (or only a comment) after it
        runcmd = []
    if not isinstance(runcmd, list):
        raise ProvisionRefused(f"the image's user-data: runcmd must be a list of commands, got {runcmd!r}"[:300])
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
        raise ProvisionFault("the image's user-data could not be written back unchanged (please report this file)")
    return out


def flash(image: Path, bundle: Path, hook: str) -> dict:
    """The bundle and the image's boot files are checked, and the new boot files made, before the
    image is written: a refusal leaves the image as it was."""
    check_bundle(bundle, flash=True)
    if not image.is_file():
        if image.exists():   # a card's device file, a directory: partitions are edited in an image file
            raise ProvisionRefused(f"{image} is not an image file (a device or a directory): prepare the image file, "
                                   "then write it to the card")
        raise ProvisionRefused(f"{image}: no such image file")
    boot_off, root_off = image_partitions(image)
    fat, root = Fat(image, boot_off), Ext4(image, root_off)
    cmdline = fat.read_text("cmdline.txt", CMDLINE_LIMIT)
    if cmdline is None:
        raise ProvisionRefused(f"{image}: the boot partition has no cmdline.txt (not a Raspberry Pi OS image?)")
    user_data = fat.read_text("user-data") if hook != "firstrun" else None   # --hook firstrun leaves it alone
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
    root.apply(bundle_commands(bundle, DEVICE_BUNDLE))
    for w in writes:
        if w[0] == "rename":
            fat.rename(w[1], w[2])
        else:
            fat.write(w[0], w[1])
    return {"image": str(image), "hook": hook, "boot_offset": boot_off, "root_offset": root_off,
            "bundle": DEVICE_BUNDLE, "collect": f"{ENROLMENT_FILE} on the boot partition after first boot"}

