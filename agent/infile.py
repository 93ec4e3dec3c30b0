"""Files an operator or another device hands the CLI (manifests, profiles, agent.toml, Commits,
evidence, hand-off packages, bundles): the one way they are read.

Each is read only when it is a regular file no larger than what its reader can use, and text only
when it is UTF-8: anything else is refused (`InputRefused`, a ValueError: the CLI's exit 2 with
one line) before more than ``limit`` + 1 bytes are read. A FIFO is opened without blocking and
refused, so a verb never waits for a writer that does not come; /dev/zero and a 200 MB file are
refused on what fstat says, not after reading them. OSError (missing, unreadable) is the
caller's, as before.
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Union

PathLike = Union[str, Path]

# What a text input (a manifest, a profile, agent.toml, a bundle's JSON) may hold: far above any
# real one (a 20 000-peer manifest is about 3 MB), far below what a Pi Zero 2 W can spare.
TEXT_LIMIT = 16 * 1024 * 1024
# A password file (a broker's, --password-file): one line.
PASSWORD_LIMIT = 64 * 1024


class InputRefused(ValueError):
    """A file refused for what it is: exit 2. ``reason``: ``not_a_file``, ``too_large`` or
    ``not_utf8`` (a reader with reason codes of its own, the mailbox, maps ``too_large`` to its own)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def read_bytes(path: PathLike, limit: int, what: str = "file", cut: bool = False) -> bytes:
    """The bytes of the regular file ``path``, refused past ``limit`` bytes; ``cut``: past it,
    its first ``limit`` + 1 bytes (for a parser that refuses an oversized input in its own words)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "not a regular file")
            raise InputRefused("not_a_file", f"{what} {path} is {kind}, not a regular file")
        if st.st_size > limit and not cut:
            raise InputRefused("too_large", f"{what} {path} is too large: {st.st_size} bytes > {limit}")
        chunks, got = [], 0
        while got <= limit:          # a file growing while it is read is cut at limit + 1 and refused
            b = os.read(fd, min(1 << 20, limit + 1 - got))
            if not b:
                break
            chunks.append(b)
            got += len(b)
        if got > limit and not cut:
            raise InputRefused("too_large", f"{what} {path} is too large: more than {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: PathLike, limit: int = TEXT_LIMIT, what: str = "file") -> str:
    """The UTF-8 text of the regular file ``path`` (as ``read_bytes``), refused if not UTF-8."""
    return decode_text(read_bytes(path, limit, what), f"{what} {path}")


def decode_text(data: bytes, what: str) -> str:
    """``data`` as strict UTF-8 text, refused (``not_utf8``) naming ``what`` and the first bad byte."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputRefused("not_utf8", f"{what} is not UTF-8 text (byte {e.start}: {data[e.start:e.start + 1].hex()})") from None


def parse_json(text: str, what: str):
    """``text`` as JSON, refused (``not_json``) naming ``what``: a syntax error, or nesting too deep."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputRefused("not_json", f"{what} is not valid JSON: {e}") from None
    except RecursionError:
        raise InputRefused("not_json", f"{what} is nested too deeply") from None
