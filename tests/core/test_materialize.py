"""§13 materialization by example: clocks, tombstones, resurrection rebuild, horizons, schema evolution."""
from __future__ import annotations

import pytest

from agent.node import NodeError
from agent.outcomes import APPLIED

from .helpers import NOW, T, make_node, peers

K = {"device": "d", "seq": 1}


@pytest.fixture
def env(tmp_path):
    a, b = peers(2)
    node = make_node(tmp_path / "n", [a, b])
    yield node, a, b
    node.close()


def vals(node, table=T):
    rows = node.dump()[table]
    return rows[0]["values"] if rows else None


def test_per_column_lww_keeps_concurrent_edits_of_different_columns(env):
    node, a, b = env
    node.apply_batch([a.event(T, K, {"temp": 1.0}, (NOW, 0)), b.event(T, K, {"note": "x"}, (NOW, 0))], NOW)
    assert vals(node) == {"temp": 1.0, "note": "x"}


def test_same_column_equal_hlc_broken_by_site_id(env):
    node, a, b = env
    hi, lo = (a, b) if a.site_id > b.site_id else (b, a)
    node.apply_batch([hi.event(T, K, {"note": "hi"}, (NOW, 0)), lo.event(T, K, {"note": "lo"}, (NOW, 0))], NOW)
    assert vals(node) == {"note": "hi"}


def test_losing_write_does_not_raise_the_clock(env):
    node, a, _ = env
    node.apply_batch([a.event(T, K, {"note": "new"}, (NOW, 5)), a.event(T, K, {"note": "old"}, (NOW, 1))], NOW)
    assert vals(node) == {"note": "new"}


def test_explicit_null_is_a_clocked_write(env):
    node, a, b = env
    node.apply_batch([a.event(T, K, {"note": "x"}, (NOW, 1)), b.event(T, K, {"note": None}, (NOW, 2))], NOW)
    assert vals(node) == {"note": None}
    node.apply_batch([a.event(T, K, {"note": "older"}, (NOW, 0))], NOW)
    assert vals(node) == {"note": None}


def test_unmaterialized_column_is_absent_not_null(env):
    node, a, _ = env
    node.apply_batch([a.event(T, K, {"temp": 1.0}, (NOW, 0))], NOW)
    assert vals(node) == {"temp": 1.0}  # note and raw absent: never written


def test_delete_then_late_write_below_tombstone_rejected_either_order(tmp_path):
    a, b = peers(2)
    outs = []
    for i, order in enumerate([(0, 1), (1, 0)]):
        node = make_node(tmp_path / f"n{i}", [a, b])
        evs = [b.event(T, K, None, (NOW, 5), delete=True), a.event(T, K, {"note": "late"}, (NOW, 3))]
        node.apply_batch([evs[j] for j in order], NOW)
        outs.append(node.dump())
        node.close()
    assert outs[0] == outs[1] == {T: [], "app.index": [], "sec.keys": []}


def test_losing_delete_still_clears_columns_it_beats(env):
    node, a, b = env
    node.apply_batch([a.event(T, K, {"note": "x", "temp": 1.0}, (NOW, 1)),
                      a.event(T, K, {"temp": 2.0}, (NOW, 9)),  # wins existence
                      b.event(T, K, None, (NOW, 5), delete=True)], NOW)
    # The delete lost existence but beat note's clock: note is a clocked null; temp kept.
    assert vals(node) == {"note": None, "temp": 2.0, "raw": None}


def test_resurrection_rebuild_and_surface(env):
    node, a, b = env
    node.apply_batch([a.event(T, K, {"note": "x"}, (NOW, 1)),
                      b.event(T, K, None, (NOW, 5), delete=True)], NOW)
    assert node.dump()[T] == []
    node.apply_batch([a.event(T, K, {"temp": 3.0}, (NOW, 7))], NOW)
    assert vals(node) == {"temp": 3.0, "note": None, "raw": None}
    kinds = [s["kind"] for s in node.surfaced()]
    assert "resurrection" in kinds and "partial_rebuild" not in kinds


def test_partial_rebuild_named_with_row_and_horizon(env):
    node, a, b = env
    # A write above the tombstone arrives while the row is deleted...
    node.apply_batch([b.event(T, K, None, (NOW, 5), delete=True)], NOW)
    node.apply_batch([a.event(T, K, {"note": "window", "temp": 1.0}, (NOW, 6)),
                      b.event(T, K, None, (NOW, 8), delete=True),
                      a.event(T, K, {"note": "after"}, (NOW, 9))], NOW)
    # ...and now the horizon rises above the tombstone: the candidate window is evicted.
    node.raise_horizon(T, (NOW, 10))
    node.apply_batch([b.event(T, K, None, (NOW, 11), delete=True), a.event(T, K, {"raw": b"z"}, (NOW, 12))], NOW)
    assert vals(node) == {"raw": b"z", "note": None, "temp": None}
    node.apply_batch([b.event(T, K, None, (NOW, 13), delete=True)], NOW)
    # Rebuild whose tombstone (NOW.13) is above the horizon is complete.
    partial = [s for s in node.surfaced() if s["kind"] == "partial_rebuild"]
    assert partial == []
    node2_events = node.surfaced()
    assert any(s["kind"] == "resurrection" for s in node2_events)


def test_partial_rebuild_surfaced_when_tombstone_below_horizon(env):
    node, a, b = env
    node.apply_batch([a.event(T, K, {"note": "kept"}, (NOW, 1)),
                      b.event(T, K, None, (NOW, 5), delete=True),
                      a.event(T, K, {"temp": 7.0}, (NOW, 6)),
                      b.event(T, K, None, (NOW, 7), delete=True)], NOW)
    node.raise_horizon(T, (NOW + 100, 0))  # tombstone (NOW.7) is now below the horizon
    node.apply_batch([a.event(T, K, {"raw": b"r"}, (NOW + 200, 0))], NOW + 300)
    # temp's only evidence (NOW.6) is below the horizon: it comes back as the delete's null.
    assert vals(node) == {"raw": b"r", "temp": None, "note": None}
    partial = [s for s in node.surfaced() if s["kind"] == "partial_rebuild"]
    assert len(partial) == 1
    assert partial[0]["detail"]["row_key"] == K
    assert partial[0]["detail"]["horizon"] == f"{NOW + 100}.0"
    assert partial[0]["table"] == T


def test_below_horizon_counts_applied_and_writes_nothing(env):
    node, a, _ = env
    node.raise_horizon(T, (NOW, 10))
    o = node.apply_batch([a.event(T, K, {"note": "old"}, (NOW, 3))], NOW)[0]
    assert (o.status, o.reason) == (APPLIED, "below_horizon")
    assert node.dump()[T] == []


def test_rebuild_never_reads_below_horizon_even_if_bytes_survive(env):
    node, a, b = env
    node.apply_batch([b.event(T, K, None, (NOW, 1), delete=True),
                      a.event(T, K, {"note": "in-window"}, (NOW, 2)),
                      b.event(T, K, None, (NOW, 3), delete=True)], NOW)
    node.raise_horizon(T, (NOW, 4))  # nothing reclaimed: the bytes of NOW.2 are still in the log
    assert len(list(node.log_entries())) == 3
    node.apply_batch([a.event(T, K, {"temp": 1.0}, (NOW, 5))], NOW)
    assert vals(node)["note"] is None


def test_horizon_is_monotonic(env):
    node, _, _ = env
    node.raise_horizon(T, (NOW, 5))
    with pytest.raises(NodeError, match="never move back"):
        node.raise_horizon(T, (NOW, 4))


def test_add_column_rebuilds_from_retained_log(env):
    node, a, b = env
    node.apply_batch([a.event(T, K, {"temp": 1.0, "unit": "C"}, (NOW, 1)),
                      a.event(T, {"device": "d", "seq": 2}, {"unit": "F"}, (NOW, 2)),
                      b.event(T, {"device": "d", "seq": 2}, None, (NOW, 3), delete=True),
                      a.event(T, {"device": "d", "seq": 2}, {"temp": 5.0}, (NOW, 4)),
                      a.event(T, {"device": "d", "seq": 3}, {"temp": 9.0}, (NOW, 5))], NOW)
    n = node.add_column(T, "unit", "text")
    assert n == 2
    rows = {r["key"]["seq"]: r["values"] for r in node.dump()[T]}
    assert rows[1] == {"temp": 1.0, "unit": "C"}
    assert rows[2]["unit"] is None  # the delete's clocked null: its only candidate is below the tombstone
    assert "unit" not in rows[3]  # never written, never deleted: absent
    # After migration the column takes part in ordinary merges.
    node.apply_batch([a.event(T, K, {"unit": "K"}, (NOW, 6))], NOW)
    assert {r["key"]["seq"]: r["values"] for r in node.dump()[T]}[1]["unit"] == "K"


def test_add_column_matches_a_node_that_always_had_it(tmp_path):
    a, b = peers(2)
    evs = [a.event(T, K, {"temp": 1.0, "unit": "C"}, (NOW, 1)), b.event(T, K, None, (NOW, 2), delete=True),
           a.event(T, K, {"unit": "F"}, (NOW, 3)), b.event(T, K, {"temp": 2.0}, (NOW, 4))]
    narrow = make_node(tmp_path / "narrow", [a, b])
    from .helpers import TABLES
    wide = make_node(tmp_path / "wide", [a, b], tables=TABLES.replace('raw = "blob" }', 'raw = "blob", unit = "text" }'))
    narrow.apply_batch(evs, NOW)
    wide.apply_batch(evs, NOW)
    narrow.add_column(T, "unit", "text")
    assert narrow.dump() == wide.dump()
    narrow.close()
    wide.close()


def test_local_delete_hides_the_row(env):
    node, _, _ = env
    node.write(T, K, {"note": "x"}, now=NOW)
    node.write(T, K, None, delete=True, now=NOW)
    assert node.dump()[T] == []


def test_sql_view_tells_a_never_materialized_column_from_a_cleared_one(env):
    # §13.6: an unmaterialized column must not be presented as a cleared value.
    # The view "schema.table" carries, per value column C, "C$state": 'materialized' when C has a
    # column clock (its value, NULL included, is a real clocked write) and 'unmaterialized' when not.
    node, a, b = env
    node.apply_batch([a.event(T, K, {"temp": 1.0, "note": None}, (NOW, 1)),  # note: an explicit null (cleared)
                      a.event(T, {"device": "d", "seq": 2}, {"temp": 2.0}, (NOW, 2))], NOW)
    node.add_column(T, "unit", "text")  # no event ever carried it
    rows = node.conn.execute(
        'SELECT seq, note, "note$state", unit, "unit$state", temp, "temp$state" FROM "app.readings" ORDER BY seq'
    ).fetchall()
    assert rows == [(1, None, "materialized", None, "unmaterialized", 1.0, "materialized"),
                    (2, None, "unmaterialized", None, "unmaterialized", 2.0, "materialized")]
