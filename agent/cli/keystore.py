"""CLI verbs `keystore show`, `rotate-data-key` and `rewrap`: which keystore and key this node
signs with (docs/keystore.md), and the keys its event log is sealed under at rest
(docs/reliability.md "At rest").
Registered into agent/cli/__init__.py's parser by `register(sub, mailbox_sub)`. Never prints secrets
(no PIN, no key material): only the keystore's own `describe()` and public values."""
from __future__ import annotations

import json
import os
from pathlib import Path

from .common import EXIT_OK, Fault, Refused, json_arg, open_node, emit


def cmd_keystore_show(args) -> int:
    from ..node import EVENT_KEY
    from ..store import atrest, db
    node = open_node(args)
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
    from ..node import now_ms, seal_keystore
    from ..store import atrest
    node = open_node(args)
    try:
        with seal_keystore(node.home, node.conn, node.bridge.keystore) as ks:   # wraps the new data key
            kid = atrest.rotate(node.conn, ks, node.site_id, now_ms())
    finally:
        node.close()
    node = open_node(args)
    try:
        emit({"data_key": kid, "at_rest": atrest.status(node.conn)})
    finally:
        node.close()
    return EXIT_OK


_NAMES = {"software": ("dir",), "pkcs11": ("module", "token_label"), "serial": ("port",)}
SEAL_PIN_FILES = ("seal-keystore.pin", "seal-keystore-2.pin")   # in the home, 0600; alternate per re-wrap


def _identity(conf: dict) -> tuple:
    """What names one keystore (a software directory, a token of a module, a serial port)."""
    kind = conf.get("kind")
    norm = lambda v: os.path.realpath(str(v)) if v else None   # noqa: E731
    if kind == "pkcs11":
        return kind, norm(conf.get("module")), conf.get("token_label")
    return kind, norm(conf.get("dir") if kind == "software" else conf.get("port"))


def _target_conf(text: str) -> dict:
    conf = json_arg(text, "--to")
    kind = conf.get("kind") if isinstance(conf, dict) else None
    if kind not in _NAMES:
        raise Refused("--to must be a keystore config: a JSON object whose kind is software, pkcs11 or serial "
                      "(docs/keystore.md)")
    missing = [k for k in _NAMES[kind] if not conf.get(k)]
    if kind == "pkcs11" and not any(k in conf for k in ("pin", "pin_file", "pin_env")):
        missing.append("pin (or pin_file, pin_env)")
    if missing:
        raise Refused(f"--to: a {kind} keystore needs {', '.join(missing)}; nothing was changed")
    if kind == "software":
        conf["dir"] = os.path.abspath(conf["dir"])
    return conf


def _stored_form(home: Path, conf: dict, current: dict | None) -> dict:
    """The target config as the store keeps it: a PIN goes to a file in the home (0600, never into
    the store, which gets copied and backed up). The file is not the one the current seal keystore
    reads, so a re-wrap that dies before its commit leaves the current one working."""
    from firmware_bridge.fsutil import atomic_write, fsync_dir
    conf = dict(conf)
    if "pin" in conf:
        in_use = os.path.basename(str((current or {}).get("pin_file", "")))
        name = next(n for n in SEAL_PIN_FILES if n != in_use)
        atomic_write(str(home / name), str(conf.pop("pin")).encode(), 0o600)
        fsync_dir(str(home))
        conf["pin_file"] = name   # relative: resolved against the home (a home that moves is followed)
    return conf


def _retire(home: Path, conn, old: dict, new: dict | None) -> str:
    """Destroy the previous seal keystore's seal key, now that no data key is sealed under it (the
    software keystore's key file lies on the same card as the store: left there, it and any old copy
    of the store would open the log); a token or device keeps its key, useless without it. Then the
    re-wrap is done."""
    from firmware_bridge import open_keystore
    from firmware_bridge.sealing import SEAL_KEY
    from ..node import home_paths
    from ..store import atrest
    if old.get("kind") == "software":
        with open_keystore(home_paths(home, old)) as ks:
            what = "deleted" if ks.delete_seal_key(SEAL_KEY) else "already gone"
    else:
        what = f"kept in its {old.get('kind')} keystore (useless without it; destroy it there if it is retired)"
    pin = old.get("pin_file")
    if pin in SEAL_PIN_FILES and pin != (new or {}).get("pin_file"):
        try:
            os.unlink(home / pin)
        except FileNotFoundError:
            pass
    atrest.rewrap_done(conn)
    return what


def cmd_keystore_rewrap(args) -> int:
    """Seal the event log's data keys under another keystore's seal key (docs/reliability.md "At
    rest", Re-wrap): e.g. from the software keystore to a token, or to a replacement token or device
    while the current one still works. No event is rewritten; the node keeps signing with its own
    keystore (a signing key never leaves a token, so it cannot follow). Run again after an
    interruption: before the store's one commit nothing changed, after it this finishes the job."""
    from firmware_bridge import open_keystore
    from ..node import home_paths, resolve_pin, seal_keystore
    from ..store import atrest, db
    target = _target_conf(args.to)
    node = open_node(args)
    try:
        home, conn = node.home, node.conn
        home_conf = json.loads(db.get_meta(conn, "keystore"))
        stored_cur = atrest.seal_keystore_conf(conn)
        pending = atrest.rewrap_pending(conn)
        if pending is not None and _identity(home_paths(home, stored_cur or home_conf)) != _identity(target):
            # an earlier re-wrap, interrupted after its commit: destroy its predecessor's seal key
            # first (this one records only its own predecessor)
            _retire(home, conn, pending, stored_cur)
        current = stored_cur or home_conf
        n = 0
        if _identity(home_paths(home, current)) == _identity(target):
            if atrest.rewrap_pending(conn) is None:
                raise Refused("the event log's data keys are already sealed by that keystore; nothing was changed")
        else:
            to_home = _identity(home_paths(home, home_conf)) == _identity(target)
            new_ks = open_keystore(resolve_pin(target))
            try:
                stored = None if to_home else _stored_form(home, target, stored_cur)
                with seal_keystore(home, conn, node.bridge.keystore) as old_ks:
                    n = atrest.rewrap(conn, old_ks, new_ks, node.site_id, new_conf=stored, retire=current)
            finally:
                new_ks.close()
        old = _retire(home, conn, atrest.rewrap_pending(conn) or current, atrest.seal_keystore_conf(conn))
        st = atrest.status(conn)
    finally:
        node.close()
    emit({"rewrapped": n, "seal_keystore": atrest.keystore_summary(target), "old_seal_key": old,
          "signing_keystore": atrest.keystore_summary(home_conf), "at_rest": st})
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
    a = ks.add_parser("rewrap", help="seal the event log's data keys under another keystore's seal key (a token "
                      "taking over from the software keystore, a replacement device); docs/reliability.md "
                      "\"At rest\"")
    a.add_argument("--to", required=True, metavar="JSON",
                   help='the keystore config, e.g. \'{"kind":"pkcs11","module":"/usr/lib/softhsm/libsofthsm2.so",'
                   '"token_label":"node","pin":"..."}\' (the PIN goes to a 0600 file in the home)')
    a.set_defaults(fn=cmd_keystore_rewrap)
