"""The `ssp-agent` command: its parser, the dispatch of a verb, and `main` (the entry point). Exit 0:
done; 1: a runtime fault (broker unreachable, keystore unavailable); 2: the request was refused (bad
input, a node that already exists, a purge request...), with a one-line reason on stderr. The verbs
live in this package's modules, one per group; agent/cli/common.py holds what they share."""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sqlite3
import sys
from pathlib import Path

from ..core.schema import ManifestError
from . import local
from .common import EXIT_FAULT, EXIT_OK, EXIT_REFUSED, Fault, Refused, emit, serving, version  # noqa: F401 - the CLI's API


class _Version(argparse.Action):
    """`--version`, looked up only when asked for (importlib.metadata is slow to import)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        sys.stdout.write(f"ssp-agent {version()}\n")
        parser.exit()


# ---------------------------------------------------------------- parser
# Verbs that other modules register, by module (a verb's start-up imports what it
# uses and not every other verb's module; `--help` and anything not recognised build the whole
# parser). tests/core/test_cli_startup.py checks this table against what the modules register.
VERB_MODULES = {
    "mailbox": "agent.cli.sync", "policy": "agent.cli.sync", "record": "agent.cli.sync",
    "authority": "agent.cli.sync", "rehydrate": "agent.cli.sync",
    "sync": "agent.cli.mqtt", "run": "agent.cli.mqtt",
    "keystore": "agent.cli.keystore",
    "sequencer": "agent.cli.sequencer", "commits": "agent.cli.sequencer", "sequencing": "agent.cli.sequencer",
    "service": "agent.cli.service",
    "provision": "agent.cli.provision",
    "check": "agent.cli.health", "metrics": "agent.cli.health",
    "watch": "agent.cli.watch",
}
CORE_VERBS = frozenset({"init", "peer", "write", "purge", "dump", "log", "evict", "events", "status", "table",
                        "identity"})


def verb_of(argv: list[str]) -> str | None:
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

    ms = local.register(sub)
    _add_later_verbs(sub, ms, modules)
    local.register_views(sub)
    return p


def _add_later_verbs(sub, mailbox_sub, modules: "set[str] | None" = None) -> None:
    """Verbs whose implementations live in other modules register themselves here."""
    for mod in ("agent.cli.sync", "agent.cli.mqtt", "agent.cli.keystore", "agent.cli.sequencer", "agent.cli.service",
                "agent.cli.provision", "agent.cli.health", "agent.cli.watch"):
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

    from ..control import served
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
    verb = verb_of(sys.argv[1:] if argv is None else list(argv))
    if verb == "run":
        # SIGTERM at any point from here on stops `run` cleanly (exit 0, its summary), even while
        # it opens its home or connects: the handler first, before the parser's imports
        from .. import stopsignal
        stopsignal.catch()
    parser = build_parser(set() if verb in CORE_VERBS else {VERB_MODULES[verb]} if verb in VERB_MODULES else None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR, stream=sys.stderr,
                        format="%(levelname)s %(name)s: %(message)s")
    if not args.home and not getattr(args, "home_optional", False):
        from ..config import ConfigError, load   # /etc/ssp-agent/agent.toml `home` (agent/config.py)
        try:
            args.home = load()["home"]
        except ConfigError as e:
            print(f"ssp-agent: {e}", file=sys.stderr)
            return EXIT_REFUSED
    if not args.home and not getattr(args, "home_optional", False):
        print("ssp-agent: --home DIR is required (or set SSP_AGENT_HOME)", file=sys.stderr)
        return EXIT_REFUSED
    from .. import control
    from ..hometurn import HeldByService
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
    from ..node import Node
    from ..sequencer.service import DB_NAME
    return Path(args.home or ".") / (DB_NAME if getattr(args, "sequencer_verb", None) else Node.STORE_FILE)


def dispatch(args) -> int:
    """Run the parsed verb; map refusals to exit 2 and local faults to exit 1."""
    from ..node import NodeError
    from ..store.db import StoreError
    from firmware_bridge import KeystoreError
    from ..infile import InputRefused
    try:
        return args.fn(args)
    except (Refused, NodeError, ManifestError, InputRefused) as e:
        print(f"ssp-agent: {e}", file=sys.stderr)
        return EXIT_REFUSED
    except KeystoreError as e:
        # A journal write that failed for want of space is a full disk, and says so (what to do).
        from ..store.db import storage_fault
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
        from ..store.db import storage_fault
        fault = storage_fault(e, _store_of(args))
        if fault is None:
            raise
        print(f"ssp-agent: {fault}", file=sys.stderr)
        return EXIT_FAULT
