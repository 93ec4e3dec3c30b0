"""No event pins a stream, over the link that ships: through a real mosquitto, one relayed event stamped
20 minutes ahead does not stall the stream behind it; it is re-offered, not lost."""
from __future__ import annotations

import time

from agent.store import sync_state as st

from agent.simpeer import SimPeer

from .helpers import MESH, T, make_nodes, runner, step_until


def test_a_skewed_event_at_the_head_does_not_pin_the_mqtt_stream(broker, tmp_path):
    s, r = make_nodes(tmp_path, 2)
    x, y = SimPeer(MESH), SimPeer(MESH)
    for n in (s, r):
        n.add_peer(x.site_id, x.public_key, None)
        n.add_peer(y.site_id, y.public_key, None)
    now = int(time.time() * 1000)
    fast = x.event(T, {"device": "x", "seq": 0}, {"temp": 9.0}, (now + 20 * 60_000, 0))
    assert s.apply_batch([fast], now + 20 * 60_000)[0].status == "applied"
    s.apply_batch([y.event(T, {"device": "y", "seq": i}, {"temp": 1.0}, (now + i, 0)) for i in range(1500)], now + 2000)
    rs = [runner(n, broker, max_events=100) for n in (s, r)]
    try:
        def ys():
            return r.conn.execute("SELECT count(*) FROM events WHERE site_id=?", (y.site_id,)).fetchone()[0]
        assert step_until(rs, lambda: ys() == 1500, 30), f"only {ys()} of 1500 behind the rejected event"
        assert r.conn.execute("SELECT count(*) FROM events WHERE site_id=?", (x.site_id,)).fetchone()[0] == 0
        assert st.reoffer_count(s.conn, r.site_id, "mqtt") == 1  # kept for later, not lost
    finally:
        for rn in rs:
            rn.close()
        s.close()
        r.close()
