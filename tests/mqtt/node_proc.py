"""A node runner in its own process, for crash tests: `python node_proc.py HOME BROKER_URL MODE`.
MODE `hang_in_apply`: the first non-empty body is applied inside its transaction, then the
process announces it and hangs before committing (the test SIGKILLs it there).
MODE `hang_before_ack`: the transaction commits, then it hangs before answering and acking."""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent import apply  # noqa: E402
from agent.node import Node  # noqa: E402
from agent.runner import RunConfig, Runner  # noqa: E402
from agent.transport.mqtt import MqttSettings  # noqa: E402


def main() -> None:
    home, url, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    marker = home / "hanging"
    node = Node.open(home)
    if mode == "hang_in_apply":
        orig = apply.apply_in_txn

        def hang(st, raws, now, origin):
            raws = list(raws)
            out = orig(st, raws, now, origin)
            if origin == "remote" and raws:
                marker.write_text("in-transaction")
                time.sleep(120)
            return out
        apply.apply_in_txn = hang
    r = Runner(node, MqttSettings.from_url(url), RunConfig(cadence_s=3600, realtime=False))
    if mode == "hang_before_ack":
        orig_recv = r.sync.receive

        def recv(data, **kw):
            res = orig_recv(data, **kw)
            if res[1]:
                marker.write_text("committed")
                time.sleep(120)
            return res
        r.sync.receive = recv
    if not r.start(10):
        sys.exit(1)
    print("ready", flush=True)
    while True:
        r.step(0.05)


if __name__ == "__main__":
    main()
