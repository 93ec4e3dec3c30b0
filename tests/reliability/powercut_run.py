"""The power-cut workload of a node syncing under `run` (tests/reliability/test_powercut_run.py),
run as `python -m tests.reliability.powercut_run CONFIG.json` under the shim by
`powercut.record(..., workload=...)`. The traced home A runs `ssp-agent run` on a real broker beside
a peer B (its own `run`, its home not traced), and while both serve:

- `write`s on A go through its control socket: each is acknowledged when the command returns;
- `write`s on B reach A through the broker: they are acknowledged once B's status shows A answered
  for every one of them (`run.peers[A].unanswered` is 0), since an answer says A holds them (§12).

A marker is written right after the acknowledgement was seen, so the trace orders it after every
operation A made before it answered. A stops on SIGTERM at the end, as the unit stops it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

T = "app.readings"
CEILING_S = 600      # a hang, not a speed


def main(cfg_path: str) -> int:
    cfg = json.loads(Path(cfg_path).read_text())
    from tests.cli_cmd import agent_cmd, agent_env

    a, b, url = cfg["home"], cfg["b_home"], cfg["broker_url"]
    a_site = json.loads(Path(a, "identity.json").read_text())["site_id"]
    mark_fd = os.open(cfg["mark"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    counts = {"acked_a": 0, "acked_b": 0, "answered_waits": 0}

    def mark(**kw) -> None:
        os.write(mark_fd, (json.dumps(kw) + "\n").encode())

    def env(home: str) -> dict:
        # B keeps its clock witness in its own directory, outside the traced roots
        return agent_env({"SSP_AGENT_WITNESS_DIR": cfg["b_witness"]} if home == b else None)

    def cli(home: str, *args) -> subprocess.CompletedProcess:
        return subprocess.run([*agent_cmd(), "--home", home, *map(str, args)], capture_output=True, text=True,
                              env=env(home), timeout=CEILING_S)

    def serving(home: str, proc) -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"run on {home} exited {proc.returncode}: {proc.communicate()[1][-2000:]}")
        q = cli(home, "status")
        return q.returncode == 0 and "run" in json.loads(q.stdout)

    def until(what: str, ok) -> None:
        deadline = time.monotonic() + CEILING_S
        while not ok():
            if time.monotonic() > deadline:
                raise RuntimeError(f"never: {what}")
            time.sleep(0.2)

    def start(home: str):
        return subprocess.Popen([*agent_cmd(), "--home", home, "run", "--broker", url, "--cadence", "0.2"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(home))

    pa, pb = start(a), start(b)
    try:
        until("both serve", lambda: serving(a, pa) and serving(b, pb))
        pending_b: list[str] = []
        for i in range(cfg["events"]):
            p = cli(a, "write", T, "--key", json.dumps({"device": "a", "seq": i}), "--set", json.dumps({"temp": i + 0.5}))
            if p.returncode != 0:
                raise RuntimeError(f"write on A: exit {p.returncode}: {p.stderr[-400:]}")
            mark(k="ack", how="run", ids=[p.stdout.strip()])
            counts["acked_a"] += 1
            p = cli(b, "write", T, "--key", json.dumps({"device": "b", "seq": i}), "--set", json.dumps({"temp": i + 0.25}))
            if p.returncode != 0:
                raise RuntimeError(f"write on B: exit {p.returncode}: {p.stderr[-400:]}")
            pending_b.append(p.stdout.strip())
            if len(pending_b) >= 3 or i == cfg["events"] - 1:
                def answered() -> bool:
                    q = cli(b, "status")
                    peer = json.loads(q.stdout)["run"]["peers"].get(a_site) if q.returncode == 0 else None
                    return peer is not None and peer["unanswered"] == 0
                until("A answered for B's writes", answered)
                mark(k="ack", how="peer", ids=pending_b)
                counts["acked_b"] += len(pending_b)
                counts["answered_waits"] += 1
                pending_b = []
    finally:
        for proc in (pa, pb):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        errs = [proc.communicate(timeout=CEILING_S)[1] for proc in (pa, pb)]
    if pa.returncode != 0 or pb.returncode != 0:
        print(f"workload: run exited {pa.returncode}/{pb.returncode}: {errs[0][-1500:]} {errs[1][-1500:]}",
              file=sys.stderr)
        return 1
    mark(k="done", t=time.time(), counts=counts)
    os.close(mark_fd)
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
