"""What goes out over MQTT is chosen by the sync layer (agent/sync.py on path "mqtt"): policy at
selection, control records in every body, durable per-path cursors in sync_state."""
from __future__ import annotations

import time

from agent.core.scope import PolicyRow
from agent.simpeer import SimPeer
from agent.store import sync_state as st
from agent.sync import issue_record

from .helpers import MESH, N, T, event_ids, make_authority, make_nodes, pulls_answered, runner, step_until, write


def _close(rs, nodes):
    for r in rs:
        r.close()
    for n in nodes:
        n.close()


def _tables(node) -> dict[str, int]:
    return {q: len(rows) for q, rows in node.dump().items()}


def test_policy_deny_stops_a_table_flowing_over_mqtt(broker, tmp_path):
    a, b, c = nodes = make_nodes(tmp_path, 3)
    # a denies app.readings to every peer (user layer beats the system default allow)
    st.ensure_schema(a.conn)
    a.conn.execute("BEGIN IMMEDIATE")
    st.put_policy_row(a.conn, PolicyRow("*", "app", "readings", "user", "deny", ""))
    a.conn.execute("COMMIT")
    rs = [runner(n, broker) for n in nodes]
    try:
        # the connect-time pulls over first: a body they make a peer give up on is sent twice
        assert step_until(rs, lambda: pulls_answered(rs), 30)
        for i in range(10):
            write(a, i, "a")
            a.write(N, {"id": f"a{i}"}, {"body": "shared"})
            write(b, i, "b")
        want_notes = {bytes(r[0]) for r in a.conn.execute("SELECT event_id FROM events WHERE qualified=?", (N,))}
        b_readings = {bytes(r[0]) for r in b.conn.execute("SELECT event_id FROM events WHERE qualified=?", (T,))}
        assert step_until(rs, lambda: all(want_notes | b_readings <= event_ids(n) for n in nodes), 20)
        # let a few more cycles run: a's readings must never leave a
        t_end = time.monotonic() + 1.5
        while time.monotonic() < t_end:
            for r in rs:
                r.step(0.01)
        for n in (b, c):
            assert not any(r["key"]["device"] == "a" for r in n.dump()[T])
            assert _tables(n)[N] == 10
        assert _tables(a)[T] == 20  # a still takes in b's readings
        # the denied rows moved a's cursors (answered) without being sent, and were reported as a gap
        maxseq = a.conn.execute("SELECT max(seq) FROM events").fetchone()[0]
        assert step_until(rs, lambda: all(rs[0].sync.cursor(p.site_id) == maxseq for p in (b, c)), 10)
        assert st.cursor(a.conn, b.site_id, "mqtt")[0] == maxseq  # the sync layer's cursor, path "mqtt"
        assert a.conn.execute("SELECT count(*) FROM meta WHERE key LIKE 'cursor:mqtt:%'").fetchone()[0] == 0
        assert rs[0].stats["events_pushed"] <= 40  # notes only (each at most re-offered), never the 10 readings
    finally:
        _close(rs, nodes)


def test_vouch_record_reaches_a_third_node_through_the_broker(broker, tmp_path):
    a, b, c = nodes = make_nodes(tmp_path, 3)
    make_authority(nodes, 0)
    newbie = SimPeer(MESH)  # a new device whose key only a vouch introduces
    raw, info = issue_record(a, "vouch", newbie.site_id, newbie.public_key)
    ra, rb = runner(a, broker), runner(b, broker)
    rc = None
    try:
        assert step_until([ra, rb], lambda: newbie.site_id in b.keyring, 10)
        ra.close()  # a leaves before c ever connects: c can only learn the record from b
        ev = newbie.event(T, {"device": "newbie", "seq": 1}, {"temp": 1.5}, (int(time.time() * 1000), 0))
        assert b.apply_batch([ev])[0].status == "applied"
        rc = runner(c, broker)
        assert step_until([rb, rc], lambda: newbie.site_id in c.keyring and
                          any(r["key"]["device"] == "newbie" for r in c.dump()[T]), 15)
        assert raw in st.record_raws(c.conn)
        assert rc.stats["bodies_received"] >= 1 and a.site_id not in rc.caps
    finally:
        _close([ra, rb] + ([rc] if rc else []), nodes)
