"""The runtime loop sleeps until something is due (docs/serial.md "A gateway", docs/mqtt.md): an
idle `run` wakes for its timers and for what arrives, not 20 times a second to look for work.

Real `ssp-agent run` processes, a real mosquitto, a pty pair through the relay:

    A --cable-- G --mqtt-- B          (and `run --broker` alone: B)

Every node runs with a batch cadence of an hour, so what moves after start-up moves because the
loop was woken: a write forwarded through G's control socket reaches A (serial) and B (MQTT); a
write on B reaches G over MQTT and is pushed on to A over the cable (the log grew on G).

The wake-up count is `run`'s own (`loop_turns` in its status), read twice around an idle period
by the test's clock. A loop that polls every 50 ms turns about 20 times a second whatever the
machine's load (load only slows each turn down); the bound is 5 a second, while the timers of an
idle gateway (serial keep-alives every 2 s each way, the clock check every minute) need about one."""
from __future__ import annotations

import dataclasses
import json
import time

from agent.profile import load_profile
from serial_relay import Relay

from ..cli_cmd import run_cli
from . import test_gateway as gw
from .test_gateway import spawn, stop, wait_rows, wait_serving, write

# Keep-alives every 2 s (the idle gateway's only serial timer); a cadence of an hour everywhere.
PROFILE = dataclasses.replace(load_profile("pi-3-4"), serial_keepalive_s=2.0, serial_dead_s=8.0,
                              serial_timeout_s=20.0, cadence_s=3600.0, serial_batch_limit=50)
IDLE_S = 3.0
MAX_TURNS_PER_S = 5.0


def _turns(home) -> tuple[int, float]:
    p = run_cli("--home", home, "status")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["run"]["loop_turns"], time.monotonic()


def _idle_rate(home) -> float:
    n0, t0 = _turns(home)
    time.sleep(IDLE_S)
    n1, t1 = _turns(home)
    return (n1 - n0) / (t1 - t0)


def test_an_idle_gateway_sleeps_and_a_write_still_reaches_every_link_at_once(tmp_path, broker, monkeypatch):
    monkeypatch.setattr(gw, "PROFILE", PROFILE)
    homes, _ids = gw.provision(tmp_path, ["g", "a", "b"])
    g, a, b = (homes[n] for n in "gab")
    cable = Relay(names=(str(tmp_path / "gw-ttyUSB0"), None)).start()
    procs = {}
    try:
        procs["g"] = spawn(g, "--serial", cable.ports[0], "--broker", broker.url, "--cadence", "3600")
        procs["a"] = spawn(a, "--serial", cable.ports[1], "--cadence", "3600")
        procs["b"] = spawn(b, "--broker", broker.url, "--cadence", "3600")
        for n in "gab":
            wait_serving(homes[n], procs[n])
        want = {("a", 0)}
        write(a, "a", 0)   # A's link to G is up once this has crossed: start-up is over
        wait_rows([g, a, b], want, procs.values())
        rate = _idle_rate(g)
        assert rate < MAX_TURNS_PER_S, f"an idle gateway turned {rate:.1f} times a second"
        rate_b = _idle_rate(b)  # MQTT alone
        assert rate_b < MAX_TURNS_PER_S, f"an idle `run --broker` turned {rate_b:.1f} times a second"
        # Realtime after the idle period: a local write wakes the loop (control socket), an MQTT
        # arrival wakes it and the events go on over the cable (the log grew).
        write(g, "g", 1)
        want.add(("g", 1))
        wait_rows([g, a, b], want, procs.values())
        write(b, "b", 2)
        want.add(("b", 2))
        wait_rows([g, a, b], want, procs.values())
        write(a, "a", 3)
        want.add(("a", 3))
        wait_rows([g, a, b], want, procs.values())
        summaries = {n: stop(procs.pop(n)) for n in list(procs)}
    finally:
        for p in procs.values():
            p.kill()
            p.communicate()
        cable.close()
    gs = summaries["g"]
    assert gs["serial"][cable.ports[0]]["link"]["incarnations"] == 1, gs   # the cable was never idle too long
    assert gs["mqtt"]["rejected"] == 0 and all(s["rejected"] == 0 for s in gs["serial"].values())
