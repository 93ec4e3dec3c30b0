"""One regression test per poison input (tests/hostile/poison.py), each through the real part it
crashed, hung or bloated: a runner on a real mosquitto, the `ssp-agent` CLI in a subprocess, the
sync driver on a real SQLite store. Each of these failed on the code before the fix (a raised
RecursionError / TypeError / OverflowError, a traceback with exit 1, a decode that took seconds
or produced 40 001 events)."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import cbor2
import pytest

from agent.core.codec import DecodeError, decode_strict
from agent.core.cose import assemble
from agent.core.messages import ProtocolError, parse_message
from agent.core.records import truncation_to_be_signed
from agent.rehydrate import to_be_signed as rehydrate_tbs
from agent.runner import RunConfig, Runner
from agent.simpeer import SimPeer
from agent.sync import SyncDriver
from agent.sync_port import PortAdapter
from agent.transport.mqtt import MqttLink, MqttSettings, Topics, _publish_props

from .poison import DEEP_META, MIXED_KEY_BODY, shared_events_body, sharing_bomb, watermark_body
from tests.waiting import HANG_S

ROOT = Path(__file__).resolve().parents[2]
MESH = bytes.fromhex("5e5e0000000000000000000000000042")


# ---------------------------------------------------------------- item 2: the decoder
def test_sharing_bomb_is_refused_by_the_strict_decoder():
    with pytest.raises(DecodeError) as e:
        decode_strict(sharing_bomb(8, 8), deterministic=False)  # 196 bytes, 8**8 nodes as a tree
    assert e.value.reason == "unexpected_tag"


def test_a_185_kb_body_cannot_expand_into_40_001_events():
    with pytest.raises(ProtocolError) as e:
        parse_message(shared_events_body())
    assert e.value.reason == "malformed_cbor"


# ---------------------------------------------------------------- item 1: crash loops over MQTT
def _nodes(tmp_path, n):
    from tests.mqtt.helpers import make_nodes
    return make_nodes(tmp_path, n)


def _runner(node, broker, **cfg):
    base = dict(cadence_s=3600, answer_timeout_s=3.0, realtime=False)
    base.update(cfg)
    r = Runner(node, MqttSettings.from_url(broker.url, backoff_min_s=0.05, backoff_max_s=0.5), RunConfig(**base))
    assert r.start(10), r.link.last_error
    return r


def _rogue(broker, site: bytes | None = None) -> MqttLink:
    link = MqttLink(MqttSettings.from_url(broker.url), MESH, site or os.urandom(16)).start()
    assert link.wait_connected(5)
    return link


def _pump_for(r: Runner, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        r.step(0.02)


def test_inbox_poison_is_refused_answered_acked_surfaced_and_not_redelivered(broker, tmp_path):
    a, b = _nodes(tmp_path, 2)
    rb = _runner(b, broker)
    rogue = _rogue(broker)
    topics = Topics(MESH)
    honest = SimPeer(MESH, site_id=a.site_id).body([])
    # under a's name: a deep ssp-meta (RecursionError) and a body with a non-text key (TypeError)
    rogue.publish_raw(topics.requests(b.site_id, a.site_id), honest,
                      _publish_props({"ssp-meta": DEEP_META}, os.urandom(16), topics.answers(a.site_id, b.site_id)))
    rogue.publish_raw(topics.requests(b.site_id, a.site_id), MIXED_KEY_BODY,
                      _publish_props({}, os.urandom(16), topics.answers(a.site_id, b.site_id)))
    try:
        deadline = time.monotonic() + HANG_S
        while len(rb.rejections) < 2 and time.monotonic() < deadline:
            rb.step(0.02)  # raised RecursionError, then TypeError, before the fix
        assert sorted(r for r, _ in rb.rejections) == ["bad_frame_meta", "bad_members"]
        refused = [(s["reason"], s["detail"]["source"]) for s in b.surfaced() if s["kind"] == "refused"]
        assert sorted(refused) == [("bad_frame_meta", "mqtt_request"), ("bad_members", "mqtt_request")]
        _pump_for(rb, 0.5)  # the acks reach the broker
        rb.close()
        # a restart: the broker redelivers what was not acknowledged; nothing is
        rb = _runner(b, broker)
        _pump_for(rb, 1.5)
        assert rb.stats["bodies_received"] == 0 and not rb.rejections
    finally:
        rogue.close()
        rb.close()
        a.close(); b.close()


def test_a_retained_poison_presence_does_not_kill_nodes_at_start(broker, tmp_path):
    a, b = _nodes(tmp_path, 2)
    rogue_site = os.urandom(16)
    rogue = _rogue(broker, rogue_site)
    # retained: every node of the mesh receives it at every start
    rogue.client.publish(Topics(MESH).presence(rogue_site), MIXED_KEY_BODY, qos=1, retain=True).wait_for_publish(5)
    rogue.close(clear_presence=False)
    ra = rb = None
    try:
        for _ in range(2):  # and again after a restart
            ra, rb = _runner(a, broker), _runner(b, broker)
            # the presence handler raised TypeError before the fix; both at once, so each answers
            # the other's pull instead of one waiting out its timeout on a peer not pumping
            both = [threading.Thread(target=r.sync_once, kwargs={"settle_s": 0.5, "timeout_s": 10}) for r in (ra, rb)]
            for t in both:
                t.start()
            for t in both:
                t.join()
            assert ra.stats["refused_presence"] >= 1 and rogue_site not in ra.caps
            ra.close(); rb.close()
        refused = [s for s in a.surfaced() if s["kind"] == "refused"]
        assert refused and {s["reason"] for s in refused} == {"bad_members"}
        assert {s["detail"]["claimed_sender"] for s in refused} == {rogue_site.hex()}
    finally:
        for r in (ra, rb):
            if r is not None:
                r.close()
        a.close(); b.close()


# ---------------------------------------------------------------- item 1: the CLI contract
def test_mailbox_import_of_a_poison_body_exits_2_with_one_line(tmp_path):
    a, = _nodes(tmp_path, 1)
    home = a.home
    before = a.conn.execute("SELECT count(*) FROM surfaced").fetchone()[0]
    a.close()
    f = tmp_path / "poison.cbor"
    f.write_bytes(MIXED_KEY_BODY)
    from tests.cli_cmd import run_cli
    p = run_cli("--home", home, "mailbox", "import", f, timeout=120)
    assert p.returncode == 2, p.stderr  # exit 1 with a TypeError traceback before the fix
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1
    assert "bad_members" in p.stderr and "nothing was changed" in p.stderr
    from agent.node import Node
    with Node.open(home) as n:
        assert n.conn.execute("SELECT count(*) FROM surfaced").fetchone()[0] == before


# ---------------------------------------------------------------- item 3: integers SQLite cannot store
def test_a_watermark_hlc_of_2_63_is_refused_not_stored(tmp_path):
    a, b = _nodes(tmp_path, 2)
    port = PortAdapter(b, secure=True)  # reports are stored only on a secure binding
    try:
        with pytest.raises(ProtocolError) as e:  # OverflowError from SQLite before the fix
            port.receive(watermark_body(a.site_id, 2**63), meta=None, sender=a.site_id)
        assert e.value.reason == "malformed_cbor" and e.value.detail == "int_out_of_range"
        port.receive(watermark_body(a.site_id, 2**63 - 1), meta=None, sender=a.site_id)  # the largest storable
    finally:
        a.close(); b.close()


def _trusted(node, tmp_path) -> SimPeer:
    p = SimPeer(MESH)
    node.add_peer(p.site_id, p.public_key, None)
    return p


def _sign(p: SimPeer, tbs: tuple[bytes, bytes, bytes]) -> bytes:
    protected, payload, sig_structure = tbs
    return assemble(protected, payload, p.key.sign(sig_structure).signature)


def test_a_rehydrate_record_with_generation_2_63_is_dropped(tmp_path):
    node, = _nodes(tmp_path, 1)
    p = _trusted(node, tmp_path)
    raw = _sign(p, rehydrate_tbs(p.site_id, MESH, 2**63, bytes(32), 1))
    try:
        out = SyncDriver(node).apply_records([raw], 1_790_000_000_000)  # OverflowError before the fix
        assert out["rehydrate"]["dropped"] == 1
        assert [s["reason"] for s in node.surfaced() if s["kind"] == "record_dropped"] == ["int_out_of_range"]
    finally:
        node.close()


def test_a_truncation_record_with_horizon_2_63_is_dropped(tmp_path):
    node, = _nodes(tmp_path, 1)
    p = _trusted(node, tmp_path)
    raw = _sign(p, truncation_to_be_signed(p.site_id, MESH, node.site_id, "app", "readings", (2**63, 0),
                                           [{"device": "d", "seq": 1}], 1))
    try:
        out = SyncDriver(node).apply_records([raw], 1_790_000_000_000)  # OverflowError before the fix
        assert out["truncation"]["dropped"] == 1
        assert [s["reason"] for s in node.surfaced() if s["kind"] == "record_dropped"] == ["int_out_of_range"]
    finally:
        node.close()


# ---------------------------------------------------------------- found while writing the classify functions
def test_a_session_frame_whose_type_is_not_text_is_refused():
    from agent.core.session import decode_frame
    with pytest.raises(ProtocolError) as e:  # TypeError (unhashable type) before the fix
        decode_frame(cbor2.dumps({"t": [1], "b": b""}))
    assert e.value.reason == "bad_frame"


def test_frame_meta_positions_beyond_what_the_store_holds_are_refused():
    from agent.core.session import StreamMeta
    with pytest.raises(ProtocolError) as e:  # accepted before the fix (stream positions reach SQLite)
        StreamMeta.from_wire({"s": 2**63, "e": 2**63, "d": [], "g": [], "x": 0}, 0)
    assert e.value.reason == "bad_frame_meta"


def test_a_retirement_cutoff_beyond_what_the_store_holds_is_refused(tmp_path):
    node, = _nodes(tmp_path, 1)
    home = node.home
    node.close()
    p = SimPeer(MESH)
    from tests.cli_cmd import run_cli
    r = run_cli("--home", home, "peer", "add", "--site-id", p.site_id.hex(), "--public-key", p.public_key.hex(),
                "--retired-after", f"{2**63}.0", timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr  # OverflowError traceback before


def test_a_truncated_serial_reply_is_a_keystore_protocol_error():
    from firmware_bridge import KeystoreError
    from firmware_bridge import serial_protocol as sp
    for op, body in ((sp.HELLO, b"\x01\x05ab"), (sp.GENERATE, b"\x07\x00\x20" + bytes(32)), (sp.SIGN, b"\x00" * 9),
                     (sp.LIST, b"\x02\x01\x01a")):
        with pytest.raises(KeystoreError) as e:  # FrameError (a ValueError) or KeyError from the driver before
            sp.parse_reply(op, sp.Frame(op | sp.OK_BIT, 1, body))
        assert isinstance(e.value, sp.ReplyError) and e.value.reason in (
            "malformed_body", "unknown_algorithm"), e.value


def test_a_serial_key_tag_reply_is_refused_when_it_cannot_be_one():
    """KEY_TAG (the serial device's tag of a key, what tells an init cut short its own key): a
    tag longer than any the host sends, a truncated blob, trailing bytes: each a ReplyError."""
    from firmware_bridge import serial_protocol as sp
    for body, reason in ((b"\x00\x21" + bytes(33), "bad_tag"), (b"\x00\x10" + bytes(3), "malformed_body"),
                         (b"\x00\x01\x07\x00", "trailing_bytes")):
        with pytest.raises(sp.ReplyError) as e:
            sp.parse_reply(sp.KEY_TAG, sp.Frame(sp.KEY_TAG | sp.OK_BIT, 1, body))
        assert e.value.reason == reason, (body, e.value)
    assert sp.parse_reply(sp.KEY_TAG, sp.Frame(sp.KEY_TAG | sp.OK_BIT, 1, b"\x00\x02ab")).data == b"ab"


def test_the_serial_device_refuses_a_key_tag_request_that_cannot_be_one(tmp_path):
    """The device side of GENERATE_TAGGED / KEY_TAG against a host that sends what no driver
    does: an empty or 33-byte tag, trailing bytes, an unknown key. Each is refused with its code
    and nothing is made; a well-formed request after them still works."""
    from firmware_bridge import serial_device
    from firmware_bridge import serial_protocol as sp
    core = serial_device.DeviceCore(str(tmp_path / "device"))

    def ask(op, body):
        frames = list(sp.FrameReader().feed(core.handle(sp.Frame(op, 1, body))))
        return sp.parse_reply(op, frames[0])
    base = bytes([sp.ALG_CODES["p256"]]) + sp.put_str("k")
    for body in (base + sp.put_blob(b""), base + sp.put_blob(bytes(33)), base + sp.put_blob(b"t") + b"\x00"):
        got = ask(sp.GENERATE_TAGGED, body)
        assert isinstance(got, sp.DeviceError) and got.code == sp.E_BAD_REQUEST, (body, got)
    assert core.keys.names() == []
    got = ask(sp.KEY_TAG, sp.put_str("k"))
    assert isinstance(got, sp.DeviceError) and got.code == sp.E_KEY_NOT_FOUND, got
    assert isinstance(ask(sp.GENERATE_TAGGED, base + sp.put_blob(b"t" * 32)), sp.KeyInfo)
    assert ask(sp.KEY_TAG, sp.put_str("k")).data == b"t" * 32
