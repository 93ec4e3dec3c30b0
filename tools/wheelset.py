"""Helpers of tools/wheelhouse.sh (docs/platform.md "Dependencies"):

  platforms ARCH GLIBC   the pip --platform tags a glibc GLIBC system of ARCH installs (newest first);
                         pip expands no manylinux_2_X tag itself, so each is named
  pins                   name==version of every runtime dependency of ssp-agent[pkcs11] installed in
                         this interpreter (the set the test suite ran against; nothing if not installed)
  compare A B            the distributions and versions of the wheels in directories A and B; exit 1
                         naming each difference (a device would run versions the suite never ran)
"""
from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

try:
    from packaging.requirements import Requirement
except ImportError:  # an interpreter without packaging: pip's own copy
    from pip._vendor.packaging.requirements import Requirement


def platforms(arch: str, glibc: str) -> list[str]:
    major, minor = (int(x) for x in glibc.split("."))
    assert major == 2 and minor >= 17, glibc
    return [f"manylinux_2_{m}_{arch}" for m in range(minor, 16, -1)] + [f"manylinux2014_{arch}"]


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pins(root: str = "ssp-agent", extras: tuple[str, ...] = ("pkcs11",)) -> dict[str, str]:
    """The installed versions of `root`'s runtime requirements (with `extras`), transitively."""
    out: dict[str, str] = {}
    todo = [(root, extras)]
    seen = set()
    while todo:
        name, ex = todo.pop()
        if (name, ex) in seen:
            continue
        seen.add((name, ex))
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if norm(name) != norm(root):
            out[norm(name)] = dist.version
        for spec in dist.requires or []:
            req = Requirement(spec)
            envs = [{"extra": e} for e in ex] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(e) for e in envs):
                todo.append((req.name, tuple(sorted(req.extras))))
    return out


def versions(d: Path) -> dict[str, str]:
    """{distribution: version} of the wheels in `d` (the wheel file name's first two fields)."""
    return {norm(w.name.split("-")[0]): w.name.split("-")[1] for w in Path(d).glob("*.whl")}


def compare(a: Path, b: Path) -> list[str]:
    va, vb = versions(a), versions(b)
    return [f"{n}: {va.get(n, 'absent')} in {a}, {vb.get(n, 'absent')} in {b}"
            for n in sorted(set(va) | set(vb)) if va.get(n) != vb.get(n)]


def main(argv: list[str]) -> int:
    if argv[:1] == ["platforms"] and len(argv) == 3:
        print(" ".join(platforms(argv[1], argv[2])))
    elif argv == ["pins"]:
        for n, v in sorted(pins().items()):
            print(f"{n}=={v}")
    elif argv[:1] == ["compare"] and len(argv) == 3:
        diff = compare(Path(argv[1]), Path(argv[2]))
        for line in diff:
            print(f"wheelhouse: version mismatch: {line}", file=sys.stderr)
        return 1 if diff else 0
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
