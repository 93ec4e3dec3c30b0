"""`ssp-agent sync --broker ... --once` (cli-contract.md): devices that wake, sync and sleep."""
from __future__ import annotations

import json

from agent.cli import main

from .helpers import T, event_ids, make_nodes, write


def test_sync_once_between_sleeping_devices(broker, tmp_path, capsys):
    a, b = make_nodes(tmp_path, 2)
    ida = {write(a, i, "a") for i in range(5)}
    ha, hb = str(a.home), str(b.home)
    a.close(); b.close()
    # b has never connected: its first --once creates its persistent session
    assert main(["--home", hb, "sync", "--broker", broker.url, "--once", "--timeout", "3"]) == 0
    capsys.readouterr()
    # a offers while b sleeps: the bodies wait at the broker
    assert main(["--home", ha, "sync", "--broker", broker.url, "--once", "--timeout", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["offered"] == 5 and out["pushed"] == 0  # nobody answered yet: not a successful push
    assert main(["--home", hb, "sync", "--broker", broker.url, "--once", "--timeout", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["applied"] == 5 and "pushed" in out
    from agent.node import Node
    b2 = Node.open(tmp_path / "n1")
    assert event_ids(b2) == ida and len(b2.dump()[T]) == 5
    b2.close()


def test_sync_once_unreachable_broker_exits_1(tmp_path, capsys):
    (a,) = make_nodes(tmp_path, 1)
    a.close()
    assert main(["--home", str(a.home), "sync", "--broker", "mqtt://127.0.0.1:1", "--once",
                 "--connect-timeout", "1"]) == 1
    err = capsys.readouterr().err
    assert "broker unreachable" in err and len(err.strip().splitlines()) == 1
