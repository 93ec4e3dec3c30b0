"""The workload of the re-issue power-cut test (tests/reliability/test_powercut_reissue.py), run as
`python -m tests.reliability.powercut_reissue CONFIG.json` under the shim: three writes stamped
ten years ahead (the override trusts the clock, as a lying source would), then a writing open at
the right time, which withdraws and re-issues them (agent/clockgap.py), then one more write.
Each acknowledgement is a marker (one JSON line) with the write's key and value."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

T = "app.readings"
TEN_YEARS_MS = 3650 * 86_400_000
WRITES = [({"device": "a", "seq": 0}, {"temp": 2.5}), ({"device": "a", "seq": 1}, {"temp": 3.5}),
          ({"device": "a", "seq": 0}, {"temp": 7.5})]
LATER = ({"device": "a", "seq": 2}, {"temp": 9.5})


def main(cfg_path: str) -> int:
    cfg = json.loads(Path(cfg_path).read_text())
    from agent.node import Node, now_ms
    home = Path(cfg["home"])
    mark_fd = os.open(cfg["mark"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def mark(**kw) -> None:
        os.write(mark_fd, (json.dumps(kw) + "\n").encode())

    fut = now_ms() + TEN_YEARS_MS
    node = Node.open(home)
    for i, (k, v) in enumerate(WRITES):
        eid = node.write(T, k, v, now=fut + i)
        mark(k="ack", how="ahead", ids=[eid.hex()], key=k, value=v)
    node.close()
    node = Node.open(home)               # the clock is right: the re-issue runs here
    mark(k="reissued")
    eid = node.write(T, *LATER)
    mark(k="ack", how="later", ids=[eid.hex()], key=LATER[0], value=LATER[1])
    node.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
