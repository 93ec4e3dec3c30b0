"""The part of a Raspberry Pi OS root filesystem `provision flash` reads to know what the first boot
installs with: /usr/bin/python3 -> python3.X (an ELF header naming the architecture) and dpkg's
record of libc6. Written into an image's ext4 partition with debugfs (no mount)."""
from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

E_MACHINE = {"x86_64": 0x3E, "aarch64": 0xB7, "armv7l": 0x28}


def host_arch() -> str:
    import platform
    return platform.machine()


def install_os(image: Path, root_offset: int, python: str | None = None, arch: str | None = None,
               glibc: str | None = None) -> None:
    """An OS root as the image's: Python `python` (default this interpreter's X.Y) for `arch`
    (default this machine's), libc6 `glibc` (default this machine's: the wheels built here fit)."""
    import platform
    python = python or f"{sys.version_info[0]}.{sys.version_info[1]}"
    glibc = glibc or platform.libc_ver()[1] or "2.36"
    header = bytearray(Path(sys.executable).resolve().read_bytes()[:64])   # a real ELF header, machine patched
    header[18:20] = E_MACHINE[arch or host_arch()].to_bytes(2, "little")
    with tempfile.TemporaryDirectory() as d:
        elf, status, cmds = Path(d) / "elf", Path(d) / "status", Path(d) / "cmds"
        elf.write_bytes(bytes(header))
        status.write_text(f"Package: libc-bin\nStatus: install ok installed\nVersion: {glibc}-9\n\n"
                          f"Package: libc6\nStatus: install ok installed\nPriority: optional\nVersion: {glibc}-9+rpt2\n\n")
        cmds.write_text("\n".join(["mkdir /usr", "mkdir /usr/bin", "mkdir /usr/lib", f"mkdir /usr/lib/python{python}",
                                   f"write {elf} /usr/bin/python{python}", f"symlink /usr/bin/python3 python{python}",
                                   "mkdir /var", "mkdir /var/lib", "mkdir /var/lib/dpkg",
                                   f"write {status} /var/lib/dpkg/status"]) + "\n")
        subprocess.run(["debugfs", "-w", "-f", str(cmds), f"{image}?offset={root_offset}"], check=True,
                       capture_output=True)
