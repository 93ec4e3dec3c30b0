"""The power-cut workload with its writers, importer and eviction running at the same time (the
sequential one is powercut_workload.py), run as `python -m tests.reliability.powercut_mixed
CONFIG.json` under the shim by `powercut.record(..., workload=...)`. Three threads, each starting
the real CLI one command after another, so the commands race for the home and take turns
(agent/hometurn.py):

- two writers: `write`, one event each;
- an importer: `mailbox import` of the peer's bodies (20 events, half of them eight days old, so
  `evict --auto` takes them);
- an evictor: `evict --auto` (the profile's horizons), again and again until the others are done.

An acknowledgement (exit 0) is written as a marker right after the command exited, so the trace
orders it after every operation the command made. A command refused while another held the home
is not acknowledged and is counted; anything else fails the workload."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

T = "app.readings"
DAY_MS = 86_400_000


def main(cfg_path: str) -> int:
    cfg = json.loads(Path(cfg_path).read_text())
    import nacl.signing

    from agent.core.events import event_id
    from agent.node import now_ms
    from agent.simpeer import SimPeer
    from tests.cli_cmd import agent_cmd, agent_env

    home = cfg["home"]
    peer = SimPeer(bytes.fromhex(cfg["mesh_id"]), bytes.fromhex(cfg["peer_site_id"]),
                   nacl.signing.SigningKey(bytes.fromhex(cfg["peer_seed"])))
    mark_fd = os.open(cfg["mark"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    lock = threading.Lock()
    failures: list[str] = []
    counts = {"acked": 0, "not_acked": 0, "evictions": 0}

    def mark(**kw) -> None:
        os.write(mark_fd, (json.dumps(kw) + "\n").encode())   # one write: whole lines whatever the threads

    def cli(*args) -> subprocess.CompletedProcess:
        return subprocess.run([*agent_cmd(), "--home", home, *map(str, args)], capture_output=True, text=True,
                              env=agent_env(), timeout=600)

    def judged(p, what: str) -> bool:
        if p.returncode == 0:
            return True
        with lock:
            if p.returncode == 1 and ("in use" in p.stderr or "held" in p.stderr):
                counts["not_acked"] += 1     # another command kept the home past the wait: not acknowledged
            else:
                failures.append(f"{what}: exit {p.returncode}: {p.stderr.strip()[-400:]}")
        return False

    # the peer's bodies, made before anything races (outside the traced roots)
    mbox = Path(cfg["mailbox_dir"])
    mbox.mkdir(parents=True, exist_ok=True)
    bodies = []
    now = now_ms()
    n_writes, n_imports = cfg["events"] // 4, max(1, cfg["events"] // 40)   # half written, half imported
    for b in range(n_imports):
        events, hlcs = [], []
        for j in range(20):
            s = b * 20 + j
            hlc = (now - 8 * DAY_MS + s, 0) if j % 2 == 0 else (now - 5_000 + s, 0)
            hlcs.append(hlc)
            events.append(peer.event(T, {"device": "peer", "seq": s}, {"temp": s + 0.75}, hlc))
        f = mbox / f"body-{b}.ssp"
        f.write_bytes(peer.body(events))
        bodies.append((f, [event_id(e).hex() for e in events], [list(h) for h in hlcs]))

    def writer(w: int) -> None:
        for i in range(n_writes):
            p = cli("write", T, "--key", json.dumps({"device": f"w{w}", "seq": i}), "--set", json.dumps({"temp": i + 0.5}))
            if judged(p, f"writer {w}"):
                mark(k="ack", how="cli", ids=[p.stdout.strip()])
                with lock:
                    counts["acked"] += 1

    def importer() -> None:
        for f, ids, hlcs in bodies:
            p = cli("mailbox", "import", f)
            if judged(p, "import"):
                got = json.loads(p.stdout)
                if got.get("applied", 0) + got.get("duplicate", 0) != len(ids):
                    failures.append(f"import of {f.name}: {got}")
                    return
                mark(k="ack", how="import", ids=ids, hlcs=hlcs)
                with lock:
                    counts["acked"] += len(ids)

    others = [threading.Thread(target=writer, args=(w,)) for w in range(2)] + [threading.Thread(target=importer)]
    for t in others:
        t.start()
    while any(t.is_alive() for t in others) or counts["evictions"] < 2:
        p = cli("evict", "--auto")
        if judged(p, "evict --auto"):
            rep = json.loads(p.stdout)
            mark(k="evicted", how="auto", report={q: t["events_deleted"] for q, t in rep["tables"].items()})
            counts["evictions"] += 1
        time.sleep(0.05)
    for t in others:
        t.join()
    mark(k="done", t=time.time(), counts=counts)
    os.close(mark_fd)
    if failures:
        print("workload: " + "\n".join(failures), file=sys.stderr)
        return 1
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
