"""A device that wakes with `sync --once` gets what an always-on gateway holds for it, on every
wake, whatever order they came up in and whatever the broker lost (docs/mqtt.md "A waking
device"). Real processes: a mosquitto started here, the gateway under `ssp-agent run` for the
whole test, started before the device ever had a broker session (so its first window went to a
topic nobody subscribed: the broker dropped it), and the device doing short `sync --once` wakes.

Before, the gateway held its lost window "in flight" until it saw the device present for the
answer timeout (15 s), which a wake never lasts: the device received nothing on every wake."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import time

from agent.node import Node
from agent.transport.broker import Broker
from agent.transport.mqtt import MqttLink

from .helpers import MANIFEST, MESH, event_ids, settings, write
from tests.cli_cmd import agent_cmd, agent_env, run_cli

WAKES = 3  # a device has the gateway's rows within this many wakes (in practice: the first)


def _pair(tmp_path, n_events: int) -> tuple[Node, Node]:
    """A gateway holding `n_events` rows and a pi-zero-2w device, each in the other's keyring;
    the device has never connected to the broker."""
    g = Node.init(tmp_path / "gateway", MANIFEST, profile="gateway")[0]
    d = Node.init(tmp_path / "device", MANIFEST, profile="pi-zero-2w")[0]
    g.add_peer(d.site_id, d.keyring[d.site_id][0], None)
    d.add_peer(g.site_id, g.keyring[g.site_id][0], None)
    for i in range(n_events):
        write(g, i, "gw")
    return g, d


def _start_gateway(home, url: str, env: dict | None = None) -> subprocess.Popen:
    # a batch cycle every second: rows written while the device sleeps go to its broker session
    return subprocess.Popen([*agent_cmd(), "--home", str(home), "run", "--broker", url, "--cadence", "1"],
                            env={**agent_env(), **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()


def _sent_to(home, peer: bytes, since_ms: int = 0) -> int:
    """Bodies the gateway's store records as sent to `peer` after `since_ms` and not answered."""
    try:
        with sqlite3.connect(f"file:{home}/store.sqlite?mode=ro", uri=True, timeout=5) as c:
            return c.execute("SELECT count(*) FROM sent_bodies WHERE peer=? AND sent_ms > ?",
                             (peer, since_ms)).fetchone()[0]
    except sqlite3.OperationalError:
        return 0


def _wait(cond, proc: subprocess.Popen, what: str, ceiling_s: float = 120.0) -> None:
    """Wait for `cond` (a ceiling that only catches a hang)."""
    deadline = time.monotonic() + ceiling_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        if cond():
            return
        time.sleep(0.1)
    raise AssertionError(f"never happened: {what}")


def _wake(home, url: str, env: dict | None = None) -> dict:
    """One wake of the device: a real `sync --once` (a generous bound on the wait for answers)."""
    p = subprocess.run([*agent_cmd(), "--home", str(home), "sync", "--broker", url, "--once", "--timeout", "60"],
                       capture_output=True, text=True, timeout=300, env={**agent_env(), **(env or {})})
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


def _ids(home) -> set[bytes]:
    n = Node.open(home)
    try:
        return event_ids(n)
    finally:
        n.close()


def _wake_until_has(home, url: str, want: set[bytes], env: dict | None = None) -> list[dict]:
    outs = []
    for _ in range(WAKES):
        outs.append(_wake(home, url, env))
        if want <= _ids(home):
            return outs
    have = _ids(home)
    raise AssertionError(f"after {WAKES} wakes the device holds {len(have & want)} of the gateway's "
                         f"{len(want)} rows; wakes: {[(o['bodies_received'], o['applied']) for o in outs]}")


def _gateway_present(url: str, site: bytes) -> bool:
    link = MqttLink(settings(None, url), MESH, os.urandom(16)).start()
    try:
        assert link.wait_connected(30), link.last_error
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if site in link.present:
                return True
            time.sleep(0.05)
        return False
    finally:
        link.abort()


def _scenario(tmp_path, url: str, n_events: int, pair=None, env: dict | None = None):
    g, d = pair or _pair(tmp_path, n_events)
    want, hg, hd, d_site, g_site = event_ids(g), g.home, d.home, d.site_id, g.site_id
    g.close()
    d.close()
    gw = _start_gateway(hg, url, env)
    # The gateway offered the device its window while the device had no broker session.
    _wait(lambda: _sent_to(hg, d_site) > 0, gw, "the gateway sends the device a window")
    return gw, want, hg, hd, d_site, g_site


def test_a_device_waking_after_the_gateway_started_gets_its_rows(broker, tmp_path):
    gw, want, _hg, hd, _d, _g = _scenario(tmp_path, broker.url, 40)
    try:
        outs = _wake_until_has(hd, broker.url, want)
        assert outs[-1]["bodies_received"] > 0
        # and every later wake still works: nothing left, nothing broken
        again = _wake(hd, broker.url)
        assert again["refused_bodies"] == 0
    finally:
        _stop(gw)


def test_a_sleeper_gets_1500_held_events(broker, tmp_path):
    gw, want, _hg, hd, _d, _g = _scenario(tmp_path, broker.url, 1500)
    try:
        _wake_until_has(hd, broker.url, want)
        assert len(want) == 1500
    finally:
        _stop(gw)


def test_a_broker_restarted_without_persistence_while_the_device_sleeps(tmp_path):
    """The device synced once; the gateway then pushes new rows into the device's broker session
    while it sleeps, and the broker restarts without persistence (what a killed mosquitto
    loses): the session and the rows in it are gone. The device's next wakes still get them."""
    b = Broker(workdir=tmp_path / "broker", persistence=False).start()
    gw = None
    try:
        gw, want, hg, hd, d_site, g_site = _scenario(tmp_path, b.url, 10)
        _wake_until_has(hd, b.url, want)
        # New rows, written through the running gateway's control socket, go to the sleeping device.
        since = int(time.time() * 1000)
        for i in range(10, 30):
            p = run_cli("--home", hg, "write", "app.readings", "--key", json.dumps({"device": "gw", "seq": i}),
                        "--set", json.dumps({"temp": float(i), "note": f"gw{i}"}))
            assert p.returncode == 0, p.stderr
        _wait(lambda: _sent_to(hg, d_site, since) > 0, gw, "the gateway pushes the new rows to the sleeping device")
        b.kill()
        b.start()
        assert _gateway_present(b.url, g_site), "the gateway did not reconnect"
        with sqlite3.connect(f"file:{hg}/store.sqlite?mode=ro", uri=True, timeout=5) as c:
            want = {bytes(r[0]) for r in c.execute("SELECT event_id FROM events")}
        assert len(want) == 30
        _wake_until_has(hd, b.url, want)
    finally:
        if gw is not None:
            _stop(gw)
        b.close()


def test_a_device_on_another_cluster_node_than_its_gateway(tmp_path):
    """A broker cluster (two ejabberd nodes) does not carry retained messages across nodes: the
    device never sees the gateway's presence, nor the gateway the device's. The device's pull
    still reaches the gateway, which sends: the device has the rows within the bounded wakes."""
    from tests.mqtt.ejabberd_cluster import EjabberdCluster
    g, d = _pair(tmp_path, 40)
    pw = {g.site_id.hex(): "gw-secret", d.site_id.hex(): "dev-secret"}
    cluster = EjabberdCluster(tmp_path / "ejabberd", pw).start()
    gw = None
    try:
        genv = {"SSP_MQTT_USERNAME": g.site_id.hex(), "SSP_MQTT_PASSWORD": pw[g.site_id.hex()]}
        denv = {"SSP_MQTT_USERNAME": d.site_id.hex(), "SSP_MQTT_PASSWORD": pw[d.site_id.hex()]}
        gw, want, _hg, hd, _d, _g = _scenario(tmp_path, cluster.url(0), 40, pair=(g, d), env=genv)
        _wake_until_has(hd, cluster.url(1), want, denv)
    finally:
        if gw is not None:
            _stop(gw)
        cluster.close()
