"""Real-world broker settings against a real mosquitto: TLS with and without a client
certificate, username/password, and the per-device ACL configuration of docs/mqtt.md (run as
written there) actually enforced. Certificates are made here with `cryptography`."""
from __future__ import annotations

import datetime
import ipaddress
import os
import re
import threading
import time
from pathlib import Path

import paho.mqtt.client as paho
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from paho.mqtt.enums import CallbackAPIVersion

from agent.store.sync_state import peer_lag
from agent.store import sync_state as st
from agent.transport.broker import Broker, free_port, write_password_file
from agent.transport.mqtt import MqttLink, MqttSettings, Topics, _publish_props

from .helpers import MESH, T, event_ids, make_nodes, runner, step_until, write
from tests.waiting import HANG_S

DOCS = Path(__file__).resolve().parents[2] / "docs" / "mqtt.md"


# ---------------------------------------------------------------- certificates
def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: str, key, issuer_name, issuer_key, *, ca=False, server=False):
    now = datetime.datetime.now(datetime.timezone.utc)
    b = (x509.CertificateBuilder().subject_name(_name(subject)).issuer_name(issuer_name)
         .public_key(key.public_key()).serial_number(x509.random_serial_number())
         .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                         x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), False)
    return b.sign(issuer_key, hashes.SHA256())


def _write(path: Path, cert, key=None) -> Path:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    if key is not None:
        path.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                               serialization.PrivateFormat.PKCS8,
                                                               serialization.NoEncryption()))
    return path


def make_pki(d: Path, clients: list[str]) -> dict[str, Path]:
    d.mkdir(parents=True, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = _cert("ssp test CA", ca_key, _name("ssp test CA"), ca_key, ca=True)
    out = {"ca": _write(d / "ca.crt", ca)}
    srv_key = ec.generate_private_key(ec.SECP256R1())
    out["server"] = _write(d / "broker.crt", _cert("127.0.0.1", srv_key, ca.subject, ca_key, server=True), srv_key)
    for cn in clients:
        k = ec.generate_private_key(ec.SECP256R1())
        out[cn] = _write(d / f"{cn}.crt", _cert(cn, k, ca.subject, ca_key), k)
    return out


# ---------------------------------------------------------------- the docs' configuration
def docs_conf_blocks() -> tuple[str, str]:
    blocks = re.findall(r"```conf\n(.*?)```", DOCS.read_text(), re.S)
    assert len(blocks) == 2, "docs/mqtt.md should hold the mosquitto.conf and the ACL file"
    return blocks[0], blocks[1]


def docs_broker(tmp: Path, pki: dict, passwords: dict[str, str], **overrides: str) -> Broker:
    """docs/mqtt.md's mosquitto.conf and ACL file as written, with only paths and the port
    replaced (and `overrides`: key -> value)."""
    conf, acl = docs_conf_blocks()
    port = free_port()
    (tmp / "ssp.acl").write_text(acl)
    write_password_file(tmp / "ssp.passwd", passwords)
    repl = {"listener": f"{port} 127.0.0.1", "certfile": str(pki["server"]),
            "keyfile": str(pki["server"].with_suffix(".key")), "cafile": str(pki["ca"]),
            "password_file": str(tmp / "ssp.passwd"), "acl_file": str(tmp / "ssp.acl"),
            "persistence_location": f"{tmp}/", **overrides}
    lines = []
    for line in conf.splitlines():
        key = line.split(" ", 1)[0]
        lines.append(f"{key} {repl.pop(key)}" if key in repl else line)
    lines += [f"{k} {v}" for k, v in repl.items()]  # overrides the docs do not set
    return Broker(port=port, workdir=tmp / "broker", raw_conf="\n".join(lines)).start()


class RawClient:
    """A plain paho client with its own credentials, recording what it receives and its acks."""

    def __init__(self, port: int, client_id: str, ca: Path, username: str | None = None,
                 password: str | None = None, cert: Path | None = None) -> None:
        self.got: list[tuple[str, bytes]] = []
        self.suback: list = []
        self.puback: dict[int, object] = {}
        self.connected = threading.Event()
        self.c = paho.Client(CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv5)
        if username:
            self.c.username_pw_set(username, password)
        self.c.tls_set(ca_certs=str(ca), certfile=str(cert) if cert else None,
                       keyfile=str(cert.with_suffix(".key")) if cert else None)
        self.c.on_connect = lambda c, u, f, rc, p: self.connected.set() if not rc.is_failure else None
        self.c.on_message = lambda c, u, m: self.got.append((m.topic, bytes(m.payload)))
        self.c.on_subscribe = lambda c, u, mid, rcs, p: self.suback.extend(rcs)
        self.c.on_publish = lambda c, u, mid, rc, p: self.puback.__setitem__(mid, rc)
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        assert self.connected.wait(HANG_S)

    def publish(self, topic: str, payload: bytes, props=None) -> None:
        self.c.publish(topic, payload, qos=1, properties=props).wait_for_publish(5)

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def _link_ok(url: str, site: bytes, **kw) -> tuple[bool, str | None]:
    lk = MqttLink(MqttSettings.from_url(url, backoff_min_s=0.05, backoff_max_s=0.2, **kw), MESH, site).start()
    try:
        return lk.wait_connected(2), lk.last_error
    finally:
        lk.close(clear_presence=False)


# ---------------------------------------------------------------- tests
def test_docs_acl_config_enforced_over_tls_with_passwords(tmp_path):
    a, b, c = nodes = make_nodes(tmp_path, 3)
    users = {n.site_id.hex(): os.urandom(8).hex() for n in nodes}
    pki = make_pki(tmp_path / "pki", [])
    br = docs_broker(tmp_path, pki, users)
    url = f"mqtts://127.0.0.1:{br.port}"
    topics = Topics(MESH)

    def cred(n):
        return dict(ca_file=str(pki["ca"]), username=n.site_id.hex(), password=users[n.site_id.hex()])

    ra = runner(a, None, url=url, link=cred(a), secure=True)
    rb = runner(b, None, url=url, link=cred(b), secure=True)
    rogue = RawClient(br.port, c.site_id.hex() + "-x", pki["ca"], c.site_id.hex(), users[c.site_id.hex()])
    try:
        # refused: no credentials, a wrong password, another device's password
        assert _link_ok(url, os.urandom(16), ca_file=str(pki["ca"]))[0] is False
        ok, err = _link_ok(url, c.site_id, ca_file=str(pki["ca"]), username=c.site_id.hex(), password="wrong")
        assert not ok and "refused" in (err or "")
        # c reads only its own inbox. (mosquitto 2.0 grants the SUBSCRIBE to b's inbox and checks
        # the read ACL per message: nothing of b's arrives, asserted below.)
        rogue.c.subscribe(topics.base(b.site_id) + "/inbox/#", qos=1)
        rogue.c.subscribe(topics.base(c.site_id) + "/inbox/#", qos=1)
        deadline = time.monotonic() + HANG_S
        while len(rogue.suback) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        # c publishes as a: into b's inbox, and into its own inbox
        honest = write(a, 0, "a")
        body = ra.sync.body([bytes(a.conn.execute("SELECT unseal(event_id, raw) FROM events").fetchone()[0])])
        rogue.publish(topics.requests(b.site_id, a.site_id), body,
                      _publish_props({}, b"x" * 16, topics.answers(a.site_id, b.site_id)))
        rogue.publish(topics.requests(c.site_id, a.site_id), body, _publish_props({}, b"y" * 16, None))
        rogue.publish(topics.presence(a.site_id), b"forged presence")
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:
            rb.pump(0.02)
        assert rb.stats["bodies_received"] == 0  # the broker dropped it: c may not speak as a
        assert rogue.got == []  # nor did its own inbox get a body "from a"
        # honest traffic flows, and c (subscribed to b's inbox) sees none of it
        for i in range(1, 20):
            write(a, i, "a")
            write(b, i, "b")
        want = event_ids(a) | event_ids(b)
        assert honest in want
        assert step_until([ra, rb], lambda: event_ids(a) == event_ids(b) == want, 20)
        assert all(not t.startswith(topics.base(b.site_id) + "/inbox") for t, _ in rogue.got)
        # the same rogue publishing under its own name does reach b (the ACL, not a broken setup)
        rogue.publish(topics.requests(b.site_id, c.site_id), b"\xff", _publish_props({}, b"z" * 16, None))
        assert step_until([ra, rb], lambda: rb.stats["rejected:malformed_cbor"] == 1, 5)
        # secure binding: watermarks moved, reports kept, nobody behind
        assert (a.site_id, T) in st.own_watermarks(b.conn) and (b.site_id, T) in st.own_watermarks(a.conn)
        assert step_until([ra, rb], lambda: peer_lag(a.conn, b.site_id) == 0 and peer_lag(b.conn, a.site_id) == 0, 10)
        assert ra.summary()["peers"][b.site_id.hex()]["behind"] == 0
    finally:
        rogue.close()
        ra.close(); rb.close()
        for n in nodes:
            n.close()
        br.close()


def test_mutual_tls_client_certificates_as_identity(tmp_path):
    a, b = nodes = make_nodes(tmp_path, 2)
    pki = make_pki(tmp_path / "pki", [a.site_id.hex(), b.site_id.hex(), "stranger"])
    br = docs_broker(tmp_path, pki, {}, require_certificate="true", use_identity_as_username="true")
    url = f"mqtts://127.0.0.1:{br.port}"

    def cred(n):
        crt = pki[n.site_id.hex()]
        return dict(ca_file=str(pki["ca"]), cert_file=str(crt), key_file=str(crt.with_suffix(".key")))

    try:
        ok, err = _link_ok(url, os.urandom(16), ca_file=str(pki["ca"]))  # TLS without a client certificate
        assert not ok and err
        ra = runner(a, None, url=url, link=cred(a), secure=True)
        rb = runner(b, None, url=url, link=cred(b), secure=True)
        # a valid certificate whose CN is not a's site id cannot speak as a (the ACL pins %u = CN)
        stranger = RawClient(br.port, "stranger", pki["ca"], cert=pki["stranger"])
        try:
            write(a, 0, "a")
            body = ra.sync.body([bytes(a.conn.execute("SELECT unseal(event_id, raw) FROM events").fetchone()[0])])
            stranger.publish(Topics(MESH).requests(b.site_id, a.site_id), body)
            t_end = time.monotonic() + 0.5
            while time.monotonic() < t_end:
                rb.pump(0.02)
            assert rb.stats["bodies_received"] == 0
            for i in range(1, 10):
                write(a, i, "a")
            assert step_until([ra, rb], lambda: event_ids(b) == event_ids(a), 15)
            assert step_until([ra, rb], lambda: peer_lag(a.conn, b.site_id) == 0, 10)
        finally:
            stranger.close()
            ra.close(); rb.close()
    finally:
        for n in nodes:
            n.close()
        br.close()


def test_a_busy_tls_link_keeps_its_connection(tmp_path):
    """Bodies, answers and acks both ways over TLS, written on the loop's thread while each link's
    network thread reads: the connections stay up. Before only the network thread wrote the
    socket (MqttLink._make_client), the loop's thread and the network thread were inside one
    OpenSSL SSL object at once: the broker dropped the connection on damaged records, and some
    runs ended in a segfault or a glibc heap abort ("corrupted double-linked list")."""
    a, b = nodes = make_nodes(tmp_path, 2)
    users = {n.site_id.hex(): os.urandom(8).hex() for n in nodes}
    pki = make_pki(tmp_path / "pki", [])
    br = docs_broker(tmp_path, pki, users)
    url = f"mqtts://127.0.0.1:{br.port}"

    def cred(n):
        return dict(ca_file=str(pki["ca"]), username=n.site_id.hex(), password=users[n.site_id.hex()])

    ra = runner(a, None, url=url, link=cred(a), secure=True, cadence_s=0.05)
    rb = runner(b, None, url=url, link=cred(b), secure=True, cadence_s=0.05)
    try:
        for i in range(0, 600, 5):
            for j in range(i, i + 5):
                write(a, j, "a")
                write(b, j, "b")
            ra.step(0.005)
            rb.step(0.005)
        assert step_until([ra, rb], lambda: len(event_ids(a)) == len(event_ids(b)) == 1200, 60)
        assert (ra.link.connects, rb.link.connects) == (1, 1), (ra.link.last_error, rb.link.last_error)
        assert ra.stats["broker_lost"] == rb.stats["broker_lost"] == 0
    finally:
        ra.close(); rb.close()
        for n in nodes:
            n.close()
        br.close()
