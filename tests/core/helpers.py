"""Shared builders for core tests: a manifest, nodes and simulated peers."""
from __future__ import annotations

from pathlib import Path

from agent.node import Node
from agent.simpeer import SimPeer

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")
T = "app.readings"

READINGS = """
[[tables]]
schema = "app"
name = "readings"
category = "syncable"
retention = "telemetry"
key = ["device", "seq"]
columns = { device = "text", seq = "integer", temp = "real", note = "text", raw = "blob" }
"""

TABLES = READINGS + """
[[tables]]
schema = "sec"
name = "keys"
category = "never_syncable"
key = ["id"]
columns = { id = "text", secret = "blob" }

[[tables]]
schema = "app"
name = "index"
category = "node_local_derived"
key = ["id"]
columns = { id = "text", v = "integer" }
"""


def manifest(peers: list[SimPeer], extra: str = "", tables: str = TABLES) -> str:
    return f'mesh_id = "{MESH.hex()}"\n' + "".join(p.manifest_peer() for p in peers) + extra + tables


def make_node(path: Path, peers: list[SimPeer], extra: str = "", tables: str = TABLES) -> Node:
    node, _ = Node.init(path, manifest(peers, extra, tables))
    return node


def peers(n: int) -> list[SimPeer]:
    return [SimPeer(MESH) for _ in range(n)]


NOW = 1_790_000_000_000  # in the past: code that reads the real clock accepts it
