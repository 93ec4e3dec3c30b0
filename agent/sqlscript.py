"""A DDL script as single statements: the versioned layouts run each step's statements inside the
step's own transaction (agent/store/migrations.py for the node's store, agent/sequencer/layout.py
for the sequencer's files), and ``executescript`` would COMMIT it first. Shared by both, so it
lives apart from either (the sequencer never imports the sync node)."""
from __future__ import annotations

import sqlite3


def statements(script: str) -> list[str]:
    """The statements of ``script``, each ending in its `;`; a `;` inside a comment or a string
    does not end one (sqlite3.complete_statement decides)."""
    out, buf = [], ""
    for part in script.split(";"):
        buf += part + ";"
        if sqlite3.complete_statement(buf):
            if buf.strip(" \n;"):
                out.append(buf)
            buf = ""
    return out
