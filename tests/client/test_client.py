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


def _events_of(home, device: str) -> list[dict]:
    return [r for r in Client(home).watch([T], since=0, idle_s=0) if r["key"]["device"] == device]


def test_a_write_retried_after_its_answer_was_lost_is_one_event(broker, tmp_path):
    """The agent applied the write and the answer was lost with the connection: the client's retry
    (the same request id) is answered with the first attempt's event ids, never signs a second
    event; also when `run` restarted between the attempt and the retry."""
    from .helpers import SwallowingProxy, start_run, stop_run, wait_serving
    with running(tmp_path, broker) as home:
        proxy = SwallowingProxy(tmp_path / "p.sock", home / "control.sock")
        try:
            with Client(socket_path=tmp_path / "p.sock") as c:
                ids = c.write_many([(T, {"device": "once", "seq": 1}, {"temp": 1.0}),
                                    (T, {"device": "once", "seq": 2}, {"temp": 2.0})])
            assert proxy.swallowed.is_set() and proxy.connections == 2
            recs = _events_of(home, "once")
            assert [r["event_id"] for r in recs] == ids
        finally:
            proxy.close()
    # the answer lost, then `run` restarted before the retry reaches it
    node, = make_nodes(tmp_path / "again", 1)
    home = node.home
    node.close()
    proc = start_run(home, broker)
    proxy = SwallowingProxy(tmp_path / "q.sock", home / "control.sock")
    try:
        wait_serving(home, proc)
        proxy.gate.clear()
        got: list = []
        t = threading.Thread(target=lambda: got.append(Client(socket_path=tmp_path / "q.sock").write(
            T, {"device": "twice", "seq": 1}, set={"temp": 3.0})))
        t.start()
        assert proxy.swallowed.wait(300)
        stop_run(proc)
        proc = start_run(home, broker)
        wait_serving(home, proc)
        proxy.gate.set()
        t.join(timeout=300)
        assert [r["event_id"] for r in _events_of(home, "twice")] == got
        stop_run(proc)
    finally:
        proxy.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_request_id_is_answered_once_and_only_for_its_own_writes(tmp_path):
    """The path a client takes when it opens the home itself (no agent): the same request id is
    the same events; reused for other writes, it is refused."""
    from agent.clientops import write_once
    from agent.errors import NodeError
    node, = make_nodes(tmp_path, 1)
    try:
        w = [(T, {"device": "r", "seq": 1}, {"temp": 1.0}, False)]
        first = write_once(node, w, "req-1")
        assert write_once(node, w, "req-1") == first
        assert node.conn.execute("SELECT count(*) FROM events").fetchone()[0] == 1
        with pytest.raises(NodeError, match="other writes"):
            write_once(node, [(T, {"device": "r", "seq": 2}, {"temp": 1.0}, False)], "req-1")
        # what it keeps of a write is no fingerprint of its values (docs/reliability.md)
        import hashlib
        import json
        kept = node.conn.execute("SELECT digest FROM client_requests").fetchone()[0]
        assert kept == hashlib.sha256(json.dumps([[T, {"device": "r", "seq": 1}, ["temp"], False]],
                                                 sort_keys=True).encode()).digest()
        assert write_once(node, w, "req-2") != first
    finally:
        node.close()
