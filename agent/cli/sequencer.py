"""CLI verbs `ssp-agent --home DIR sequencer ...`, `commits ...` and `sequencing ...` (SOVM
§22.5-§22.7; docs/sequencer.md): their arguments, the calls and what they print. The sequencer
(agent/sequencer/) has its own home, separate from any node's; a member's Commit client beside its
node is agent/member_commits.py, its node's receipts and bindings agent/sequencing.py.
Registered into agent/cli/__init__.py's parser by `register(sub, mailbox_sub)`."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import EXIT_OK, EXIT_REFUSED, PASSWORD_LIMIT, Fault, Refused, json_arg, emit, read_input
from .args import count_arg, seconds_arg

# Files handed to the sequencer verbs (agent/infile.py): a Commit is at most framing's 1 MiB (one
# more byte is read, so an oversized one is refused `too_large` by the framing); an evidence file or
# a hand-off package holds a group's receipts, gaps and statements: 64 MiB is some 200 000 receipts
RECEIPT_FILE_LIMIT = 64 * 1024
PACKAGE_LIMIT = 64 * 1024 * 1024


def _read_message(path: str) -> bytes:
    """An MLSMessage file (`sequencer submit`, `commits queue`): past framing's limit only its
    first MAX_MESSAGE_BYTES + 1 bytes are read, and the framing refuses it (`too_large`)."""
    from ..sequencer.framing import MAX_MESSAGE_BYTES
    return read_input(path, MAX_MESSAGE_BYTES, "message file", cut=True)


def _print(obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")


def _print_streamed(doc: dict) -> None:
    """``doc`` as ``_print`` writes it, byte for byte, a value that is an iterator written item by
    item as it comes (`sequencer status`: its groups, never all in memory at once)."""
    out = sys.stdout
    out.write("{")
    for i, (k, v) in enumerate(doc.items()):
        out.write((", " if i else "") + json.dumps(k) + ": ")
        if isinstance(v, (list, dict, str, int, float, bool)) or v is None:
            out.write(json.dumps(v))
            continue
        out.write("[")
        for j, item in enumerate(v):
            out.write((", " if j else "") + json.dumps(item))
        out.write("]")
    out.write("}\n")


def _write_out(path, doc: dict) -> None:
    """--out: the JSON also written to ``path`` (atomically, mode 0600: it may hold key material
    or a member's receipts)."""
    if path:
        from firmware_bridge.fsutil import atomic_write
        atomic_write(str(path), (json.dumps(doc, indent=2) + "\n").encode(), 0o600)


def _group(text: str) -> bytes:
    try:
        gid = bytes.fromhex(text)
    except ValueError:
        raise Refused(f"--group must be hex, got {text!r}") from None
    if not 1 <= len(gid) <= 255:
        raise Refused("--group must be 1..255 bytes")
    return gid


def open_node(args, *, reader_ok: bool = False, serve: bool = False):
    """The sequencer, resumed (§22.6 step 1). While a `sequencer run` holds the home, reads
    (``reader_ok``) go to its committed state read-only; writes are refused (use the broker)."""
    from ..sequencer import layout, service
    try:
        try:
            return service.Sequencer(Path(args.home), serve=serve)
        except service.SequencerServing as e:
            if reader_ok:
                return service.Reader(Path(args.home))
            raise Refused(str(e)) from None
    except service.SequencerRefused as e:
        raise Refused(str(e)) from None
    except (service.SequencerFault, layout.LayoutError) as e:
        # LayoutError: a state file from a newer release (or an unknown layout), left untouched
        raise Fault(str(e)) from None


def cmd_init(args) -> int:
    from ..sequencer import service
    keystore = None
    if args.keystore:
        keystore = json_arg(args.keystore, "--keystore")
        if not isinstance(keystore, dict):
            raise Refused("--keystore must be a JSON object, e.g. {\"kind\": \"software\", \"dir\": \"/path\"}")
    from ..sequencer import layout
    try:
        public = service.init(Path(args.home), keystore)
    except service.SequencerRefused as e:
        raise Refused(str(e)) from None
    except layout.LayoutError as e:      # a leftover sequencer.db.new of a newer release's init
        raise Fault(str(e)) from None
    emit({"sequencer_key": public.hex()})
    return EXIT_OK


def cmd_register(args) -> int:
    from ..sequencer import service
    gid = _group(args.group)
    with open_node(args) as s:
        try:
            s.register(gid, args.epoch)
        except service.SequencerRefused as e:
            raise Refused(str(e)) from None
    _print({"group": gid.hex(), "epoch": args.epoch})
    return EXIT_OK


def cmd_submit(args) -> int:
    from ..sequencer import service
    message = _read_message(args.file)
    with open_node(args) as s:
        ans = s.submit(message)
    if isinstance(ans, service.Accepted):
        _print({"accepted": True, "group": ans.group_id.hex(), "epoch": ans.epoch, "receipt": ans.receipt.hex()})
        return EXIT_OK
    _print({"accepted": False, "reason": ans.reason,
            "group": None if ans.group_id is None else ans.group_id.hex(),
            "current_epoch": ans.current_epoch, "head": None if ans.head is None else ans.head.hex()})
    if ans.detail:
        print(f"ssp-agent: not accepted: {ans.detail}", file=sys.stderr)
    return EXIT_REFUSED


def cmd_receipt(args) -> int:
    from ..sequencer import service
    gid = _group(args.group)
    with open_node(args, reader_ok=True) as s:
        try:
            got = s.receipt(gid, args.epoch)
        except service.SequencerRefused as e:
            raise Refused(str(e)) from None
    if isinstance(got, bytes):
        _print({"receipt": got.hex()})
    else:   # §22.6: a stated absence, never a new signature
        _print({"receipt": None, "absent": True, "discontinuity": got.discontinuity})
    return EXIT_OK


def cmd_status(args) -> int:
    with open_node(args, reader_ok=True) as s:
        _print_streamed(s.status(stream=True))
    return EXIT_OK


def _bindings(items: list[str]) -> dict[int, bytes]:
    out = {}
    for item in items or []:
        epoch, _, key = item.partition(":")
        try:
            e = count_arg(epoch)
            out[e] = bytes.fromhex(key)
        except (ValueError, argparse.ArgumentTypeError):
            raise Refused(f"--binding must be EPOCH:KEYHEX (33-byte compressed key), got {item!r}") from None
        if len(out[e]) != 33:
            raise Refused("--binding keys are 33-byte compressed SEC1 P-256 keys (66 hex)")
    if not out:
        raise Refused("at least one --binding EPOCH:KEYHEX is needed to verify the receipts")
    return out


def cmd_recover(args) -> int:
    from ..sequencer import recovery
    gid = _group(args.group)
    bindings = _bindings(args.binding)
    evidence = []
    for path in args.evidence:
        try:
            evidence.append(recovery.parse_evidence(read_input(path, PACKAGE_LIMIT, "evidence file")))
        except recovery.EvidenceError as e:
            raise Refused(f"evidence file {path}: {e}; expected JSON {{\"member\", \"receipts\": [hex], "
                          "\"attested_epoch\", \"discontinuities\": [epochs], \"statements\": [hex]}") from None
    with open_node(args) as s:
        try:
            out = s.recover(gid, evidence, bindings)
        except Exception as e:
            from ..sequencer import service
            if isinstance(e, service.SequencerRefused):
                raise Refused(str(e)) from None
            raise
    _print(recovery.answer(gid, out))
    return EXIT_OK if recovery.succeeded(out) else EXIT_REFUSED


def cmd_migrate(args) -> int:
    from ..sequencer import service
    gid = _group(args.group)
    with open_node(args) as s:
        try:
            package = s.handoff(gid)
        except service.SequencerRefused as e:
            raise Refused(str(e)) from None
    _write_out(args.out, package)
    _print(package)
    return EXIT_OK


def cmd_adopt(args) -> int:
    from ..sequencer import service
    text = read_input(args.file, PACKAGE_LIMIT, "hand-off package", text=True)
    try:
        package = json.loads(text)
    except ValueError as e:
        raise Refused(f"cannot read the hand-off package {args.file}: {e}") from None
    except RecursionError:
        raise Refused(f"the hand-off package {args.file} is nested too deeply") from None
    with open_node(args) as s:
        try:
            st = s.adopt(package)
        except service.SequencerRefused as e:
            raise Refused(str(e)) from None
        key = s.public_key.hex()
    _print({"group": st.group_id.hex(), "current_epoch": st.current_epoch, "generation": st.current_epoch,
            "sequencer_key": key})
    return EXIT_OK


def cmd_run(args) -> int:
    import signal
    from ..sequencer import serve, service
    settings = _broker_settings(args)
    seq = open_node(args, serve=True)
    seq.max_groups = serve.DEFAULT_MAX_GROUPS if args.max_groups is None else args.max_groups
    server = serve.Server(seq, settings)
    try:
        try:
            server.start(args.connect_timeout)
            # §22.5 cl. 2: members' evidence (the heads the broker retains) before any group is served
            server.check_heads(serve.HEADS_WAIT_S if args.heads_wait is None else args.heads_wait)
        except service.SequencerFault as e:
            raise Fault(str(e)) from None
        signal.signal(signal.SIGTERM, lambda *_: server.stop.set())
        signal.signal(signal.SIGINT, lambda *_: server.stop.set())
        _print({"serving": args.broker, "prefix": settings.prefix, "sequencer_key": seq.public_key.hex()})
        sys.stdout.flush()
        server.serve_forever()
        _print({"stopped": True, **server.stats})   # how many submits, in how many group commits
    finally:
        server.close()
        seq.close()
    return EXIT_OK


def _group_epoch(a) -> None:
    a.add_argument("--group", required=True, help="group_id, hex")
    a.add_argument("--epoch", required=True, type=count_arg, help="the group's epoch (an integer)")


def register(sub, mailbox_sub) -> None:
    s = sub.add_parser("sequencer", help="the blind Commit sequencer (its own home; docs/sequencer.md)")
    ss = s.add_subparsers(dest="sequencer_verb", metavar="ACTION")
    ss.required = True
    a = ss.add_parser("init", help="create the sequencer and its receipt-signing key (ES256, in the keystore)")
    a.add_argument("--keystore", help='keystore as JSON, e.g. {"kind":"software","dir":"/var/lib/seq/keys"}; '
                                      "default: a software keystore in HOME/keystore")
    a.set_defaults(fn=cmd_init)
    a = ss.add_parser("register", help="register a new opaque group_id with its initial epoch (§22.6)")
    _group_epoch(a)
    a.set_defaults(fn=cmd_register)
    a = ss.add_parser("submit", help="submit one MLSMessage file exactly as a member sent it")
    a.add_argument("file", help="the MLSMessage (a Commit) as a file")
    a.set_defaults(fn=cmd_submit)
    a = ss.add_parser("receipt", help="the exact receipt released for (group, epoch), or a stated absence")
    _group_epoch(a)
    a.set_defaults(fn=cmd_receipt)
    a = ss.add_parser("status", help="groups, current epochs, receipt-chain heads, discontinuities (JSON)")
    a.set_defaults(fn=cmd_status)
    a = ss.add_parser("recover", help="rebuild a lost group's state from members' receipt chains (§22.6), or "
                                      "take back the receipts a restored state lost (receipts_lost)")
    a.add_argument("--group", required=True, help="group_id, hex")
    a.add_argument("--binding", action="append", help="EPOCH:KEYHEX: the sequencer bound from that epoch (repeat)")
    a.add_argument("evidence", nargs="+", help="member evidence JSON files")
    a.set_defaults(fn=cmd_recover)
    a = ss.add_parser("migrate", help="hand a group off to another sequencer (§22.6): print the package, stop serving it")
    a.add_argument("--group", required=True, help="group_id, hex")
    a.add_argument("--out", help="also write the package to this file (0600)")
    a.set_defaults(fn=cmd_migrate)
    a = ss.add_parser("adopt", help="take over a group from a hand-off package made by `sequencer migrate`")
    a.add_argument("file", help="the hand-off package file")
    a.set_defaults(fn=cmd_adopt)
    a = ss.add_parser("run", help="serve groups through an MQTT 5 broker until SIGTERM/SIGINT")
    a.add_argument("--broker", required=True, help="mqtt://HOST:PORT or mqtts://HOST:PORT")
    a.add_argument("--prefix", default=None, help="topic prefix (default sovm-seq)")
    a.add_argument("--ca-file", help="CA bundle for TLS (implies TLS)")
    a.add_argument("--username", help="broker username (password from --password-file)")
    a.add_argument("--password-file", help="file holding the broker password")
    a.add_argument("--connect-timeout", type=seconds_arg, default=10.0,
                   help="seconds to wait for the broker to accept the connection (default 10)")
    a.add_argument("--max-groups", type=count_arg, default=None, metavar="N",
                   help="track at most N groups: the first Commit (or a registration) of a new group beyond "
                        "them is refused `group_limit` (default 100000)")
    a.add_argument("--heads-wait", type=seconds_arg, default=None, metavar="S",
                   help="seconds to wait for the receipt heads the broker retains before serving (default 30; "
                        "docs/sequencer.md \"Evidence from members on resume\")")
    a.set_defaults(fn=cmd_run)
    register_commits(sub)
    register_sequencing(sub)


# -- the member side: the Commit queue (§22.7; agent/sequencer/commit_queue.py) ----------------
def _queue(args):
    """The queue, with --sequencer-key and --keep-events (the event log's retention) kept in it
    when given."""
    key = None
    if getattr(args, "sequencer_key", None):
        try:
            key = bytes.fromhex(args.sequencer_key)
        except ValueError:
            raise Refused("--sequencer-key must be hex (66 digits: the compressed P-256 key)") from None
        if len(key) != 33:
            raise Refused("--sequencer-key must be the 33-byte compressed P-256 key (66 hex digits)")
    return _open_queue(Path(args.home), key, getattr(args, "keep_events", None))


def _open_queue(home: Path, key=None, events_kept=None):
    """The member's Commit queue; a file it cannot use (a newer release's layout: left untouched,
    layout.py) is a local fault, exit 1."""
    from ..sequencer import commit_queue, layout
    try:
        return commit_queue.open_queue(home, key, events_kept)
    except layout.LayoutError as e:
        raise Fault(str(e)) from None
    except Exception as e:  # noqa: BLE001 - sqlite3 errors: the queue file is unusable
        raise Fault(f"cannot open the Commit queue in {home}: {e}") from None


def cmd_commits_queue(args) -> int:
    from ..sequencer import commit_queue
    message = _read_message(args.file)
    q = _queue(args)
    try:
        e = q.enqueue(message)
    except commit_queue.QueueRefused as e:
        raise Refused(str(e)) from None
    finally:
        q.close()
    _print(e.as_json())
    return EXIT_OK


def cmd_commits_status(args) -> int:
    """The queue: every queued Commit and the --limit most recent ones, each group's --limit most
    recent heads, the --limit most recent events (--all: everything kept), every retained
    unsettled receipt and discontinuity; ``omitted`` counts what was left out."""
    q = _queue(args)
    try:
        from ..sequencer import commit_queue
        _print(q.status(None if args.all else (commit_queue.STATUS_TAIL if args.limit is None else args.limit)))
    finally:
        q.close()
    return EXIT_OK


def _broker_settings(args):
    """The broker of `sequencer run` and of a member's `commits` verbs, from the same flags."""
    from ..sequencer import serve
    password = None
    if args.password_file:
        password = read_input(args.password_file, PASSWORD_LIMIT, "--password-file", text=True).strip()
    try:
        return serve.BrokerSettings.from_url(args.broker, ca_file=args.ca_file, username=args.username,
                                             password=password, prefix=args.prefix)
    except ValueError as e:
        raise Refused(str(e)) from None


def _client(args, q):
    from ..member_commits import commit_client
    return commit_client(Path(args.home), q, _broker_settings(args))


def cmd_commits_send(args) -> int:
    """Submit every queued Commit and wait up to --timeout for the outcomes; what is left stays
    queued (exit 1: the sequencer or its broker is unreachable; run it again, or `commits run`)."""
    import threading
    import time
    from .. import member_commits
    q = _queue(args)
    try:
        c = _client(args, q)
        feeder = member_commits.GossipFeeder(Path(args.home), q)
        c.start()
        try:
            c.run(threading.Event(), until_settled=True, deadline=time.monotonic() + args.timeout)
        finally:
            c.close()
        feeder.flush()
        left = q.outstanding()
        _print({"commits": [e.as_json() for e in q.entries()], "outstanding": len(left)})
    finally:
        q.close()
    if left:
        sys.stderr.write(f"error: {len(left)} Commit(s) still queued: the sequencer or its broker did not answer "
                         f"within {args.timeout:g} s; they are kept and resubmitted by the next send or run\n")
        return 1
    return EXIT_OK


def cmd_commits_run(args) -> int:
    """Keep submitting: every queued Commit on every (re)connection, new ones as they are queued."""
    import signal
    import threading
    from .. import member_commits
    q = _queue(args)
    stop = threading.Event()
    try:
        c = _client(args, q)
        feeder = member_commits.GossipFeeder(Path(args.home), q)
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        c.start()
        _print({"member_id": q.member_id, "broker": args.broker})
        sys.stdout.flush()
        try:
            c.run(stop, after=feeder.flush)
        finally:
            c.close()
    finally:
        q.close()
    return EXIT_OK


def _broker_args(a) -> None:
    a.add_argument("--broker", required=True, help="mqtt://HOST:PORT or mqtts://HOST:PORT (the sequencer's)")
    a.add_argument("--prefix", default=None, help="the sequencer's topic prefix (default sovm-seq)")
    a.add_argument("--ca-file", help="CA bundle for TLS (implies TLS)")
    a.add_argument("--username", help="broker username (password from --password-file)")
    a.add_argument("--password-file", help="file holding the broker password")


def _keep_events_arg(a) -> None:
    a.add_argument("--keep-events", type=count_arg, default=None, metavar="N",
                   help="the queue's event log keeps its N most recent routine events (kept in the queue file; "
                   "default 1000); attribution records and discontinuities are never pruned")


def cmd_commits_evidence(args) -> int:
    """This member's receipts, gaps and statements for one group, as the JSON evidence file
    `sequencer recover` reads (§22.6 step 1; docs/sequencer.md)."""
    from .. import sequencing
    from ..node import Node
    gid = _group(args.group)
    q = _queue(args)
    try:
        # what the member node heard over the mesh too (receipt heads, discontinuity records)
        doc = q.evidence(gid, args.attested_epoch, sequencing.held_of(Path(args.home) / Node.STORE_FILE, gid))
    finally:
        q.close()
    _write_out(args.out, doc)
    _print(doc)
    return EXIT_OK if doc["receipts"] else EXIT_REFUSED     # nothing held for that group


def register_commits(sub) -> None:
    s = sub.add_parser("commits", help="a member's queue of membership Commits for the sequencer (§22.7)")
    ss = s.add_subparsers(dest="commits_verb", metavar="ACTION")
    ss.required = True
    a = ss.add_parser("queue", help="queue one Commit (an MLSMessage file); one outstanding per group")
    a.add_argument("file", help="the MLSMessage (a Commit) as a file")
    a.add_argument("--sequencer-key", help="the sequencer's key (66 hex): receipts must be signed by it where the "
                   "node holds no binding record for the group (the binding records decide otherwise)")
    _keep_events_arg(a)
    a.set_defaults(fn=cmd_commits_queue)
    a = ss.add_parser("send", help="submit the queued Commits once and wait for their outcomes")
    _broker_args(a)
    a.add_argument("--timeout", type=seconds_arg, default=30.0, help="seconds to wait for outcomes (default 30)")
    _keep_events_arg(a)
    a.set_defaults(fn=cmd_commits_send)
    a = ss.add_parser("run", help="keep submitting queued Commits, again on every reconnection, until SIGTERM")
    _broker_args(a)
    _keep_events_arg(a)
    a.set_defaults(fn=cmd_commits_run)
    a = ss.add_parser("status", help="the queue: each Commit's state, reason and receipt, recent events (JSON)")
    a.add_argument("--limit", type=count_arg, default=None,
                   help="print the N most recent Commits (and every queued one), heads a group and events "
                   "(default 50)")
    a.add_argument("--all", action="store_true", help="print every Commit, head and event kept")
    a.set_defaults(fn=cmd_commits_status)
    a = ss.add_parser("evidence", help="this member's receipts for a group as a `sequencer recover` evidence file")
    a.add_argument("--group", required=True, help="group_id, hex")
    a.add_argument("--attested-epoch", type=count_arg, default=None,
                   help="the member's current MLS epoch (default: one above the highest receipt held)")
    a.add_argument("--out", help="also write the evidence to this file (0600)")
    a.set_defaults(fn=cmd_commits_evidence)


# -- a member node's view: receipt gossip and sequencer bindings in `records` (agent/sequencing.py)
def _receipt_bytes(text: str) -> bytes:
    """A receipt given as a file of raw bytes, a file of hex, or hex on the command line."""
    p = Path(text)
    try:
        is_file = p.is_file()
    except OSError:          # hex longer than a file name may be (ENAMETOOLONG): not a file
        is_file = False
    if is_file:
        data = read_input(p, RECEIPT_FILE_LIMIT, "receipt file")
        try:
            return bytes.fromhex(data.decode("ascii").strip())
        except (UnicodeDecodeError, ValueError):
            return data
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise Refused(f"{text!r} is neither a file nor hex") from None


def _gossip_raws(args) -> list[bytes]:
    raws = [_receipt_bytes(t) for t in args.receipt]
    if args.from_queue:
        from ..sequencer import commit_queue
        if commit_queue.queue_path(Path(args.home)).exists():
            q = _open_queue(Path(args.home))
            try:
                raws += q.receipts_held()
            finally:
                q.close()
    return raws


def _gossip_argv(args) -> list[str]:
    """`sequencing gossip` forwarded to a running agent: the receipts as hex (read here)."""
    return ["--home", str(Path(args.home).resolve()), "sequencing", "gossip", *[r.hex() for r in _gossip_raws(args)]]


def _bind_argv(args) -> list[str]:
    out = ["--home", str(Path(args.home).resolve()), "sequencing", "bind", "--group", args.group,
           "--sequencer-key", args.sequencer_key, "--generation", str(args.generation)]
    return out + (["--authority-key", str(Path(args.authority_key).resolve())] if args.authority_key else [])


def cmd_sequencing_gossip(args) -> int:
    from .. import sequencing
    from .common import open_node
    from ..node import now_ms
    raws = _gossip_raws(args)
    node = open_node(args)
    try:
        out = []
        for raw in raws:
            try:
                out.append(sequencing.gossip(node, raw, now_ms()))
            except sequencing.SequencingRefused as e:
                raise Refused(str(e)) from None
        _print({"gossip": out})
    finally:
        node.close()
    return EXIT_OK


def cmd_sequencing_bind(args) -> int:
    from .. import sequencing
    from .common import open_node
    from .sync import load_authority
    from ..node import now_ms
    gid = _group(args.group)
    try:
        key = bytes.fromhex(args.sequencer_key)
    except ValueError:
        raise Refused("--sequencer-key must be hex") from None
    authority = load_authority(args.authority_key) if args.authority_key else None
    try:
        node = open_node(args)
        try:
            _print(sequencing.bind(node, gid, key, args.generation, now_ms(), authority))
        except sequencing.SequencingRefused as e:
            raise Refused(str(e)) from None
        finally:
            node.close()
    finally:
        if authority is not None:
            authority.close()
    return EXIT_OK


def cmd_sequencing_status(args) -> int:
    from .. import sequencing
    from .common import open_node
    node = open_node(args, read_only=True)
    try:
        _print(sequencing.status(node, _group(args.group) if args.group else None))
    finally:
        node.close()
    return EXIT_OK


def register_sequencing(sub) -> None:
    s = sub.add_parser("sequencing", help="a member node's sequencing receipts and sequencer bindings, "
                                          "gossiped in records (docs/sequencer.md)")
    ss = s.add_subparsers(dest="sequencing_verb", metavar="ACTION")
    ss.required = True
    a = ss.add_parser("gossip", help="spread receipts this member holds to the mesh (receipt-head records)")
    a.add_argument("receipt", nargs="*", help="a receipt: file (raw or hex) or hex")
    a.add_argument("--from-queue", action="store_true",
                   help="also every receipt in HOME/commit-queue.db (outcomes and heads heard on the broker)")
    a.set_defaults(fn=cmd_sequencing_gossip, forward_argv=_gossip_argv)
    a = ss.add_parser("bind", help="(mesh authority) bind a sequencer to a group from an MLS epoch (§22.6)")
    a.add_argument("--group", required=True, help="group_id, hex")
    a.add_argument("--sequencer-key", required=True, help="the sequencer's key (66 hex: compressed P-256)")
    a.add_argument("--generation", required=True, type=count_arg, help="the MLS epoch from which the binding takes effect")
    a.add_argument("--authority-key", help="a standalone authority's directory (`authority create`)")
    a.set_defaults(fn=cmd_sequencing_bind, forward_argv=_bind_argv)
    a = ss.add_parser("status", help="per group: bindings, receipts held, head, held, attributed, equivocation")
    a.add_argument("--group", help="only this group (hex)")
    a.set_defaults(fn=cmd_sequencing_status)
