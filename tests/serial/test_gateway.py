"""Two nodes and a gateway sync and rehydrate over pty serial links and MQTT
together. Real `ssp-agent` processes (the installed command, tests/cli_cmd.py), a real mosquitto,
real pseudo-terminals through the relay (tools/serial_relay.py):

    A --cable 1-- G --cable 2-- C (later its replacement D)
                  |
              mosquitto -- B

G is one `run --serial PORT1 --serial PORT2 --broker URL` (agent/runtime.py: one loop). Writes
on every node reach every other; the USB adapter of cable 2 is pulled out of the gateway and
plugged back (its pty closes and its name disappears, then comes back) without disturbing cable
1 or MQTT; then C dies, and a replacement D on the same cable is rehydrated from the gateway.
Waits have generous deadlines; nothing asserts how long anything took."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import time

import pytest

from agent.node import Node
from agent.profile import load_profile
from serial_relay import Relay

from ..cli_cmd import agent_cmd, agent_env, run_cli
from ..mqtt.helpers import MANIFEST, T, wait_serving

# dead_s 4: a link ends 4 s after its cable goes quiet; long enough that a loaded CI machine does
# not end cable 1's link while the gateway applies a body (the "undisturbed" check below).
PROFILE = dataclasses.replace(load_profile("pi-3-4"), serial_keepalive_s=0.5, serial_dead_s=4.0,
                              serial_timeout_s=20.0, cadence_s=1.0, serial_batch_limit=50)
WAIT_S = 90


def provision(tmp, names):
    """Nodes that all trust each other's keys (D, the replacement, is provisioned in advance)."""
    nodes = {n: Node.init(tmp / n, MANIFEST, profile=PROFILE)[0] for n in names}
    for x in nodes.values():
        for y in nodes.values():
            if x is not y:
                x.add_peer(y.site_id, y.keyring[y.site_id][0], None)
    ids = {n: x.site_id.hex() for n, x in nodes.items()}
    for x in nodes.values():
        x.close()
    return {n: tmp / n for n in names}, ids


def spawn(home, *args):
    return subprocess.Popen([*agent_cmd(), "--home", str(home), "run", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=agent_env())




def stop(proc) -> dict:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out)


def write(home, device, seq):
    p = run_cli("--home", home, "write", T, "--key", json.dumps({"device": device, "seq": seq}),
                "--set", json.dumps({"temp": float(seq)}))
    assert p.returncode == 0, p.stderr


def rows(home) -> set:
    p = run_cli("--home", home, "dump")
    assert p.returncode == 0, p.stderr
    return {(r["key"]["device"], r["key"]["seq"]) for r in json.loads(p.stdout).get(T, [])}


def wait_rows(homes, want, procs):
    deadline = time.monotonic() + WAIT_S
    got = {}
    while time.monotonic() < deadline:
        for p in procs:
            assert p.poll() is None, p.communicate()[1][-3000:]
        got = {h.name: rows(h) for h in homes}
        if all(g == want for g in got.values()):
            return
        time.sleep(0.3)
    raise AssertionError(f"not converged: want {sorted(want)}, got {got}")


def test_a_gateway_serves_two_cables_and_mqtt_and_rehydrates_a_replacement(tmp_path, broker):
    homes, ids = provision(tmp_path, ["g", "a", "b", "c", "d"])
    g, a, b, c, d = (homes[n] for n in "gabcd")
    # End 0 of each relay is the gateway's USB adapter, under a stable name (/dev/serial/by-id/...).
    cable1 = Relay(names=(str(tmp_path / "gw-ttyUSB0"), None)).start()
    cable2 = Relay(names=(str(tmp_path / "gw-ttyUSB1"), None)).start()
    procs = {}
    try:
        procs["g"] = spawn(g, "--serial", cable1.ports[0], "--serial", cable2.ports[0], "--broker", broker.url,
                           "--cadence", "1")
        procs["a"] = spawn(a, "--serial", cable1.ports[1])
        procs["b"] = spawn(b, "--broker", broker.url, "--cadence", "1")
        procs["c"] = spawn(c, "--serial", cable2.ports[1])
        for n in "gabc":
            wait_serving(homes[n], procs[n])
        # --- writes on every node reach every other: serial <-> MQTT <-> serial through G
        want = set()
        for n in "gabc":
            write(homes[n], n, 0)
            want.add((n, 0))
        wait_rows([g, a, b, c], want, procs.values())
        # --- cable 2's adapter is pulled out of the gateway: A and B go on through G meanwhile
        cable2.unplug(0)
        assert not os.path.exists(cable2.ports[0])
        for n in "ab":
            write(homes[n], n, 1)
            want.add((n, 1))
        wait_rows([g, a, b], want, procs.values())
        assert rows(c) == want - {("a", 1), ("b", 1)}
        time.sleep(PROFILE.serial_dead_s + 1.0)  # both ends of cable 2 notice the silence
        cable2.replug(0)                         # the same name, a new device behind it
        wait_rows([g, a, b, c], want, procs.values())
        # --- C's hardware dies; its replacement D is plugged into the same cable and rehydrates
        stop(procs.pop("c"))
        p = run_cli("--home", d, "rehydrate", "--from", ids["g"])
        assert p.returncode == 0 and json.loads(p.stdout)["generation"] == 0, p.stderr
        procs["d"] = spawn(d, "--serial", cable2.ports[1])
        wait_serving(d, procs["d"])
        wait_rows([g, d], want, procs.values())
        served = {}
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:  # D's answers move the gateway's cursor for it
            st = json.loads(run_cli("--home", g, "status").stdout)
            served = st["run"]["serial"][cable2.ports[0]]
            if served["peer"] == ids["d"] and served["unanswered"] == 0:
                break
            time.sleep(0.3)
        assert served["peer"] == ids["d"] and served["unanswered"] == 0, served
        # --- the gateway saw cable 2's link end, in `events`, naming the port
        events = [json.loads(x) for x in run_cli("--home", g, "events").stdout.splitlines()]
        lost = [e for e in events if e["kind"] == "link_lost"]
        assert lost and all(e["detail"]["source"] == "link:serial" for e in lost)
        assert {e["reason"] for e in lost} <= {"peer_silent", "peer_restarted"}
        assert all(cable2.ports[0] in e["detail"]["detail"] for e in lost), lost
        summaries = {n: stop(procs.pop(n)) for n in list(procs)}
    finally:
        for p in procs.values():
            p.kill()
            p.communicate()
        cable1.close()
        cable2.close()
    gs = summaries["g"]
    # Cable 1 and MQTT were not disturbed by cable 2's adapter leaving and coming back: one link
    # incarnation on cable 1 for the whole run; cable 2 had more than one.
    assert gs["serial"][cable1.ports[0]]["link"]["incarnations"] == 1, gs
    assert gs["serial"][cable2.ports[0]]["link"]["incarnations"] >= 2, gs
    assert gs["mqtt"]["peers"][ids["b"]]["present"] is True, gs
    assert all(s["rejected"] == 0 for s in gs["serial"].values()) and gs["mqtt"]["rejected"] == 0
    # The replacement rehydrated: its rows came from the gateway, which knows nothing remains.
    dst = json.loads(run_cli("--home", d, "rehydrate", "--status").stdout)["rehydrating"]
    n_events = len(run_cli("--home", g, "log").stdout.splitlines())
    assert dst["events_applied"] == n_events and dst["rows_received"] == len(want), dst
    serving = json.loads(run_cli("--home", g, "rehydrate", "--status").stdout)["serving"]
    assert [(s["subject"], s["remaining_events_by_path"].get("serial")) for s in serving] == [(ids["d"], 0)]
    assert rows(d) == rows(g) == rows(a) == rows(b) == want


def test_run_serial_reopens_its_port_when_the_adapter_comes_back(tmp_path):
    """One line: the USB adapter leaves the computer (end of file on its tty, the name gone) and
    comes back under the same name; `run --serial` opens it again and syncs on."""
    homes, _ids = provision(tmp_path, ["a", "b"])
    a, b = homes["a"], homes["b"]
    cable = Relay(names=(str(tmp_path / "ttyUSB0"), None)).start()
    procs = {}
    try:
        procs["a"] = spawn(a, "--serial", cable.ports[0])
        procs["b"] = spawn(b, "--serial", cable.ports[1])
        for n, h in homes.items():
            wait_serving(h, procs[n])
        write(a, "a", 0)
        wait_rows([a, b], {("a", 0)}, procs.values())
        cable.unplug(0)
        write(a, "a", 1)
        write(b, "b", 1)
        time.sleep(1.0)  # a few reopen attempts on a name that is not there
        cable.replug(0)
        wait_rows([a, b], {("a", 0), ("a", 1), ("b", 1)}, procs.values())
        sa = stop(procs.pop("a"))
        stop(procs.pop("b"))
    finally:
        for p in procs.values():
            p.kill()
            p.communicate()
        cable.close()
    assert sa["rejected"] == 0 and sa["link"]["state"] == "up"
    assert sa["evictions"] >= 1  # the profile's eviction job runs over a serial line too (it did not before)


def test_the_gateway_relays_at_once_across_its_links(tmp_path, broker):
    """Realtime across links (agent/runtime.py): with batch cycles an hour apart everywhere, a
    write on the device on cable 1 reaches the device on cable 2 and the MQTT node, and a write on
    the MQTT node reaches both cables, only because the gateway pushes what arrived over one link
    on the others as soon as it arrives (before, each link waited for its own next cycle)."""
    homes, ids = provision(tmp_path, ["g", "a", "b", "c"])
    g, a, b, c = (homes[n] for n in "gabc")
    cable1, cable2 = Relay().start(), Relay().start()
    hour = ("--cadence", "3600")
    procs = {}
    try:
        procs["g"] = spawn(g, "--serial", cable1.ports[0], "--serial", cable2.ports[0], "--broker", broker.url, *hour)
        procs["a"] = spawn(a, "--serial", cable1.ports[1], *hour)
        procs["b"] = spawn(b, "--broker", broker.url, *hour)
        procs["c"] = spawn(c, "--serial", cable2.ports[1], *hour)
        for n in "gabc":
            wait_serving(homes[n], procs[n])
        deadline = time.monotonic() + WAIT_S
        st = {}
        while time.monotonic() < deadline:  # every link up and in realtime mode
            st = json.loads(run_cli("--home", g, "status").stdout)["run"]
            cables = [st["serial"][cable.ports[0]] for cable in (cable1, cable2)]
            if all(x["realtime"] and x["peer"] for x in cables) and st["mqtt"]["peers"][ids["b"]]["realtime"]:
                break
            time.sleep(0.3)
        else:
            raise AssertionError(st)
        write(a, "a", 0)
        wait_rows([g, a, b, c], {("a", 0)}, procs.values())
        write(b, "b", 0)
        wait_rows([g, a, b, c], {("a", 0), ("b", 0)}, procs.values())
        for n in list(procs):
            stop(procs.pop(n))
    finally:
        for p in procs.values():
            p.kill()
            p.communicate()
        cable1.close()
        cable2.close()
