"""Two-, three- and four-node simulations over the in-memory link: faults, crashes, late relays,
lying peers, self-echo (§14, §32.1, §34, docs/protocol.md §2-§3)."""
from __future__ import annotations

from dataclasses import replace

from agent.core.messages import Watermark, emit_body, parse_body
from agent.core.session import Outgoing
from agent.store import sync_state as st
from agent.sync import SyncDriver
from agent.transport.memory import Faults

from .helpers import NOW, T, log_set, mesh, pair, reopen, sync, sync_until_quiet


def watermarks_sound(node) -> None:
    """Every watermark claims only what the log demonstrably holds (§14.2)."""
    for (site, table), h in st.own_watermarks(node.conn).items():
        held = {(p, l) for p, l in node.conn.execute(
            "SELECT hlc_p, hlc_l FROM events WHERE site_id=? AND qualified=?", (site, table))}
        assert any(x == h for x in held), "a watermark names an HLC the node does not hold"


def write_n(node, n, dev, t=NOW, table=T):
    for i in range(n):
        if table == T:
            node.write(T, {"device": dev, "seq": i}, {"temp": float(i), "note": dev}, now=t)
        else:
            node.write(table, {"id": f"{dev}{i}"}, {"body": dev}, now=t)


def faulty_rounds(drivers, t, rounds, seed, faults):
    for r in range(rounds):
        for i, a in enumerate(drivers):
            for j, b in enumerate(drivers):
                if i != j:
                    t = sync(a, b, t + 1, faults=faults, seed=seed * 1000 + r * 10 + i * 3 + j, cycles=2)
    return t


def assert_converged(nodes):
    dumps = [n.dump() for n in nodes]
    logs = [log_set(n) for n in nodes]
    assert all(d == dumps[0] for d in dumps) and all(lg == logs[0] for lg in logs)
    for n in nodes:
        watermarks_sound(n)


def test_two_nodes_converge_through_drops_duplicates_reordering(tmp_path):
    a, b = mesh(tmp_path, 2)
    da, db_ = SyncDriver(a, batch_limit=4), SyncDriver(b, batch_limit=4)
    write_n(a, 15, "a")
    write_n(b, 9, "b")
    write_n(b, 3, "b", table="app.notes")
    t = faulty_rounds([da, db_], NOW, 4, 1, Faults(drop=0.25, duplicate=0.3, reorder=0.4, delay_ms=(0, 30)))
    sync_until_quiet([da, db_], t + 1)
    assert_converged([a, b])
    assert len(log_set(a)) == 27
    # watermarks were inferred on the way (live, authenticated, continuous streams)
    assert (a.site_id, T) in st.own_watermarks(b.conn)


def test_three_nodes_converge_with_faults_and_relays(tmp_path):
    nodes = mesh(tmp_path, 3)
    drivers = [SyncDriver(n, batch_limit=3) for n in nodes]
    for k, n in enumerate(nodes):
        write_n(n, 6, f"n{k}")
        n.write(T, {"device": "shared", "seq": 0}, {"temp": float(k)}, now=NOW + k)  # concurrent edits
    # a line topology first: 0 <-> 1 <-> 2 (2's data reaches 0 only via 1)
    t = NOW
    for r in range(3):
        t = sync(drivers[0], drivers[1], t + 1, faults=Faults(drop=0.3, duplicate=0.2, reorder=0.3), seed=r, cycles=3)
        t = sync(drivers[2], drivers[1], t + 1, faults=Faults(drop=0.3, duplicate=0.2, reorder=0.3), seed=50 + r, cycles=3)
    sync_until_quiet(drivers, t + 1)
    assert_converged(nodes)
    assert len(log_set(nodes[0])) == 21


def test_crash_between_push_and_cursor_advance_reoffers_and_is_absorbed(tmp_path):
    a, b = mesh(tmp_path, 2)
    da, db_ = SyncDriver(a), SyncDriver(b)
    write_n(a, 5, "a")
    p = pair(da, db_, cycle_ms=10**9)
    p.start(NOW)
    sa, sb = p.sessions
    handshake(p, NOW)
    assert sa.cycle(NOW + 100)
    p.flush(NOW + 100)
    for to, data in p.link.due(NOW + 200):  # the body reaches b, which applies, commits and answers
        p.sessions[to].receive(data, NOW + 200)
    assert len(log_set(b)) == 5
    answer = sb.data_to_send()
    assert answer  # ... and a crashes before the answer is processed: the cursor did not move
    assert st.cursor(a.conn, b.site_id, "memory")[0] == 0
    a = reopen(a)
    da = SyncDriver(a)
    before = b.conn.execute("SELECT count(*) FROM surfaced").fetchone()[0]
    # a re-offers from its durable cursor: the same five again, absorbed as duplicates
    p2 = pair(da, db_, cycle_ms=10**9)
    p2.start(NOW + 300)
    handshake(p2, NOW + 300)
    assert p2.sessions[0].cycle(NOW + 400)
    p2.flush(NOW + 400)
    p2.run(NOW + 400, NOW + 10_000)
    assert db_.stats["received_events"] == 10
    assert len(log_set(b)) == 5 and b.conn.execute("SELECT count(*) FROM surfaced").fetchone()[0] == before
    assert st.cursor(a.conn, b.site_id, "memory")[0] == 5  # ... and now the cursor moved
    assert_converged([a, b])


def test_crash_before_answer_then_peer_watermark_spares_the_resend(tmp_path):
    """Same crash, but b speaks first after the restart: its body reports the watermark it
    demonstrably reached, so a need not re-send what b holds (the §14.2 optimisation)."""
    a, b = mesh(tmp_path, 2)
    da, db_ = SyncDriver(a), SyncDriver(b)
    write_n(a, 5, "a")
    p = pair(da, db_, cycle_ms=10**9)
    p.start(NOW)
    handshake(p, NOW)
    p.sessions[0].cycle(NOW + 100)
    p.flush(NOW + 100)
    for to, data in p.link.due(NOW + 200):
        p.sessions[to].receive(data, NOW + 200)
    assert st.own_watermarks(b.conn)[(a.site_id, T)] == a.clock.current()
    a = reopen(a)
    da = SyncDriver(a)
    p2 = pair(db_, da, cycle_ms=10**9)
    p2.start(NOW + 300)
    handshake(p2, NOW + 300)
    p2.sessions[0].cycle(NOW + 400)
    p2.flush(NOW + 400)
    p2.run(NOW + 400, NOW + 10_000)
    assert db_.stats["received_events"] == 5  # nothing re-sent
    assert st.cursor(a.conn, b.site_id, "memory")[0] == 5
    assert_converged([a, b])


def handshake(p, now):
    for step in (1, 2):  # deliver the handshakes by hand (no timers: no cycle starts on its own)
        for to, data in p.link.due(now + step):
            p.sessions[to].receive(data, now + step)
        p.flush(now + step)
    assert p.sessions[0].state == p.sessions[1].state == "ready"
    for s in p.sessions:
        s.sched.next_batch = float("inf")  # only the test starts exchanges


def test_old_event_relayed_late_is_not_skipped(tmp_path):
    """B's cursor toward A has passed HLC h; an event of C with an HLC far below h reaches B only
    later, relayed by D. B must still offer it to A (docs/protocol.md §2, late relays)."""
    a, b, c, d = mesh(tmp_path, 4)
    da, dbb, dc, dd = (SyncDriver(x) for x in (a, b, c, d))
    c.write(T, {"device": "old", "seq": 1}, {"temp": 1.0}, now=NOW - 200_000)  # old HLC, not yet sent
    write_n(b, 3, "b", t=NOW)
    t = sync(dbb, da, NOW)
    assert st.cursor(b.conn, a.site_id, "memory")[0] == 3
    t = sync(dc, dd, t + 1)  # C -> D
    t = sync(dd, dbb, t + 1)  # D -> B (relay)
    old = [e for e in log_set(b) if e not in log_set(a)]
    assert len(old) == 1
    t = sync(dbb, da, t + 1)
    assert set(old) <= log_set(a)


class LyingDriver(SyncDriver):
    """Reports watermarks claiming everything from every site, and a huge have_max_hlc."""

    def __init__(self, node, lie_watermarks=True, lie_max=True, sites=()):
        super().__init__(node)
        self.lie_wm, self.lie_max, self.sites = lie_watermarks, lie_max, sites

    def have_max_hlc(self):
        # the largest lie a body can carry: from 2**63 on the strict decoder refuses the body
        # (int_out_of_range: the store cannot hold it), which costs the liar its own data only
        return (2**63 - 1, 0) if self.lie_max else super().have_max_hlc()

    def build(self, peer, path, mode, now=None, *args, **kw):
        o = super().build(peer, path, mode, now, *args, **kw)
        if not self.lie_wm:
            return o
        b = parse_body(o.body)
        wms = tuple(Watermark(s, q, (2**62, 0)) for s in self.sites for q in (T, "app.notes"))
        return Outgoing(emit_body(replace(b, applied_watermarks=wms)), o.meta, o.token, o.n_events, o.backfill)


def test_a_lying_peer_loses_only_its_own_data(tmp_path):
    a, b, m = mesh(tmp_path, 3)
    da, dbb = SyncDriver(a), SyncDriver(b)
    dm = LyingDriver(m, sites=(a.site_id, b.site_id))
    t = sync(dm, da, NOW)  # the liar speaks first: its (false) report is what a and b hold
    t = sync(dm, dbb, t + 1)
    write_n(a, 4, "a")
    write_n(b, 2, "b")
    write_n(m, 3, "m")
    for _ in range(3):
        for x, y in ((da, dbb), (da, dm), (dbb, dm), (dm, da), (dm, dbb), (dbb, da)):
            t = sync(x, y, t + 1)
    # the liar claimed to hold everything of a and b, so nobody re-offers it: its own loss
    assert not any(e["site_id"] in (a.site_id.hex(), b.site_id.hex()) for e in m.log_entries())
    # honest nodes are whole, including the liar's own events
    assert log_set(a) == log_set(b) and len(log_set(a)) == 9
    assert a.dump() == b.dump()


def test_false_have_max_hlc_changes_nothing(tmp_path):
    a, m = mesh(tmp_path, 2)
    da, dm = SyncDriver(a), LyingDriver(m, lie_watermarks=False)
    write_n(a, 4, "a")
    write_n(m, 2, "m")
    sync(dm, da, NOW, cycles=2)
    assert log_set(a) == log_set(m) and len(log_set(a)) == 6


def test_self_echo_never_sent_and_dropped_if_received(tmp_path):
    a, b = mesh(tmp_path, 2)
    da, db_ = SyncDriver(a), SyncDriver(b)
    write_n(a, 3, "a")
    sync(da, db_, NOW)
    sel, *_ = db_.select_for(a.site_id, "another-path")  # a fresh cursor walks all of b's log
    assert sel.events == [] and sel.skipped.get("self_echo") == 3
    # a misbehaving relay that sends a its own events back: dropped as self-echo, nothing re-ingested
    raws = [bytes(r[0]) for r in b.conn.execute("SELECT unseal(event_id, raw) FROM events")]
    before = a.conn.execute("SELECT count(*) FROM events").fetchone()[0]
    outs = a.apply_batch(raws, NOW)
    assert {o.reason for o in outs} == {"self_echo"}
    assert a.conn.execute("SELECT count(*) FROM events").fetchone()[0] == before


def test_held_group_never_gets_a_watermark_past_it_until_released(tmp_path):
    extra = """
[[tables]]
schema = "app"
name = "later"
category = "syncable"
key = ["id"]
columns = { id = "text", v = "integer" }
"""
    from .helpers import TABLES
    a, = mesh(tmp_path / "x", 1, tables=TABLES + extra)
    b, = mesh(tmp_path / "y", 1, tables=TABLES)
    from agent.store import db as dbm
    a.add_peer(b.site_id, bytes(dbm.get_meta(b.conn, "public_key")), None)
    b.add_peer(a.site_id, bytes(dbm.get_meta(a.conn, "public_key")), None)
    da, db_ = SyncDriver(a), SyncDriver(b)
    a.write("app.later", {"id": "1"}, {"v": 1}, now=NOW)
    a.write("app.later", {"id": "2"}, {"v": 2}, now=NOW)
    t = sync(da, db_, NOW)
    assert b.conn.execute("SELECT count(*) FROM held").fetchone()[0] == 2
    assert (a.site_id, "app.later") not in st.own_watermarks(b.conn)
    a.write("app.later", {"id": "3"}, {"v": 3}, now=NOW)
    t = sync(da, db_, t + 1)
    assert (a.site_id, "app.later") not in st.own_watermarks(b.conn)
    b.create_table({"schema": "app", "name": "later", "category": "syncable", "key": ["id"],
                    "columns": {"id": "text", "v": "integer"}})
    a.write("app.later", {"id": "4"}, {"v": 4}, now=NOW)
    sync(da, db_, t + 1)
    assert (a.site_id, "app.later") in st.own_watermarks(b.conn)
    watermarks_sound(b)
    assert len(b.dump()["app.later"]) == 4


def test_receiver_restored_from_backup_infers_nothing_across_the_gap(tmp_path):
    """b's store goes back in time (restored copy): a's cursor is past events b no longer holds,
    so a's next body does not continue b's recorded stream and b must infer no watermark from it."""
    import shutil
    a, b = mesh(tmp_path, 2)
    da, db_ = SyncDriver(a), SyncDriver(b)
    t = sync(da, db_, NOW)  # streams exist, nothing in them
    home = b.home
    b.close()
    shutil.copytree(home, tmp_path / "backup")
    b = Node_open(home)
    db_ = SyncDriver(b)
    write_n(a, 3, "a")
    t = sync(da, db_, t + 1)
    assert len(log_set(b)) == 3
    b.close()
    shutil.rmtree(home)
    shutil.copytree(tmp_path / "backup", home)
    b = Node_open(home)
    db_ = SyncDriver(b)
    assert log_set(b) == set()
    a.write(T, {"device": "a", "seq": 9}, {"temp": 9.0}, now=NOW)
    p = pair(da, db_, cycle_ms=10**9)
    p.start(t + 1)
    handshake(p, t + 1)
    p.sessions[0].cycle(t + 10)  # a's body starts at its cursor (3): beyond b's completed stream (0)
    p.flush(t + 10)
    p.step(t + 11)  # that body reaches b (the link's latency is 1 ms)
    assert len(log_set(b)) == 1
    assert (a.site_id, T) not in st.own_watermarks(b.conn)
    watermarks_sound(b)
    # Then the catch-up goes on (the window kept full: b's rehydration request reset a's cursor)
    # and every watermark b infers from the stream restarted at genesis is sound.
    p.run(t + 11, t + 10_000)
    assert log_set(b) == log_set(a)
    watermarks_sound(b)


def Node_open(home):
    from agent.node import Node
    return Node.open(home)
