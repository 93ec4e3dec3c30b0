"""`ssp-agent sync --serial` / `run --serial` as real processes on real pseudo-terminals, joined
through the seeded relay (tools/serial_relay.py) that flips bits, drops, doubles, reorders and
truncates frames, stalls, and pulls the cable."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import time

import pytest

from agent.node import Node
from agent.profile import load_profile
from serial_relay import LineFaults, Relay

from ..cli_cmd import agent_cmd, agent_env
from ..mqtt.helpers import MANIFEST, T

# serial_batch_limit 12: every sync below takes several exchanges, chained one after the other.
PROFILE = dataclasses.replace(load_profile("pi-3-4"), serial_keepalive_s=0.3, serial_dead_s=1.5,
                              serial_timeout_s=20.0, cadence_s=1.0, serial_batch_limit=12)


def homes(tmp, n_a: int, n_b: int):
    nodes = [Node.init(tmp / f"n{i}", MANIFEST, profile=PROFILE)[0] for i in range(2)]
    a, b = nodes
    a.add_peer(b.site_id, b.keyring[b.site_id][0], None)
    b.add_peer(a.site_id, a.keyring[a.site_id][0], None)
    for i in range(n_a):
        a.write(T, {"device": "a", "seq": i}, {"temp": float(i), "note": "from a " * 5})
    for i in range(n_b):
        b.write(T, {"device": "b", "seq": i}, {"temp": float(i), "note": "from b " * 5})
    for x in nodes:
        x.close()
    return tmp / "n0", tmp / "n1"


def cli(home, *args, **kw):
    return subprocess.run([*agent_cmd(), "--home", str(home), *args], capture_output=True, text=True,
                          env=agent_env(), timeout=kw.pop("timeout", 120), **kw)


def spawn(home, *args):
    return subprocess.Popen([*agent_cmd(), "--home", str(home), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=agent_env())


def dump(home):
    p = cli(home, "dump")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def protocol_errors(home):
    """Frames a session refused: surfaced as kind `refused` from source `session:serial`."""
    p = cli(home, "events")
    return [ln for ln in p.stdout.splitlines() if '"session:serial"' in ln]


@pytest.fixture
def relay_factory():
    made = []

    def make(**faults):
        r = Relay(LineFaults(seed=11, **faults), LineFaults(seed=12, **faults)).start()
        made.append(r)
        return r
    yield make
    for r in made:
        r.close()


@pytest.mark.parametrize("ber", [1e-4, 1e-3])
def test_both_ends_sync_once_at_the_same_time_over_a_faulty_line(tmp_path, relay_factory, ber):
    ha, hb = homes(tmp_path, 30, 20)
    relay = relay_factory(ber=ber, drop=0.01, duplicate=0.01, reorder=0.01, truncate=0.01)
    # A wake (`--once`) on a lossy line may end before everything crossed: the next wake goes on
    # from the cursors (at BER 1e-3 on a loaded machine one wake is not always enough). At most 4.
    total = {"a": 0, "b": 0}
    for wake in range(4):
        pa = spawn(ha, "sync", "--serial", relay.ports[0], "--once")
        pb = spawn(hb, "sync", "--serial", relay.ports[1], "--once")
        outs = [p.communicate(timeout=120) for p in (pa, pb)]
        assert pa.returncode == 0 and pb.returncode == 0, outs
        sa, sb = (json.loads(o[0]) for o in outs)
        assert sa["rejected"] == sb["rejected"] == 0  # no corrupted event got as far as the apply path
        total["a"] += sa["applied"]
        total["b"] += sb["applied"]
        if total == {"a": 20, "b": 30}:
            break
    assert total == {"a": 20, "b": 30}, (total, sa, sb)
    if ber <= 1e-4 and wake == 0:
        # One exchange carries both directions: the ends do not both start one (which would send
        # every event twice: a body and an answer from the same cursor).
        assert (sa["pushed"], sb["pushed"], sa["duplicate"], sb["duplicate"]) == (30, 20, 0, 0), (sa, sb)
    da, db = dump(ha), dump(hb)
    assert da == db and len(da[T]) == 50
    assert {(r["key"]["device"], r["values"]["temp"]) for r in da[T]} == \
        {("a", float(i)) for i in range(30)} | {("b", float(i)) for i in range(20)}
    assert not protocol_errors(ha) and not protocol_errors(hb)  # every corrupted frame died in the framing
    faults = relay.faults[0].counts
    assert faults["frames"] > 0 and (faults["bit_flips"] + faults["dropped"] + faults["truncated"]) > 0


def test_sync_once_without_the_other_end_exits_1_with_a_reason(tmp_path, relay_factory):
    ha, _ = homes(tmp_path, 1, 0)
    relay = relay_factory()
    p = cli(ha, "sync", "--serial", relay.ports[0], "--once", "--timeout", "1.5")
    assert p.returncode == 1 and "no answer on" in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_a_port_that_does_not_exist_exits_1_and_mqtt_flags_are_refused(tmp_path):
    ha, _ = homes(tmp_path, 0, 0)
    p = cli(ha, "sync", "--serial", str(tmp_path / "ttyNONE"), "--once")
    assert p.returncode == 1 and "cannot open serial port" in p.stderr, p.stderr
    p = cli(ha, "sync", "--serial", str(tmp_path / "ttyNONE"), "--broker", "mqtt://x:1", "--once")
    assert p.returncode == 2 and "--broker" in p.stderr
    p = cli(ha, "sync", "--serial", str(tmp_path / "ttyNONE"), "--baud", "0", "--once")
    assert p.returncode == 2
    # `run` serves several ports (a gateway); `sync --once` takes one; a port named twice is a mistake
    p = cli(ha, "sync", "--serial", str(tmp_path / "tty1"), "--serial", str(tmp_path / "tty2"), "--once")
    assert p.returncode == 2 and "one port" in p.stderr, p.stderr
    p = cli(ha, "run", "--serial", str(tmp_path / "tty1"), "--serial", str(tmp_path / "tty1"))
    assert p.returncode == 2 and "twice" in p.stderr, p.stderr
    # MQTT flags beside --serial need --broker (then MQTT is served too)
    p = cli(ha, "run", "--serial", str(tmp_path / "tty1"), "--username", "u")
    assert p.returncode == 2 and "--broker" in p.stderr, p.stderr
    p = cli(ha, "run", "--serial", str(tmp_path / "ttyNONE"), "--broker", "mqtt://127.0.0.1:1")
    assert p.returncode == 1 and "cannot open serial port" in p.stderr, p.stderr


def _wait(cond, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.3)
    return False


def test_run_over_a_cable_that_stalls_and_is_pulled_and_replugged(tmp_path, relay_factory):
    ha, hb = homes(tmp_path, 20, 0)
    relay = relay_factory(ber=1e-5, drop=0.005)
    ra = spawn(ha, "run", "--serial", relay.ports[0])
    rb = spawn(hb, "run", "--serial", relay.ports[1])
    try:
        rows = lambda h: len(dump(h).get(T, []))  # noqa: E731 - forwarded to the running agent
        assert _wait(lambda: rows(hb) == 20, 40)
        relay.stall(800)  # shorter than dead_s: the link survives it
        assert cli(ha, "write", T, "--key", '{"device": "a", "seq": 100}', "--set", '{"temp": 1.0}').returncode == 0
        assert _wait(lambda: rows(hb) == 21, 30)
        relay.pull()
        for i in range(101, 106):  # written while the cable is out
            assert cli(ha, "write", T, "--key", json.dumps({"device": "a", "seq": i}), "--set",
                       '{"temp": 2.0}').returncode == 0
        assert cli(hb, "write", T, "--key", '{"device": "b", "seq": 1}', "--set", '{"temp": 3.0}').returncode == 0
        time.sleep(PROFILE.serial_dead_s + 1.0)  # both ends notice the silence
        relay.plug()
        assert _wait(lambda: rows(hb) == 27 and rows(ha) == 27, 40)
        assert dump(ha) == dump(hb)
    finally:
        for p in (ra, rb):
            p.terminate()
        outs = [p.communicate(timeout=30) for p in (ra, rb)]
    assert ra.returncode == 0 and rb.returncode == 0, outs
    sa = json.loads(outs[0][0])
    assert sa["link"]["incarnations"] >= 2, sa  # the pulled cable ended one link and a new one started
