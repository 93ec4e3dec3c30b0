"""The key an unfinished `init` generated, told from another's (docs/operations.md "An init cut
short"; node and sequencer alike).

A key cannot be taken back off a PKCS#11 token or the serial device, and an `init` killed between
the keystore generating its key and the home recording it left a key no later `init` could use:
every retry failed on KeyExists until an operator removed the key by hand. So `init` records,
durably and before it asks for the key, a *key record*: the keystore's kind, a random tag the
keystore stores with the key where it can (PKCS#11: CKA_ID; ``Keystore.key_tag``), and whether a
key of that name was already there. Once the key is made, its public key goes into the record
too. The next `init` of the same home takes up an existing key of that name only when it is the
one the record describes; any other is still refused (on a shared token it may be another home's).
"""
from __future__ import annotations

import os
from typing import Any, Optional

TAG_BYTES = 16


def new_record(kind: str, existed_before: bool) -> dict[str, Any]:
    """The record written before the key is asked for (JSON-ready)."""
    return {"kind": kind, "tag": os.urandom(TAG_BYTES).hex(), "existed_before": bool(existed_before),
            "public_key": None}


def tag_of(record: dict[str, Any]) -> bytes:
    return bytes.fromhex(record["tag"])


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
