"""While `ssp-agent run` holds a home, `status`, `dump`, `events`, `log` and `write`
work, forwarded through the running agent's control socket (HOME/control.sock, 0600) and executed
on its own node: one writer, the bridge's persist-before-release intact. A script writes a reading
every 0.2 s through the CLI while the agent syncs with a second running node: none is lost and the
second node converges."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import time

from tests.cli_cmd import agent_cmd, agent_env, run_cli

from .helpers import T, make_nodes, start_run, stop_run, wait_serving

READINGS = 25  # one every 0.2 s: five seconds of writing








def test_cli_verbs_reach_the_running_agent_and_writes_sync(broker, tmp_path):
    a, b = make_nodes(tmp_path, 2)
    ha, hb = a.home, b.home
    a.close(); b.close()
    pa, pb = start_run(ha, broker), start_run(hb, broker)
    try:
        wait_serving(ha, pa)
        wait_serving(hb, pb)
        assert stat.S_IMODE(os.stat(ha / "control.sock").st_mode) == 0o600
        st = json.loads(run_cli("--home", ha, "status").stdout)
        assert st["site_id"] == a.site_id.hex() and st["run"]["pid"] == pa.pid
        # the sensor script: a reading every 0.2 s through the CLI while the agent syncs
        written = {}
        t0 = time.monotonic()
        for i in range(READINGS):
            time.sleep(max(0.0, t0 + 0.2 * i - time.monotonic()))
            p = run_cli("--home", ha, "write", T, "--key", json.dumps({"device": "sensor", "seq": i}),
                        "--set", json.dumps({"temp": 20.0 + i / 10}))
            assert p.returncode == 0, p.stderr
            written[p.stdout.strip()] = i
            if i % 8 == 0:  # inspection while it runs
                for verb in ("status", "events", "log", "dump"):
                    q = run_cli("--home", ha, verb)
                    assert q.returncode == 0, (verb, q.stderr)
        assert len(written) == READINGS
        # a refusal is forwarded as one: exit 2, the reason on stderr, nothing written
        p = run_cli("--home", ha, "write", "app.nope", "--key", "{}", "--set", "{}")
        assert p.returncode == 2 and "no table" in p.stderr, (p.returncode, p.stderr)
        # none lost: every event_id the script got is in the running node's log
        log = [json.loads(line) for line in run_cli("--home", ha, "log").stdout.splitlines()]
        assert set(written) <= {e["event_id"] for e in log}
        # the second node converges (asked through its own running agent)
        want = {i: 20.0 + i / 10 for i in range(READINGS)}
        deadline = time.monotonic() + 60
        got = {}
        while time.monotonic() < deadline:
            rows = json.loads(run_cli("--home", hb, "dump").stdout)[T]
            got = {r["key"]["seq"]: r["values"].get("temp") for r in rows if r["key"]["device"] == "sensor"}
            if got == want:
                break
            time.sleep(0.2)
        assert got == want
        sa, sb = stop_run(pa), stop_run(pb)
        assert sb["applied"] >= READINGS and sa["pushed"] >= READINGS
    finally:
        for p in (pa, pb):
            if p.poll() is None:
                p.kill()
                p.wait()
    # stopped: the socket is gone and the verbs open the home themselves again
    assert not (ha / "control.sock").exists()
    log = [json.loads(line) for line in run_cli("--home", ha, "log").stdout.splitlines()]
    assert set(written) <= {e["event_id"] for e in log}


def test_a_stale_socket_left_by_a_killed_agent_does_not_block(broker, tmp_path):
    (a,) = make_nodes(tmp_path, 1)
    ha = a.home
    a.close()
    p = start_run(ha, broker)
    try:
        wait_serving(ha, p)
    finally:
        p.kill()  # SIGKILL: no chance to remove the socket
        p.wait()
    assert (ha / "control.sock").exists()
    q = run_cli("--home", ha, "write", T, "--key", '{"device": "d", "seq": 1}', "--set", '{"temp": 1.5}')
    assert q.returncode == 0, q.stderr
    # and a new `run` takes the home over, socket and all
    p = start_run(ha, broker)
    try:
        wait_serving(ha, p)
        assert json.loads(run_cli("--home", ha, "status").stdout)["events"] == 1
    finally:
        stop_run(p)


def test_run_keeps_retrying_a_broker_that_is_down_at_start(tmp_path):
    """A device that boots before its gateway. `run` does not exit (systemd restarts
    are the backstop, not the plan): it serves its control socket (writes keep working) and syncs
    once the broker comes up."""
    from agent.transport.broker import Broker, free_port
    a, b = make_nodes(tmp_path, 2)
    ha, hb = a.home, b.home
    a.close(); b.close()
    port = free_port()
    url = f"mqtt://127.0.0.1:{port}"
    pa = subprocess.Popen([*agent_cmd(), "--home", str(ha), "run", "--broker", url, "--cadence", "0.3",
                           "--connect-timeout", "1"], env=agent_env(), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
    br = pb = None
    try:
        wait_serving(ha, pa)
        p = run_cli("--home", ha, "write", T, "--key", '{"device": "early", "seq": 1}', "--set", '{"temp": 3.5}')
        assert p.returncode == 0, p.stderr
        assert pa.poll() is None  # still running, broker or not
        br = Broker(port=port, workdir=tmp_path / "broker").start()
        pb = subprocess.Popen([*agent_cmd(), "--home", str(hb), "run", "--broker", url, "--cadence", "0.3"],
                              env=agent_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_serving(hb, pb)
        deadline = time.monotonic() + 60
        rows = []
        while time.monotonic() < deadline:
            rows = [r for r in json.loads(run_cli("--home", hb, "dump").stdout)[T] if r["key"]["device"] == "early"]
            if rows:
                break
            time.sleep(0.2)
        assert rows and rows[0]["values"]["temp"] == 3.5
        stop_run(pa)
        stop_run(pb)
    finally:
        for p in (pa, pb):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        if br is not None:
            br.close()
