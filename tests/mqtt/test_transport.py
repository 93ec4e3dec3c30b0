"""The MQTT binding itself, against a real mosquitto: request/response correlation, manual ack
after commit (redelivery of an un-acked body), presence with a last will, reconnect with
backoff across a broker restart, splitting under the packet and body limits."""
from __future__ import annotations

import os
import threading
import time

import pytest

from agent.transport.broker import Broker
from agent.transport.mqtt import (Backoff, MqttLink, MqttSettings, Topics, split_sizes, wait_for,
                                  _publish_props)
from tests.waiting import HANG_S, wait_until

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")


def link(broker, site, hs=b"hs", **kw):
    s = MqttSettings.from_url(broker.url, backoff_min_s=0.05, backoff_max_s=0.5, **kw)
    lk = MqttLink(s, MESH, site, lambda: hs).start()
    assert lk.wait_connected(HANG_S), lk.last_error
    return lk


def test_request_answer_correlation(broker):
    a, b = os.urandom(16), os.urandom(16)
    la, lb = link(broker, a), link(broker, b)
    try:
        corr = la.push(b, b"body", {"ssp-start": "3", "ssp-end": "9"})
        m = wait_for(lb.inbound, "req", HANG_S)
        assert m is not None and m.payload == b"body" and m.correlation == corr
        assert m.props["ssp-start"] == "3" and m.props["ssp-from"] == a.hex()
        assert m.response_topic == Topics(MESH).answers(a, b) and m.sender == a
        assert lb.answer(m, b"answer", {"ssp-processed": "7"})
        assert lb.ack(m)
        ans = wait_for(la.inbound, "ans", HANG_S)
        assert ans.correlation == corr and ans.props["ssp-processed"] == "7" and ans.payload == b"answer"
    finally:
        la.close(); lb.close()


def test_only_the_network_thread_writes_the_socket(broker):
    """paho's client is not thread-safe: with no loop_start() thread of its own, a publish or an ack
    called on another thread wrote the socket right there (Client._packet_queue -> loop_write),
    while the link's network thread read and wrote the same socket in loop(). Over TLS that is two
    threads inside one OpenSSL SSL object at once (undefined: a corrupted record, a lost connection,
    a corrupted heap; a CI run segfaulted later in an unrelated SQLite call); over TCP two packets'
    bytes can interleave. The loop's thread publishes, answers and acks; the link's network
    thread must be the only one that ever sends."""
    a, b = os.urandom(16), os.urandom(16)
    la, lb = link(broker, a), link(broker, b)
    senders: set[int] = set()
    for lk in (la, lb):
        send = lk._client._sock_send

        def spy(buf, send=send):
            senders.add(threading.get_ident())
            return send(buf)
        lk._client._sock_send = spy
    try:
        for i in range(20):
            la.push(b, b"body %d" % i, {})
        got = []
        while len(got) < 20:
            m = wait_for(lb.inbound, "req", HANG_S)
            assert m is not None, f"{len(got)} of 20 bodies arrived"
            got.append(m)
            assert lb.answer(m, b"answer", {}) and lb.ack(m)
        assert sorted(m.payload for m in got) == sorted(b"body %d" % i for i in range(20))
        for _ in range(20):
            assert wait_for(la.inbound, "ans", HANG_S) is not None
        assert senders and senders <= {la._thread.ident, lb._thread.ident}
        assert threading.get_ident() not in senders
    finally:
        la.close(); lb.close()


def test_abort_closes_the_socket_only_after_the_network_thread_ended(broker):
    """abort() closed the socket from the caller's thread while the link's network thread was
    inside paho's loop() on it: the descriptor (over TLS, the SSL object) pulled from under that
    thread, and a number reused meanwhile read or written as someone else's file."""
    a = os.urandom(16)
    la = link(broker, a)
    th = la._thread
    real = la._client._sock
    closed_while_alive: list[bool] = []

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def close(self):
            closed_while_alive.append(th.is_alive())
            real.close()
    la._client._sock = Spy()
    la.abort()
    assert closed_while_alive == [False]
    assert not th.is_alive()


def test_answer_refuses_foreign_response_topic(broker):
    a, b = os.urandom(16), os.urandom(16)
    la, lb = link(broker, a), link(broker, b)
    try:
        la.publish_raw(Topics(MESH).requests(b, a), b"x", _publish_props({}, b"c" * 16, "elsewhere/topic"))
        m = wait_for(lb.inbound, "req", HANG_S)
        assert m is not None and not lb.answer(m, b"a", {})
        la.publish_raw(Topics(MESH).requests(b, a), b"x", _publish_props({}, None, Topics(MESH).answers(a, b)))
        m = wait_for(lb.inbound, "req", HANG_S)
        assert m is not None and not lb.answer(m, b"a", {})  # no correlation data: nothing to answer
        c = os.urandom(16)  # an answer topic that is not the requester's, or does not name us
        for rt in (Topics(MESH).answers(c, b), Topics(MESH).answers(a, c)):
            la.publish_raw(Topics(MESH).requests(b, a), b"x", _publish_props({}, b"c" * 16, rt))
            m = wait_for(lb.inbound, "req", HANG_S)
            assert m is not None and not lb.answer(m, b"a", {})
    finally:
        la.close(); lb.close()


def test_unacked_body_is_redelivered_after_reconnect(broker):
    a, b = os.urandom(16), os.urandom(16)
    la, lb = link(broker, a), link(broker, b)
    la.push(b, b"first", {})
    m = wait_for(lb.inbound, "req", HANG_S)
    assert m.payload == b"first" and not m.dup
    lb.abort()  # killed before its transaction committed: never acked
    lb2 = link(broker, b)
    try:
        m2 = wait_for(lb2.inbound, "req", HANG_S)
        assert m2 is not None and m2.payload == b"first" and m2.dup
        assert lb2.session_present
        assert lb2.ack(m2)
        assert not lb2.ack(m)  # an ack from the old connection is never sent on the new one
    finally:
        la.close(); lb2.close()


def test_offline_node_mailbox_and_presence_will(broker):
    a, b = os.urandom(16), os.urandom(16)
    la, lb = link(broker, a, hs=b"A"), link(broker, b, hs=b"B")
    deadline = time.monotonic() + HANG_S
    while b not in la.present and time.monotonic() < deadline:
        time.sleep(0.02)
    assert la.present.get(b) == b"B"
    lb.abort()  # vanishes without DISCONNECT: the will clears its retained presence
    deadline = time.monotonic() + HANG_S
    while b in la.present and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b not in la.present
    for i in range(5):
        la.push(b, b"while-away-%d" % i, {})
    time.sleep(0.3)
    lb2 = link(broker, b, hs=b"B")
    try:
        got = []
        while len(got) < 5:
            m = wait_for(lb2.inbound, "req", HANG_S)
            assert m is not None, got
            got.append(m.payload)
            lb2.ack(m)
        assert got == [b"while-away-%d" % i for i in range(5)]
    finally:
        la.close(); lb2.close()


def test_reconnect_after_broker_restart(broker):
    a, b = os.urandom(16), os.urandom(16)
    la, lb = link(broker, a), link(broker, b)
    try:
        broker.kill()
        wait_until(lambda: not la.connected.is_set(), "the link saw the broker go")
        broker.start()
        assert la.wait_connected(HANG_S) and lb.wait_connected(HANG_S)
        assert la.connects >= 2
        corr = la.push(b, b"after", {})
        m = wait_for(lb.inbound, "req", HANG_S)
        assert m is not None and m.correlation == corr
    finally:
        la.close(); lb.close()


def test_unreachable_broker_reports_error():
    s = MqttSettings(host="127.0.0.1", port=1, backoff_min_s=0.05, backoff_max_s=0.1)
    lk = MqttLink(s, MESH, os.urandom(16)).start()
    try:
        assert not lk.wait_connected(0.5)
        assert "cannot reach broker" in (lk.last_error or "")
    finally:
        lk.close()


def test_backoff_capped_with_jitter():
    bo = Backoff(0.5, 8.0)
    d = [bo.next() for _ in range(10)]
    assert all(0.25 <= x <= 8.0 for x in d)
    assert max(d[6:]) <= 8.0 and min(d[6:]) >= 4.0  # at the cap: half fixed, half random
    assert len({round(x, 6) for x in d[6:]}) > 1
    bo.reset()
    assert bo.next() <= 0.5


def test_split_sizes_respects_limits():
    sizes = [300] * 100
    r = split_sizes(sizes, 200, 4096, 1000)
    assert r[0][0] == 0 and r[-1][1] == 100
    assert all(200 + 8 + sum(s + 3 for s in sizes[x:y]) <= 4096 for x, y in r)
    assert split_sizes(sizes, 200, 10**9, 7)[0] == (0, 7)
    assert split_sizes([10_000], 200, 4096, 10) == [(0, 1)]  # an oversized item stands alone
    assert split_sizes([], 200, 4096, 10) == []


def test_broker_max_packet_size_is_honoured(tmp_path):
    with Broker(workdir=tmp_path / "b", max_packet_size=20_000) as br:
        lk = link(br, os.urandom(16))
        try:
            assert lk.broker_max_packet == 20_000
            assert lk.max_payload() <= 20_000 - 1024
        finally:
            lk.close()


def test_topics_name_the_sender():
    t = Topics(MESH)
    a, b = os.urandom(16), os.urandom(16)
    assert t.classify(t.requests(b, a)) == (b, "inbox/req", a)
    assert t.classify(t.answers(a, b)) == (a, "inbox/ans", b)
    assert t.classify(t.presence(a)) == (a, "presence", None)
    assert t.classify(t.base(b) + "/inbox/req") is None  # an inbox topic must name its sender
    assert t.classify(t.presence(a) + "/" + b.hex()) is None


def test_settings_from_url():
    s = MqttSettings.from_url("mqtts://dev1:s3cret@gw.local", ca_file=None)
    assert (s.host, s.port, s.tls, s.username, s.password) == ("gw.local", 8883, True, "dev1", "s3cret")
    s = MqttSettings.from_url("mqtt://127.0.0.1:1884")
    assert (s.port, s.tls) == (1884, False)
    with pytest.raises(ValueError):
        MqttSettings.from_url("http://x")


def test_a_members_link_takes_only_its_members_presence(broker):
    """settings.presence "members" (docs/scale.md "Presence"): the link subscribes to its own and
    its members' presence topics, so a stranger's retained presence never reaches it (with the
    mesh's wildcard every device took every device's presence at each reconnect: D² deliveries);
    a member added later is followed from then on, and past PRESENCE_TOPICS_MAX the wildcard."""
    me, peer, stranger = os.urandom(16), os.urandom(16), os.urandom(16)
    lp, ls = link(broker, peer, hs=b"P"), link(broker, stranger, hs=b"S")
    members = [peer]
    s = MqttSettings.from_url(broker.url, backoff_min_s=0.05, backoff_max_s=0.5, presence="members")
    lm = MqttLink(s, MESH, me, lambda: b"M", members=lambda: members).start()
    lw = link(broker, os.urandom(16))   # the default: the mesh's wildcard
    try:
        assert lm.wait_connected(HANG_S), lm.last_error
        # everything retained for its subscriptions is delivered before its own presence's echo
        assert wait_until(lambda: lm.presence_echo.is_set(), "its own presence echoed")
        assert lm.present.get(peer) == b"P" and stranger not in lm.present
        assert wait_until(lambda: stranger in lw.present and peer in lw.present, "the wildcard link takes both")
        members.append(stranger)
        lm.follow_members()
        assert wait_until(lambda: lm.present.get(stranger) == b"S", "the new member's presence")
        members.extend(os.urandom(16) for _ in range(70))   # past PRESENCE_TOPICS_MAX: the wildcard
        lm.follow_members()
        late = link(broker, os.urandom(16), hs=b"L")
        try:
            assert wait_until(lambda: late.site_id in lm.present, "a presence through the wildcard")
        finally:
            late.close()
    finally:
        for lk in (lm, lw, lp, ls):
            lk.close()
