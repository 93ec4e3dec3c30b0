"""CLI verb `keystore show`: which keystore and key this node signs with (docs/keystore.md).
Registered into agent/cli.py's parser by `register(sub, mailbox_sub)`. Never prints secrets
(no PIN, no key material): only the keystore's own `describe()` and public values."""
from __future__ import annotations

from .cli import EXIT_OK, Fault, _open, emit


def cmd_keystore_show(args) -> int:
    from .node import EVENT_KEY
    from .store import atrest, db
    node = _open(args)
    try:
        if node.bridge is None:
            raise Fault("this node was opened without a keystore bridge")
        ks = node.bridge.keystore
        recorded = bytes(db.get_meta(node.conn, "public_key"))
        public = ks.public_key(EVENT_KEY)
        stats = node.bridge.journal_stats()
        hi = node.bridge.max_event_hlc(node.site_id)
        emit({"site_id": node.site_id.hex(),
              "keystore": ks.describe(),
              "event_key": {"name": EVENT_KEY, "algorithm": ks.algorithm(EVENT_KEY), "public_key": public.hex(),
                            "matches_node": public == recorded},
              "journal": {"path": node.bridge.describe()["journal"], "bytes": stats["bytes"],
                          "entries": stats["entries"], "compactions_this_open": stats["compactions"],
                          "max_event_hlc": None if hi is None else f"{hi[0]}.{hi[1]}"},
              "at_rest": atrest.status(node.conn)})
        if public != recorded:
            raise Fault(f"the keystore's key {EVENT_KEY!r} ({public.hex()}) is not the key this node was "
                        f"initialised with ({recorded.hex()}): wrong token or device attached")
    finally:
        node.close()
    return EXIT_OK


def cmd_keystore_rotate(args) -> int:
    """A new data key for the sealed log (docs/reliability.md "At rest", Key rotation): recorded with
    its re-seal job, which the reopen right after runs (every row and the journal's outputs under
    the new key, then the older keys deleted; an interrupted job resumes on the next writing open)."""
    from .node import now_ms
    from .store import atrest
    node = _open(args)
    try:
        kid = atrest.rotate(node.conn, node.bridge.keystore, node.site_id, now_ms())
    finally:
        node.close()
    node = _open(args)
    try:
        emit({"data_key": kid, "at_rest": atrest.status(node.conn)})
    finally:
        node.close()
    return EXIT_OK


def register(sub, mailbox_sub) -> None:
    s = sub.add_parser("keystore", help="the node's keystore: which one, which key (never secrets)")
    ks = s.add_subparsers(dest="keystore_verb", metavar="ACTION")
    ks.required = True
    a = ks.add_parser("show", help="print the keystore kind, its description, the event key and the journal")
    a.set_defaults(fn=cmd_keystore_show)
    a = ks.add_parser("rotate-data-key", help="seal the event log under a new data key (re-seals every stored "
                      "event; docs/reliability.md \"At rest\")")
    a.set_defaults(fn=cmd_keystore_rotate)
