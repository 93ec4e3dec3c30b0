"""What every `ssp-agent` verb module shares: the exit codes and the two exceptions `dispatch` maps
to them (Refused: exit 2, Fault: exit 1; the CLI contract), JSON in and out, the files a verb is
handed, and the node a verb works on (the running agent's when it serves the verb)."""
from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from .. import infile
from ..outcomes import to_json

EXIT_OK, EXIT_FAULT, EXIT_REFUSED = 0, 1, 2


class Refused(Exception):
    """Exit 2 with this one-line reason."""


class Fault(Exception):
    """Exit 1 with this one-line reason."""


def from_json(v: Any) -> Any:
    """JSON values for --key/--set: {"$bytes": hex} is a byte string; no other coercion."""
    if isinstance(v, dict):
        if set(v) == {"$bytes"} and isinstance(v["$bytes"], str):
            try:
                return bytes.fromhex(v["$bytes"])
            except ValueError:
                raise Refused("{\"$bytes\": ...} must hold hex") from None
        raise Refused("nested objects are not column values (use {\"$bytes\": \"hex\"} for bytes)")
    if isinstance(v, list):
        raise Refused("arrays are not column values")
    if isinstance(v, bool):
        raise Refused("booleans are not column values (SSP/1 has no bool type; use 0/1)")
    return v


def emit(obj: Any) -> None:
    sys.stdout.write(json.dumps(to_json(obj), sort_keys=False) + "\n")


# While `run` serves a forwarded verb (agent/control.py), the verb runs on the running agent's own
# node: `open_node` lends it (closing it is the agent's business) and `status` adds the run's state.
served_state: dict[str, Any] = {}


@contextlib.contextmanager
def serving(node, status_extra=None):
    served_state.update(node=node, status_extra=status_extra)
    try:
        yield
    finally:
        served_state.clear()


class _Lent:
    """The running agent's node, lent to one forwarded verb: `with` and close() leave it open."""

    def __init__(self, node) -> None:
        object.__setattr__(self, "_node", node)

    def __enter__(self):
        return self._node

    def __exit__(self, *exc) -> None:
        pass

    def close(self) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self._node, name)

    def __setattr__(self, name, value) -> None:
        setattr(self._node, name, value)   # e.g. `authority add` sets node.authorities: the agent's


def open_node(args, read_only: bool = False, check_machine: bool = True):
    """The verb's node: the running agent's when it serves the verb, a read view, or the home
    opened for writing once no other process holds it (agent/hometurn.py: a one-shot holder is
    waited for, a running service raises HeldByService, which `main` forwards to or refuses)."""
    if served_state:
        return _Lent(served_state["node"])
    from ..node import Node
    home = Path(args.home)
    if read_only:
        return Node.open(home, read_only=True)
    from .. import hometurn
    try:
        wait_s = hometurn.budget()
    except ValueError as e:
        raise Refused(str(e)) from None
    try:
        return hometurn.open_in_turn(home, lambda: Node.open(home, check_machine=check_machine), wait_s=wait_s,
                                     should_stop=getattr(args, "should_stop", None),
                                     say=lambda m: print(f"ssp-agent: {m}", file=sys.stderr, flush=True))
    except hometurn.StillHeld as e:
        raise Fault(str(e)) from None


PASSWORD_LIMIT = infile.PASSWORD_LIMIT   # a password file (a broker's, --password-file)


def read_input(path, limit: int, what: str, *, text: bool = False, cut: bool = False):
    """A file a verb is handed, through agent/infile.py (a regular file, at most ``limit`` bytes,
    text strictly UTF-8; ``cut``: past the limit its first limit + 1 bytes, for a parser that
    refuses it in its own words). Anything else is a refusal (exit 2, one line), and so is a file
    missing or unreadable, or a NUL in its name."""
    try:
        return infile.read_text(path, limit, what) if text else infile.read_bytes(path, limit, what, cut=cut)
    except OSError as e:
        raise Refused(f"cannot read {what} {path}: {e.strerror}") from None
    except infile.InputRefused as e:
        raise Refused(str(e)) from None
    except ValueError as e:   # a NUL in the name
        raise Refused(f"{what} {path}: {e}") from None


def json_arg(text: str, what: str) -> Any:
    try:
        return infile.parse_json(text, what)
    except infile.InputRefused as e:
        raise Refused(str(e)) from None


def use_reserve(home, who: str) -> None:
    """Opening a home writes (WAL index, journal compaction): on a disk full to the last block
    eviction, the way to free space, could not even open it. `evict` and `run` (whose eviction
    job frees it) release the home's reserve first (docs/reliability.md "Full disk")."""
    from ..store import db
    free = db.free_bytes(Path(home))
    if free is not None and free < db.LOW_SPACE_BYTES:
        freed = db.release_reserve(Path(home))
        if freed:
            print(f"ssp-agent: the disk is full: {who} uses the {freed} bytes the home reserves for it",
                  file=sys.stderr)


def version() -> str:
    """The installed distribution's version; from a checkout that was never installed, the
    version pyproject.toml declares (so `--version` always answers)."""
    from importlib import metadata
    try:
        return metadata.version("ssp-agent")
    except metadata.PackageNotFoundError:
        pass
    try:
        import tomllib
        return tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())["project"]["version"]
    except (OSError, KeyError, ValueError):
        return "unknown"

