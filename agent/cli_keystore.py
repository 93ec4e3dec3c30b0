"""CLI verb `keystore show`: which keystore and key this node signs with (docs/keystore.md).
Registered into agent/cli.py's parser by `register(sub, mailbox_sub)`. Never prints secrets
(no PIN, no key material): only the keystore's own `describe()` and public values."""
from __future__ import annotations

from .cli import EXIT_OK, Fault, _open, emit


def cmd_keystore_show(args) -> int:
    from .node import EVENT_KEY
    from .store import db
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
                          "max_event_hlc": None if hi is None else f"{hi[0]}.{hi[1]}"}})
        if public != recorded:
            raise Fault(f"the keystore's key {EVENT_KEY!r} ({public.hex()}) is not the key this node was "
                        f"initialised with ({recorded.hex()}): wrong token or device attached")
    finally:
        node.close()
    return EXIT_OK


def register(sub, mailbox_sub) -> None:
    s = sub.add_parser("keystore", help="the node's keystore: which one, which key (never secrets)")
    ks = s.add_subparsers(dest="keystore_verb", metavar="ACTION")
    ks.required = True
    a = ks.add_parser("show", help="print the keystore kind, its description, the event key and the journal")
    a.set_defaults(fn=cmd_keystore_show)
