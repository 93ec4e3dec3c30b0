"""What stops the node, and what does not (docs/protocol.md §11): a fault of the
node's own machinery (its store, its keystore, its disk, its clock ceiling) is local and ends
`run` with exit 1; anything else raised while a received message is handled is that message's
fault, refused and surfaced (reason `unclassified`), never an exit: a message from outside,
redelivered after every restart, must not keep a node down."""
from __future__ import annotations

import sqlite3

from firmware_bridge import KeystoreError

from .core.clock import ClockError
from .store.db import StoreError

# Not MemoryError: a message that makes handling it run out of memory is refused and acknowledged,
# never handed back by the broker to do it again after every restart.
LOCAL_FAULTS: tuple[type[BaseException], ...] = (sqlite3.Error, OSError, StoreError, KeystoreError, ClockError)


def describe(e: BaseException) -> str:
    """The refusal's detail: the exception's type and first words (its traceback goes to the log)."""
    text = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {text}"[:200] if text else type(e).__name__
