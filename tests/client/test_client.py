"""`agent.client` on a home no agent runs on (it opens the home itself, in its turn) and on one
`ssp-agent run` holds (a persistent session): the same writes, reads with each value's state, and
the change feed; importing it costs a program no agent module; `ssp-agent watch` prints the feed."""
from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from agent.client import Client, ClientError, RequestRefused
from tests.cli_cmd import agent_env, run_cli

from .helpers import BLOBS, T, make_nodes, running

HEAVY = ("cbor2", "nacl", "cryptography", "sqlite3", "agent.node", "agent.store", "agent.core", "agent.cli")


def test_importing_the_client_loads_no_agent_machinery():
    code = "import json, sys, agent.client; print(json.dumps(sorted(sys.modules)))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=agent_env(), check=True)
    mods = json.loads(p.stdout)
    assert [m for m in mods for h in HEAVY if m == h or m.startswith(h + ".")] == []


def _exercise(c: Client) -> None:
    k1, k2 = {"device": "c", "seq": 1}, {"device": "c", "seq": 2}
    eid = c.write(T, k1, set={"temp": 1.5, "note": "one"})
    assert len(eid) == 64
    ids = c.write_many([(T, k2, {"temp": 2.5}), {"table": T, "key": k1, "delete": True},
                        {"table": T, "key": {"device": "c", "seq": 3}, "set": {"note": "three"}}])
    assert len(set(ids)) == 3
    assert c.read(T, k1).state == "deleted" and c.value(T, k1, "note") == (None, "deleted")
    assert c.value(T, k2, "temp") == (2.5, "materialized")
    assert c.value(T, k2, "note") == (None, "unmaterialized")
    assert c.read(T, {"device": "c", "seq": 9}).state == "absent"
    with pytest.raises(RequestRefused, match="no table"):
        c.write("app.nope", {"id": 1}, set={"v": 1})
    with pytest.raises(RequestRefused, match="does not fit"):
        c.write(T, k1, set={"temp": 20})
    with pytest.raises(ClientError):
        c.write(T, k1)
    recs = list(c.watch([T], since=0, idle_s=1))
    assert [(r["key"]["seq"], r["op"]) for r in recs] == [(1, "upsert"), (2, "upsert"), (1, "delete"), (3, "upsert")]
    assert recs[0]["event_id"] == eid and recs[1]["columns"]["temp"]["value"] == 2.5
    # the row's first values were cleared by its delete since: kept nowhere, said so
    assert recs[0]["columns"]["note"] == {"superseded": True, "site": recs[0]["site"], "hlc": recs[0]["hlc"]}


def test_without_a_running_agent_the_client_opens_the_home_itself(tmp_path):
    node, = make_nodes(tmp_path, 1)
    home = node.home
    node.close()
    with Client(home) as c:
        _exercise(c)
    # the CLI's watch reads the same feed, as JSON lines; an expired cursor is a refusal
    p = run_cli("--home", home, "watch", "--since", "2", "--idle", "0")
    assert p.returncode == 0, p.stderr
    assert [json.loads(x)["cursor"] for x in p.stdout.splitlines()] == [3, 4]


def test_with_run_the_client_keeps_one_session_and_follows_changes(broker, tmp_path):
    with running(tmp_path, broker, manifest=BLOBS) as home:
        with Client(home) as c:
            _exercise(c)
            seen: list[dict] = []

            def follow():
                with Client(home) as w:
                    for r in w.watch([T], since=4):   # the four records _exercise made
                        seen.append(r)
                        if len(seen) == 2:
                            return
            t = threading.Thread(target=follow)
            t.start()
            for i in range(2):
                c.write(T, {"device": "w", "seq": i}, set={"temp": float(i), "raw": b"\x00\x01"})
            t.join(timeout=300)
            assert [r["key"] for r in seen] == [{"device": "w", "seq": 0}, {"device": "w", "seq": 1}]
            assert seen[0]["columns"]["raw"]["value"] == b"\x00\x01"
        p = run_cli("--home", home, "watch", "--table", T, "--since", "4", "--idle", "1")
        assert p.returncode == 0, p.stderr
        assert [json.loads(x)["key"]["device"] for x in p.stdout.splitlines()] == ["w", "w"]
