"""Whether a wheel installs on a given machine, from its file name alone (PEP 425 tags, PEP 600
manylinux): `provision flash` checks a bundle's wheelhouse against the image it writes, so a set
built for another architecture or Python is refused on the technician's machine instead of
failing at the device's first boot (docs/operations.md "Fleet workflow")."""
from __future__ import annotations

import re

# the manylinux names before PEP 600, as the glibc they require
LEGACY = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}
WHEEL = re.compile(r"(?P<name>[^-]+)-(?P<ver>[^-]+)(-\d[^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)-(?P<plat>[^-]+)\.whl")


def tags(filename: str) -> list[tuple[str, str, str]] | None:
    """(python, abi, platform) for every tag a wheel file name names (compressed sets expanded)."""
    m = WHEEL.fullmatch(filename)
    if m is None:
        return None
    return [(p, a, pl) for p in m["py"].split(".") for a in m["abi"].split(".") for pl in m["plat"].split(".")]


def _python_fits(py: str, abi: str, version: tuple[int, int]) -> bool:
    """CPython `version`: py3/pyXY up to it, cpXY-abi3 up to it, cpXY with its own ABI exactly."""
    m = re.fullmatch(r"(py|cp)(\d)(\d*)", py)
    if m is None or int(m[2]) != version[0]:
        return False
    if not m[3]:
        return m[1] == "py" and abi == "none"
    minor = int(m[3])
    if abi == "none":
        return minor <= version[1] if m[1] == "py" else minor == version[1]
    if abi == "abi3":
        return m[1] == "cp" and minor <= version[1]
    return m[1] == "cp" and minor == version[1] and abi == f"cp{version[0]}{version[1]}"


def _platform_fits(plat: str, arch: str, glibc: tuple[int, int] | None) -> bool:
    if plat == "any" or plat == f"linux_{arch}":
        return True
    m = re.fullmatch(r"manylinux_(\d+)_(\d+)_(.+)", plat)
    if m is not None:
        need = (int(m[1]), int(m[2]))
    else:
        m = re.fullmatch(r"(manylinux1|manylinux2010|manylinux2014)_(.+)", plat)
        if m is None:
            return False   # musllinux, macOS, Windows
        need = LEGACY[m[1]]
    return m.group(m.lastindex) == arch and (glibc is None or need <= glibc)


def fits(filename: str, version: tuple[int, int], arch: str, glibc: tuple[int, int] | None) -> bool:
    """True when pip on CPython `version` on `arch` (with `glibc`, None: not known) would take it."""
    return any(_python_fits(p, a, version) and _platform_fits(pl, arch, glibc) for p, a, pl in tags(filename) or [])
