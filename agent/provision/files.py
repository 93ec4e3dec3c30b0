"""What the provisioning steps share: their two errors (a refusal, which the CLI reports with exit
2; a fault, exit 1), the bounded reads of the files they are handed (agent/infile.py), and the
writes under a device's root directory."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .. import infile


class ProvisionRefused(Exception):
    """A bundle, image or input refused, with a one-line reason (the CLI's exit 2)."""


class ProvisionFault(Exception):
    """A tool or step that failed, with a one-line reason (the CLI's exit 1)."""


def read_input(path, limit: int, what: str, *, text: bool = False):
    """A file a step is handed, through agent/infile.py (a regular file, at most ``limit`` bytes,
    text strictly UTF-8). Anything else is a refusal, and so is a file missing or unreadable, or
    a NUL in its name."""
    try:
        return infile.read_text(path, limit, what) if text else infile.read_bytes(path, limit, what)
    except OSError as e:
        raise ProvisionRefused(f"cannot read {what} {path}: {e.strerror}") from None
    except infile.InputRefused as e:
        raise ProvisionRefused(str(e)) from None
    except ValueError as e:   # a NUL in the name
        raise ProvisionRefused(f"{what} {path}: {e}") from None


def read_text(path: Path, limit: int, what: str) -> str:
    return read_input(path, limit, what, text=True)


def json_doc(text: str, what: str) -> Any:
    try:
        return infile.parse_json(text, what)
    except infile.InputRefused as e:
        raise ProvisionRefused(str(e)) from None


def under(root: Path, path: str) -> Path:
    return root / path.lstrip("/")


def write_file(path: Path, data: str | bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def enable_unit(root: Path, unit: str, target: str) -> None:
    wants = root / "etc/systemd/system" / f"{target}.wants"
    wants.mkdir(parents=True, exist_ok=True)
    link = wants / unit
    if not link.is_symlink():
        link.symlink_to(f"/etc/systemd/system/{unit}")


def disable_unit(root: Path, unit: str, target: str) -> None:
    (root / "etc/systemd/system" / f"{target}.wants" / unit).unlink(missing_ok=True)
