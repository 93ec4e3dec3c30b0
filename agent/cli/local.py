"""The verbs that work on one home by itself: `init`, `peer`, `write`, `purge`, `mailbox import`,
`dump`, `log`, `evict`, `events`, `status`, `table`, `identity` (the CLI contract's core verbs).
Registered first into the parser of agent/cli/__init__.py, around the other modules' verbs."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from ..core.ids import IdFormatError, parse_hlc, parse_public_key, parse_site_id
from ..core.messages import ProtocolError
from ..outcomes import to_json
from .args import count_arg, seconds_arg
from .common import EXIT_OK, Refused, emit, from_json, json_arg, open_node, read_input, served_state, use_reserve


def _table_arg(text: str) -> str:
    if text.count(".") != 1 or not all(text.split(".")):
        raise Refused(f"table must be SCHEMA.TABLE, got {text!r}")
    return text


def cmd_init(args) -> int:
    from ..node import Node
    from ..infile import TEXT_LIMIT
    text = read_input(args.manifest, TEXT_LIMIT, "manifest", text=True)
    keystore = None
    if args.keystore:
        keystore = json_arg(args.keystore, "--keystore")
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
    from .. import clockstate
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
    with open_node(args) as node:
        node.add_peer(site, pk, ra, replace=args.replace)
    emit({"site_id": site.hex(), "public_key": pk.hex(), "retired_after": args.retired_after})
    return EXIT_OK


def cmd_peer_list(args) -> int:
    with open_node(args, read_only=True) as node:
        emit(node.keyring_entries())
    return EXIT_OK


def cmd_peer_remove(args) -> int:
    try:
        site = parse_site_id(args.site_id)
    except IdFormatError as e:
        raise Refused(str(e)) from None
    with open_node(args) as node:
        node.remove_peer(site)
    emit({"removed": site.hex()})
    return EXIT_OK


def cmd_write(args) -> int:
    table = _table_arg(args.table)
    key = json_arg(args.key, "--key")
    if not isinstance(key, dict):
        raise Refused("--key must be a JSON object of key columns")
    key = {k: from_json(v) for k, v in key.items()}
    values = None
    if not args.delete:
        values = json_arg(args.set, "--set")
        if not isinstance(values, dict):
            raise Refused("--set must be a JSON object of column values")
        values = {k: from_json(v) for k, v in values.items()}
    with open_node(args) as node:
        eid = node.write(table, key, values, delete=args.delete)
    print(eid.hex())
    return EXIT_OK


def cmd_purge(args) -> int:
    # Scope excerpt §4.2: purge is reserved and not available; never a silent soft delete.
    raise Refused("purge is not available in SSP/1 (reserved, no message format exists); nothing was changed. "
                  "A soft delete (`write --delete`) hides a row but keeps history; permanent erasure needs "
                  "destruction of the keys protecting the data at a layer above SSP/1")


def cmd_mailbox_import(args) -> int:
    from .. import mailbox
    try:
        data = mailbox.read_file(Path(args.file))
    except OSError as e:
        raise Refused(f"cannot read {args.file}: {e.strerror}") from None
    except ProtocolError as e:
        raise Refused(f"malformed sync body ({e.reason}): {e.detail}; nothing was changed") from None
    node = open_node(args)
    try:
        from ..sync import import_mailbox_body
        result = import_mailbox_body(node, data)
    except ProtocolError as e:
        raise Refused(f"malformed sync body ({e.reason}): {e.detail or 'see SSP/1 §32'}; nothing was changed") from None
    finally:
        node.close()
    emit(result)
    return EXIT_OK


def cmd_dump(args) -> int:
    with open_node(args, read_only=True) as node:
        emit(node.dump())
    return EXIT_OK


def cmd_log(args) -> int:
    with open_node(args, read_only=True) as node:
        for entry in node.log_entries():
            sys.stdout.write(json.dumps(to_json(entry)) + "\n")
    return EXIT_OK


def cmd_evict(args) -> int:
    if not served_state:
        use_reserve(args.home, "eviction")
    if args.auto:
        if args.table or args.horizon:
            raise Refused("--auto takes no table or horizon: it uses the profile's horizons for every evictable table")
        with open_node(args) as node:
            emit(node.run_eviction(clock_override=args.clock_trusted, wait_clock_s=args.wait_clock))
        return EXIT_OK
    if not args.table or not args.horizon:
        raise Refused("give SCHEMA.TABLE --horizon HLC, or --auto")
    table = _table_arg(args.table)
    try:
        h = parse_hlc(args.horizon)
    except IdFormatError as e:
        raise Refused(str(e)) from None
    with open_node(args) as node:
        deleted = node.evict_table(table, h, clock_override=args.clock_trusted, wait_clock_s=args.wait_clock)
        _warn_unverified_clock(node, "evict")
    emit({"table": table, "horizon": args.horizon, "events_deleted": deleted})
    return EXIT_OK


def cmd_events(args) -> int:
    with open_node(args, read_only=True) as node:
        for e in node.surfaced(args.limit):
            sys.stdout.write(json.dumps(e) + "\n")
        if args.ignored_columns:
            for e in node.ignored_columns():
                sys.stdout.write(json.dumps({"kind": "ignored_column", **e}) + "\n")
    return EXIT_OK


def cmd_status(args) -> int:
    with open_node(args, read_only=True) as node:
        st = node.status()
        if served_state.get("status_extra"):
            st["run"] = served_state["status_extra"]()  # served by `run`: its pid, broker, peers, counters
        emit(st)
    return EXIT_OK


def cmd_add_column(args) -> int:
    table = _table_arg(args.table)
    with open_node(args) as node:
        n = node.add_column(table, args.column, args.type)
    emit({"table": table, "column": args.column, "type": args.type, "rows_rebuilt": n})
    return EXIT_OK


def cmd_create_table(args) -> int:
    spec = json_arg(args.spec, "--spec")
    if not isinstance(spec, dict):
        raise Refused("--spec must be a JSON object like a manifest [[tables]] entry")
    with open_node(args) as node:
        outs = node.create_table(spec)
    from ..outcomes import counts
    emit({"table": f"{spec.get('schema')}.{spec.get('name')}", "released_held": counts(outs)})
    return EXIT_OK


def cmd_rebind(args) -> int:
    if not args.confirm_original_destroyed:
        raise Refused("rebind moves this identity to this machine; pass --confirm-original-destroyed only if the "
                      "device that created it can never run again (otherwise initialise a new node)")
    node = open_node(args, check_machine=False)
    try:
        node.rebind_machine()
    finally:
        node.close()
    emit({"site_id": node.site_id.hex(), "rebound": True})
    return EXIT_OK


def register(sub):
    """`init`, `peer`, `write`, `purge` and `mailbox import`; returns the `mailbox` actions, which
    other modules add to."""
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
    return ms


def register_views(sub) -> None:
    """`dump`, `log`, `evict`, `events`, `status`, `table` and `identity`."""
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


def _clock_flags(s) -> None:
    # docs/apply.md "Clocks without an RTC": these verbs need a trustworthy wall clock.
    s.add_argument("--clock-trusted", action="store_true",
                   help="the wall clock is right even though no time sync says so (an RTC, set by hand): "
                        "proceed without waiting for NTP")
    s.add_argument("--wait-clock", type=seconds_arg, default=0, metavar="SECONDS",
                   help="wait up to SECONDS for the clock to be synchronised before refusing (exit 2, clock_untrusted)")
