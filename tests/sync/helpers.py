"""Builders for sync tests: meshes of real Nodes joined by in-memory links."""
from __future__ import annotations

import json
from pathlib import Path

import nacl.signing

from agent.core import cose, events as ev
from agent.node import Node
from agent.simpeer import NOTES_TABLE, readings_table
from agent.store import db
from agent.sync import SyncDriver
from agent.transport.memory import Faults, MemoryLink, Pair

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")
T = "app.readings"
NOW = 1_790_000_000_000

TABLES = readings_table() + NOTES_TABLE + """
[[tables]]
schema = "sec"
name = "keys"
category = "never_syncable"
key = ["id"]
columns = { id = "text", secret = "blob" }
"""


def manifest(tables: str = TABLES) -> str:
    return f'mesh_id = "{MESH.hex()}"\n' + tables


def mesh(base: Path, n: int, tables: str = TABLES, authority: int | None = None) -> list[Node]:
    """n nodes that all trust each other's keys; node `authority` (if given) is the mesh authority."""
    nodes = []
    for i in range(n):
        node, _ = Node.init(base / f"n{i}", manifest(tables))
        nodes.append(node)
    for a in nodes:
        for b in nodes:
            if a is not b:
                a.add_peer(b.site_id, bytes(db.get_meta(b.conn, "public_key")), None)
    if authority is not None:
        auth = nodes[authority].site_id.hex()
        for i, nd in enumerate(nodes):
            nd.conn.execute("INSERT OR REPLACE INTO meta VALUES ('authorities', ?)", (json.dumps([auth]),))
            nd.authorities = {nodes[authority].site_id}
    return nodes


def reopen(node: Node) -> Node:
    home = node.home
    node.close()
    return Node.open(home)


def pair(da: SyncDriver, db_: SyncDriver, faults: Faults | None = None, seed: int = 0, path: str = "memory",
         **kw) -> Pair:
    a = da.session(path, db_.node.site_id, secure=True, **kw)
    b = db_.session(path, da.node.site_id, secure=True, **kw)
    return Pair(a, b, MemoryLink(faults or Faults(), seed=seed))


def sync(da: SyncDriver, db_: SyncDriver, now: int, faults: Faults | None = None, seed: int = 0,
         cycles: int = 1, **kw) -> int:
    """Handshake, then `cycles` batch exchanges started by `da`. Returns the time reached."""
    p = pair(da, db_, faults, seed, **kw)
    p.start(now)
    t = p.run(now, now + 60_000)
    for _ in range(cycles):
        t = p.exchange(t + 1, t + 60_000)
    return t


def partial_exchange(da: SyncDriver, db_: SyncDriver, now: int, faults: Faults, seed: int, cut: int) -> int:
    """An exchange over a faulty link that the simulation stops after `cut` ms, in whatever state
    it is (bodies in flight are lost with the session). Returns the time reached."""
    p = pair(da, db_, faults, seed, cycle_ms=40)
    p.start(now)
    return p.run(now, now + cut, idle_stop=False) + 1


def sync_until_quiet(drivers: list[SyncDriver], now: int, max_rounds: int = 50) -> int:
    """Every ordered pair exchanges, round after round, until no node's log grows."""
    t = now
    for _ in range(max_rounds):
        before = [len(list(d.node.log_entries())) for d in drivers]
        cur = [st_cursors(d) for d in drivers]
        for i, a in enumerate(drivers):
            for j, b in enumerate(drivers):
                if i != j:
                    t = sync(a, b, t + 1)
        after = [len(list(d.node.log_entries())) for d in drivers]
        if before == after and cur == [st_cursors(d) for d in drivers]:
            return t
    raise AssertionError("no quiescence")


def st_cursors(d: SyncDriver):
    return d.conn.execute("SELECT peer, path, live FROM sync_cursors ORDER BY 1,2").fetchall()


def log_set(node: Node) -> set[str]:
    return {e["event_id"] for e in node.log_entries()}


class Signer:
    """A raw Ed25519 site (not a node) for hostile or synthetic events."""

    def __init__(self, site_id: bytes | None = None) -> None:
        import os
        self.site_id = site_id or os.urandom(16)
        self.key = nacl.signing.SigningKey.generate()

    @property
    def public_key(self) -> bytes:
        return bytes(self.key.verify_key)

    def sign(self, tbs: bytes) -> bytes:
        return self.key.sign(tbs).signature

    def event(self, table: str, key: dict, values: dict | None, hlc: tuple[int, int], delete: bool = False,
              kid: bytes | None = None) -> bytes:
        schema, name = table.split(".", 1)
        pb = ev.payload_bytes(schema, name, key, "delete" if delete else "upsert", None if delete else values, hlc)
        protected = cose.protected_header(cose.ALG_EDDSA, ev.EVENT_CONTENT_TYPE, kid or self.site_id)
        return cose.assemble(protected, pb, self.sign(cose.sig_structure(protected, MESH, pb)))
