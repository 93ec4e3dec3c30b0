"""`ssp-agent sync --broker ... --once` (docs/cli.md "Sync"): devices that wake, sync and sleep."""
from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
import time

from tests.cli_cmd import agent_cmd, agent_env, main
from agent.node import Node
from agent.transport.broker import Broker, free_port, write_password_file

from .helpers import T, event_ids, make_nodes, step_until, write
from tests.waiting import HANG_S


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


def _store(home) -> sqlite3.Connection:
    return sqlite3.connect(f"file:{home}/store.sqlite?mode=ro", uri=True, timeout=5)


def test_run_stops_cleanly_on_sigterm_and_sync_once_resumes(tmp_path, capsys):
    """`ssp-agent run` under username/password (a broker that refuses anonymous devices), as a
    subprocess stopped with SIGTERM: exit 0 with its summary; a later `sync --once` offers only
    what is new, from the durable cursor the run left."""
    a, b = make_nodes(tmp_path, 2)
    users = {a.site_id.hex(): "pw-a", b.site_id.hex(): "pw-b"}
    write_password_file(tmp_path / "passwd", users)
    port = free_port()
    br = Broker(port=port, workdir=tmp_path / "broker", listener_conf=(
        f"listener {port} 127.0.0.1\nallow_anonymous false\npassword_file {tmp_path / 'passwd'}")).start()
    ha, hb = str(a.home), str(b.home)
    for i in range(3):
        write(b, i, "b")
    for i in range(5):
        write(a, i, "a")
    a.close(); b.close()
    (tmp_path / "pw-a").write_text("pw-a\n")
    cred_a = ["--username", a.site_id.hex(), "--password-file", str(tmp_path / "pw-a")]
    env = agent_env({"SSP_MQTT_USERNAME": b.site_id.hex(), "SSP_MQTT_PASSWORD": "pw-b"})
    proc = None
    try:
        # no credentials: refused, exit 1
        assert main(["--home", ha, "sync", "--broker", br.url, "--once", "--connect-timeout", "1"]) == 1
        assert "broker unreachable" in capsys.readouterr().err
        assert main(["--home", ha, "sync", "--broker", br.url, "--once", "--timeout", "1", *cred_a]) == 0
        capsys.readouterr()  # a's session now exists at the broker
        proc = subprocess.Popen([*agent_cmd(), "--home", hb, "run", "--broker", br.url,
                                 "--cadence", "0.3"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        deadline = time.monotonic() + HANG_S
        got = {}
        while time.monotonic() < deadline:  # a wakes a few times while b runs
            assert main(["--home", ha, "sync", "--broker", br.url, "--once", "--timeout", "2", *cred_a]) == 0
            got = json.loads(capsys.readouterr().out)
            with _store(hb) as c:
                n_b = c.execute("SELECT count(*) FROM events").fetchone()[0]
            if n_b == 8 and got["peers"][b.site_id.hex()]["unanswered"] == 0:
                break
        assert n_b == 8 and got["peers"][b.site_id.hex()]["present"]
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=HANG_S)
        assert proc.returncode == 0, err.decode()[-2000:]
        summary = json.loads(out)
        assert summary["applied"] == 5 and summary["pushed"] >= 3
        with _store(hb) as c:
            cur = c.execute("SELECT live FROM sync_cursors WHERE peer=? AND path='mqtt'", (a.site_id,)).fetchone()[0]
        assert cur >= 3  # b's own three events were answered for
        # b wakes later with two new events: only those are offered, from the cursor the run left
        b2 = Node.open(tmp_path / "n1")
        new = {write(b2, i, "b") for i in range(3, 5)}
        b2.close()
        assert main(["--home", hb, "sync", "--broker", br.url, "--once", "--timeout", "1",
                     "--username", b.site_id.hex(), "--password-file", _pw(tmp_path, "pw-b")]) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["offered"] == 2 and out["applied"] == 0
        assert main(["--home", ha, "sync", "--broker", br.url, "--once", "--timeout", "2", *cred_a]) == 0
        assert json.loads(capsys.readouterr().out)["applied"] == 2
        a2 = Node.open(tmp_path / "n0")
        assert new <= event_ids(a2)
        a2.close()
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
        br.close()


def _pw(tmp_path, pw: str) -> str:
    p = tmp_path / pw
    p.write_text(pw + "\n")
    return str(p)


def test_profile_gives_the_defaults_and_run_evicts(broker, tmp_path, capsys):
    from .helpers import MANIFEST, runner
    from agent.runner import RunConfig
    n, _ = Node.init(tmp_path / "zero", MANIFEST, profile="pi-zero-2w")
    n.close()
    assert main(["--home", str(tmp_path / "zero"), "sync", "--broker", broker.url, "--once", "--timeout", "0.5"]) == 0
    cfg = json.loads(capsys.readouterr().out)["config"]
    assert cfg == {"cadence_s": 60.0, "max_events": 250, "body_limit_bytes": 65536, "session_expiry_s": 604800,
                   "eviction_interval_s": None}  # --once leaves eviction to `evict --auto`
    assert RunConfig.from_profile(n.profile, cadence_s=2.0).eviction_interval_s == 900.0
    node = Node.open(tmp_path / "zero")
    r = runner(node, broker, eviction_interval_s=0.2)
    try:
        # two eviction runs, however long the machine takes to get there
        assert step_until([r], lambda: r.stats["evictions"] >= 2 and "budget" in (r.last_eviction or {})), r.stats
    finally:
        r.close()
        node.close()


def _bad_body(broker, to: bytes, sender: bytes) -> None:
    """One body b's decoder refuses (`malformed_cbor`), on b's inbox topic for `sender`, held by the
    broker for b's persistent session (QoS 1)."""
    import uuid
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    from agent.transport.mqtt import Topics
    from .helpers import MESH
    t = Topics(MESH)
    c = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"bad-{uuid.uuid4().hex[:8]}", protocol=paho.MQTTv5)
    c.connect("127.0.0.1", broker.port)
    c.loop_start()
    p = Properties(PacketTypes.PUBLISH)
    p.ResponseTopic = t.answers(sender, to)
    p.CorrelationData = b"\x01" * 16
    c.publish(t.requests(to, sender), b"\xff\x00", qos=1, properties=p).wait_for_publish(60)
    c.loop_stop()
    c.disconnect()


def test_sync_once_that_refuses_every_body_is_not_a_success(broker, tmp_path, capsys):
    """A device whose every received body is refused (a decoder that cannot read its peers' bodies
    refused each as `malformed_cbor`) exits 2 and says what it refused; one that also took a body
    exits 0 and still says so on stderr."""
    a, b = make_nodes(tmp_path, 2)
    ha, hb = str(a.home), str(b.home)
    write(a, 1, "a")
    a.close(); b.close()
    once = ["sync", "--broker", broker.url, "--once", "--timeout", "3"]
    assert main(["--home", hb, *once]) == 0      # b's persistent session
    capsys.readouterr()
    _bad_body(broker, b.site_id, a.site_id)
    assert main(["--home", hb, *once]) == 2
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert out["bodies_received"] == out["refused_bodies"] == 1 and out["applied"] == 0
    assert "refused every body it received (1): malformed_cbor" in cap.err, cap.err
    assert main(["--home", ha, *once[:-1], "1"]) == 0   # a's body waits for b at the broker
    _bad_body(broker, b.site_id, a.site_id)
    capsys.readouterr()
    assert main(["--home", hb, *once]) == 0
    cap = capsys.readouterr()
    out = json.loads(cap.out)
    assert out["applied"] == 1 and out["refused_bodies"] == 1
    assert "refused 1 of 2 bodies received: malformed_cbor" in cap.err, cap.err


def test_mqtts_against_a_plain_port_hints_at_tls(broker, tmp_path, capsys):
    """`mqtts://` to a listener that speaks plain MQTT: the broker drops the TLS handshake
    ("Connection reset by peer"); the one line says the port may not be a TLS listener."""
    from .test_broker_security import make_pki
    pki = make_pki(tmp_path / "pki", [])
    (a,) = make_nodes(tmp_path, 1)
    a.close()
    rc = main(["--home", str(a.home), "sync", "--broker", f"mqtts://127.0.0.1:{broker.port}", "--once",
               "--ca-file", str(pki["ca"]), "--connect-timeout", "5"])
    err = capsys.readouterr().err
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert "mqtts://" in err and "TLS listener" in err and f"mqtt://127.0.0.1:{broker.port}" in err, err
