"""The pure §13 merge rules, exhaustively over small histories: the final clocks and values of a
row do not depend on the order its events arrive in (no store involved)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from agent.core.merge import RowState, merge_delete, merge_upsert
from agent.core.schema import TableDef

TABLE = TableDef("app", "t", "syncable", ("id",), {"id": "text", "a": "integer", "b": "text"})
SITES = [bytes([i]) * 16 for i in range(3)]

event = st.tuples(
    st.integers(0, 2), st.integers(0, 2), st.integers(0, 2),  # physical, logical, site
    st.one_of(st.none(), st.dictionaries(st.sampled_from(["a", "b", "zz"]),
                                         st.one_of(st.none(), st.integers(-3, 3), st.text(max_size=2)), max_size=3)))


def run(events):
    row = RowState()
    values = {}
    for p, l, s, payload in events:
        stamp = (p, l, SITES[s])
        fx = merge_delete(TABLE, row, stamp) if payload is None else merge_upsert(TABLE, row, stamp, payload)
        row = fx.state
        for col, (v, _c) in fx.writes.items():
            values[col] = v
    return row, values


@settings(max_examples=400, deadline=None)
@given(st.lists(event, max_size=8, unique_by=lambda e: (e[0], e[1], e[2])), st.randoms())
def test_final_row_state_is_order_independent(events, rnd):
    shuffled = list(events)
    rnd.shuffle(shuffled)
    r1, v1 = run(events)
    r2, v2 = run(shuffled + events[:2])  # with duplicates too
    assert (r1.exists, r1.exist_clock, r1.tomb_clock, r1.cells) == (r2.exists, r2.exist_clock, r2.tomb_clock, r2.cells)
    assert v1 == v2


def test_ignored_columns_do_not_touch_clocks():
    fx = merge_upsert(TABLE, RowState(), (1, 0, SITES[0]), {"zz": 1, "a": "wrong type", "id": "k", "b": "ok"})
    assert sorted(fx.ignored) == ["a", "id", "zz"]
    assert set(fx.state.cells) == {"b"}


def test_delete_clears_unclocked_columns_and_losing_upsert_still_applies():
    d = merge_delete(TABLE, RowState(), (5, 0, SITES[0]))
    assert d.writes == {"a": (None, (5, 0, SITES[0])), "b": (None, (5, 0, SITES[0]))}
    u = merge_upsert(TABLE, d.state, (4, 0, SITES[1]), {"a": 1})
    assert u.writes == {} and not u.state.exists and not u.resurrected
    r = merge_upsert(TABLE, d.state, (6, 0, SITES[1]), {"a": 1})
    assert r.resurrected and r.writes == {"a": (1, (6, 0, SITES[1]))}
