"""One session, every link, over the serial link: the endpoint's session runs
the exchange rules MQTT runs (agent/core/exchange.py). Each test failed on the session that kept
its own rules: a push never moved the cursor, one body at a time whatever the window, and a body
larger than the link carries was retried at the same size for ever."""
from __future__ import annotations

import cbor2

from agent.store import sync_state as st
from agent.sync import SyncDriver

from ..sync.helpers import NOW, T, mesh
from .test_endpoint import EndpointLine, all_in


def write_rows(node, n, dev, note=40):
    for i in range(n):
        node.write(T, {"device": dev, "seq": i}, {"temp": float(i), "note": "x" * note}, now=NOW + i)


def _tap(line):
    """The frame types each endpoint's session handed to its link, and received, in order."""
    log = []
    for i, ep in enumerate(line.eps):
        send = ep.link.send_message

        def sent(data, mono, _send=send, _i=i):
            log.append((_i, "sent", cbor2.loads(data)["t"]))
            return _send(data, mono)
        ep.link.send_message = sent
        messages = ep.link.messages

        def got(_messages=messages, _i=i):
            ms = _messages()
            log.extend((_i, "got", cbor2.loads(m)["t"]) for m in ms)
            return ms
        ep.link.messages = got
    return log


def _quiet_line(tmp_path, **cfg):
    a, b = mesh(tmp_path, 2)
    line = EndpointLine([SyncDriver(a, 50), SyncDriver(b, 50)], [_Clean(), _Clean()], **cfg)
    for ep in line.eps:
        ep.settings.cycle_ms = 600_000  # only the exchange at the handshake, then what the test starts
        ep.start(0)
    assert line.run(200_000, lambda: all(ep.ready and not ep.busy() for ep in line.eps))
    return a, b, line


class _Clean:
    def apply(self, data):
        return data


def test_a_serial_push_is_answered_and_moves_the_cursor(tmp_path):
    a, b, line = _quiet_line(tmp_path)
    assert line.eps[0].session.realtime
    write_rows(a, 5, "rt")
    t0 = line.t
    line.eps[0].local_events(t0, line.base + t0)
    top = a.conn.execute("SELECT max(seq) FROM events").fetchone()[0]
    # well before any batch cycle: only the push and its answer can move the cursor (§33)
    assert line.run(t0 + 5_000, lambda: st.cursor(a.conn, b.site_id, "serial")[0] >= top)
    assert all_in((a, b), 5)


def test_a_serial_link_carries_the_window_of_bodies(tmp_path):
    a, b, line = _quiet_line(tmp_path)
    log = _tap(line)
    write_rows(a, 500, "w")
    line.eps[0].session.cycle(line.base + line.t)
    line.eps[0]._pump(line.t, line.base + line.t)
    assert line.run(600_000, lambda: all_in((a, b), 500))
    first_answer = next(k for k, x in enumerate(log) if x == (0, "got", "answer"))
    assert [x for x in log[:first_answer] if x == (0, "sent", "body")] == [(0, "sent", "body")] * 4


def test_a_body_larger_than_the_link_carries_goes_smaller(tmp_path):
    a, b, line = _quiet_line(tmp_path, max_message=20_000)
    write_rows(a, 100, "big", note=600)  # 50 events a body: ~40 KB, twice what the link carries
    line.eps[0].session.cycle(line.base + line.t)
    line.eps[0]._pump(line.t, line.base + line.t)
    assert line.run(1_200_000, lambda: all_in((a, b), 100))
    assert not [e for e in line.eps[0].events if e[0] == "warning"]
