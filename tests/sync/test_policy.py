"""Policy resolution (scope §1.2), one case per rule, and the sender applying it at selection time."""
from __future__ import annotations

import pytest

from agent.core.scope import FORKED, PolicyError, PolicyRow, check_row, resolve
from agent.store import sync_state as st
from agent.sync import SyncDriver, _txn

from .helpers import NOW, T, log_set, mesh, sync

P, Q = "aa" * 16, "bb" * 16
SYN, NEVER = "syncable", "never_syncable"


def R(peer, table, layer, effect, role="", schema="app"):
    return PolicyRow(peer, schema, table, layer, effect, role)


CASES = [
    # (rows, peer, table, category, role, expected allow, reason)
    ([R("*", "*", "system", "allow")], P, "readings", NEVER, None, False, "floor"),  # 1. floor first
    ([R("*", "*", "user", "allow")], P, "readings", None, None, False, "floor"),  # unknown table: outside
    ([], P, "readings", SYN, None, False, "no_row"),  # 5. no row: deny
    ([R(Q, "*", "user", "allow")], P, "readings", SYN, None, False, "no_row"),  # rows for others don't match
    ([R("*", "*", "user", "allow", schema="other")], P, "readings", SYN, None, False, "no_row"),
    ([R("*", "*", "system", "allow")], P, "readings", SYN, None, True, "allow"),
    # 2. the highest layer with any match wins, even against a more specific lower row
    ([R(P, "readings", "system", "allow"), R("*", "*", "user", "deny")], P, "readings", SYN, None, False, "deny"),
    ([R(P, "readings", "user", "deny"), R("*", "*", "role", "allow")], P, "readings", SYN, None, False, "deny"),
    ([R("*", "*", "system", "deny"), R("*", "readings", "role", "allow")], P, "readings", SYN, None, True, "allow"),
    # 3. most specific undominated row within the layer
    ([R("*", "*", "user", "deny"), R(P, "*", "user", "allow")], P, "readings", SYN, None, True, "allow"),
    ([R("*", "*", "user", "deny"), R("*", "readings", "user", "allow")], P, "readings", SYN, None, True, "allow"),
    ([R(P, "*", "user", "allow"), R(P, "readings", "user", "deny")], P, "readings", SYN, None, False, "deny"),
    ([R("*", "*", "user", "allow"), R(P, "*", "user", "allow"), R(P, "readings", "user", "deny"),
      R("*", "readings", "user", "allow")], P, "readings", SYN, None, False, "deny"),
    # 4. incomparable maxima: deny and log, even when both allow
    ([R(P, "*", "user", "allow"), R("*", "readings", "user", "deny")], P, "readings", SYN, None, False, "incomparable"),
    ([R(P, "*", "user", "allow"), R("*", "readings", "user", "allow")], P, "readings", SYN, None, False, "incomparable"),
    # role-layer rows naming a role apply to holders of that role only
    ([R("*", "*", "system", "allow"), R("*", "*", "role", "deny", role="quarantine")], P, "readings", SYN,
     "quarantine", False, "deny"),
    ([R("*", "*", "system", "allow"), R("*", "*", "role", "deny", role="quarantine")], P, "readings", SYN,
     "field", True, "allow"),
    ([R("*", "*", "system", "allow"), R("*", "*", "role", "deny", role="quarantine")], P, "readings", SYN,
     None, True, "allow"),
    ([R("*", "*", "role", "allow"), R("*", "*", "role", "deny", role="q")], P, "readings", SYN, "q", False, "deny"),
    # a forked role chain: role layer absent, resolution fails closed
    ([R("*", "*", "system", "allow")], P, "readings", SYN, FORKED, False, "role_fork"),
]


@pytest.mark.parametrize("rows,peer,table,cat,role,allow,reason", CASES)
def test_resolution(rows, peer, table, cat, role, allow, reason):
    d = resolve(rows, peer, "app", table, cat, role)
    assert (d.allow, d.reason) == (allow, reason)
    if reason in ("incomparable", "role_fork"):
        assert d.log


@pytest.mark.parametrize("row,msg", [
    (R("*", "*", "user", "allow", schema="*"), "schema wildcard"),
    (R("*", "readings", "user", "allow", schema="a*"), "schema wildcard"),
    (R("*", "keys", "user", "allow", schema="sec"), "never_syncable"),
    (R("*", "idx", "user", "deny", schema="app"), "node_local_derived"),
    (R("xyz", "*", "user", "allow"), "site_id"),
    (R("*", "*", "admin", "allow"), "layer"),
    (R("*", "*", "user", "maybe"), "effect"),
    (R("*", "*", "user", "allow", role="r"), "role"),
])
def test_unrepresentable_rows_refused_at_input(row, msg):
    with pytest.raises(PolicyError, match=msg):
        check_row(row, {"sec.keys": NEVER, "app.idx": "node_local_derived", "app.readings": SYN})


def test_wildcard_table_in_a_schema_with_floor_tables_is_fine_and_floor_still_denies():
    row = check_row(R("*", "*", "user", "allow", schema="sec"), {"sec.keys": NEVER})
    assert not resolve([row], P, "sec", "keys", NEVER).allow


def test_default_rows_let_a_fresh_mesh_sync(tmp_path):
    a, b = mesh(tmp_path, 2)
    a.write(T, {"device": "d", "seq": 1}, {"temp": 1.0}, now=NOW)
    da, db_ = SyncDriver(a), SyncDriver(b)
    assert R("*", "*", "system", "allow") in st.policy_rows(a.conn)
    sync(da, db_, NOW)
    assert log_set(a) == log_set(b)


def test_narrowing_stops_selection_at_once_and_widening_backfills(tmp_path):
    a, b = mesh(tmp_path, 2)
    da, db_ = SyncDriver(a), SyncDriver(b)
    a.write(T, {"device": "d", "seq": 1}, {"temp": 1.0}, now=NOW)
    a.write("app.notes", {"id": "n1"}, {"body": "x"}, now=NOW)
    t = sync(da, db_, NOW)
    assert len(log_set(b)) == 2
    with _txn(a.conn):
        st.put_policy_row(a.conn, R(b.site_id.hex(), "notes", "user", "deny"))
    a.write(T, {"device": "d", "seq": 2}, {"temp": 2.0}, now=NOW)
    a.write("app.notes", {"id": "n2"}, {"body": "secret"}, now=NOW)
    # the very next selection honours the narrowing
    sel, *_ = da.select_for(b.site_id, "memory")
    assert len(sel.events) == 1 and sel.gaps == {"app.notes"}
    t = sync(da, db_, t + 1)
    assert len(log_set(b)) == 3
    assert [r["key"] for r in b.dump()["app.notes"]] == [{"id": "n1"}]
    # b's stream from a is gapped for app.notes: no watermark may ever be inferred there
    assert st.stream_gaps(b.conn, a.site_id) == {"app.notes"}
    # widening: remove the deny, schedule the backfill; the withheld history flows
    with _txn(a.conn):
        st.delete_policy_row(a.conn, R(b.site_id.hex(), "notes", "user", "deny"))
        assert st.schedule_backfill(a.conn, "*") >= 1
    sync(da, db_, t + 1)
    assert log_set(a) == log_set(b)
    assert a.dump() == b.dump()


def test_receiver_cannot_widen_its_own_feed(tmp_path):
    """Policy is the sender's: b has no say in what a withholds from it."""
    a, b = mesh(tmp_path, 2)
    da, db_ = SyncDriver(a), SyncDriver(b)
    with _txn(a.conn):
        st.put_policy_row(a.conn, R("*", "*", "user", "deny"))
    with _txn(b.conn):
        st.put_policy_row(b.conn, R(a.site_id.hex(), "*", "user", "allow"))
    a.write(T, {"device": "d", "seq": 1}, {"temp": 1.0}, now=NOW)
    sync(da, db_, NOW, cycles=2)
    assert log_set(b) == set()


def test_an_incomparable_denial_is_surfaced_where_events_shows_it(tmp_path):
    # scope §1.2 rule 4: "deny and log" (it left no trace by default). Surfaced
    # once per (peer, table, reason) while that entry is kept, however many bodies hit it.
    a, b = mesh(tmp_path, 2)
    da = SyncDriver(a)
    a.write(T, {"device": "d", "seq": 1}, {"temp": 1.0}, now=NOW)
    with _txn(a.conn):
        st.put_policy_row(a.conn, R(b.site_id.hex(), "*", "user", "allow"))
        st.put_policy_row(a.conn, R("*", "readings", "user", "deny"))
    for _ in range(3):
        sel, *_ = da.select_for(b.site_id, "memory")
        assert sel.events == []
    hits = [s for s in a.surfaced() if s["reason"] == "incomparable"]
    assert len(hits) == 1
    assert hits[0]["kind"] == "policy_denied" and hits[0]["table"] == T and hits[0]["site_id"] == b.site_id.hex()


def test_selection_opens_only_the_sealed_events_it_offers(tmp_path):
    """The selection read and unsealed every log row it examined, denied by policy or not: a
    gateway whose policy sends its devices nothing of the fleet's telemetry decrypted every event
    once per device per cycle (bench_fleet's profile: 337 400 unseals for ~4 000 events). Only
    what is offered is opened (docs/reliability.md "At rest")."""
    from agent.store import atrest

    a, b = mesh(tmp_path, 2)
    da = SyncDriver(a)
    for i in range(50):
        a.write("app.notes", {"id": f"n{i}"}, {"body": "x"}, now=NOW)
    a.write(T, {"device": "d", "seq": 1}, {"temp": 1.0}, now=NOW)
    with _txn(a.conn):
        st.put_policy_row(a.conn, R(b.site_id.hex(), "notes", "user", "deny"))

    class Counting:
        def __init__(self, inner):
            self.inner, self.opened = inner, 0

        def open(self, eid, blob):
            self.opened += 1
            return self.inner.open(eid, blob)
    counting = Counting(a.log_seal)
    atrest.install(a.conn, counting)
    sel, *_ = da.select_for(b.site_id, "memory")
    assert len(sel.events) == 1 and sel.gaps == {"app.notes"}
    assert counting.opened == 1, counting.opened
    assert sel.events == [bytes(r[0]) for r in a.conn.execute(
        "SELECT unseal(event_id, raw) FROM events WHERE seq = ?", (sel.seqs[0],))]


def test_selection_passes_over_quietly_denied_rows_in_sql(tmp_path, monkeypatch):
    """A gateway's log is mostly its devices' telemetry, which policy sends no device: the
    selection built a Python row for each of them, once per device per cycle (bench_fleet: 1.6 M
    rows for 200 devices, the gateway's selection grew with devices x events). Rows of tables
    policy denies the peer without a denial to surface are passed over in SQL; the cursor still
    moves past them, and own denied rows still show as gaps."""
    from agent import sync as syncmod

    a, b, c = mesh(tmp_path, 3)
    da, dc = SyncDriver(a), SyncDriver(c)
    for i in range(80):
        c.write(T, {"device": "c", "seq": i}, {"temp": 1.0}, now=NOW)
    sync(dc, da, NOW)
    with _txn(a.conn):
        st.put_policy_row(a.conn, R(b.site_id.hex(), "readings", "user", "deny"))
    a.write(T, {"device": "a", "seq": 1}, {"temp": 1.0}, now=NOW)     # its own, denied: a gap
    a.write("app.notes", {"id": "n1"}, {"body": "x"}, now=NOW)        # the one event b may have
    seen = []
    real = syncmod.eventlog.rows_after

    def counting(*args, **kw):
        rows = real(*args, **kw)
        seen.extend(rows)
        return rows
    monkeypatch.setattr(syncmod.eventlog, "rows_after", counting)
    sel, *_ = da.select_for(b.site_id, "fresh")   # a path whose cursor is still 0: the whole log
    top = a.conn.execute("SELECT max(seq) FROM events").fetchone()[0]
    assert len(sel.events) == 1 and sel.gaps == {T} and sel.end == top == 82
    assert len(seen) <= 2, len(seen)


def test_roles_without_role_records_cost_no_trust_resolution(tmp_path, monkeypatch):
    """Each selection resolved the whole trust (every keyring entry, every record) for the peers'
    roles: a gateway with D devices in its keyring paid O(D) per selection and D selections per
    cycle (bench_fleet, 200 devices: 40 % of the selection). A store holding no role record has
    no roles, and says so without resolving anything."""
    a, b = mesh(tmp_path, 2)
    da = SyncDriver(a)
    a.write(T, {"device": "d", "seq": 1}, {"temp": 1.0}, now=NOW)
    calls = []
    real = st.provisioned_keyring
    monkeypatch.setattr(st, "provisioned_keyring", lambda conn: calls.append(1) or real(conn))
    from agent.store import sync_records
    monkeypatch.setattr(sync_records, "provisioned_keyring", lambda conn: calls.append(1) or real(conn))
    sel, *_ = da.select_for(b.site_id, "memory")
    assert len(sel.events) == 1 and st.current_roles(a.conn) == {} and calls == []
