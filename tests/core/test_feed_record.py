"""The change feed's record of an applied event is put together as text from parts (it is on
every applied event); it must be exactly the JSON of the record's members (docs/client.md "The
change feed"), whatever the columns, clocks, keys and signals."""
import json

from hypothesis import given, settings, strategies as st

from agent import feed
from agent.core import events as ev
from agent.core.merge import Effects, RowState
from agent.core.schema import TableDef

from .test_events_encoding import keys, scalars

stamps = st.tuples(st.integers(0, 2**63 - 1), st.integers(0, 2**32 - 1), st.binary(min_size=16, max_size=16))


def expected(tdef, e, existed, fx, writes, partial, horizon) -> str:
    own = e.stamp
    cols = {c: {"state": "unmaterialized"} if w is None else {} if w[1] == own else
            {"site": w[1][2].hex(), "hlc": f"{w[1][0]}.{w[1][1]}"} for c, w in writes.items()}
    rec = {"kind": "change", "table": tdef.qualified, "key": {k: feed.value_json(v) for k, v in e.row_key.items()},
           "op": e.operation, "event_id": e.event_id.hex(), "site": own[2].hex(), "hlc": f"{own[0]}.{own[1]}",
           "existed": existed, "exists": fx.state.exists, "columns": cols}
    if fx.ignored:
        rec["ignored"] = sorted(fx.ignored)
    if fx.resurrected:
        rec["resurrected"] = True
        if partial:
            t = fx.state.tomb_clock
            rec["partial"] = {"horizon": f"{horizon[0]}.{horizon[1]}", "tombstone": f"{t[0]}.{t[1]}"}
    return json.dumps(rec, separators=(",", ":"))


@settings(max_examples=300, deadline=None)
@given(name=keys, row_key=st.dictionaries(keys, scalars, min_size=1, max_size=3), stamp=stamps,
       op=st.sampled_from(["upsert", "delete"]), existed=st.booleans(), exists=st.booleans(),
       writes=st.dictionaries(keys, st.one_of(st.none(), st.tuples(scalars, stamps), st.just("own")), max_size=5),
       ignored=st.lists(keys, max_size=3), resurrected=st.booleans(), partial=st.booleans(), tomb=stamps,
       horizon=st.tuples(st.integers(0, 2**40), st.integers(0, 9)))
def test_the_record_is_the_json_of_its_members(name, row_key, stamp, op, existed, exists, writes,
                                              ignored, resurrected, partial, tomb, horizon):
    tdef = TableDef("app", name, "syncable", ("k",), {"v": "text"}, None)
    e = ev.Event(bytes(32), b"", stamp[2], "app", name, row_key, op, None, stamp[:2])
    writes = {c: (1, stamp) if w == "own" else w for c, w in writes.items()}
    fx = Effects(state=RowState(exists, None, tomb, {}), resurrected=resurrected, ignored=ignored)
    got = []

    class Conn:   # the feed's store appends with one statement
        lastrowid = 1

        def execute(self, sql, params):
            got.append(params)
            return self
    rk = ev.text_map(row_key)
    feed.note_change(Conn(), tdef, e, rk, existed, fx, writes, partial, horizon)
    assert got == [(tdef.qualified, rk, expected(tdef, e, existed, fx, writes, partial, horizon))]
