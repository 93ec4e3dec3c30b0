"""A Unicode digit that `str.isdigit()` accepts and `int()` refuses (`²`, U+00B2) in a message
property or in the frame meta: a rogue client publishes it (anonymous, under a member's name on
the default binding; as a member on the secure binding), including a retained presence that the
broker hands to every node at every start. `run` and `sync --once`, real processes on a real
mosquitto, neither exit nor die: the value is not a number (docs/protocol.md §11 "Numbers from outside")
and is ignored or refused, and honest traffic flows on."""
from __future__ import annotations

import json
import os
import queue
import subprocess
import threading
import time

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from agent.transport.mqtt import Topics, _publish_props

from ..cli_cmd import agent_cmd, agent_env, run_cli
from ..reasons_catalogue import body, handshake
from .helpers import MESH, make_nodes, write

POISON = "\u00b2"   # SUPERSCRIPT TWO: str.isdigit() says yes, int() raises ValueError
CEILING_S = 180     # only catches a hang: every wait below ends on an event


class Rogue:
    """A plain paho client with broker access and no credentials: publishes what it likes under
    any name, and collects what arrives on the topics it subscribed to."""

    def __init__(self, broker) -> None:
        self.got: queue.Queue = queue.Queue()
        self._subscribed = threading.Event()
        self.c = paho.Client(CallbackAPIVersion.VERSION2, client_id="rogue-" + os.urandom(4).hex(),
                             protocol=paho.MQTTv5)
        self.c.on_message = lambda _c, _u, msg: self.got.put(msg)
        self.c.on_subscribe = lambda *_a: self._subscribed.set()
        self.c.connect(broker.host, broker.port)
        self.c.loop_start()

    def subscribe(self, topic: str) -> None:
        self._subscribed.clear()
        self.c.subscribe(topic, qos=1)
        assert self._subscribed.wait(CEILING_S)

    def publish(self, topic: str, payload: bytes, user: dict, corr: bytes | None = None,
                response_topic: str | None = None, retain: bool = False) -> None:
        info = self.c.publish(topic, payload, qos=1, retain=retain,
                              properties=_publish_props(user, corr, response_topic))
        info.wait_for_publish(CEILING_S)

    def wait_for(self, match, proc: subprocess.Popen | None = None):
        """The first message `match` accepts, or None once `proc` exited (or the ceiling)."""
        deadline = time.monotonic() + CEILING_S
        while time.monotonic() < deadline:
            try:
                m = self.got.get(timeout=0.2)
            except queue.Empty:
                if proc is not None and proc.poll() is not None:
                    return None
                continue
            if match(m):
                return m
        return None

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


def _spawn_run(home, broker, *extra) -> subprocess.Popen:
    return subprocess.Popen([*agent_cmd(), "--home", str(home), "run", "--broker", broker.url, "--cadence", "3600",
                             *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env())


def _stop(proc: subprocess.Popen) -> tuple[int, str, str]:
    if proc.poll() is None:
        proc.terminate()
    out, err = proc.communicate(timeout=CEILING_S)
    return proc.returncode, out, err


def _request(rogue: Rogue, topics: Topics, to: bytes, as_: bytes, payload: bytes, user: dict) -> bytes:
    corr = os.urandom(16)
    rogue.publish(topics.requests(to, as_), payload, user, corr, topics.answers(as_, to))
    return corr


def _answered(corr: bytes):
    return lambda m: getattr(m.properties, "CorrelationData", None) == corr


def _clear_retained(rogue: Rogue, topic: str) -> None:
    rogue.publish(topic, b"", {}, retain=True)


def test_run_on_the_default_binding_survives_a_body_limit_int_refuses(broker, tmp_path):
    """An anonymous client publishes a request under member a's name with `ssp-body-limit: ²`,
    then a retained presence of a with the same property: `run` answers the request, takes the
    presence and answers a probe published after it, still running."""
    a, b = nodes = make_nodes(tmp_path, 2)
    for n in nodes:
        n.close()
    topics = Topics(MESH)
    rogue = Rogue(broker)
    rogue.subscribe(topics.answers(a.site_id, b.site_id))
    stranger = os.urandom(16)
    rogue.subscribe(topics.answers(stranger, b.site_id))
    proc = _spawn_run(b.home, broker)
    try:
        # the first answer also says `run` subscribed: published before that, a request could be lost
        m = None
        deadline = time.monotonic() + CEILING_S
        while m is None and proc.poll() is None and time.monotonic() < deadline:
            corr = _request(rogue, topics, b.site_id, a.site_id, body(a.site_id), {"ssp-body-limit": POISON})
            m = _wait_short(rogue, corr, proc)
        assert m is not None and proc.poll() is None, _stop(proc)
        rogue.publish(topics.presence(a.site_id), handshake(a.site_id), {"ssp-body-limit": POISON}, retain=True)
        probe = _request(rogue, topics, b.site_id, stranger, b"\xff garbage", {})
        m = rogue.wait_for(_answered(probe), proc)
        assert m is not None and proc.poll() is None, _stop(proc)
        assert dict(m.properties.UserProperty).get("ssp-reason") == "malformed_cbor"
    finally:
        _clear_retained(rogue, topics.presence(a.site_id))
        rc, out, err = _stop(proc)
        rogue.close()
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err


def _wait_short(rogue: Rogue, corr: bytes, proc: subprocess.Popen):
    """The answer to `corr` within a few seconds (a request published before `run` subscribed
    is not delivered to it: the caller publishes again), or None."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            m = rogue.got.get(timeout=0.2)
        except queue.Empty:
            if proc.poll() is not None:
                return None
            continue
        if _answered(corr)(m):
            return m
    return None


def test_sync_once_survives_a_retained_presence_int_refuses(broker, tmp_path):
    """A retained presence of member a carrying `ssp-body-limit: ²` reaches every node at every
    start: `sync --once` exits 0 each time, and still syncs with a."""
    a, b = nodes = make_nodes(tmp_path, 2)
    ids = {write(a, i, "a") for i in range(3)}
    for n in nodes:
        n.close()
    topics = Topics(MESH)
    rogue = Rogue(broker)
    try:
        rogue.publish(topics.presence(a.site_id), handshake(a.site_id), {"ssp-body-limit": POISON}, retain=True)
        for _ in range(2):   # the broker hands it back at every wake
            p = run_cli("--home", b.home, "sync", "--broker", broker.url, "--once", "--timeout", "2")
            assert p.returncode == 0, p.stderr[-3000:]
        p = run_cli("--home", a.home, "sync", "--broker", broker.url, "--once", "--timeout", "2")
        assert p.returncode == 0, p.stderr[-3000:]
        p = run_cli("--home", b.home, "sync", "--broker", broker.url, "--once", "--timeout", "5")
        assert p.returncode == 0, p.stderr[-3000:]
        got = {r["event_id"] for r in _events(b.home)}
        assert {e.hex() for e in ids} <= got
    finally:
        _clear_retained(rogue, topics.presence(a.site_id))
        rogue.close()


def _events(home) -> list[dict]:
    import sqlite3
    with sqlite3.connect(f"file:{home}/store.sqlite?mode=ro", uri=True, timeout=30) as c:
        return [{"event_id": bytes(r[0]).hex()} for r in c.execute("SELECT event_id FROM events")]


def test_an_answer_with_rejected_at_int_refuses_does_not_kill_the_sender(broker, tmp_path):
    """b has a body in flight to a; a reader of a's inbox (the default binding has no ACLs)
    answers it first, with the real correlation data and `ssp-rejected-at: ²`. b's `run` takes the
    answer (it proves nothing) and answers a probe published after it, still running."""
    a, b = nodes = make_nodes(tmp_path, 2)
    write(b, 1, "b")
    for n in nodes:
        n.close()
    topics = Topics(MESH)
    rogue = Rogue(broker)
    rogue.subscribe(topics.requests(a.site_id, b.site_id))
    stranger = os.urandom(16)
    rogue.subscribe(topics.answers(stranger, b.site_id))
    proc = subprocess.Popen([*agent_cmd(), "--home", str(b.home), "run", "--broker", broker.url, "--cadence", "0.5"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env())
    try:
        req = rogue.wait_for(lambda m: m.topic == topics.requests(a.site_id, b.site_id) and len(m.payload) > 0, proc)
        assert req is not None, _stop(proc)
        p = req.properties
        rogue.publish(p.ResponseTopic, b"", {"ssp-from": a.site_id.hex(), "ssp-status": "ok", "ssp-processed": "1",
                                             "ssp-count": "1", "ssp-rejected-at": POISON}, p.CorrelationData)
        probe = _request(rogue, topics, b.site_id, stranger, b"\xff garbage", {})
        m = rogue.wait_for(_answered(probe), proc)
        assert m is not None and proc.poll() is None, _stop(proc)
    finally:
        rc, out, err = _stop(proc)
        rogue.close()
    assert rc == 0, err[-3000:]
    assert "Traceback" not in err


GAP_META = json.dumps({"s": 0, "e": 0, "d": [], "g": [f"app.readings@{POISON}.0"], "x": 0}, ensure_ascii=False)


def test_secure_binding_survives_a_floor_int_refuses(broker, tmp_path):
    """On the secure binding a member's body whose frame meta names the policy gap
    `app.readings@².0` (read after the body is committed): `run --secure-binding` answers it and
    keeps running; `sync --once --secure-binding` exits 0 with it waiting, and is not handed it
    again."""
    a, b = nodes = make_nodes(tmp_path, 2)
    for n in nodes:
        n.close()
    topics = Topics(MESH)
    rogue = Rogue(broker)
    rogue.subscribe(topics.answers(a.site_id, b.site_id))
    # b's persistent session exists: what is published for it waits in the broker
    p = run_cli("--home", b.home, "sync", "--broker", broker.url, "--once", "--timeout", "1", "--secure-binding")
    assert p.returncode == 0, p.stderr[-3000:]
    try:
        corr = _request(rogue, topics, b.site_id, a.site_id, body(a.site_id), {"ssp-meta": GAP_META})
        p = run_cli("--home", b.home, "sync", "--broker", broker.url, "--once", "--timeout", "2", "--secure-binding")
        assert p.returncode == 0, p.stderr[-3000:]
        assert rogue.wait_for(_answered(corr)) is not None
        proc = _spawn_run(b.home, broker, "--secure-binding")
        try:
            m = None
            deadline = time.monotonic() + CEILING_S
            while m is None and proc.poll() is None and time.monotonic() < deadline:
                corr = _request(rogue, topics, b.site_id, a.site_id, body(a.site_id), {"ssp-meta": GAP_META})
                m = _wait_short(rogue, corr, proc)
            assert m is not None and proc.poll() is None, _stop(proc)
        finally:
            rc, out, err = _stop(proc)
        assert rc == 0, err[-3000:]
        assert "Traceback" not in err
    finally:
        rogue.close()


# A fault past every boundary parser, put in by the test: a bug handling a message from outside
# (RuntimeError), and a local fault (the store's disk failing) where the same message is handled.
FAULTY_HANDLING = """
import sqlite3
import agent.core.delivery as _delivery
_split = _delivery.split_gaps
def _faulty(entries):
    entries = list(entries)
    if "bug" in entries:
        raise RuntimeError("a bug past the boundary")
    if "disk" in entries:
        raise sqlite3.OperationalError("disk I/O error")
    return _split(entries)
_delivery.split_gaps = _faulty
"""


def _meta(gap: str) -> dict:
    return {"ssp-meta": json.dumps({"s": 0, "e": 0, "d": [], "g": [gap], "x": 0})}


def test_whatever_handling_raises_is_a_refusal_and_a_local_fault_still_stops_run(broker, tmp_path):
    """The runtime loop's net: a message whose handling raises (past its boundary parser) is
    answered `rejected` (`unclassified`), surfaced in `ssp-agent events`, and `run` goes on; a
    local fault (the store's disk) while handling one stops `run` with exit 1."""
    from ..cli_cmd import patched_cmd
    a, b = nodes = make_nodes(tmp_path, 2)
    for n in nodes:
        n.close()
    topics = Topics(MESH)
    rogue = Rogue(broker)
    rogue.subscribe(topics.answers(a.site_id, b.site_id))
    proc = subprocess.Popen([*patched_cmd(FAULTY_HANDLING), "--home", str(b.home), "run", "--broker", broker.url,
                             "--cadence", "3600", "--secure-binding"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env())
    try:
        m = None
        deadline = time.monotonic() + CEILING_S
        while m is None and proc.poll() is None and time.monotonic() < deadline:
            corr = _request(rogue, topics, b.site_id, a.site_id, body(a.site_id), _meta("bug"))
            m = _wait_short(rogue, corr, proc)
        assert m is not None and proc.poll() is None, _stop(proc)
        props = dict(m.properties.UserProperty)
        assert props["ssp-status"] == "rejected" and props["ssp-reason"] == "unclassified", props
        ev = run_cli("--home", b.home, "events")   # forwarded to the running agent
        assert ev.returncode == 0 and '"unclassified"' in ev.stdout and "RuntimeError" in ev.stdout, ev
        _request(rogue, topics, b.site_id, a.site_id, body(a.site_id), _meta("disk"))
        proc.wait(timeout=CEILING_S)
    finally:
        rc, out, err = _stop(proc)
        rogue.close()
    assert rc == 1, err[-3000:]
    assert "disk I/O error" in err
