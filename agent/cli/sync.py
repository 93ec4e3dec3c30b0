"""CLI verbs of the sync layer (docs/cli.md "Sync", "Trust and policy"): `mailbox export`, `policy`, `record`.
Registered into agent/cli/__init__.py's parser by `register(sub, mailbox_sub)`."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .common import EXIT_OK, Fault, Refused, open_node, emit
from ..hometurn import HeldByService
from ..core.ids import IdFormatError, parse_hlc, parse_public_key, parse_site_id


def cmd_mailbox_export(args) -> int:
    from ..sync import export_mailbox_body
    try:
        peer = parse_site_id(args.peer, "--peer")
    except IdFormatError as e:
        raise Refused(str(e)) from None
    node = open_node(args)
    try:
        if peer == node.site_id:
            raise Refused("--peer is this node's own site_id; export for another node")
        out = Path(args.out)
        if not out.parent.exists():
            raise Refused(f"directory {out.parent} does not exist")
        try:
            res = export_mailbox_body(node, peer, out)
        except OSError as e:  # a full or failing medium: a local fault; nothing moved (docs/protocol.md §6)
            raise Fault(f"cannot write {out}: {e.strerror or e}; nothing was exported (the mailbox cursor "
                        "did not move)") from None
        emit(res)
    finally:
        node.close()
    return EXIT_OK


def _policy_row(args, effect: str):
    from ..core.scope import PolicyRow
    peer = args.peer
    if peer != "*":
        try:
            peer = parse_site_id(peer, "--peer").hex()
        except IdFormatError as e:
            raise Refused(str(e)) from None
    if args.table.count(".") != 1:
        raise Refused(f"--table must be SCHEMA.TABLE or SCHEMA.*, got {args.table!r}")
    schema, table = args.table.split(".")
    return PolicyRow(peer, schema, table, args.layer, effect, args.role or "")


def cmd_policy_set(args) -> int:
    from ..core.scope import PolicyError, check_row
    from ..store import sync_state as st
    from ..sync import change_policy
    effect = args.policy_verb
    node = open_node(args)
    try:
        row = _policy_row(args, effect)
        try:
            check_row(row, {q: t.tdef.category for q, t in node.tables.items()})
        except PolicyError as e:
            raise Refused(str(e)) from None
        # A widening (deny before, allow after, per peer and table) enqueues backfill jobs (scope §2).
        widened = change_policy(node, lambda conn: st.put_policy_row(conn, row))
        emit({"peer": row.peer, "table": f"{row.schema}.{row.table}", "layer": row.layer, "effect": effect,
              "role": row.role or None, "backfill_scheduled": len(widened),
              "backfill": [{"peer": p, "table": q} for p, q in widened]})
    finally:
        node.close()
    return EXIT_OK


def cmd_policy_remove(args) -> int:
    from ..store import sync_state as st
    from ..sync import change_policy
    node = open_node(args)
    try:
        row = _policy_row(args, "allow")
        removed = []
        # Removing a deny may widen: backfill jobs for what it opens (scope §2).
        widened = change_policy(node, lambda conn: removed.append(st.delete_policy_row(conn, row)))
        emit({"removed": removed[0] if removed else 0, "backfill_scheduled": len(widened),
              "backfill": [{"peer": p, "table": q} for p, q in widened]})
    finally:
        node.close()
    return EXIT_OK


def sync_state_view(args):
    """A read view when the sync-state tables are there, so a full disk does not stop a read verb
    (`policy list`, `record list`, `rehydrate --status`); an older home's first read creates them."""
    from ..store import sync_state as st
    node = open_node(args, read_only=True)
    if not st.schema_ready(node.conn):
        node.close()
        node = open_node(args)
    return node


def cmd_policy_list(args) -> int:
    from ..store import sync_state as st
    node = sync_state_view(args)
    try:
        st.ensure_schema(node.conn)
        for r in sorted(st.policy_rows(node.conn), key=lambda r: (r.schema, r.table, r.peer, r.layer, r.role)):
            sys.stdout.write(json.dumps({"peer": r.peer, "table": f"{r.schema}.{r.table}", "layer": r.layer,
                                         "role": r.role or None, "effect": r.effect}) + "\n")
    finally:
        node.close()
    return EXIT_OK


def cmd_record_issue(args) -> int:
    from ..core.scope import PolicyError, check_role
    from ..sync import issue_record
    try:
        subject = parse_site_id(args.subject, "--subject")
        if args.record_verb == "issue-vouch":
            kind, value = "vouch", parse_public_key(args.public_key)
        elif args.record_verb == "issue-retire":
            succ = parse_site_id(args.successor, "--successor") if args.successor else None
            kind, value = "retire", (parse_hlc(args.retired_after), succ)
        else:
            if not args.role:
                raise Refused("--role must name a role")
            kind, value = "role", check_role(args.role)   # one a policy row can name
    except (IdFormatError, PolicyError) as e:
        raise Refused(str(e)) from None
    authority = load_authority(args.authority_key) if getattr(args, "authority_key", None) else None
    try:
        try:
            node, store = open_node(args), None
        except HeldByService:
            if authority is None:
                raise      # forwarded whole (`_record_argv`): not reached unless the service went away
            # A running service holds the home: sign here, where the authority directory is at hand
            # (the service may not reach it: a sandboxed unit), reading the chains from a read view
            # (SQLite WAL: a reader beside the writer), and hand the records to the service, which
            # verifies and stores them as any it receives (`record import`, one writer).
            node, store = open_node(args, read_only=True), lambda raws: _import_live(args, raws)
        try:
            raw, info = issue_record(node, kind, subject, value, authority=authority, store=store)
            if args.out:
                Path(args.out).write_bytes(raw)
            emit(info)
        finally:
            node.close()
    finally:
        if authority is not None:
            authority.close()
    return EXIT_OK


def _import_live(args, raws: list[bytes]) -> dict:
    from .. import control
    res = control.forward(Path(args.home), ["--home", str(Path(args.home).resolve()), "record", "import",
                                            *[r.hex() for r in raws]])
    if res is None:
        raise Fault("the running service stopped while the record was being issued; the authority released it: "
                    "run the same command again (it stores the released record first)")
    rc, out, err = res
    if rc != 0:
        raise (Refused if rc == 2 else Fault)(err.strip().removeprefix("ssp-agent: "))
    return json.loads(out)


RECORD_FILE_LIMIT = 64 * 1024   # one control record: a few hundred bytes


def _record_bytes(text: str) -> bytes:
    """A record given as a file (raw bytes, as `issue-* --out` writes it) or as hex."""
    from .common import read_input
    p = Path(text)
    try:
        is_file = p.is_file()
    except OSError:          # hex longer than a file name may be: not a file
        is_file = False
    if is_file:
        return read_input(p, RECORD_FILE_LIMIT, "record file")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise Refused(f"{text[:80]!r} is neither a record file nor hex") from None


def _records_of(args) -> list[bytes]:
    from ..core.cose import content_type
    from ..core.records import KINDS
    raws = [_record_bytes(t) for t in args.record]
    for t, raw in zip(args.record, raws):
        if content_type(raw) not in KINDS:
            raise Refused(f"{t[:80]} is not a vouch, retire or role record (SSP/1 §5); nothing was stored")
    return raws


def _import_argv(args) -> list[str]:
    """`record import` forwarded to a running agent: the records as hex (files read here)."""
    return ["--home", str(Path(args.home).resolve()), "record", "import", *[r.hex() for r in _records_of(args)]]


def cmd_record_import(args) -> int:
    """Verify and store control records as received ones are (a bad one is dropped and surfaced)."""
    from ..node import now_ms
    from ..sync import SyncDriver
    raws = _records_of(args)
    with open_node(args) as node:
        emit(SyncDriver(node).apply_records(raws, now_ms()))
    return EXIT_OK


def _record_argv(args) -> list[str] | None:
    """`record issue-*` forwarded to a running agent, --out made absolute (the agent's working
    directory is not the operator's). With --authority-key, not forwarded (None): the record is
    signed here and handed to the agent (`cmd_record_issue`)."""
    if args.authority_key:
        return None
    out = ["--home", str(Path(args.home).resolve()), "record", args.record_verb, f"--subject={args.subject}"]
    if args.record_verb == "issue-vouch":
        out.append(f"--public-key={args.public_key}")
    elif args.record_verb == "issue-retire":
        out.append(f"--retired-after={args.retired_after}")
        out += [f"--successor={args.successor}"] if args.successor else []
    else:
        out.append(f"--role={args.role}")
    return out + ([f"--out={Path(args.out).resolve()}"] if args.out else [])


def load_authority(path: str):
    from ..authority import Authority, AuthorityError
    try:
        return Authority(Path(path))
    except AuthorityError as e:
        raise Refused(f"--authority-key: {e}") from None


def cmd_authority_create(args) -> int:
    """A standalone mesh authority (agent/authority.py): its own site_id and an Ed25519 key generated
    inside a keystore (software by default, or --keystore JSON as for `init`), in a directory made
    before any node exists, so its id can go into every node's manifest (`authorities` and `peers`).
    Records are then issued from any node with `record issue-* --authority-key DIR`, signed through
    the directory's keystore bridge."""
    from ..authority import AuthorityError, create
    conf = None
    if args.keystore:
        try:
            conf = json.loads(args.keystore)
            if not isinstance(conf, dict):
                raise ValueError("not a JSON object")
        except ValueError as e:
            raise Refused(f"--keystore must be a JSON object ({e})") from None
    try:
        card = create(Path(args.out), conf)
    except AuthorityError as e:
        raise Refused(str(e)) from None
    site, pk = card["site_id"], card["public_key"]
    emit({"site_id": site, "public_key": pk, "dir": str(args.out), "keystore": card["keystore"].get("kind"),
          "manifest": {"authorities": [site], "peers": [{"site_id": site, "public_key": pk}]}})
    return EXIT_OK


def cmd_authority_show(args) -> int:
    """An authority directory's identity, keystore and released records (never secrets); exit 1
    when its keystore holds another key than the card names (wrong token or device)."""
    from collections import Counter
    from ..authority import KEY_NAME
    from ..core.cose import content_type
    from ..core.records import KINDS
    a = load_authority(args.authority_key)
    try:
        released = a.released()
        kinds = Counter(KINDS.get(ct, ct) for ct in map(content_type, released))
        stats = a.bridge.journal_stats()
        emit({"site_id": a.site_id.hex(), "public_key": a.public_key.hex(), "dir": str(a.directory),
              "keystore": a.bridge.keystore.describe(), "key": KEY_NAME,
              "journal": {"path": a.bridge.describe()["journal"], "bytes": stats["bytes"], "entries": stats["entries"]},
              "records_released": len(released), "by_kind": dict(kinds)})
    finally:
        a.close()
    return EXIT_OK


def cmd_authority_add(args) -> int:
    """Amend this node's mesh authorities (the manifest's `authorities`) after init: trust the
    authority's key for records and list it as an authority. Run on every node of the mesh."""
    from ..store import db
    try:
        site = parse_site_id(args.site_id, "--site-id")
        pk = parse_public_key(args.public_key) if args.public_key else None
    except IdFormatError as e:
        raise Refused(str(e)) from None
    node = open_node(args)
    try:
        if site != node.site_id:
            if pk is None:
                if site not in node.keyring:
                    raise Refused("--public-key is required for an authority this node does not know yet")
            else:
                node.add_peer(site, pk, None, source="authority")
        auth = sorted({a.hex() for a in node.authorities} | {site.hex()})
        with db.transaction(node.conn):
            db.set_meta(node.conn, "authorities", json.dumps(auth))
        node.authorities = {bytes.fromhex(a) for a in auth}
        node.refresh_trust()  # records it issued that this node holds count now
        emit({"authorities": auth})
    finally:
        node.close()
    return EXIT_OK


def cmd_rehydrate(args) -> int:
    from .. import rehydrate
    if bool(args.status) == bool(args.from_peer):
        raise Refused("give --from PEER (start) or --status")
    node = sync_state_view(args) if args.status else open_node(args)
    try:
        if args.status:
            emit(rehydrate.status(node))
            return EXIT_OK
        try:
            peer = parse_site_id(args.from_peer, "--from")
        except IdFormatError as e:
            raise Refused(str(e)) from None
        if peer == node.site_id:
            raise Refused("--from is this node itself; name a peer that holds the history (a gateway)")
        emit(rehydrate.start(node, peer))
    finally:
        node.close()
    return EXIT_OK


def cmd_record_list(args) -> int:
    from ..store import sync_state as st
    node = sync_state_view(args)
    try:
        st.ensure_schema(node.conn)
        recs = st.records(node.conn)
        trust = st.trust(node.conn, node.site_id)
        chains = trust.chains
        for r in recs:
            ch = chains.get((r.kind, r.subject))
            void = trust.void.get(r.record_hash)
            sys.stdout.write(json.dumps({"counts": void is None, **({"void": void} if void else {}),
                "record_hash": r.record_hash.hex(), "kind": r.kind, "issuer": r.issuer.hex(),
                "subject": r.subject.hex(), "generation": r.generation,
                "previous_record_hash": r.previous.hex() if r.previous else None,
                "head": ch is not None and ch.head is not None and ch.head.record_hash == r.record_hash,
                "forked": ch is not None and ch.forked}) + "\n")
    finally:
        node.close()
    return EXIT_OK


def register(sub, mailbox_sub) -> None:
    a = mailbox_sub.add_parser("export", help="write one sync body for a peer (its mailbox cursor moves when "
                                              "the peer's answer comes back in a file from it)")
    a.add_argument("--peer", required=True, help="the peer's site_id")
    a.add_argument("--out", required=True, help="file to write")
    a.set_defaults(fn=cmd_mailbox_export)

    s = sub.add_parser("policy", help="the local policy store (scope §1.2; never replicated)")
    ps = s.add_subparsers(dest="policy_verb", metavar="ACTION")
    ps.required = True
    for eff in ("allow", "deny", "remove"):
        a = ps.add_parser(eff, help=f"{eff} a (peer, table, layer) row" if eff != "remove" else "remove a row")
        a.add_argument("--peer", required=True, help="SITE_ID or *")
        a.add_argument("--table", required=True, help="SCHEMA.TABLE or SCHEMA.* (a schema wildcard is refused)")
        a.add_argument("--layer", required=True, choices=["system", "role", "user"],
                       help="the policy layer the row belongs to (scope §1.2)")
        a.add_argument("--role", help="role layer only: the row applies to peers holding this role")
        a.set_defaults(fn=cmd_policy_remove if eff == "remove" else cmd_policy_set)
    a = ps.add_parser("list", help="print the policy rows, one JSON object a line")
    a.set_defaults(fn=cmd_policy_list)

    s = sub.add_parser("record", help="control records: vouch, retire, role (issued by a mesh authority)")
    rs = s.add_subparsers(dest="record_verb", metavar="ACTION")
    rs.required = True
    a = rs.add_parser("issue-vouch", help="vouch for a site's Ed25519 key")
    a.add_argument("--subject", required=True, help="the vouched site's site_id (32 hex characters)")
    a.add_argument("--public-key", required=True, help="its Ed25519 public key (64 hex characters)")
    a.add_argument("--out", help="also write the signed record to this file")
    a.add_argument("--authority-key", help="sign as a standalone authority: the directory made by `authority create`")
    a.set_defaults(fn=cmd_record_issue, forward_argv=_record_argv)
    a = rs.add_parser("issue-retire", help="retire a site: its events above the cutoff are dropped")
    a.add_argument("--subject", required=True, help="the retired site's site_id (32 hex characters)")
    a.add_argument("--retired-after", required=True, help="HLC cutoff, e.g. 1764669600000.0")
    a.add_argument("--successor", help="the replacing device's site_id")
    a.add_argument("--out", help="also write the signed record to this file")
    a.add_argument("--authority-key", help="sign as a standalone authority: the directory made by `authority create`")
    a.set_defaults(fn=cmd_record_issue, forward_argv=_record_argv)
    a = rs.add_parser("issue-role", help="assign a role to a site (role layer of policy)")
    a.add_argument("--subject", required=True, help="the site's site_id (32 hex characters)")
    a.add_argument("--role", required=True, help="the role name a policy row can name")
    a.add_argument("--out", help="also write the signed record to this file")
    a.add_argument("--authority-key", help="sign as a standalone authority: the directory made by `authority create`")
    a.set_defaults(fn=cmd_record_issue, forward_argv=_record_argv)
    a = rs.add_parser("import", help="verify and store control records (files `issue-* --out` wrote, or hex), "
                                     "as if received")
    a.add_argument("record", nargs="+", help="a record: file (raw) or hex")
    a.set_defaults(fn=cmd_record_import, forward_argv=_import_argv)
    a = rs.add_parser("list", help="print the control records this node holds")
    a.set_defaults(fn=cmd_record_list)

    s = sub.add_parser("authority", help="mesh authorities: standalone authority keys, amending a node's list")
    as_ = s.add_subparsers(dest="authority_verb", metavar="ACTION")
    as_.required = True
    a = as_.add_parser("create", help="make a standalone authority (a directory: keystore, signing journal, card) "
                                      "and print its id for manifests")
    a.add_argument("--out", required=True, help="a new, empty directory")
    a.add_argument("--keystore", help='keystore JSON as for init (default {"kind": "software"} inside the directory)')
    a.set_defaults(fn=cmd_authority_create, home_optional=True)
    a = as_.add_parser("show", help="which authority a directory holds: site_id, key, keystore, records released")
    a.add_argument("--authority-key", required=True, help="the directory made by `authority create`")
    a.set_defaults(fn=cmd_authority_show, home_optional=True)
    a = as_.add_parser("add", help="list a site as a mesh authority on this node (and trust its key)")
    a.add_argument("--site-id", required=True, help="the authority's site_id (32 hex characters)")
    a.add_argument("--public-key", help="its Ed25519 public key (64 hex characters), when not already trusted")
    a.set_defaults(fn=cmd_authority_add)

    s = sub.add_parser("rehydrate", help="take history back from peers: horizons to zero, peers re-offer")
    s.add_argument("--from", dest="from_peer", help="the peer that holds the history (e.g. a gateway)")
    s.add_argument("--status", action="store_true", help="progress here, and what remains for peers served")
    s.set_defaults(fn=cmd_rehydrate)
