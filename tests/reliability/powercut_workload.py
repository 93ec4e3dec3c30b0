"""The workload the power-cut harness records (tests/reliability/powercut.py), run as
`python -m tests.reliability.powercut_workload CONFIG.json` with the shim LD_PRELOADed (the
CLI `write`s it starts inherit it). 200 events by default, in a seeded order:

- CLI `write` (the command under test, tests/cli_cmd.py), one event each: 20 % of the events;
- `Node.write_many` batches of 10: 40 %;
- mailbox imports of the peer's bodies (20 events each: half of them eight days old, so the
  profile's eviction takes them; a few up to a minute ahead of this clock), each followed by an
  export to the peer that carries this node's signed answer: 40 %;
- eviction: the profile's job (`run_eviction`) after imports, and a manual horizon over this
  node's own older writes (`evict_table`).

Every acknowledgement is written as a marker (one JSON line) to the shim's marker file right after
the call returned, so the trace orders it after every operation the call made."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

T = "app.readings"
DAY_MS = 86_400_000


def main(cfg_path: str) -> int:
    cfg = json.loads(Path(cfg_path).read_text())
    import nacl.signing

    from agent.sync import export_mailbox_body as export_body, import_mailbox_body as import_body
    from agent.node import Node, now_ms
    from agent.simpeer import SimPeer
    from tests.cli_cmd import agent_cmd, agent_env

    home = Path(cfg["home"])
    rng = random.Random(cfg["seed"])
    peer = SimPeer(bytes.fromhex(cfg["mesh_id"]), bytes.fromhex(cfg["peer_site_id"]),
                   nacl.signing.SigningKey(bytes.fromhex(cfg["peer_seed"])))
    mark_fd = os.open(cfg["mark"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def mark(**kw) -> None:
        os.write(mark_fd, (json.dumps(kw) + "\n").encode())

    total = cfg["events"]
    n_cli, n_many = total // 5, (total * 2) // 5
    n_import = total - n_cli - n_many
    steps = ["cli"] * n_cli + ["many"] * (n_many // 10) + ["import"] * (n_import // 20)
    rng.shuffle(steps)
    node = None
    seq = 0
    peer_seq = 0
    own_hlcs: list[tuple[int, int]] = []
    mbox = Path(cfg["mailbox_dir"])
    mbox.mkdir(parents=True, exist_ok=True)
    for k, step in enumerate(steps):
        if step == "cli":
            if node is not None:     # the CLI needs the home to itself (the journal's lock)
                node.close()
                node = None
            seq += 1
            p = subprocess.run([*agent_cmd(), "--home", str(home), "write", T, "--key",
                                json.dumps({"device": "cli", "seq": seq}), "--set", json.dumps({"temp": seq + 0.5})],
                               capture_output=True, text=True, env=agent_env(), timeout=120)
            if p.returncode != 0:
                print(f"workload: cli write failed: {p.stderr}", file=sys.stderr)
                return 1
            mark(k="ack", how="cli", ids=[p.stdout.strip()])
            continue
        if node is None:
            node = Node.open(home)
        if step == "many":
            batch = []
            for _ in range(10):
                seq += 1
                batch.append((T, {"device": "many", "seq": seq}, {"temp": seq + 0.25, "note": f"n{seq}"}, False))
            ids = node.write_many(batch)
            mark(k="ack", how="write_many", ids=[i.hex() for i in ids])
            own_hlcs += [tuple(r) for r in node.conn.execute(
                "SELECT hlc_p, hlc_l FROM events WHERE event_id IN (%s)" % ",".join("?" * len(ids)), ids)]
        else:
            now = now_ms()
            events, hlcs = [], []
            for j in range(20):
                peer_seq += 1
                if j % 2 == 0:
                    hlc = (now - 8 * DAY_MS + peer_seq, 0)        # old: the profile's eviction takes it
                elif j % 7 == 1:
                    hlc = (now + rng.randrange(1, 60_000), 0)      # ahead of this clock, within the skew bound
                else:
                    hlc = (now - rng.randrange(1, 5_000), 0)
                hlcs.append(hlc)
                events.append(peer.event(T, {"device": "peer", "seq": peer_seq}, {"temp": peer_seq + 0.75}, hlc))
            result = import_body(node, peer.body(events))
            applied = result.get("applied", 0) + result.get("duplicate", 0)
            if applied != len(events):
                print(f"workload: import applied {result}", file=sys.stderr)
                return 1
            from agent.core.events import event_id
            mark(k="ack", how="import", ids=[event_id(e).hex() for e in events],
                 hlcs=[list(h) for h in hlcs])
            out = export_body(node, peer.site_id, mbox / f"to-peer-{k}.ssp")
            mark(k="answered", how="export", answers=out["answers"])
            if rng.random() < 0.5:
                rep = node.run_eviction()
                mark(k="evicted", how="auto", report={q: t["events_deleted"] for q, t in rep["tables"].items()})
        if own_hlcs and k % 9 == 8:
            # a manual horizon over this node's own older writes (a third of them)
            h = sorted(own_hlcs)[len(own_hlcs) // 3]
            if node.tables[T].horizon is None or h > node.tables[T].horizon:
                n = node.evict_table(T, h)
                mark(k="evicted", how="manual", horizon=list(h), deleted=n)
    if node is not None:
        node.close()
    mark(k="done", t=time.time())
    os.close(mark_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
