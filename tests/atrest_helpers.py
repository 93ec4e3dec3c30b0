"""Test helpers for homes whose event log is sealed at rest (agent/store/atrest.py)."""
from __future__ import annotations

import sqlite3
from pathlib import Path


def downgrade_to_clear(home: Path):
    """Make a home look as a release before sealing left it: clear log and held
    values, clear journal outputs, no data-key table, the layout version before sealing. Returns the LogSeal that
    opened it (its sealer opens what was sealed)."""
    from agent.node import Node
    from agent.store import atrest
    from firmware_bridge.journal import HDR, MAGIC, SEALED, encode_released, record_at, sealed_ad
    home = Path(home)
    conn, seal = Node.log_view(home)
    conn.close()
    conn = sqlite3.connect(home / "store.sqlite")
    atrest.install(conn, seal)
    for t in ("events", "held"):
        conn.execute(f"UPDATE {t} SET raw = unseal(event_id, raw)")
    conn.execute("DROP TABLE IF EXISTS atrest_keys")
    conn.execute("DELETE FROM meta WHERE key LIKE 'atrest_%'")
    from agent.store import migrations
    before = next(v for v, name, _step in migrations.MIGRATIONS if name.startswith("at-rest")) - 1
    conn.execute(f"PRAGMA user_version = {before}")
    conn.commit()
    conn.close()
    path = home / "sign-journal"
    if path.exists():
        data = path.read_bytes()
        out, pos = bytearray(MAGIC), len(MAGIC)
        while (got := record_at(data, pos, len(data))) is not None:
            rtype, ident, off, ln, end = got
            if rtype == SEALED:
                body = data[pos + HDR.size + off:pos + HDR.size + off + ln]
                out += encode_released(ident, seal.sealer.open(sealed_ad(ident), body))
            else:
                out += data[pos:end]
            pos = end
        path.write_bytes(bytes(out))
    return seal


def journal_outputs(home: Path) -> list[tuple[bytes, bytes]]:
    """(identity, clear output) of every released output in a stopped node's journal, read without
    opening the node (opening compacts), the sealed ones opened with the home's data keys."""
    from agent.node import Node
    from firmware_bridge.journal import Journal
    conn, seal = Node.log_view(home)
    conn.close()
    j = Journal(str(Path(home) / "sign-journal"), sealer=seal.sealer)
    try:
        return [(i, j.read_released(i)) for i, _loc in j.released_items()]
    finally:
        j.close()
