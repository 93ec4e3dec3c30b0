"""`status` counts without counting: the events in the log and the events held
are maintained counts (agent/store/db.py log_count, held_counts), read as one row, so `status`
costs the same at a million events as at ten. They must stay exactly what count(*) says through
every path that adds or removes log rows: the apply path (local writes, sync, mailbox batches),
eviction, rehydration, held events released when their table appears."""
from __future__ import annotations

from agent import rehydrate
from agent.sync import SyncDriver
from tests.lifecycle.test_eviction import DAY, R, T0, TABLES
from tests.sync.helpers import mesh, sync


def counts(node) -> tuple[int, int]:
    st = node.status()
    return st["events"], st["held"]


def truth(node) -> tuple[int, int]:
    return (node.conn.execute("SELECT count(*) FROM events").fetchone()[0],
            node.conn.execute("SELECT count(*) FROM held").fetchone()[0])


def test_status_reads_counts_and_never_scans_the_log(tmp_path):
    (node,) = mesh(tmp_path, 1, TABLES)
    for s in range(5):
        node.write(R, {"device": "d", "seq": s}, {"temp": float(s)}, now=T0 + s)
    seen: list[str] = []
    node.conn.set_trace_callback(seen.append)
    try:
        st = node.status()
    finally:
        node.conn.set_trace_callback(None)
    assert st["events"] == 5 and st["held"] == 0
    scans = [q for q in seen if "count(" in q.lower() and (" events" in q or " held" in q)]
    assert scans == [], scans


def test_the_counts_stay_exact_through_apply_eviction_rehydration_and_held_events(tmp_path):
    gw, pi, other = mesh(tmp_path, 3, TABLES)
    for s in range(40):
        other.write(R, {"device": "o", "seq": s}, {"temp": float(s)}, now=T0 + s)
    dg, dp, do = SyncDriver(gw), SyncDriver(pi), SyncDriver(other)
    t = sync(do, dg, T0 + 100)
    t = sync(dg, dp, t + 1)
    for n in (gw, pi, other):
        assert counts(n) == truth(n) == (40, 0)
    # duplicates change nothing
    pi.apply_batch([r for (r,) in other.conn.execute("SELECT unseal(event_id, raw) FROM events")], T0 + 200)
    assert counts(pi) == truth(pi) == (40, 0)
    # eviction removes the log rows
    pi.evict_table(R, (T0 + 20, 0))
    assert counts(pi) == truth(pi) == (20, 0)
    pi.evict_table(R, (T0 + DAY, 0))
    assert counts(pi) == truth(pi) == (0, 0)
    # rehydration brings them back through the apply path
    rehydrate.start(pi, gw.site_id, now=T0 + 2 * DAY)
    sync(dp, dg, t + 1, cycles=3)
    assert counts(pi) == truth(pi) == (40, 0)
    # held events (a table this node lacks) are counted apart, and move to the log when it appears
    spec = {"schema": "app", "name": "later", "category": "syncable", "key": ["id"], "columns": {"id": "text", "v": "integer"}}
    other.create_table(spec)
    for i in range(3):
        other.write("app.later", {"id": str(i)}, {"v": i}, now=T0 + 300 + i)
    sync(do, dp, T0 + 400)
    assert counts(pi) == truth(pi) == (40, 3)
    pi.create_table(spec)
    assert counts(pi) == truth(pi) == (43, 0)
    # a reopened node reads the same counts
    home = pi.home
    pi.close()
    from agent.node import Node
    pi = Node.open(home, check_machine=False)
    assert counts(pi) == truth(pi) == (43, 0)
    pi.close()
