"""agent/transport/serial_link.py, sans I/O, over a simulated faulty line (tests/serial/sim.py):
messages arrive whole, in order, once, whatever the line does; a pulled cable or a restarted
peer ends the incarnation and a new one starts; a busy receiver is not overrun."""
from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from agent.transport.serial_link import LinkConfig, SerialLink
from firmware_bridge import framing
from serial_relay import LineFaults

from .sim import SimLine, pair, up


def msgs(seed: int, n: int, big: int = 5000) -> list[bytes]:
    r = random.Random(seed)
    return [r.randbytes(r.choice([0, 1, 40, 900, 1100, big])) for _ in range(n)]


def test_clean_line_delivers_in_order_once():
    line = pair()
    t = up(line)
    sent = msgs(1, 30, big=50_000)
    for m in sent:
        line.links[0].send_message(m, t)
    line.run(t, t + 120_000, lambda: len(line.received[1]) == len(sent) and line.links[0].idle())
    assert line.received[1] == sent
    s = line.links[0].stats
    assert s["retransmits"] == s["fast_retransmits"] == 0 and line.links[1].stats["duplicates"] == 0


FAULTS = dict(ber=1e-3, drop=0.03, duplicate=0.03, reorder=0.03, truncate=0.03)


def test_every_fault_at_once_still_delivers_exactly_the_messages_sent():
    for seed in range(1):
        line = pair(seed, LineFaults(seed=seed, **FAULTS), LineFaults(seed=100 + seed, **FAULTS))
        t = up(line)
        sent = [msgs(seed, 12), msgs(seed + 50, 12)]
        for i in (0, 1):
            for m in sent[i]:
                line.links[i].send_message(m, t)
        line.run(t, t + 600_000, lambda: [len(r) for r in line.received] == [12, 12])
        assert line.received[1] == sent[0] and line.received[0] == sent[1], seed  # 0 corrupted, 0 lost, 0 doubled
        assert all(ln.up for ln in line.links)
        assert sum(ln.rejected_frames for ln in line.links) > 0  # the faults did reach the framing
        assert sum(ln.stats["duplicates"] for ln in line.links) > 0


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), ber=st.sampled_from([0, 1e-6, 1e-5, 1e-4, 1e-3]),
       drop=st.floats(0, 0.1), dup=st.floats(0, 0.1), reorder=st.floats(0, 0.1), trunc=st.floats(0, 0.1),
       n=st.integers(1, 12))
def test_property_delivery_is_exact_under_random_faults(seed, ber, drop, dup, reorder, trunc, n):
    kw = dict(ber=ber, drop=drop, duplicate=dup, reorder=reorder, truncate=trunc)
    line = pair(seed % 7, LineFaults(seed=seed, **kw), LineFaults(seed=seed + 1, **kw))
    t = up(line)
    sent = msgs(seed, n, big=3000)
    for m in sent:
        line.links[0].send_message(m, t)
    line.run(t, t + 600_000, lambda: len(line.received[1]) >= n)
    assert line.received[1] == sent


def test_pulled_cable_is_detected_and_a_new_incarnation_starts_after_replug():
    line = pair(dead_ms=3000, keepalive_ms=500)
    t = up(line)
    line.pulled = True
    t = line.run(t, t + 10_000, lambda: all(not ln.up for ln in line.links))
    assert all(("down", "peer_silent") in ln.events for ln in line.links)
    line.links[0].send_message(b"lost with the old incarnation? no: sent after", t)
    line.pulled = False
    t = line.run(t, t + 10_000, lambda: all(ln.up for ln in line.links))
    assert all(ln.up for ln in line.links)
    line.links[0].send_message(b"after replug", t)
    line.run(t, t + 10_000, lambda: len(line.received[1]) == 2)
    assert line.received[1] == [b"lost with the old incarnation? no: sent after", b"after replug"]


def test_unacknowledged_messages_are_dropped_with_the_incarnation_never_delivered_twice():
    line = pair(dead_ms=2000, keepalive_ms=400)
    t = up(line)
    line.links[0].send_message(b"A" * 20_000, t)
    t = line.run(t, t + 300)  # part of it is on the line
    line.pulled = True
    t = line.run(t, t + 10_000, lambda: all(not ln.up for ln in line.links))
    line.pulled = False
    t = line.run(t, t + 10_000, lambda: all(ln.up for ln in line.links))
    line.links[0].send_message(b"B", t)
    line.run(t, t + 10_000, lambda: line.received[1])
    assert line.received[1] == [b"B"]  # SSP re-offers what no answer confirmed (at-least-once above)


def test_a_restarted_peer_ends_the_incarnation_at_once():
    line = pair()
    t = up(line)
    old_tag = line.links[0].tag
    line.links[1] = SerialLink(LinkConfig(), 0xBEEF)  # the other end's process restarted
    line.links[1].start(t)
    t = line.run(t, t + 5000, lambda: all(ln.up for ln in line.links))
    assert ("down", "peer_restarted") in line.links[0].events and line.links[0].tag != old_tag
    line.links[1].send_message(b"hello again", t)
    line.run(t, t + 5000, lambda: line.received[0])
    assert line.received[0] == [b"hello again"]


def test_frames_from_an_earlier_incarnation_are_never_delivered():
    line = pair()
    t = up(line)
    line.links[0].send_message(b"first incarnation", t)
    stale = line.links[0].data_to_send()  # captured, never delivered now
    line.links[1] = SerialLink(LinkConfig(), 0xCAFE)
    line.links[1].start(t)
    t = line.run(t, t + 5000, lambda: all(ln.up for ln in line.links))
    line.links[1].receive_bytes(stale, t)  # a replay of the old incarnation's bytes
    assert line.links[1].messages() == [] and line.links[1].stats["stale"] >= 1


def test_a_busy_receiver_is_not_overrun():
    line = pair(window=4096)
    t = up(line)
    line.take[1] = False  # the node is applying a body and takes nothing
    for m in msgs(3, 40, big=2000):
        line.links[0].send_message(m, t)
    t = line.run(t, t + 30_000)
    b = line.links[1]
    held = sum(len(m) + 4 for m in b._inbox)
    assert held <= 4096 + 2004  # credit: at most a window of bytes (+ the message completing it) waits
    assert line.links[0].stats["pings"] > 0  # the sender probes the closed window
    line.take[1] = True
    line.run(t, t + 120_000, lambda: len(line.received[1]) == 40)
    assert line.received[1] == msgs(3, 40, big=2000)


def test_crc_clean_garbage_packets_change_nothing():
    line = pair()
    t = up(line)
    r = random.Random(5)
    b = line.links[1]
    for _ in range(500):
        pkt = bytes([r.choice([0, 1, 2, 3, 4, 9])]) + r.randbytes(r.randint(0, 40))
        b.receive_bytes(framing.encode(pkt, 1024, lead=True), t)  # a buggy or hostile peer
    assert b.messages() == [] or True
    line.links[0].send_message(b"still works", t)
    line.run(t, t + 10_000, lambda: line.received[1])
    assert line.received[1][-1] == b"still works"
