"""Widening backfill (scope §2) and rehydration over MQTT, through a real mosquitto: the runner's
bodies carry the sync layer's backfill rows after the live tail, at most one such body in flight
per peer, and a job's row cursor moves only on the peer's answer."""
from __future__ import annotations

import dataclasses
import time

from agent import rehydrate
from agent.core.scope import PolicyRow
from agent.node import Node
from agent.simpeer import NOTES_TABLE, manifest_text, readings_table
from agent.store import sync_state as st
from agent.sync import change_policy

from .helpers import MESH, N, T, event_ids, make_nodes, runner, step_until, write


def deny(peer, table="notes"):
    return PolicyRow(peer.site_id.hex(), "app", table, "user", "deny", "")


def raws(node, table):
    return {bytes(e): bytes(r) for e, r in node.conn.execute("SELECT event_id, unseal(event_id, raw) FROM events WHERE qualified=?",
                                                             (table,))}


def small(node, rows):
    node.profile = dataclasses.replace(node.profile, backfill_rows_per_cycle=rows)


def jobs(a, b):
    return st.backfill_jobs(a.conn, b.site_id)


def watch_one_backfill_body(r, peer):
    """Fail if the runner ever has two backfill bodies to `peer` in flight."""
    orig = r._send
    seen = []

    def send(p, kind, off):
        orig(p, kind, off)
        n = sum(1 for q in r.pending.values() if q.peer == peer and q.backfill)
        assert n <= 1, "two backfill bodies in flight"
        if off.n_backfill:
            seen.append(off.n_backfill)
    r._send = send
    return seen


def run_for(rs, seconds):
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for r in rs:
            r.step(0.01)


def withheld(tmp_path, broker, rows):
    """a holds notes history (updates, a delete, a resurrection) that policy withheld from b; both
    run on the broker until b has a's readings."""
    a, b = nodes = make_nodes(tmp_path, 2)
    change_policy(a, lambda c: st.put_policy_row(c, deny(b)))
    for i in range(rows):
        a.write(N, {"id": f"n{i:03d}"}, {"body": f"v0-{i}"})
    for i in range(0, rows, 3):
        a.write(N, {"id": f"n{i:03d}"}, {"body": f"v1-{i}"})
    a.write(N, {"id": "n004"}, None, delete=True)
    a.write(N, {"id": "n007"}, None, delete=True)
    a.write(N, {"id": "n007"}, {"body": "back"})
    write(a, 1, "a")
    rs = [runner(n, broker) for n in nodes]
    assert step_until(rs, lambda: raws(a, T).keys() <= event_ids(b), 15)
    run_for(rs, 0.3)
    assert b.dump()[N] == [] and len(b.dump()[T]) == 1
    return a, b, nodes, rs


def close(rs, nodes):
    for r in rs:
        r.close()
    for n in nodes:
        n.close()


def test_widening_delivers_withheld_history_over_mqtt_byte_for_byte_live_first(broker, tmp_path):
    a, b, nodes, rs = withheld(tmp_path, broker, 60)
    try:
        small(a, 3)
        seen = watch_one_backfill_body(rs[0], b.site_id)
        assert change_policy(a, lambda c: st.delete_policy_row(c, deny(b))) == [(b.site_id.hex(), N)]
        # live written at the widening goes before any backfilled row (one log order at b)
        live = [write(a, i, "a") for i in range(2, 6)]
        assert step_until(rs, lambda: len(b.dump()[N]) > 0, 10)
        first_note = b.conn.execute("SELECT min(seq) FROM events WHERE qualified=?", (N,)).fetchone()[0]
        for e in live:
            assert b.conn.execute("SELECT seq FROM events WHERE event_id=?", (e,)).fetchone()[0] < first_note
        # a live event written mid-backfill is not starved: it arrives while the job still runs
        e = write(a, 99, "a")
        assert step_until(rs, lambda: e in event_ids(b), 5)
        assert jobs(a, b), "the live event waited for the whole backfill"
        assert step_until(rs, lambda: not jobs(a, b), 20)
        assert a.dump()[N] == b.dump()[N]
        got, have = raws(b, N), raws(a, N)
        assert got and all(have[k] == v for k, v in got.items())  # same event_ids, same bytes
        assert len(got) < len(have)  # the covering sets, not the superseded versions
        assert seen and max(seen) <= 3 * 3 and len(seen) >= 20  # 3 rows a body (covering sets), one body at a time
        assert a.dump()[T] == b.dump()[T]
        # nothing more goes out for notes once the job is done
        pushed = rs[0].stats["backfill_events_pushed"]
        run_for(rs, 0.8)
        assert rs[0].stats["backfill_events_pushed"] == pushed and raws(b, N) == got
    finally:
        close(rs, nodes)


def test_narrowing_mid_backfill_stops_the_excluded_rows(broker, tmp_path):
    a, b, nodes, rs = withheld(tmp_path, broker, 60)
    try:
        small(a, 2)
        change_policy(a, lambda c: st.delete_policy_row(c, deny(b)))
        assert step_until(rs, lambda: (j := jobs(a, b)) and j[0]["rows_sent"] >= 4, 10)
        # narrowed again mid-backfill (a body of at most 2 rows, emitted before, may be in flight)
        change_policy(a, lambda c: st.put_policy_row(c, deny(b)))
        n_before, pushed = len(b.dump()[N]), rs[0].stats["backfill_events_pushed"]
        assert 0 < n_before < len(a.dump()[N])
        e = write(a, 50, "a")
        assert step_until(rs, lambda: e in event_ids(b), 5)  # the table still allowed flows
        run_for(rs, 1.2)
        assert rs[0].stats["backfill_events_pushed"] == pushed  # nothing emitted after the narrowing
        assert n_before <= len(b.dump()[N]) <= n_before + 2
        assert not jobs(a, b)  # stopped at emit time; a later widening enqueues it again
    finally:
        close(rs, nodes)


def test_restart_mid_backfill_resumes_from_the_durable_row_cursor(broker, tmp_path):
    a, b, nodes, rs = withheld(tmp_path, broker, 60)
    ra, rb = rs
    try:
        small(a, 3)
        change_policy(a, lambda c: st.delete_policy_row(c, deny(b)))
        assert step_until(rs, lambda: (j := jobs(a, b)) and j[0]["rows_sent"] >= 6, 10)
        # a sends the next backfill body; b never answers it before a goes down
        assert step_until([ra], lambda: ra.backfill_in_flight(b.site_id), 5)
        job = jobs(a, b)[0]
        assert job["resume_after_row_key"] is not None
        ra.close()
        home = a.home
        a.close()
        a = Node.open(home)
        nodes[0] = a
        small(a, 3)
        job2 = jobs(a, b)[0]
        assert job2["resume_after_row_key"] == job["resume_after_row_key"]  # nothing committed unanswered
        assert job2["rows_sent"] == job["rows_sent"]
        ra = runner(a, broker)
        rs[0] = ra
        assert step_until(rs, lambda: not jobs(a, b), 20)
        assert a.dump()[N] == b.dump()[N]  # no row lost
        got, have = raws(b, N), raws(a, N)
        assert all(have[k] == v for k, v in got.items())
    finally:
        close(rs, nodes)


def test_rehydration_over_mqtt_brings_back_an_evicted_nodes_history(broker, tmp_path):
    manifest = manifest_text(MESH, readings_table(retention="telemetry") + NOTES_TABLE)
    gw, pi = nodes = make_nodes(tmp_path, 2, manifest)
    for i in range(30):
        write(gw, i, "g")
    want = raws(gw, T)
    rs = [runner(n, broker) for n in nodes]
    try:
        assert step_until(rs, lambda: want.keys() <= event_ids(pi), 15)
        rows = pi.dump()[T]
        # Everything it holds, up to its clock (a horizon above the clock is refused).
        pi.evict_table(T, (pi.clock.current()[0] + 1, 0), now=pi.clock.current()[0] + 1)
        assert raws(pi, T) == {}
        run_for(rs, 1.0)  # the gateway's cursor passed it: nothing comes back on its own
        assert raws(pi, T) == {}
        s = rehydrate.start(pi, gw.site_id)
        assert s["generation"] == 0
        # the record reaches the gateway in a body of its own, which re-offers from genesis
        assert step_until(rs, lambda: raws(pi, T) == want, 15)
        assert pi.dump()[T] == rows
        assert st.rehydrate_generation(gw.conn, pi.site_id) == 0
        # the gateway's cursor for pi moves again on pi's answers: nothing left to re-send
        assert step_until(rs, lambda: rehydrate.status(gw)["serving"][0]["remaining_events"] == 0, 5)
        assert rehydrate.status(gw)["serving"][0]["subject"] == pi.site_id.hex()
        assert rehydrate.status(pi)["rehydrating"]["events_applied"] == 30
    finally:
        close(rs, nodes)
