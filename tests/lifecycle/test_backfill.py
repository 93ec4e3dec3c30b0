"""Widening backfill (scope §2): durable per-(peer, table) jobs over row_key order, original bytes,
policy re-checked at emit time, live tail first, progress only on the peer's answer."""
from __future__ import annotations

import dataclasses

from agent.core.scope import PolicyRow
from agent.node import Node
from agent.store import sync_state as st
from agent.sync import SyncDriver, change_policy
from tests.sync.helpers import NOW, T, mesh, sync

N = "app.notes"


def deny(node, peer, table="notes"):
    return PolicyRow(peer.site_id.hex(), "app", table, "user", "deny", "")


def raws(node, table=None):
    return {bytes(e): bytes(r) for e, r, q in node.conn.execute("SELECT event_id, unseal(event_id, raw), qualified FROM events")
            if table is None or q == table}


def small(node, rows=3):
    node.profile = dataclasses.replace(node.profile, backfill_rows_per_cycle=rows)


def withheld_history(tmp_path, rows=10):
    """a holds notes history (updates, a delete, a resurrection) that policy withheld from b."""
    a, b = mesh(tmp_path, 2)
    change_policy(a, lambda c: st.put_policy_row(c, deny(a, b)))
    t = NOW
    for i in range(rows):
        a.write(N, {"id": f"n{i:02d}"}, {"body": f"v0-{i}"}, now=t)
        t += 1
    for i in range(0, rows, 2):
        a.write(N, {"id": f"n{i:02d}"}, {"body": f"v1-{i}"}, now=t)
        t += 1
    a.write(N, {"id": "n03"}, None, delete=True, now=t)
    a.write(N, {"id": "n05"}, None, delete=True, now=t + 1)
    a.write(N, {"id": "n05"}, {"body": "back"}, now=t + 2)
    a.write(T, {"device": "d", "seq": 1}, {"temp": 1.0}, now=t + 3)
    da, db_ = SyncDriver(a), SyncDriver(b)
    t = sync(da, db_, t + 10)
    assert b.dump()[N] == [] and len(b.dump()[T]) == 1
    return a, b, da, db_, t


def test_widening_delivers_the_withheld_history_byte_for_byte(tmp_path):
    a, b, da, db_, t = withheld_history(tmp_path)
    small(a, 3)
    widened = change_policy(a, lambda c: st.delete_policy_row(c, deny(a, b)))
    assert widened == [(b.site_id.hex(), N)]
    assert [j["table"] for j in st.backfill_jobs(a.conn, b.site_id)] == [N]
    per_body = []
    orig = da.select_backfill

    def spy(*args):
        bf = orig(*args)
        if bf is not None:
            per_body.append(sum(len(p.row_keys) for p in bf.parts))
        return bf
    da.select_backfill = spy
    cycles = 0
    while st.backfill_jobs(a.conn, b.site_id):
        t = sync(da, db_, t + 1)
        cycles += 1
        assert cycles < 20
    assert max(per_body) <= 3 and sum(1 for n in per_body if n) >= 4  # 10 rows, at most 3 per cycle
    assert a.dump()[N] == b.dump()[N]
    got, have = raws(b, N), raws(a, N)
    assert got and all(have[e] == r for e, r in got.items())  # same event_ids, same bytes
    # the covering set, not the whole history: superseded versions were not re-sent
    assert len(got) < len(have)
    # a second sync sends nothing more for notes
    sync(da, db_, t + 1)
    assert raws(b, N) == got


def test_live_tail_goes_first(tmp_path):
    a, b, da, db_, t = withheld_history(tmp_path)
    change_policy(a, lambda c: st.delete_policy_row(c, deny(a, b)))
    da.batch_limit = 4
    a.write(T, {"device": "d", "seq": 2}, {"temp": 2.0}, now=t + 1)
    sel, bf, *_ = da.select_for(b.site_id, "memory")
    assert len(sel.events) == 1 and bf is not None and len(bf.events) <= 3


def test_narrowing_mid_backfill_stops_the_excluded_rows_at_emit_time(tmp_path):
    a, b, da, db_, t = withheld_history(tmp_path)
    change_policy(a, lambda c: st.put_policy_row(c, deny(a, b, "readings")))
    a.write(T, {"device": "d", "seq": 9}, {"temp": 9.0}, now=t + 1)
    small(a, 2)
    # widen both tables, run one cycle, then narrow notes again while its job is in flight
    change_policy(a, lambda c: (st.delete_policy_row(c, deny(a, b)), st.delete_policy_row(c, deny(a, b, "readings"))))
    assert {j["table"] for j in st.backfill_jobs(a.conn, b.site_id)} == {N, T}
    t = sync(da, db_, t + 2)
    n_before = len(b.dump()[N])
    assert 0 < n_before < len(a.dump()[N])
    # the narrowing lands between selection and emit: the body built now carries no notes
    change_policy(a, lambda c: st.put_policy_row(c, deny(a, b)))
    for _ in range(10):
        t = sync(da, db_, t + 1)
    assert len(b.dump()[N]) == n_before
    assert not [j for j in st.backfill_jobs(a.conn, b.site_id) if j["table"] == N]
    assert b.dump()[T] == a.dump()[T]  # the table still allowed finished


def test_crash_mid_backfill_resumes_from_the_durable_row_cursor(tmp_path):
    a, b, da, db_, t = withheld_history(tmp_path, rows=30)
    small(a, 3)
    change_policy(a, lambda c: st.delete_policy_row(c, deny(a, b)))
    t = sync(da, db_, t + 1)
    job = st.backfill_jobs(a.conn, b.site_id)[0]
    assert 0 < job["rows_sent"] < 30 and job["resume_after_row_key"] is not None
    assert len(b.dump()[N]) == job["rows_sent"] - (1 if job["rows_sent"] > 3 else 0)  # n03 is deleted
    # a body is built (rows 7..9) but the answer never comes: the node crashes
    out = da.build(b.site_id, "memory", "batch")
    assert out.n_events > 0
    home = a.home
    a.close()
    a = Node.open(home)
    small(a, 3)
    job2 = st.backfill_jobs(a.conn, b.site_id)[0]
    assert job2["resume_after_row_key"] == job["resume_after_row_key"]  # nothing committed unanswered
    da = SyncDriver(a)
    for _ in range(30):
        if not st.backfill_jobs(a.conn, b.site_id):
            break
        t = sync(da, db_, t + 1)
    assert not st.backfill_jobs(a.conn, b.site_id)
    assert a.dump()[N] == b.dump()[N]  # no row lost
    got, have = raws(b, N), raws(a, N)
    assert all(have[e] == r for e, r in got.items())


def test_policy_cli_reports_the_backfill_it_enqueued(tmp_path):
    a, b, da, db_, t = withheld_history(tmp_path)
    from tests.cli_cmd import main
    a_home = str(a.home)
    a.close()
    import io
    import json
    import contextlib
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["--home", a_home, "policy", "remove", "--peer", b.site_id.hex(), "--table", "app.notes",
                   "--layer", "user"])
    assert rc == 0
    out = json.loads(buf.getvalue())
    assert out["removed"] == 1 and out["backfill"] == [{"peer": b.site_id.hex(), "table": N}]


def test_a_role_record_that_widens_policy_backfills_the_withheld_history(tmp_path):
    """Scope §2 and §1.3: widening triggers backfill whatever widens it, here the role layer."""
    from agent.sync import issue_record
    auth, a, b = mesh(tmp_path, 3, authority=0)
    # a withholds notes from everyone, except holders of the role "field".
    change_policy(a, lambda c: (st.put_policy_row(c, PolicyRow("*", "app", "notes", "system", "deny", "")),
                                st.put_policy_row(c, PolicyRow("*", "app", "notes", "role", "allow", "field"))))
    t = NOW
    for i in range(6):
        a.write(N, {"id": f"n{i}"}, {"body": f"v{i}"}, now=t + i)
    sync(SyncDriver(a), SyncDriver(b), t + 10, cycles=2)
    assert raws(b, N) == {}  # withheld
    issue_record(auth, "role", b.site_id, "field", now=t + 20)
    da = SyncDriver(a)
    sync(SyncDriver(auth), da, t + 30)  # the role record reaches a: its policy widens for b
    assert st.peers_with_cursors(a.conn)
    jobs = a.conn.execute("SELECT count(*) FROM backfill_jobs").fetchone()[0]
    assert jobs == 1
    sync(da, SyncDriver(b), t + 40, cycles=3)
    assert raws(b, N) == raws(a, N) and len(raws(b, N)) == 6  # byte for byte, same event_ids
