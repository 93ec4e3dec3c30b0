"""Widening backfill (scope §2): durable per-(peer, table) jobs over row_key order, original bytes,
policy re-checked at emit time, live tail first, progress only on the peer's answer."""
from __future__ import annotations

import dataclasses

from agent.core.scope import PolicyRow
from agent.node import Node
from agent.store import sync_state as st
from agent.sync import SyncDriver, change_policy
from tests.sync.helpers import NOW, T, mesh, pair, sync

N = "app.notes"


def deny(node, peer, table="notes"):
    return PolicyRow(peer.site_id.hex(), "app", table, "user", "deny", "")


def raws(node, table=None):
    return {bytes(e): bytes(r) for e, r, q in node.conn.execute("SELECT event_id, unseal(event_id, raw), qualified FROM events")
            if table is None or q == table}


def small(node, rows=3):
    node.profile = dataclasses.replace(node.profile, backfill_rows_per_cycle=rows)


def exchange_until(da, db_, now, cond):
    """A session between `da` and `db_` (handshake, then the batch cycle it starts), stepped until
    `cond()` holds (checked after every step) or the link is quiet. One exchange walks a whole
    backfill, one body per round trip (docs/protocol.md §7 "Budget", "On MQTT"), so a test that
    wants the walk half done stops it here. Returns the pair; what is on the link stays undelivered."""
    p = pair(da, db_)
    p.start(now)
    t = now
    while not cond():
        p.step(t)
        nxt = [x for x in [p.link.next_due()] + [s.timer() for s in p.sessions] if x is not None]
        if not nxt or (p.link.next_due() is None and p.quiet()):
            break
        t = max(t + 1, min(nxt))
    return p


def notes_job(node, peer):
    return next((j for j in st.backfill_jobs(node.conn, peer.site_id) if j["table"] == N), None)


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
    """Scope §2 (docs/protocol.md §7 "Emit time"): policy is resolved when a body is built, so a
    narrowing that lands mid-backfill stops the excluded rows at once. It lands here inside one
    running exchange, right after the answer to a notes body commits and before the next body is
    selected: no notes row may go after it, while the table still allowed finishes."""
    a, b, da, db_, t = withheld_history(tmp_path)
    change_policy(a, lambda c: st.put_policy_row(c, deny(a, b, "readings")))
    a.write(T, {"device": "d", "seq": 9}, {"temp": 9.0}, now=t + 1)
    small(a, 2)
    change_policy(a, lambda c: (st.delete_policy_row(c, deny(a, b)), st.delete_policy_row(c, deny(a, b, "readings"))))
    assert {j["table"] for j in st.backfill_jobs(a.conn, b.site_id)} == {N, T}
    at_narrowing = []
    confirm = da.confirm

    def narrow_after_first_notes_answer(*args, **kw):
        moved = confirm(*args, **kw)
        job = notes_job(a, b)
        if not at_narrowing and job is not None and job["rows_sent"]:
            # one backfill body in flight at most, and its answer just committed: b holds all
            # that went so far, and the next body is selected after this
            at_narrowing.append(len(b.dump()[N]))
            change_policy(a, lambda c: st.put_policy_row(c, deny(a, b)))
        return moved
    da.confirm = narrow_after_first_notes_answer
    t = sync(da, db_, t + 2)
    assert at_narrowing, "the notes job never moved"
    n_before = at_narrowing[0]
    assert 0 < n_before < len(a.dump()[N])  # mid-backfill
    assert len(b.dump()[N]) == n_before  # nothing more after the narrowing, in the same exchange
    for _ in range(3):
        t = sync(da, db_, t + 1)
    assert len(b.dump()[N]) == n_before
    assert notes_job(a, b) is None  # dropped (a later widening enqueues it again)
    assert b.dump()[T] == a.dump()[T]  # the table still allowed finished


def test_crash_mid_backfill_resumes_from_the_durable_row_cursor(tmp_path):
    """Scope §2 (docs/protocol.md §7 "Progress"): rows commit only on the peer's answer; a crash with
    a backfill body in flight re-sends the same rows from the durable row cursor, and no row is lost."""
    a, b, da, db_, t = withheld_history(tmp_path, rows=30)
    small(a, 3)
    change_policy(a, lambda c: st.delete_policy_row(c, deny(a, b)))
    # the first answer commits, and at once the next body (rows 4..6) goes: stop there, undelivered
    p = exchange_until(da, db_, t + 1, lambda: (notes_job(a, b) or {}).get("rows_sent"))
    job = notes_job(a, b)
    assert job is not None and 0 < job["rows_sent"] < 30 and job["resume_after_row_key"] is not None
    assert len(b.dump()[N]) == job["rows_sent"] - (1 if job["rows_sent"] > 3 else 0)  # n03 is deleted
    lost = [f for f in p.sessions[0].ex.pending.values() if f.backfill]
    assert len(lost) == 1 and lost[0].n_backfill > 0  # built and sent; its answer never comes
    # the node crashes
    home = a.home
    a.close()
    a = Node.open(home)
    small(a, 3)
    job2 = notes_job(a, b)
    assert job2["resume_after_row_key"] == job["resume_after_row_key"]  # nothing committed unanswered
    assert job2["rows_sent"] == job["rows_sent"]
    da = SyncDriver(a)
    t += 60_000
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
