"""Parameters bound as they are: the sqlite3 module binds int, float, str and bytearray directly,
but looks every other value up as an adaptation first (its adapter registry, then the
``__adapt__`` and ``__conform__`` protocols, each miss raising and discarding an AttributeError
with a formatted message) before binding it unchanged. Blobs (``bytes``), NULLs (``None``) and
booleans are most of what the stores bind: the sequencer's group commit binds about ten a Commit
(~0.2 µs each, ~2 µs a Commit measured). Registering each type's identity as its adapter ends
the look-up at the registry's first probe; what is bound is exactly what was bound before (the
same blob, NULL, and 0/1 for a bool, which the module binds as an integer). Process-wide, as the
registry is; shared by the node's store and the sequencer's files, so it lives apart from either
(the sequencer never imports the sync node)."""
from __future__ import annotations

import sqlite3


def _same(value: object) -> object:
    return value


def bind_plainly() -> None:
    """Register the identity adapters (idempotent). ``bytes`` and ``int`` are C callables that
    return an exact bytes object itself and a bool's integer; a bytes subclass, like any type
    not named here, keeps the module's own look-up."""
    sqlite3.register_adapter(bytes, bytes)
    sqlite3.register_adapter(bool, int)
    sqlite3.register_adapter(type(None), _same)
