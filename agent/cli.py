"""The `ssp-agent` command (shared/spec/cli-contract.md). Exit 0: done; 1: a runtime fault
(broker unreachable, keystore unavailable); 2: the request was refused (bad input, a node
that already exists, a purge request...), with a one-line reason on stderr."""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sqlite3
import sys
from pathlib import Path
from typing import Any

from .core.ids import IdFormatError, parse_hlc, parse_public_key, parse_site_id
from .core.messages import ProtocolError
from .core.schema import ManifestError
from .cliargs import count_arg, seconds_arg
from .outcomes import to_json  # noqa: F401 - re-exported for tools

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
# node: `_open` lends it (closing it is the agent's business) and `status` adds the run's state.
_served: dict[str, Any] = {}


@contextlib.contextmanager
def serving(node, status_extra=None):
    _served.update(node=node, status_extra=status_extra)
    try:
        yield
    finally:
        _served.clear()


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


def _open(args, read_only: bool = False, check_machine: bool = True):
    """The verb's node: the running agent's when it serves the verb, a read view, or the home
    opened for writing once no other process holds it (agent/hometurn.py: a one-shot holder is
    waited for, a running service raises HeldByService, which `main` forwards to or refuses)."""
    if _served:
        return _Lent(_served["node"])
    from .node import Node
    home = Path(args.home)
    if read_only:
        return Node.open(home, read_only=True)
    from . import hometurn
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


# A password file (a broker's, --password-file): one line
PASSWORD_LIMIT = 64 * 1024


def read_input(path, limit: int, what: str, *, text: bool = False, cut: bool = False):
    """A file a verb is handed, through agent/infile.py (a regular file, at most ``limit`` bytes,
    text strictly UTF-8; ``cut``: past the limit its first limit + 1 bytes, for a parser that
    refuses it in its own words). Anything else is a refusal (exit 2, one line), and so is a file
    missing or unreadable, or a NUL in its name."""
    from . import infile
    try:
        return infile.read_text(path, limit, what) if text else infile.read_bytes(path, limit, what, cut=cut)
    except OSError as e:
        raise Refused(f"cannot read {what} {path}: {e.strerror}") from None
    except infile.InputRefused as e:
        raise Refused(str(e)) from None
    except ValueError as e:   # a NUL in the name
        raise Refused(f"{what} {path}: {e}") from None


def _json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise Refused(f"{what} is not valid JSON: {e}") from None
    except RecursionError:
        raise Refused(f"{what} is nested too deeply") from None


def _table_arg(text: str) -> str:
    if text.count(".") != 1 or not all(text.split(".")):
        raise Refused(f"table must be SCHEMA.TABLE, got {text!r}")
    return text


# ---------------------------------------------------------------- verbs
def cmd_init(args) -> int:
    from .node import Node
    from .infile import TEXT_LIMIT
    text = read_input(args.manifest, TEXT_LIMIT, "manifest", text=True)
    keystore = None
    if args.keystore:
        keystore = _json_arg(args.keystore, "--keystore")
        if not isinstance(keystore, dict):
            raise Refused("--keystore must be a JSON object, e.g. {\"kind\": \"software\", \"dir\": \"/path\"}")
    node, pk = Node.init(Path(args.home), text, keystore, args.profile,
                         clock_trusted=args.clock_trusted, wait_clock_s=args.wait_clock)
    emit({"site_id": node.site_id.hex(), "public_key": pk.hex()})
    _warn_unverified_clock(node, "init")
    node.close()
    return EXIT_OK


def _warn_unverified_clock(node, what: str) -> None:
    """One stderr line when a verb went ahead on a clock nobody vouches for (docs/apply.md)."""
    from . import clockstate
    st = clockstate.assess(node)
    if not st["trusted"]:
        print(f"warning: {what}: the wall clock is not known to be synchronised ({st['state']}); "
              "use --wait-clock SECONDS (or SSP_AGENT_CLOCK_STRICT=1) to wait for time sync", file=sys.stderr)


def cmd_peer_add(args) -> int:
    try:
        site = parse_site_id(args.site_id)
        pk = parse_public_key(args.public_key)
        ra = parse_hlc(args.retired_after) if args.retired_after else None
    except IdFormatError as e:
        raise Refused(str(e)) from None
    with _open(args) as node:
        node.add_peer(site, pk, ra, replace=args.replace)
    emit({"site_id": site.hex(), "public_key": pk.hex(), "retired_after": args.retired_after})
    return EXIT_OK


def cmd_peer_list(args) -> int:
    with _open(args, read_only=True) as node:
        emit(node.keyring_entries())
    return EXIT_OK


def cmd_peer_remove(args) -> int:
    try:
        site = parse_site_id(args.site_id)
    except IdFormatError as e:
        raise Refused(str(e)) from None
    with _open(args) as node:
        node.remove_peer(site)
    emit({"removed": site.hex()})
    return EXIT_OK


def cmd_write(args) -> int:
    table = _table_arg(args.table)
    key = _json_arg(args.key, "--key")
    if not isinstance(key, dict):
        raise Refused("--key must be a JSON object of key columns")
    key = {k: from_json(v) for k, v in key.items()}
    values = None
    if not args.delete:
        values = _json_arg(args.set, "--set")
        if not isinstance(values, dict):
            raise Refused("--set must be a JSON object of column values")
        values = {k: from_json(v) for k, v in values.items()}
    with _open(args) as node:
        eid = node.write(table, key, values, delete=args.delete)
    print(eid.hex())
    return EXIT_OK


def cmd_purge(args) -> int:
    # Scope excerpt §4.2: purge is reserved and not available; never a silent soft delete.
    raise Refused("purge is not available in SSP/1 (reserved, no message format exists); nothing was changed. "
                  "A soft delete (`write --delete`) hides a row but keeps history; permanent erasure needs "
                  "destruction of the keys protecting the data at a layer above SSP/1")


def cmd_mailbox_import(args) -> int:
    from . import mailbox
    try:
        data = mailbox.read_file(Path(args.file))
    except OSError as e:
        raise Refused(f"cannot read {args.file}: {e.strerror}") from None
    except ProtocolError as e:
        raise Refused(f"malformed sync body ({e.reason}): {e.detail}; nothing was changed") from None
    node = _open(args)
    try:
        from .sync import import_mailbox_body
        result = import_mailbox_body(node, data)
    except ProtocolError as e:
        raise Refused(f"malformed sync body ({e.reason}): {e.detail or 'see SSP/1 §32'}; nothing was changed") from None
    finally:
        node.close()
    emit(result)
    return EXIT_OK


def cmd_dump(args) -> int:
    with _open(args, read_only=True) as node:
        emit(node.dump())
    return EXIT_OK


def cmd_log(args) -> int:
    with _open(args, read_only=True) as node:
        for entry in node.log_entries():
            sys.stdout.write(json.dumps(to_json(entry)) + "\n")
    return EXIT_OK


def cmd_evict(args) -> int:
    if not _served:
        # Opening a home writes (WAL index, journal compaction): on a disk full to the last block
        # eviction, the way to free space, could not even open it. Use the reserve (issue 16 item 2).
        from .store import db
        free = db.free_bytes(Path(args.home))
        if free is not None and free < db.LOW_SPACE_BYTES:
            freed = db.release_reserve(Path(args.home))
            if freed:
                print(f"ssp-agent: the disk is full: eviction uses the {freed} bytes the home reserves for it",
                      file=sys.stderr)
    if args.auto:
        if args.table or args.horizon:
            raise Refused("--auto takes no table or horizon: it uses the profile's horizons for every evictable table")
        with _open(args) as node:
            emit(node.run_eviction(clock_override=args.clock_trusted, wait_clock_s=args.wait_clock))
        return EXIT_OK
    if not args.table or not args.horizon:
        raise Refused("give SCHEMA.TABLE --horizon HLC, or --auto")
    table = _table_arg(args.table)
    try:
        h = parse_hlc(args.horizon)
    except IdFormatError as e:
        raise Refused(str(e)) from None
    with _open(args) as node:
        deleted = node.evict_table(table, h, clock_override=args.clock_trusted, wait_clock_s=args.wait_clock)
        _warn_unverified_clock(node, "evict")
    emit({"table": table, "horizon": args.horizon, "events_deleted": deleted})
    return EXIT_OK


def cmd_events(args) -> int:
    with _open(args, read_only=True) as node:
        for e in node.surfaced(args.limit):
            sys.stdout.write(json.dumps(e) + "\n")
        if args.ignored_columns:
            for e in node.ignored_columns():
                sys.stdout.write(json.dumps({"kind": "ignored_column", **e}) + "\n")
    return EXIT_OK


def cmd_status(args) -> int:
    with _open(args, read_only=True) as node:
        st = node.status()
        if _served.get("status_extra"):
            st["run"] = _served["status_extra"]()  # served by `run`: its pid, broker, peers, counters
        emit(st)
    return EXIT_OK


def cmd_add_column(args) -> int:
    table = _table_arg(args.table)
    with _open(args) as node:
        n = node.add_column(table, args.column, args.type)
    emit({"table": table, "column": args.column, "type": args.type, "rows_rebuilt": n})
    return EXIT_OK


def cmd_create_table(args) -> int:
    spec = _json_arg(args.spec, "--spec")
    if not isinstance(spec, dict):
        raise Refused("--spec must be a JSON object like a manifest [[tables]] entry")
    with _open(args) as node:
        outs = node.create_table(spec)
    from .outcomes import counts
    emit({"table": f"{spec.get('schema')}.{spec.get('name')}", "released_held": counts(outs)})
    return EXIT_OK


def cmd_rebind(args) -> int:
    if not args.confirm_original_destroyed:
        raise Refused("rebind moves this identity to this machine; pass --confirm-original-destroyed only if the "
                      "device that created it can never run again (otherwise initialise a new node)")
    node = _open(args, check_machine=False)
    try:
        node.rebind_machine()
    finally:
        node.close()
    emit({"site_id": node.site_id.hex(), "rebound": True})
    return EXIT_OK


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
        return tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]["version"]
    except (OSError, KeyError, ValueError):
        return "unknown"


class _Version(argparse.Action):
    """`--version`, looked up only when asked for (importlib.metadata is slow to import)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        sys.stdout.write(f"ssp-agent {version()}\n")
        parser.exit()


# ---------------------------------------------------------------- parser
# Verbs that other modules register, by module (issue 15 item 3: a verb's start-up imports what it
# uses and not every other verb's module; `--help` and anything not recognised build the whole
# parser). tests/core/test_cli_startup.py checks this table against what the modules register.
VERB_MODULES = {
    "mailbox": "agent.cli_sync", "policy": "agent.cli_sync", "record": "agent.cli_sync",
    "authority": "agent.cli_sync", "rehydrate": "agent.cli_sync",
    "sync": "agent.cli_mqtt", "run": "agent.cli_mqtt",
    "keystore": "agent.cli_keystore",
    "sequencer": "agent.cli_sequencer", "commits": "agent.cli_sequencer", "sequencing": "agent.cli_sequencer",
    "service": "agent.cli_service",
    "provision": "agent.cli_provision",
    "check": "agent.cli_health", "metrics": "agent.cli_health",
}
CORE_VERBS = frozenset({"init", "peer", "write", "purge", "dump", "log", "evict", "events", "status", "table",
                        "identity"})


def _verb_of(argv: list[str]) -> str | None:
    """The verb of a command line, if the global options before it are ones we know exactly;
    None when unsure (then the whole parser decides)."""
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--home":
            i += 2
        elif a.startswith("--home=") or a in ("-v", "--verbose"):
            i += 1
        elif a.startswith("-"):
            return None   # --help, --version, an abbreviation, a typo: the whole parser
        else:
            return a
    return None


def build_parser(modules: "set[str] | None" = None) -> argparse.ArgumentParser:
    """The command's parser; `modules`: register only the verbs of these modules (None: all)."""
    p = argparse.ArgumentParser(
        prog="ssp-agent",
        description="SSP/1 sync node for field devices: signed, per-column-merged SQLite replication.",
        epilog="Exit status: 0 done, 1 runtime fault (e.g. broker unreachable), 2 request refused "
               "(the reason is on stderr). Docs: README.md and docs/.")
    p.add_argument("--home", default=os.environ.get("SSP_AGENT_HOME"),
                   help="the node's state directory (default: $SSP_AGENT_HOME)")
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level to stderr")
    p.add_argument("--version", action=_Version, nargs=0, help="print the installed version and exit")
    sub = p.add_subparsers(dest="verb", metavar="VERB")
    sub.required = True

    s = sub.add_parser("init", help="create a node from a provisioning manifest (TOML)")
    s.add_argument("--manifest", required=True, help="provisioning manifest: mesh_id, peers, tables")
    s.add_argument("--profile", help="device profile: a built-in name (agent/profiles/: pi-zero-2w, pi-3-4, pi-5-cm4, "
                                     "gateway) or a path to a .toml file; default pi-3-4")
    s.add_argument("--keystore", help='keystore as JSON, e.g. {"kind":"software","dir":"/var/lib/ssp/keys"}; '
                                      "default: a software keystore in HOME/keystore")
    _clock_flags(s)
    s.set_defaults(fn=cmd_init)

    s = sub.add_parser("peer", help="manage the trusted-peer keyring")
    ps = s.add_subparsers(dest="peer_verb", metavar="ACTION")
    ps.required = True
    a = ps.add_parser("add", help="trust a peer's Ed25519 key")
    a.add_argument("--site-id", required=True, help="the peer's site_id (32 hex characters)")
    a.add_argument("--public-key", required=True, help="64 hex characters")
    a.add_argument("--retired-after", help="retirement cutoff HLC: this peer's later events are dropped")
    a.add_argument("--replace", action="store_true",
                   help="replace the key of a site_id already in the keyring (refused without it)")
    a.set_defaults(fn=cmd_peer_add)
    a = ps.add_parser("list", help="the keyring as JSON: site_id, public_key, retired_after, source")
    a.set_defaults(fn=cmd_peer_list)
    a = ps.add_parser("remove", help="drop a manifest or operator peer from the keyring")
    a.add_argument("--site-id", required=True, help="the peer's site_id (32 hex characters)")
    a.set_defaults(fn=cmd_peer_remove)

    s = sub.add_parser("write", help="produce one signed local event and apply it")
    s.add_argument("table", metavar="SCHEMA.TABLE", help="the table to write to, e.g. app.readings")
    s.add_argument("--key", required=True, help='row key as JSON, e.g. {"device":"d1","seq":1}')
    g = s.add_mutually_exclusive_group(required=True)
    g.add_argument("--set", help='column values as JSON, e.g. {"temp":20.5}; {"$bytes":"hex"} for blobs')
    g.add_argument("--delete", action="store_true", help="soft delete the row (a tombstone; resurrectable)")
    s.set_defaults(fn=cmd_write)

    s = sub.add_parser("purge", help="refused: purge is not available in SSP/1 (exit 2)")
    s.add_argument("rest", nargs="*", help="anything: purge is refused whatever it is given")
    s.set_defaults(fn=cmd_purge)

    s = sub.add_parser("mailbox", help="store-and-forward sync bodies as files")
    ms = s.add_subparsers(dest="mailbox_verb", metavar="ACTION")
    ms.required = True
    a = ms.add_parser("import", help="apply every event of one sync body file")
    a.add_argument("file", help="a sync body file made by `mailbox export`")
    a.set_defaults(fn=cmd_mailbox_import)
    _add_later_verbs(sub, ms, modules)

    s = sub.add_parser("dump", help="print the materialized tables as JSON")
    s.set_defaults(fn=cmd_dump)
    s = sub.add_parser("log", help="print the retained event log, one JSON object a line")
    s.set_defaults(fn=cmd_log)
    s = sub.add_parser("evict", help="raise a table's eviction horizon (never lowers it) and reclaim space")
    s.add_argument("table", metavar="SCHEMA.TABLE", nargs="?", help="the table whose horizon --horizon raises")
    s.add_argument("--horizon", help="HLC, e.g. 1764669600000.0")
    s.add_argument("--auto", action="store_true",
                   help="run the eviction job: every evictable table to now minus its profile duration")
    _clock_flags(s)
    s.set_defaults(fn=cmd_evict)
    s = sub.add_parser("events", help="list what the node surfaced: drops, rejects, holds, partial rebuilds")
    s.add_argument("--limit", type=count_arg, default=1000, help="list at most the newest N rows (default 1000)")
    s.add_argument("--ignored-columns", action="store_true", help="also list metered ignored payload columns")
    s.set_defaults(fn=cmd_events)
    s = sub.add_parser("status", help="identity, keystore, tables and horizons")
    s.set_defaults(fn=cmd_status)

    s = sub.add_parser("table", help="schema changes")
    ts = s.add_subparsers(dest="table_verb", metavar="ACTION")
    ts.required = True
    a = ts.add_parser("add-column", help="add a value column and rebuild it from the retained log")
    a.add_argument("table", metavar="SCHEMA.TABLE", help="the table to add the column to")
    a.add_argument("--column", required=True, help="the new value column's name")
    a.add_argument("--type", required=True, choices=["integer", "real", "text", "blob"], help="its type")
    a.set_defaults(fn=cmd_add_column)
    a = ts.add_parser("create", help="create a table (events held for it are then applied)")
    a.add_argument("--spec", required=True, help='JSON like a manifest [[tables]] entry')
    a.set_defaults(fn=cmd_create_table)

    s = sub.add_parser("identity", help="identity binding of this home to this machine")
    is_ = s.add_subparsers(dest="identity_verb", metavar="ACTION")
    is_.required = True
    a = is_.add_parser("rebind", help="bind this identity to this machine (original device destroyed)")
    a.add_argument("--confirm-original-destroyed", action="store_true",
                   help="required: the device this identity was bound to is destroyed (two devices signing "
                        "as one site corrupt the mesh)")
    a.set_defaults(fn=cmd_rebind)
    return p


def _clock_flags(s) -> None:
    # docs/apply.md "Clocks without an RTC": these verbs need a trustworthy wall clock.
    s.add_argument("--clock-trusted", action="store_true",
                   help="the wall clock is right even though no time sync says so (an RTC, set by hand): "
                        "proceed without waiting for NTP")
    s.add_argument("--wait-clock", type=seconds_arg, default=0, metavar="SECONDS",
                   help="wait up to SECONDS for the clock to be synchronised before refusing (exit 2, clock_untrusted)")


def _add_later_verbs(sub, mailbox_sub, modules: "set[str] | None" = None) -> None:
    """Verbs whose implementations live in other modules register themselves here."""
    for mod in ("agent.cli_sync", "agent.cli_mqtt", "agent.cli_keystore", "agent.cli_sequencer", "agent.cli_service",
                "agent.cli_provision", "agent.cli_health"):
        if modules is not None and mod not in modules:
            continue
        # Every one ships in the package: an import error is a broken install, said loudly, never
        # a verb that silently disappears.
        m = __import__(mod, fromlist=["register"])
        m.register(sub, mailbox_sub)


def verb_path(args) -> str:
    """The verb and its action, as agent/control.py's FORWARDED names them: "record list"."""
    action = getattr(args, f"{args.verb}_verb", None)
    return f"{args.verb} {action}" if action else args.verb


def not_served(path: str, home, pid) -> str:
    """Why a verb is refused while `run` (pid) holds the home, and what to do."""
    if path == "sync":
        return (f"`ssp-agent run` (pid {pid}) is syncing {home} already: `sync --once` is for a home no service "
                "holds (a device on the sync timer); leave the syncing to the service, or stop it first")
    if path == "run":
        return f"`ssp-agent run` (pid {pid}) serves {home} already; one service per home: stop that one first"
    return (f"{home} is held by the running service (`ssp-agent run`, pid {pid}), which does not run `{path}`: "
            "stop the service (e.g. `systemctl stop ssp-agent`), run this, then start it again")


def run_forwarded(argv: list[str], node, status_extra=None) -> tuple[int, str, str]:
    """Execute one forwarded command line on `node` (the running agent's), capturing what the verb
    prints. Only the FORWARDED verbs; anything else is refused. Here, beside the verbs, not in
    agent/control.py: the control socket server never imports the CLI (no import circle)."""
    import io

    from .control import served
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as e:  # argparse already explained on stderr
            return (e.code if isinstance(e.code, int) else 2), out.getvalue(), err.getvalue()
        if not served(verb_path(args)):
            return 2, "", f"ssp-agent: {not_served(verb_path(args), node.home, os.getpid())}\n"
        with serving(node, status_extra):
            rc = dispatch(args)
    return rc, out.getvalue(), err.getvalue()


def main(argv: list[str] | None = None) -> int:
    verb = _verb_of(sys.argv[1:] if argv is None else list(argv))
    if verb == "run":
        # SIGTERM at any point from here on stops `run` cleanly (exit 0, its summary), even while
        # it opens its home or connects: the handler first, before the parser's imports
        from . import stopsignal
        stopsignal.catch()
    parser = build_parser(set() if verb in CORE_VERBS else {VERB_MODULES[verb]} if verb in VERB_MODULES else None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.home and not getattr(args, "home_optional", False):
        from .config import ConfigError, load   # /etc/ssp-agent/agent.toml `home` (agent/config.py)
        try:
            args.home = load()["home"]
        except ConfigError as e:
            print(f"ssp-agent: {e}", file=sys.stderr)
            return EXIT_REFUSED
    if not args.home and not getattr(args, "home_optional", False):
        print("ssp-agent: --home DIR is required (or set SSP_AGENT_HOME)", file=sys.stderr)
        return EXIT_REFUSED
    from . import control
    from .hometurn import HeldByService
    path = verb_path(args)
    forwarded = None
    if control.served(path):
        # `run` holds this home: the verb runs inside it, on its node (one writer; docs/operations.md)
        # a verb naming files gives its own command line, with their contents or absolute paths
        # (the agent's working directory is not this one's): `forward_argv`
        fwd = getattr(args, "forward_argv", None)
        try:
            # reading those files can fail like the verb itself (exit 2 or 1, one line)
            # (None from it: this one is not forwarded whole; the verb talks to the agent itself)
            forwarded = fwd(args) if fwd is not None else sys.argv[1:] if argv is None else list(argv)
        except (Refused, Fault) as e:
            print(f"ssp-agent: {e}", file=sys.stderr)
            return EXIT_REFUSED if isinstance(e, Refused) else EXIT_FAULT
    while True:
        if forwarded is not None:
            res = control.forward(Path(args.home), forwarded)
            if res is not None:
                rc, out, err = res
                sys.stdout.write(out)
                sys.stderr.write(err)
                return rc
        try:
            return dispatch(args)
        except HeldByService as e:
            # a `run` took the home (or served it) while this verb waited for its turn
            if forwarded is None:
                print(f"ssp-agent: {not_served(path, e.home, e.pid)}", file=sys.stderr)
                return EXIT_REFUSED


def _store_of(args) -> Path:
    """The state file a verb works on, for storage_fault's advice: a `sequencer` verb's home holds
    sequencer.db (docs/sequencer.md), every other verb's a node's store.sqlite."""
    from .node import Node
    from .sequencer.service import DB_NAME
    return Path(args.home or ".") / (DB_NAME if getattr(args, "sequencer_verb", None) else Node.STORE_FILE)


def dispatch(args) -> int:
    """Run the parsed verb; map refusals to exit 2 and local faults to exit 1."""
    from .node import NodeError
    from .store.db import StoreError
    from firmware_bridge import KeystoreError
    from .infile import InputRefused
    try:
        return args.fn(args)
    except (Refused, NodeError, ManifestError, InputRefused) as e:
        print(f"ssp-agent: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except KeystoreError as e:
        # A journal write that failed for want of space is a full disk, and says so (what to do).
        from .store.db import storage_fault
        cause, fault = e.__cause__, None
        while cause is not None and fault is None:
            fault = storage_fault(cause, _store_of(args))
            cause = cause.__cause__
        print(f"ssp-agent: {fault}" if fault is not None else f"ssp-agent: keystore: {e}", file=sys.stderr)
        return EXIT_FAULT
    except (Fault, StoreError) as e:
        print(f"ssp-agent: {e}", file=sys.stderr)
        return EXIT_FAULT
    except (sqlite3.Error, OSError) as e:
        # A full disk, a damaged store, a failing medium: one line with what to do, exit 1. Anything
        # storage_fault does not recognise is a bug and keeps its traceback.
        from .store.db import storage_fault
        fault = storage_fault(e, _store_of(args))
        if fault is None:
            raise
        print(f"ssp-agent: {fault}", file=sys.stderr)
        return EXIT_FAULT


if __name__ == "__main__":
    # `python -m agent.cli`: run the package's copy of this module, whose Refused and Fault are the
    # classes the verb modules (cli_sync, cli_mqtt, ...) import, so their refusals exit 2, not 1.
    from agent.cli import main as _package_main
    sys.exit(_package_main())
