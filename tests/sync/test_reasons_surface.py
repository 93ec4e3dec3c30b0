"""Every reason code a transport can reach shows in `ssp-agent events` under its one name
(agent/core/reasons.py): the shipped session over the in-memory link and over the serial link
state machine, and mailbox files (refused on stderr, nothing stored: docs/protocol.md §6). MQTT:
tests/mqtt/test_reasons_mqtt.py. The catalogue of inputs: tests/reasons_catalogue.py."""
from __future__ import annotations

import json
import sqlite3
import subprocess

from agent.core import reasons as R
from agent.core.session import MAX_FRAME_BYTES, encode_frame
from agent.sync import SyncDriver
from agent.transport.memory import MemoryLink
from agent.transport.serial import SerialEndpoint, SessionSettings
from agent.transport.serial_link import LinkConfig, SerialLink

from ..cli_cmd import agent_cmd, agent_env
from ..reasons_catalogue import (LINK_CODES, MAILBOX_CODES, MQTT_CODES, MQTT_LINK_CODES, SERIAL_CODES, SESSION_CODES, UNREACHABLE, bad_messages,
                                 body, handshake)
from .helpers import NOW, mesh

META0 = {"s": 0, "e": 0, "d": [], "g": [], "x": 0}


def rogue_frames(peer: bytes, me: bytes, stranger: bytes, too_large: bool = True) -> list[tuple[str, bytes]]:
    """(expected code, frame) in the order a rogue sends them to a fresh session of `me`,
    speaking as `peer` (batch only): before the handshake, the handshake, then everything else."""
    out = [(R.NO_HANDSHAKE, encode_frame("body", c=1, b=body(peer), m=META0)),
           (R.SELF_HANDSHAKE, encode_frame("hello", b=handshake(me), r=False)),
           (R.NOT_A_HANDSHAKE, encode_frame("hello", b=body(peer), r=False)),
           ("", encode_frame("hello", b=handshake(peer, realtime=False), r=False)),  # now ready, batch mode
           (R.HANDSHAKE_SITE_MISMATCH, encode_frame("hello", b=handshake(stranger), r=False)),
           (R.SENDER_MISMATCH, encode_frame("body", c=2, b=body(stranger), m=META0)),
           (R.REALTIME_NOT_ESTABLISHED, encode_frame("push", c=3, b=body(peer), m=META0)),
           (R.BAD_FRAME, encode_frame("nope", c=4)),
           (R.BAD_FRAME_META, encode_frame("body", c=5, b=body(peer), m={"s": 0, "e": 0, "d": [1], "g": [], "x": 0}))]
    out += [(code, encode_frame("body", c=10 + i, b=msg, m=META0)) for i, (code, msg) in enumerate(bad_messages(peer).items())]
    if too_large:
        out.append((R.TOO_LARGE, b"\x00" * (MAX_FRAME_BYTES + 1)))
    return out


def events_reasons(home) -> dict[str, set[str]]:
    """`ssp-agent events` as an operator runs it: reason -> the sources it was refused from."""
    p = subprocess.run([*agent_cmd(), "--home", str(home), "events"], capture_output=True, text=True,
                       env=agent_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    out: dict[str, set[str]] = {}
    for line in p.stdout.splitlines():
        e = json.loads(line)
        if e["kind"] == "refused":
            out.setdefault(e["reason"], set()).add(e["detail"]["source"])
    return out


def test_the_transports_together_reach_every_code():
    assert (SESSION_CODES | SERIAL_CODES | MQTT_CODES | MAILBOX_CODES | LINK_CODES | MQTT_LINK_CODES
            | UNREACHABLE == R.ALL)
    assert not (SESSION_CODES | MQTT_CODES | MAILBOX_CODES) & UNREACHABLE


def test_every_session_code_over_the_memory_link_shows_in_events(tmp_path):
    a, b, stranger = mesh(tmp_path, 3)
    s = SyncDriver(b).session("memory", None, secure=True)  # as a transport makes one: the peer from its handshake
    link = MemoryLink()
    s.start(NOW)
    expected = rogue_frames(a.site_id, b.site_id, stranger.site_id)
    for i, (_code, frame) in enumerate(expected):
        link.send(0, frame, NOW + i)
        for _to, data in link.due(NOW + i + 5):
            s.receive(data, NOW + i + 5)
    codes = [code for code, _ in expected if code]
    assert [e.detail for e in s.events if e.kind == "protocol_error"] == codes
    assert not list(b.log_entries())
    home = b.home
    for n in (a, b, stranger):
        n.close()
    seen = events_reasons(home)
    assert set(codes) == SESSION_CODES
    assert {c: seen.get(c) for c in codes} == {c: {"session:memory"} for c in codes}


class RogueLine:
    """A bare serial link (the rogue end: it sends whatever session frames it likes) and the
    shipped SerialEndpoint of a real node, byte pipes between them, time simulated."""

    def __init__(self, driver, ep_cfg: LinkConfig | None = None):
        self.t = 0
        self.rogue = SerialLink(LinkConfig(), 0x1234)
        self.to_rogue: list[bytes] = []
        self.silent = False  # the rogue's end of the cable hears and says nothing (pulled)
        self.ep = SerialEndpoint(driver, SerialLink(ep_cfg or LinkConfig(), 0x5678), self.to_rogue.append,
                                 SessionSettings(realtime=True, cycle_ms=3_600_000))

    def run(self, ms: int) -> None:
        end = self.t + ms
        while self.t < end:
            if self.silent:
                self.to_rogue.clear()
                self.ep.handle_timer(self.t, NOW + self.t)
                self.t += 5
                continue
            data = self.rogue.data_to_send()
            if data:
                self.ep.receive_bytes(data, self.t, NOW + self.t)
            while self.to_rogue:
                self.rogue.receive_bytes(self.to_rogue.pop(0), self.t)
            self.rogue.messages()  # whatever the endpoint says is read and ignored
            if (t := self.rogue.timer()) is not None and t <= self.t:
                self.rogue.handle_timer(self.t)
            self.ep.handle_timer(self.t, NOW + self.t)
            self.t += 5


def test_every_serial_code_shows_in_events(tmp_path):
    a, b, stranger = mesh(tmp_path, 3)
    line = RogueLine(SyncDriver(b))
    line.rogue.start(0)
    line.ep.start(0)
    line.run(2_000)
    assert line.rogue.up and line.ep.session is not None
    expected = rogue_frames(a.site_id, b.site_id, stranger.site_id, too_large=False)
    for _code, frame in expected:
        line.rogue.send_message(frame, line.t)
        line.run(200)
    codes = [code for code, _ in expected if code]
    got = [d for k, d in line.ep.events if k == "protocol_error"]
    assert got == codes and line.ep.sessions == 1  # one incarnation: refusals never end the link
    home = b.home
    for n in (a, b, stranger):
        n.close()
    seen = events_reasons(home)
    assert set(codes) == SERIAL_CODES
    assert {c: seen.get(c) for c in codes} == {c: {"session:serial"} for c in codes}


def test_every_link_loss_shows_in_events(tmp_path):
    """A serial link incarnation that ends (docs/serial.md "State machine") shows in `ssp-agent
    events` with its reason code from the one list (kind `link_lost`, source `link:serial`), not
    only in the sync summary: a compressed message this end never offered, a message over the
    link's bound, a peer that restarted, and a peer gone silent (a pulled cable)."""
    a, b, _stranger = mesh(tmp_path, 3)
    line = RogueLine(SyncDriver(b), LinkConfig(compress=False, max_message=4096))
    line.rogue.start(0)
    line.ep.start(0)
    line.run(2_000)
    assert line.rogue.up and line.ep.link.up
    line.rogue.peer_zlib = True  # it compresses although this end's HELLO did not offer it
    line.rogue.send_message(b"a" * 600, line.t)
    line.run(2_000)
    assert line.rogue.up and line.ep.link.up  # a new incarnation
    line.rogue.send_message(b"\x00" * 5000, line.t)  # over the endpoint's max_message
    line.run(2_000)
    assert line.ep.link.up
    line.rogue = SerialLink(LinkConfig(), 0x9999)  # the other process restarted: a new nonce
    line.rogue.start(line.t)
    line.run(2_000)
    assert line.ep.link.up
    line.silent = True
    line.run(LinkConfig().dead_ms + 1_000)
    assert not line.ep.link.up
    codes = ["bad_compressed_message", "message_too_large", "peer_restarted", "peer_silent"]
    assert [d for k, d in line.ep.events if k == "link_down"] == codes
    home = b.home
    for n in (a, b, _stranger):
        n.close()
    p = subprocess.run([*agent_cmd(), "--home", str(home), "events"], capture_output=True, text=True,
                       env=agent_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    lost = [json.loads(x) for x in p.stdout.splitlines() if json.loads(x)["kind"] == "link_lost"]
    assert [e["reason"] for e in lost] == codes
    assert {e["detail"]["source"] for e in lost} == {"link:serial"}
    assert set(codes) == LINK_CODES


def test_link_losses_a_peer_provokes_are_bounded_in_events(tmp_path):
    """A peer restarting its link again and again (new nonces) surfaces at most
    LOSSES_SURFACED_PER_WINDOW rows per reason and window (each row is an fsync); the rest are
    counted in one row when the next window starts."""
    from agent.transport.serial import LOSS_WINDOW_MS, LOSSES_SURFACED_PER_WINDOW
    a, b = mesh(tmp_path, 2)
    line = RogueLine(SyncDriver(b))
    line.rogue.start(0)
    line.ep.start(0)
    line.run(1_000)
    extra = 5
    for i in range(LOSSES_SURFACED_PER_WINDOW + extra):
        line.rogue = SerialLink(LinkConfig(), 0x2000 + i)
        line.rogue.start(line.t)
        line.run(300)
        assert line.ep.link.up
    line.run(LOSS_WINDOW_MS)
    line.rogue = SerialLink(LinkConfig(), 0x3000)
    line.rogue.start(line.t)
    line.run(300)
    n = LOSSES_SURFACED_PER_WINDOW + extra + 1
    assert [d for k, d in line.ep.events if k == "link_down"] == [R.PEER_RESTARTED] * n
    home = b.home
    a.close()
    b.close()
    p = subprocess.run([*agent_cmd(), "--home", str(home), "events"], capture_output=True, text=True,
                       env=agent_env(), timeout=120)
    lost = [json.loads(x) for x in p.stdout.splitlines() if json.loads(x)["kind"] == "link_lost"]
    assert len(lost) == LOSSES_SURFACED_PER_WINDOW + 2
    assert f"{extra} more not surfaced" in lost[-2]["detail"]["detail"]


def test_session_refusals_over_a_cable_are_bounded_in_events(tmp_path):
    """A rogue on a gateway's cable sending frame after refused frame costs at most
    LOSSES_SURFACED_PER_WINDOW surfaced rows (each a transaction: an fsync on the loop that serves
    every other link too) per reason and window; the rest are counted in one row when the next
    window starts (as the MQTT runner bounds its refusals)."""
    from agent.transport.serial import LOSS_WINDOW_MS, LOSSES_SURFACED_PER_WINDOW
    a, b = mesh(tmp_path, 2)
    line = RogueLine(SyncDriver(b))
    line.rogue.start(0)
    line.ep.start(0)
    line.run(1_000)
    line.rogue.send_message(encode_frame("hello", b=handshake(a.site_id, realtime=False), r=False), line.t)
    line.run(500)
    extra = 7
    for i in range(LOSSES_SURFACED_PER_WINDOW + extra):
        line.rogue.send_message(encode_frame("nope", c=100 + i), line.t)
    line.run(2_000)
    line.run(LOSS_WINDOW_MS)
    line.rogue.send_message(encode_frame("nope", c=999), line.t)
    line.run(500)
    assert [d for k, d in line.ep.events if k == "protocol_error"] == [R.BAD_FRAME] * (LOSSES_SURFACED_PER_WINDOW + extra + 1)
    assert line.ep.sessions == 1
    home = b.home
    a.close()
    b.close()
    p = subprocess.run([*agent_cmd(), "--home", str(home), "events"], capture_output=True, text=True,
                       env=agent_env(), timeout=120)
    refused = [json.loads(x) for x in p.stdout.splitlines() if json.loads(x)["kind"] == "refused"]
    assert [e["reason"] for e in refused] == [R.BAD_FRAME] * (LOSSES_SURFACED_PER_WINDOW + 2)
    assert f"{extra} more not surfaced" in refused[-2]["detail"]["detail"]


def store_dump(home) -> list[str]:
    conn = sqlite3.connect(str(home / "store.sqlite"))
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


def test_every_mailbox_code_is_refused_on_stderr_and_changes_nothing(tmp_path):
    a, b = mesh(tmp_path, 2)
    home = b.home
    a.close()
    b.close()
    files = dict(bad_messages(a.site_id))
    files[R.TOO_LARGE] = b"\x00" * (16 * 1024 * 1024 + 1)
    assert set(files) == MAILBOX_CODES
    before = store_dump(home)
    for code, data in files.items():
        f = tmp_path / f"{code}.ssp"
        f.write_bytes(data)
        p = subprocess.run([*agent_cmd(), "--home", str(home), "mailbox", "import", str(f)], capture_output=True,
                           text=True, env=agent_env(), timeout=120)
        assert p.returncode == 2 and f"({code})" in p.stderr, (code, p.returncode, p.stderr)
    assert store_dump(home) == before
