"""The change feed on a node applying peers' events: the spec's application signals arrive inline
(resurrection §13.2, partial rebuild with its horizon §13.4, ignored columns §13.6, holds, drops,
rejections); for random delivery orders replaying the feed from cursor 0 rebuilds exactly the
node's tables; a watcher resumed from its cursor ends where one that never stopped does; a cursor
older than what the node retains is refused explicitly."""
from __future__ import annotations

import random

import pytest

from agent.client import Client, CursorExpired
from agent.core import reasons as R
from agent.simpeer import SimPeer
from agent.store import feed as feedstore
from tests.core.helpers import MESH, NOW, T, make_node, peers

from .helpers import before_the_feed

K = {"device": "d", "seq": 1}


def records(node, since=0, tables=None) -> list[dict]:
    return list(Client(node.home).watch(tables, since, idle_s=0))


@pytest.fixture
def env(tmp_path):
    a, b = peers(2)
    node = make_node(tmp_path / "n", [a, b])
    yield node, a, b
    node.close()


def test_resurrection_and_a_partial_rebuild_name_the_row_and_the_horizon(env):
    node, a, b = env
    node.apply_batch([a.event(T, K, {"note": "kept"}, (NOW, 1)),
                      b.event(T, K, None, (NOW, 5), delete=True),
                      a.event(T, K, {"temp": 7.0}, (NOW, 6)),
                      b.event(T, K, None, (NOW, 7), delete=True)], NOW)
    node.raise_horizon(T, (NOW + 100, 0))   # the tombstone (NOW.7) is now below the horizon
    node.apply_batch([a.event(T, K, {"raw": b"r"}, (NOW + 200, 0))], NOW + 300)
    recs = records(node)
    assert [r["cursor"] for r in recs] == list(range(1, 6))
    assert [(r["op"], r["existed"], r["exists"]) for r in recs] == [
        ("upsert", False, True), ("delete", True, False), ("upsert", False, True), ("delete", True, False),
        ("upsert", False, True)]
    assert recs[2]["resurrected"] is True and "partial" not in recs[2]
    last = recs[-1]
    assert last["resurrected"] is True and last["key"] == K
    assert last["partial"] == {"horizon": f"{NOW + 100}.0", "tombstone": f"{NOW}.7"}
    assert last["columns"]["raw"] == {"value": b"r", "site": a.site_id.hex(), "hlc": f"{NOW + 200}.0"}
    # the delete's clocked nulls (§13.3), not values from below the horizon
    assert last["columns"]["temp"]["value"] is None and last["columns"]["temp"]["hlc"] == f"{NOW}.7"
    # what later changes replaced is not kept in the feed (docs/reliability.md "Superseded values")
    assert recs[0]["columns"]["note"] == {"superseded": True, "site": a.site_id.hex(), "hlc": f"{NOW}.1"}
    node.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    assert not any(b"kept" in f.read_bytes() for f in node.home.glob("store.sqlite*"))


def test_ignored_columns_holds_drops_and_rejections_arrive_inline(env, tmp_path):
    node, a, b = env
    stranger = SimPeer(MESH)
    node.apply_batch([a.event(T, K, {"temp": 1.0, "colour": "red"}, (NOW, 1)),
                      a.event("app.missing", {"id": "x"}, {"v": 1}, (NOW, 2)),
                      a.event("sec.keys", {"id": "k"}, {"secret": b"s"}, (NOW, 3)),
                      stranger.event(T, K, {"temp": 9.0}, (NOW, 4))], NOW)
    recs = records(node)
    assert recs[0]["kind"] == "change" and recs[0]["ignored"] == ["colour"] and set(recs[0]["columns"]) == {"temp"}
    assert [(r["kind"], r["reason"], r["table"]) for r in recs[1:]] == [
        ("held", R.TABLE_MISSING, "app.missing"), ("logged", R.OUT_OF_FLOOR, "sec.keys"),
        ("rejected", R.UNKNOWN_KID, None)]
    # a watcher of one table gets its records and those about events of no known table
    assert [r["cursor"] for r in records(node, tables=[T])] == [1, 4]
    # §13.6: the unknown column is never shown as a value
    assert Client(node.home).read(T, K).values == {"temp": 1.0, "note": None, "raw": None}
    assert Client(node.home).value(T, K, "note") == (None, "unmaterialized")


def replay(recs: list[dict]) -> dict[str, list]:
    """The tables a feed describes: each row's existence and its columns' last written values."""
    rows: dict = {}
    for r in recs:
        if r["kind"] != "change":
            continue
        row = rows.setdefault((r["table"], tuple(sorted(r["key"].items()))), {"exists": False, "values": {}})
        row["exists"] = r["exists"]
        for c, w in r["columns"].items():
            if w.get("state") == "unmaterialized":
                row["values"].pop(c, None)
            elif w.get("superseded"):
                row["values"][c] = "SUPERSEDED"   # a later record must replace it
            else:
                row["values"][c] = w["value"]
    out: dict[str, list] = {}
    for (table, key), row in sorted(rows.items(), key=lambda kv: repr(kv[0])):
        if row["exists"]:
            out.setdefault(table, []).append({"key": dict(key), "values": row["values"]})
    return out


@pytest.mark.parametrize("seed", range(6))
def test_replaying_the_feed_rebuilds_the_tables_for_random_delivery_orders(tmp_path, seed):
    rnd = random.Random(seed)
    ps = peers(3)
    evs = []
    for i in range(60):
        p = rnd.choice(ps)
        key = {"device": rnd.choice("ab"), "seq": rnd.randrange(3)}
        hlc = (NOW + rnd.randrange(40), rnd.randrange(3))
        if rnd.random() < 0.25:
            evs.append(p.event(T, key, None, hlc, delete=True))
        else:
            cols = rnd.sample(["temp", "note", "raw"], rnd.randrange(1, 4))
            vals = {"temp": float(i), "note": f"n{i}", "raw": bytes([i])}
            evs.append(p.event(T, key, {c: vals[c] for c in cols}, hlc))
    rnd.shuffle(evs)
    node = make_node(tmp_path / "n", ps)
    try:
        i = 0
        cut = None
        while i < len(evs):   # batches of random sizes, a horizon raised part way on some runs
            n = rnd.randrange(1, 12)
            node.apply_batch(evs[i:i + n], NOW + 100)
            i += n
            if seed % 2 and cut is None and i > 30:
                cut = (NOW + 15, 0)
                node.raise_horizon(T, cut)
        full = records(node)
        rows = [r for r in node.dump()[T]]
        assert replay(full).get(T, []) == sorted(rows, key=lambda r: repr(tuple(sorted(r["key"].items()))))
        # a watcher killed part way and resumed from its cursor ends with the same records
        k = rnd.randrange(1, len(full))
        resumed = full[:k] + records(node, since=full[k - 1]["cursor"])
        assert resumed == full
    finally:
        node.close()


def test_a_cursor_older_than_the_node_retains_is_refused(env, monkeypatch):
    node, a, _ = env
    from agent.store import db
    db.set_meta(node.conn, "feed_retain", 8)      # the profile's [store] feed_retain, as init stores it
    monkeypatch.setattr(feedstore, "PRUNE_EVERY", 4)
    node.apply_batch([a.event(T, {"device": "d", "seq": i}, {"temp": 1.0}, (NOW, i)) for i in range(20)], NOW)
    with pytest.raises(CursorExpired) as e:
        records(node, since=0)
    assert e.value.oldest == 12 and e.value.head == 20 and e.value.cursor == 0
    assert [r["cursor"] for r in records(node, since=12)] == list(range(13, 21))


def test_rows_a_trust_change_or_a_new_column_rebuilds_arrive_as_rebuild_records(env):
    """A row rebuilt outside the apply of an event (a peer removed: its writes no longer count;
    a column added: rebuilt from the log, §13.6) is a change the application must see too."""
    node, a, b = env
    K2 = {"device": "d", "seq": 2}
    node.apply_batch([a.event(T, K, {"temp": 1.0}, (NOW, 1)), b.event(T, K, {"temp": 2.0}, (NOW, 2)),
                      b.event(T, K2, {"note": "only b"}, (NOW, 3))], NOW)
    head = records(node)[-1]["cursor"]
    node.remove_peer(b.site_id)
    recs = records(node, since=head)
    by_key = {r["key"]["seq"]: r for r in recs if r["kind"] == "change"}
    assert by_key[1]["op"] == "rebuild" and by_key[1]["cause"] == "trust_change"
    assert by_key[1]["columns"]["temp"] == {"value": 1.0, "site": a.site_id.hex(), "hlc": f"{NOW}.1"}
    assert (by_key[1]["existed"], by_key[1]["exists"]) == (True, True)
    assert by_key[2]["op"] == "rebuild" and (by_key[2]["existed"], by_key[2]["exists"]) == (True, False)
    assert replay(records(node)).get(T, []) == node.dump()[T]
    head = records(node)[-1]["cursor"]
    a_ev = a.event(T, K, {"temp": 3.0, "colour": "blue"}, (NOW, 9))
    node.apply_batch([a_ev], NOW)
    head = records(node)[-1]["cursor"]
    node.add_column(T, "colour", "text")
    recs = records(node, since=head)
    assert [(r["op"], r["cause"], r["key"]) for r in recs] == [("rebuild", "column_added", K)]
    assert recs[0]["columns"] == {"colour": {"value": "blue", "site": a.site_id.hex(), "hlc": f"{NOW}.9"}}
    assert replay(records(node)).get(T, []) == node.dump()[T]


def test_a_home_older_than_the_feed_tells_a_watcher_from_zero_to_re_read_the_tables(tmp_path):
    """A home made at the store version before the feed (7) holds rows no record describes: a
    watcher from cursor 0 is told to re-read the tables, never shown an empty history; a home
    that had the feed from its start has no such record."""
    import sqlite3

    from agent.node import Node
    from agent.store import migrations
    a, = peers(1)
    node = make_node(tmp_path / "old", [a])
    node.apply_batch([a.event(T, K, {"temp": 1.0}, (NOW, 1))], NOW)
    home = node.home
    node.close()
    before_the_feed(home)
    conn = sqlite3.connect(home / "store.sqlite")
    assert migrations.store_version(conn) == 7 and migrations.MIGRATIONS[7][0] == 8
    conn.close()
    node = Node.open(home)   # a writing open migrates
    try:
        node.apply_batch([a.event(T, {"device": "d", "seq": 2}, {"temp": 2.0}, (NOW, 2))], NOW)
        recs = records(node)
        assert [(r["kind"], r.get("cause"), r["table"]) for r in recs[:1]] == [("rebuild", "feed_started", None)]
        assert [(r["kind"], r["key"]) for r in recs[1:]] == [("change", {"device": "d", "seq": 2})]
        assert [r["cursor"] for r in records(node, tables=[T])] == [r["cursor"] for r in recs]
    finally:
        node.close()
    fresh = make_node(tmp_path / "new", [a])
    try:
        fresh.apply_batch([a.event(T, K, {"temp": 1.0}, (NOW, 1))], NOW)
        assert [r["kind"] for r in records(fresh)] == ["change"]
    finally:
        fresh.close()


def test_rows_rebuilt_when_writes_a_clock_stamped_ahead_are_reissued_arrive_as_rebuild_records(tmp_path):
    """Own writes a clock ten years ahead stamped are withdrawn and re-issued on the next open
    (docs/apply.md): their rows are rebuilt from what remains, a change the feed must carry."""
    from agent.node import Node
    from tests.lifecycle.test_clock_reissue import _ahead
    home = tmp_path / "a"
    _ahead(home)
    node = Node.open(home)   # recovers: re-issues in the clock's gap, withdraws the originals
    try:
        recs = records(node)
        assert any(r.get("cause") == "clock_reissued" for r in recs), [(r["op"], r.get("cause")) for r in recs]
        rows = sorted(node.dump()[T], key=lambda r: repr(tuple(sorted(r["key"].items()))))
        assert replay(recs).get(T, []) == rows
    finally:
        node.close()


def test_a_home_no_agent_migrated_yet_is_said_to_have_no_feed(tmp_path):
    """Read from a home an older agent made and nothing has opened for writing since: no records
    is not an empty history, so the watch says there is no feed yet."""
    from agent.client import ClientError
    from tests.cli_cmd import run_cli
    a, = peers(1)
    node = make_node(tmp_path / "old", [a])
    node.apply_batch([a.event(T, K, {"temp": 1.0}, (NOW, 1))], NOW)
    node.close()
    before_the_feed(tmp_path / "old")
    with pytest.raises(ClientError, match="no change feed yet"):
        list(Client(tmp_path / "old").watch(None, since=0, idle_s=0))
    p = run_cli("--home", tmp_path / "old", "watch", "--since", "0", "--idle", "0")
    assert p.returncode != 0 and "no change feed yet" in p.stderr and p.stdout == ""


def test_the_feed_keeps_what_the_profile_says_not_more(tmp_path, monkeypatch):
    """A small card's profile keeps fewer feed records: the pi-zero-2w profile's `feed_retain`,
    stored by `init`, bounds the feed (a record is a few hundred bytes: 100 000 of them were most of a
    Pi Zero's store with eviction on); a home without it keeps RETAIN."""
    from agent.node import Node
    from agent.profile import load_profile
    from agent.simpeer import SimPeer, manifest_text, readings_table
    from agent.store import db
    prof = load_profile("pi-zero-2w")
    assert prof.feed_retain < feedstore.RETAIN
    monkeypatch.setattr(feedstore, "PRUNE_EVERY", 16)
    peer = SimPeer(bytes(16))
    node, _ = Node.init(tmp_path / "z", manifest_text(bytes(16), readings_table(), [peer]), profile=prof)
    try:
        assert int(db.get_meta(node.conn, "feed_retain")) == prof.feed_retain
        db.set_meta(node.conn, "feed_retain", 40)   # the same bound, small enough to fill here
        node.apply_batch([peer.event(T, {"device": "d", "seq": i}, {"temp": 1.0}, (NOW, i)) for i in range(200)], NOW)
        n = node.conn.execute("SELECT count(*) FROM feed").fetchone()[0]
        assert 40 <= n <= 40 + 16, n
    finally:
        node.close()
