"""A one-node demo: create a node, write to it, import a mailbox body of events signed by
simulated peers, print the resulting tables and what was surfaced."""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

from agent.cli import to_json
from agent.mailbox import import_body
from agent.node import Node
from agent.simpeer import SimPeer

MESH = bytes.fromhex("5e55a9e7000000000000000000000001")


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="ssp-demo-"))
    alice, bob = SimPeer(MESH), SimPeer(MESH)
    manifest = f'mesh_id = "{MESH.hex()}"\n' + alice.manifest_peer() + bob.manifest_peer() + """
[[tables]]
schema = "app"
name = "readings"
category = "syncable"
key = ["device", "seq"]
columns = { device = "text", seq = "integer", temp = "real", note = "text" }
"""
    print(f"[1/4] creating a node in {root / 'node'}")
    node, pk = Node.init(root / "node", manifest)
    print(f"      site_id {node.site_id.hex()}  public key {pk.hex()}")
    print("[2/4] writing two local readings")
    node.write("app.readings", {"device": "local", "seq": 1}, {"temp": 21.5, "note": "boot"})
    node.write("app.readings", {"device": "local", "seq": 2}, {"temp": 21.7})
    now = time.time_ns() // 1_000_000
    print("[3/4] importing a mailbox body from two simulated peers (with a duplicate, a forgery, a delete)")
    evs = [alice.event("app.readings", {"device": "alice", "seq": 1}, {"temp": 18.0}, (now, 0)),
           bob.event("app.readings", {"device": "bob", "seq": 1}, {"temp": 30.1, "note": "hot"}, (now, 0)),
           bob.event("app.readings", {"device": "alice", "seq": 1}, {"note": "checked by bob"}, (now, 1)),
           alice.event("app.readings", {"device": "bob", "seq": 1}, None, (now, 2), delete=True)]
    evs.append(evs[0])
    evs.append(bob.sign_payload(b"\xa0", kid=alice.site_id))
    result = import_body(node, alice.body(evs))
    print("      " + json.dumps({k: result[k] for k in ("applied", "duplicate", "dropped", "rejected", "held")}))
    print("[4/4] materialized tables:")
    print(json.dumps(to_json(node.dump()), indent=2))
    print("surfaced:", json.dumps([{k: s[k] for k in ("kind", "reason")} for s in node.surfaced()]))
    node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
