"""The key an unfinished `init` generated, told from another's (docs/operations.md "An init cut
short"; node and sequencer alike).

A key cannot be taken back off a PKCS#11 token or the serial device, and an `init` killed between
the keystore generating its key and the home recording it left a key no later `init` could use:
every retry failed on KeyExists until an operator removed the key by hand. So `init` records,
durably and before it asks for the key, a *key record*: the keystore's kind, a random tag the
keystore stores with the key (PKCS#11: its CKA_ID; the serial device: GENERATE_TAGGED; software:
in the key file; ``Keystore.key_tag``), and whether a key of that name was already there. Once
the key is made, its public key goes into the record too. The next `init` of the same home takes
up an existing key of that name only when it is the one the record describes; any other is still
refused (on a shared token it may be another home's).
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from .errors import DeviceTimeout, KeyExists, KeystoreError, KeystoreUnavailable
from .fsutil import atomic_write

if TYPE_CHECKING:
    from .keystore import Keystore

TAG_BYTES = 16


def new_record(kind: str, existed_before: bool) -> dict[str, Any]:
    """The record written before the key is asked for (JSON-ready)."""
    return {"kind": kind, "tag": os.urandom(TAG_BYTES).hex(), "existed_before": bool(existed_before),
            "public_key": None}


def tag_of(record: dict[str, Any]) -> bytes:
    return bytes.fromhex(record["tag"])


def _hex(value: Any, lengths: tuple[int, ...]) -> bool:
    try:
        return isinstance(value, str) and len(bytes.fromhex(value)) in lengths
    except ValueError:
        return False


def valid(record: Any) -> bool:
    """Whether ``record`` is one ``new_record`` made (and its public key added to): anything else
    (damaged, edited, from before tags) is no record, so no key is taken up on its word."""
    return (isinstance(record, dict) and isinstance(record.get("kind"), str)
            and _hex(record.get("tag"), (TAG_BYTES,)) and isinstance(record.get("existed_before"), bool)
            and (record.get("public_key") is None or _hex(record["public_key"], (32, 33, 65))))


def is_ours(record: Optional[dict[str, Any]], kind: str, public_key: bytes, tag: Optional[bytes],
            own_directory: bool = False) -> bool:
    """Whether the existing key (its ``public_key``, and the ``tag`` the keystore stored with it,
    None where it stores none) is the one the unfinished init of ``record`` made: the public key it
    recorded, or the tag it chose. ``own_directory``: a software keystore whose directory is the
    home's own (nothing else keeps keys there, and a home without its state never signed with
    one), where a key that was not there before the record was written is that init's."""
    if not isinstance(record, dict) or record.get("kind") != kind:
        return False
    if record.get("public_key") and record["public_key"] == public_key.hex():
        return True
    if tag is not None and isinstance(record.get("tag"), str) and record["tag"] == tag.hex():
        return True
    return own_directory and record.get("existed_before") is False


def own_directory(conf: dict[str, Any], home: Path) -> bool:
    """Whether keystore ``conf`` is a software keystore in ``home``'s own ``keystore/`` directory
    (``is_ours``'s ``own_directory``)."""
    own = (Path(home) / "keystore").absolute()
    return conf.get("kind") == "software" and Path(conf.get("dir", "")).absolute() == own


def read_record(path: Path) -> Optional[dict[str, Any]]:
    """The record at ``path``, or None (none, unreadable or not ``valid``: an existing key is then
    refused as anyone's would be, and a new record replaces it)."""
    try:
        got = json.loads(Path(path).read_bytes())
    except (OSError, ValueError):
        return None
    return got if valid(got) else None


def generate_or_take_up(ks: Keystore, name: str, alg: str, path: Path, kind: str,
                        own_directory: bool = False) -> tuple[bytes, bool]:
    """Key ``name`` for an init whose record file is ``path`` (a file of its own; the node keeps
    its record inside its init marker instead): the record written first (or the one a cut-short
    init left, of the same kind), then the key generated with its tag, or, when the keystore
    already holds ``name``, that key taken up if ``is_ours`` (else KeyExists, as before); then its
    public key recorded. Returns (public key, taken up). A definite refusal by the keystore, or
    another's key of that name, drops a record that holds no public key yet (nothing of this
    init is on the device); a timeout or a lost device keeps it (the key may have been made)."""
    record = read_record(path)
    if record is None or record.get("kind") != kind:
        record = new_record(kind, name in ks.key_names())
        atomic_write(str(path), json.dumps(record).encode(), 0o600)
    taken_up = False
    try:
        try:
            public = ks.generate_key(name, alg, tag=tag_of(record))
        except KeyExists:
            public = ks.public_key(name)
            if not is_ours(record, kind, public, ks.key_tag(name), own_directory):
                raise
            taken_up = True
    except (DeviceTimeout, KeystoreUnavailable):
        raise
    except KeystoreError:       # refused, or another's key of that name: none of this init's is there
        if not record.get("public_key"):
            Path(path).unlink(missing_ok=True)
        raise
    if record.get("public_key") != public.hex():
        record["public_key"] = public.hex()
        atomic_write(str(path), json.dumps(record).encode(), 0o600)
    return public, taken_up
