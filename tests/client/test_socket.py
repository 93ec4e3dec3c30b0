"""The control socket's session protocol against a real `ssp-agent run`: hostile requests (a
malformed line, an oversize one, a wrong version, an unknown op, a request inside a subscription
stream, a watcher that stops reading) each get an error and end their own connection while the
agent keeps serving everyone else; the CLI's one-verb-per-connection use keeps working."""
from __future__ import annotations

import json
import os
import threading

from agent.client import Client
from agent.control import MAX_REQUEST
from tests.cli_cmd import run_cli

from .helpers import T, Raw, running


def _serving(home) -> None:
    """The agent still serves: the CLI through its socket, and a client session."""
    st = run_cli("--home", home, "status")
    assert st.returncode == 0 and "run" in json.loads(st.stdout), st.stderr
    with Client(home) as c:
        assert c.read(T, {"device": "alive", "seq": 0}).state == "absent"


def test_hostile_requests_end_their_connection_not_the_agent(broker, tmp_path):
    with running(tmp_path, broker) as home:
        # a first line that is not JSON: answered in a form the CLI and a session both read
        r = Raw(home)
        r.send(b"{not json\n")
        assert [x.get("error") for x in r.rest()] == ["malformed"]
        # an oversize first line (no newline ever comes)
        r = Raw(home)
        r.send(b"x" * (MAX_REQUEST + 10))
        r.s.shutdown(1)
        assert [x.get("error") for x in r.rest()] == ["too_large"]
        # a version this agent does not speak
        r = Raw(home)
        ans = r.hello(version=99)
        assert ans["error"] == "version" and ans["versions"] == [1]
        assert r.rest() == []
        # inside a session: a line that is not JSON, an unknown op, an oversize request
        for bad, err in ((b"{oops\n", "malformed"), (json.dumps({"op": "format_disk", "id": 7}).encode() + b"\n",
                                                     "malformed"),
                         (b"[" * (MAX_REQUEST + 1), "too_large"),
                         (json.dumps({"op": "write", "table": T, "key": {"device": "d", "seq": 1},
                                      "set": {"temp": {"nested": 1}}}).encode() + b"\n", "malformed"),
                         (json.dumps({"op": "write", "table": T, "key": {"device": "d", "seq": 1},
                                      "set": {"temp": 1.0}, "request_id": "x" * 65}).encode() + b"\n", "malformed")):
            r = Raw(home)
            assert r.hello()["ok"] is True
            r.send(bad)
            if err == "too_large":
                r.s.shutdown(1)
            got = r.rest()
            assert [x.get("error") for x in got] == [err], got
        # a request cut short: the client closes its side halfway through the line
        r = Raw(home)
        assert r.hello()["ok"] is True
        r.send(b'{"op": "write_many", "writes": [{"table": "app.rea')
        r.s.shutdown(1)
        assert [x.get("error") for x in r.rest()] == ["malformed"]
        # a request inside a subscription stream
        r = Raw(home)
        assert r.hello()["ok"] is True
        r.send({"op": "watch", "since": 0, "id": 1})
        assert r.line() == {"id": 1, "ok": True, "cursor": 0}
        r.send({"op": "ping"})
        assert [x.get("error") for x in r.rest()] == ["malformed"]
        # ... and an acknowledgement of a record never sent
        r = Raw(home)
        assert r.hello()["ok"] is True
        r.send({"op": "watch", "since": 0})
        assert r.line()["ok"] is True
        r.send({"ack": 10 ** 9})
        assert [x.get("error") for x in r.rest()] == ["malformed"]
        # a session's refusal is an answer, and the session goes on
        r = Raw(home)
        r.hello()
        r.send({"op": "write", "id": 2, "table": "app.nope", "key": {}, "set": {}})
        a = r.line()
        assert a["id"] == 2 and a["error"] == "refused" and "no table" in a["message"]
        r.send({"op": "ping", "id": 3})
        assert r.line() == {"id": 3, "ok": True}
        r.close()
        _serving(home)


def test_a_watcher_that_stops_reading_is_cut_off_and_resumes_from_its_cursor(broker, tmp_path):
    with running(tmp_path, broker, {"SSP_AGENT_WATCH_STALL_S": "1"}) as home:
        stalled = Raw(home)
        window = stalled.hello()["window"]
        assert window["stall_s"] == 1.0 and 0 < window["records"] < 5000
        # it never acknowledges: the agent sends at most its window, whatever the kernel buffers
        stalled.send({"op": "watch", "since": 0})
        assert stalled.line()["ok"] is True
        # far more than a socket buffer holds, while the stalled watcher reads nothing
        note = "n" * 200
        with Client(home) as c:
            for b in range(10):
                c.write_many([(T, {"device": "s", "seq": b * 500 + i}, {"temp": 1.0, "note": note})
                              for i in range(500)])
        _serving(home)   # the apply path and the socket were never held up
        # the stalled watcher now reads: its stream ends (cut off), having carried only whole
        # records in order, then perhaps the "behind" notice
        data = stalled.f.read()
        got = []
        for ln in data.split(b"\n")[:-1]:
            rec = json.loads(ln)
            if "error" in rec:
                assert rec["error"] == "behind" and rec["cursor"] == (got[-1] if got else 0)
                break
            got.append(rec["cursor"])
        assert got == list(range(1, len(got) + 1)) and len(got) <= window["records"]
        # resuming from its cursor misses nothing (through windows it acknowledges as it reads)
        with Client(home) as c:
            rest = [r["cursor"] for r in c.watch(since=got[-1] if got else 0, idle_s=2)]
        assert got + rest == list(range(1, 5001))


def test_a_watcher_that_consumes_slowly_but_acknowledges_is_never_cut_off(broker, tmp_path):
    import time
    # a stall time the client's acknowledgements (every quarter of it) beat by 6 s on any machine
    with running(tmp_path, broker, {"SSP_AGENT_WATCH_STALL_S": "8"}) as home:
        with Client(home) as c:
            raw = Raw(home)
            window = raw.hello()["window"]["records"]
            raw.close()
            n = window + 50
            c.write_many([(T, {"device": "slow", "seq": i}, {"temp": 1.0}) for i in range(n)])
            # the agent fills the window at once; consuming half of it takes longer than the stall
            # time, so only the acknowledgements made while consuming keep this watcher on
            got = []
            for r in c.watch([T], since=0, idle_s=3):
                got.append(r["cursor"])
                time.sleep(16.0 / window)   # half a window: 8 s
        assert got == list(range(1, n + 1))


def test_a_named_group_connects_through_the_extra_socket(broker, tmp_path):
    import grp
    group = grp.getgrgid(os.getgid()).gr_name
    extra = tmp_path / "run" / "app.sock"
    extra.parent.mkdir()
    with running(tmp_path, broker, {"SSP_AGENT_CONTROL_SOCKET": str(extra), "SSP_AGENT_CONTROL_GROUP": group}) \
            as home:
        st = os.stat(extra)
        assert st.st_mode & 0o777 == 0o660 and st.st_gid == os.getgid()
        assert os.stat(home / "control.sock").st_mode & 0o777 == 0o600
        # applications only: the CLI's verbs stay with the home's own socket
        import socket as so
        s = so.socket(so.AF_UNIX, so.SOCK_STREAM)
        s.connect(str(extra))
        s.sendall(json.dumps({"argv": ["--home", str(home), "peer", "list"]}).encode() + b"\n")
        ans = json.loads(s.makefile("rb").readline())
        s.close()
        assert ans["exit"] == 2 and ans["error"] == "refused" and ans["stdout"] == ""
        with Client(socket_path=extra) as c:
            c.write(T, {"device": "g", "seq": 1}, set={"temp": 2.5})
            assert c.value(T, {"device": "g", "seq": 1}, "temp") == (2.5, "materialized")
    assert not extra.exists()


def test_the_cli_and_sessions_share_the_socket(broker, tmp_path):
    with running(tmp_path, broker) as home:
        results = []

        def writer(k):
            with Client(home) as c:
                results.append(len(c.write_many([(T, {"device": f"w{k}", "seq": i}, {"temp": 0.5})
                                                 for i in range(20)])))
        ts = [threading.Thread(target=writer, args=(k,)) for k in range(4)]
        for t in ts:
            t.start()
        p = run_cli("--home", home, "write", T, "--key", '{"device": "cli", "seq": 1}', "--set", '{"temp": 1.5}')
        for t in ts:
            t.join()
        assert p.returncode == 0 and len(p.stdout.strip()) == 64
        assert results == [20] * 4
        dump = json.loads(run_cli("--home", home, "dump").stdout)[T]
        assert len(dump) == 81


def test_sessions_held_open_never_lock_out_the_cli(broker, tmp_path):
    from agent.control import MAX_SESSIONS
    with running(tmp_path, broker) as home:
        held = []
        for _ in range(MAX_SESSIONS):
            r = Raw(home)
            assert r.hello()["ok"] is True
            held.append(r)
        extra = Raw(home)
        ans = extra.hello()
        assert ans["error"] == "busy" and extra.rest() == []
        _cli_serving = run_cli("--home", home, "status")
        assert _cli_serving.returncode == 0 and "run" in json.loads(_cli_serving.stdout)
        held.pop().close()
        _serving(home)
        for r in held:
            r.close()
