"""A home admits one writing process at a time (docs/operations.md "A running service other commands
can talk to"). A start-up or one-shot verb that finds it held by another process waits its turn
(bounded, with a line saying for whom) instead of failing at once, and goes through the service's
control socket as soon as `run` serves; `run` sent SIGTERM at any point of its start-up stops cleanly
(exit 0, its summary), never by the signal. Real subprocesses; the holders are held by events
(files), never by a sleep of some length."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time

import pytest

from tests.cli_cmd import agent_cmd, agent_env, patched_cmd, run_cli

from .helpers import T, make_nodes
from .test_live_verbs import stop_run, wait_serving

CEILING_S = 120   # catches a hang, never a slow machine

# A CLI `write` that holds the home (its node open) until the test says so.
HOLD_WRITE = """
import os, time
import agent.node as _node
_write = _node.Node.write
def _held(self, *a, **k):
    open(os.environ["T_HELD"], "w").close()
    while not os.path.exists(os.environ["T_RELEASE"]):
        time.sleep(0.05)
    return _write(self, *a, **k)
_node.Node.write = _held
"""

# A `run` that holds the home (node open, control socket not yet served) until the test says so.
HOLD_RUN_START = """
import os, time
import agent.cli.mqtt as _m
_open_runner = _m.open_runner
def _held(*a, **k):
    open(os.environ["T_HELD"], "w").close()
    while not os.path.exists(os.environ["T_RELEASE"]):
        time.sleep(0.05)
    return _open_runner(*a, **k)
_m.open_runner = _held
"""


def _one_home(tmp_path):
    (a,) = make_nodes(tmp_path, 1)
    home = a.home
    a.close()
    return home


def _wait_file(path, proc) -> None:
    deadline = time.monotonic() + CEILING_S
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the holder never got the home"
        time.sleep(0.05)


def _line_with(proc, word: str) -> str:
    """The first stderr line of `proc` containing `word` (EOF first: the process gave up)."""
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if word in line:
            return line
    proc.wait()
    raise AssertionError(f"exit {proc.returncode} without a line saying {word!r}: {''.join(seen)[-2000:]}")


def _holder(env_extra, preamble, *argv):
    return subprocess.Popen([*patched_cmd(preamble), *map(str, argv)], env=agent_env(env_extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _kill(*procs):
    for p in procs:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()


def test_run_waits_for_a_cli_write_that_holds_the_home(broker, tmp_path):
    home = _one_home(tmp_path)
    held, release = tmp_path / "held", tmp_path / "release"
    w = _holder({"T_HELD": str(held), "T_RELEASE": str(release)}, HOLD_WRITE, "--home", home, "write", T,
                "--key", '{"device": "w", "seq": 1}', "--set", '{"temp": 1.5}')
    r = None
    try:
        _wait_file(held, w)
        r = subprocess.Popen([*agent_cmd(), "--home", str(home), "run", "--broker", broker.url, "--cadence", "0.3"],
                             env=agent_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = _line_with(r, "waiting")
        assert f"pid {w.pid}" in line, line          # says for whom it waits
        release.touch()
        out, err = w.communicate(timeout=CEILING_S)
        assert w.returncode == 0, err
        eid = out.strip()
        wait_serving(home, r)
        log = [json.loads(x) for x in run_cli("--home", home, "log").stdout.splitlines()]
        assert eid in {e["event_id"] for e in log}
        stop_run(r)
    finally:
        _kill(w, r)


def test_a_cli_write_waits_for_run_starting_then_goes_through_it(broker, tmp_path):
    home = _one_home(tmp_path)
    held, release = tmp_path / "held", tmp_path / "release"
    r = _holder({"T_HELD": str(held), "T_RELEASE": str(release)}, HOLD_RUN_START, "--home", home, "run",
                "--broker", broker.url, "--cadence", "0.3")
    w = None
    try:
        _wait_file(held, r)     # `run` holds the home and serves no socket yet
        w = subprocess.Popen([*agent_cmd(), "--home", str(home), "write", T, "--key", '{"device": "w", "seq": 2}',
                              "--set", '{"temp": 2.5}'], env=agent_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        line = _line_with(w, "waiting")
        assert f"pid {r.pid}" in line, line
        release.touch()
        out, err = w.communicate(timeout=CEILING_S)
        assert w.returncode == 0, err
        wait_serving(home, r)
        log = [json.loads(x) for x in run_cli("--home", home, "log").stdout.splitlines()]
        assert out.strip() in {e["event_id"] for e in log}
        assert stop_run(r)["pushed"] >= 0
    finally:
        _kill(w, r)


def test_the_wait_is_bounded_and_says_so(tmp_path):
    home = _one_home(tmp_path)
    held, release = tmp_path / "held", tmp_path / "release"
    w = _holder({"T_HELD": str(held), "T_RELEASE": str(release)}, HOLD_WRITE, "--home", home, "write", T,
                "--key", '{"device": "w", "seq": 1}', "--set", '{"temp": 1.5}')
    try:
        _wait_file(held, w)
        q = run_cli("--home", home, "write", T, "--key", '{"device": "w", "seq": 3}', "--set", '{"temp": 3.5}',
                    env={"SSP_AGENT_HOME_WAIT": "1"})
        assert q.returncode == 1, (q.returncode, q.stderr)
        assert f"pid {w.pid}" in q.stderr and "nothing was done" in q.stderr, q.stderr
        release.touch()
        assert w.wait(timeout=CEILING_S) == 0
    finally:
        _kill(w)
    # the one that waited changed nothing; the holder's write is there
    log = [json.loads(x) for x in run_cli("--home", home, "log").stdout.splitlines()]
    assert len(log) == 1


def _summary(proc) -> dict:
    out, err = proc.communicate(timeout=CEILING_S)
    assert proc.returncode == 0, (proc.returncode, err[-2000:])
    return json.loads(out)


def test_sigterm_while_run_waits_for_its_turn(tmp_path):
    home = _one_home(tmp_path)
    held, release = tmp_path / "held", tmp_path / "release"
    w = _holder({"T_HELD": str(held), "T_RELEASE": str(release)}, HOLD_WRITE, "--home", home, "write", T,
                "--key", '{"device": "w", "seq": 1}', "--set", '{"temp": 1.5}')
    r = None
    try:
        _wait_file(held, w)
        r = subprocess.Popen([*agent_cmd(), "--home", str(home), "run", "--broker", "mqtt://127.0.0.1:1"],
                             env=agent_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _line_with(r, "waiting")
        r.send_signal(signal.SIGTERM)
        assert _summary(r)["started"] is False
        release.touch()
        assert w.wait(timeout=CEILING_S) == 0
    finally:
        _kill(w, r)


def test_sigterm_while_run_connects_to_its_broker(tmp_path):
    """A broker that accepts the connection and never answers: `run` is inside its start-up."""
    home = _one_home(tmp_path)
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(8)
    lst.settimeout(CEILING_S)
    r = subprocess.Popen([*agent_cmd(), "--home", str(home), "run", "--broker",
                          f"mqtt://127.0.0.1:{lst.getsockname()[1]}", "--connect-timeout", "600"],
                         env=agent_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        conn, _ = lst.accept()   # it is connecting
        r.send_signal(signal.SIGTERM)
        s = _summary(r)
        assert s["pushed"] == 0
        conn.close()
    finally:
        _kill(r)
        lst.close()


def _handler_installed(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


@pytest.mark.parametrize("delay", [0.0, 0.05, 0.2, 0.5, 1.0, 2.0])
def test_sigterm_at_any_point_of_the_start_up(broker, tmp_path, delay):
    """From the moment its handler exists (the first thing `run` does), SIGTERM stops it cleanly,
    whatever it is doing then (opening the home, connecting, serving)."""
    home = _one_home(tmp_path)
    r = subprocess.Popen([*agent_cmd(), "--home", str(home), "run", "--broker", broker.url],
                         env=agent_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + CEILING_S
        while not _handler_installed(r.pid):
            assert r.poll() is None, r.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.002)
        time.sleep(delay)
        r.send_signal(signal.SIGTERM)
        assert "pushed" in _summary(r)
    finally:
        _kill(r)
    assert not (home / "control.sock").exists()
    assert os.path.exists(home / "store.sqlite")


# A `run` whose loop takes no control request (they queue) and says when one waits.
RUN_NEVER_SERVES = """
import os
import agent.control as _c
def _serve(self, max_items=64):
    if not self.requests.empty():
        open(os.environ["T_QUEUED"], "w").close()
    return 0
_c.ControlServer.serve = _serve
"""


def test_a_write_the_stopping_service_never_ran_takes_its_turn_after_it(broker, tmp_path):
    """`run` restarting around a CLI write: a request still queued when the service stops was never
    run (the service says so), so the write waits for the home and runs, instead of failing."""
    home = _one_home(tmp_path)
    queued = tmp_path / "queued"
    r = _holder({"T_QUEUED": str(queued)}, RUN_NEVER_SERVES, "--home", home, "run", "--broker", broker.url,
                "--cadence", "0.3")
    w = None
    try:
        deadline = time.monotonic() + CEILING_S
        while not (home / "control.sock").exists():
            assert r.poll() is None and time.monotonic() < deadline, r.communicate()
            time.sleep(0.05)
        w = subprocess.Popen([*agent_cmd(), "--home", str(home), "write", T, "--key", '{"device": "w", "seq": 4}',
                              "--set", '{"temp": 4.5}'], env=agent_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
        _wait_file(queued, r)           # the write waits in the service's queue
        r.send_signal(signal.SIGTERM)
        assert _summary(r)["pushed"] == 0
        out, err = w.communicate(timeout=CEILING_S)
        assert w.returncode == 0, err
    finally:
        _kill(w, r)
    log = [json.loads(x) for x in run_cli("--home", home, "log").stdout.splitlines()]
    assert [e["event_id"] for e in log] == [out.strip()]


def test_cli_writes_while_run_restarts_around_them(broker, tmp_path):
    """A sensor script writing while the service is restarted again and again: every write exits 0
    and is in the log (forwarded, or waiting its turn and run by itself), none lost, none doubled."""
    import threading
    home = _one_home(tmp_path)
    restarts, done, errors = 4, threading.Event(), []

    def restarter():
        try:
            for _ in range(restarts):
                p = subprocess.Popen([*agent_cmd(), "--home", str(home), "run", "--broker", broker.url,
                                      "--cadence", "0.3"], env=agent_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
                try:
                    wait_serving(home, p)
                    stop_run(p)
                finally:
                    _kill(p)
        except BaseException as e:  # noqa: BLE001 - reported by the test thread
            errors.append(e)
        finally:
            done.set()

    t = threading.Thread(target=restarter)
    t.start()
    written, failed, i = [], [], 0
    try:
        while not done.is_set() or i < 12:
            q = run_cli("--home", home, "write", T, "--key", json.dumps({"device": "s", "seq": i}),
                        "--set", json.dumps({"temp": float(i)}))
            (written if q.returncode == 0 else failed).append(q.stdout.strip() if q.returncode == 0 else q.stderr)
            i += 1
    finally:
        t.join()
    assert not errors, errors
    assert failed == [], failed
    log = [json.loads(x) for x in run_cli("--home", home, "log").stdout.splitlines()]
    assert sorted(e["event_id"] for e in log) == sorted(written) and len(written) == i
