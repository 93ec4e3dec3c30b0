"""`events.payload_bytes` puts the deterministic encoding of an EventPayload together from parts
(it is on every local write); it must equal the generic deterministic encoder
(`codec.encode`, docs/protocol.md §0) for every value the shape check admits, or peers would drop
our events as `non_deterministic`."""
from hypothesis import given, settings, strategies as st

from agent.core import events as ev
from agent.core.codec import INT64_MAX, INT64_MIN, encode

BOUNDARY_INTS = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, INT64_MAX, -1, -24, -25, -256, -257,
                 -65537, INT64_MIN]
ints = st.one_of(st.sampled_from(BOUNDARY_INTS), st.integers(INT64_MIN, INT64_MAX))
floats = st.one_of(st.sampled_from([0.0, -0.0, 0.5, 1.1, 65504.0, 65505.0, 5.960464477539063e-08, 6.1e-05,
                                    3.4028234663852886e38, 1e300, -2.5, float(2**24 + 1)]),
                   st.floats(allow_nan=False, allow_infinity=False))
scalars = st.one_of(ints, floats, st.text(max_size=40), st.binary(max_size=300))
keys = st.text(min_size=1, max_size=30)
hlcs = st.tuples(st.one_of(st.sampled_from([0, 23, 24, 2**32, INT64_MAX]), st.integers(0, INT64_MAX)),
                 st.one_of(st.sampled_from([0, 23, 24, 255, 256, 65536, 2**32 - 1]), st.integers(0, 2**32 - 1)))


@settings(max_examples=400, deadline=None)
@given(schema=keys, name=keys, row_key=st.dictionaries(keys, scalars, min_size=1, max_size=4),
       payload=st.one_of(st.none(), st.dictionaries(keys, st.one_of(st.none(), scalars), max_size=30)), hlc=hlcs)
def test_payload_bytes_equal_the_deterministic_encoding(schema, name, row_key, payload, hlc):
    op = "delete" if payload is None else "upsert"
    obj = {"table_schema": schema, "table_name": name, "row_key": row_key, "operation": op, "payload": payload,
           "hlc_physical_ms": hlc[0], "hlc_logical": hlc[1]}
    assert ev.check_payload_shape(obj) is None
    assert ev.payload_bytes(schema, name, row_key, op, payload, hlc) == encode(obj)


def test_payload_bytes_with_24_and_more_columns():
    """Map heads past the one-byte form (24 members and more)."""
    for n in (23, 24, 25, 255, 256, 300):
        payload = {f"c{i:03d}": float(i) for i in range(n)}
        obj = {"table_schema": "s", "table_name": "t", "row_key": {"k": 1}, "operation": "upsert",
               "payload": payload, "hlc_physical_ms": 1, "hlc_logical": 0}
        assert ev.payload_bytes("s", "t", {"k": 1}, "upsert", payload, (1, 0)) == encode(obj)


@settings(max_examples=300, deadline=None)
@given(row_key=st.dictionaries(keys, scalars, min_size=1, max_size=6))
def test_row_addresses_equal_the_deterministic_encoding(row_key):
    """agent/store/rows.py `row_key_bytes` (a row's address, and the log's `row_key` column) is
    built by the events encoder's map form: it must stay the bytes it was (`codec.encode`)."""
    from agent.store.rows import row_key_bytes
    assert row_key_bytes(row_key) == encode(row_key)


columns = st.dictionaries(keys, st.sampled_from(["integer", "real", "text", "blob"]), min_size=2, max_size=6)
anything = st.one_of(st.none(), st.booleans(), scalars, st.lists(st.integers(), max_size=2),
                     st.integers(2**63, 2**70), st.just(float("nan")), st.just(float("inf")))


@settings(max_examples=400, deadline=None)
@given(cols=columns, data=st.data())
def test_one_pass_check_of_a_local_write_agrees_with_the_column_checks(cols, data):
    """`TableDef.fits_exactly` (Node.write_many's one-pass check) is true exactly
    when `key_fits` and `value_fits` accept the key and every value column."""
    from agent.core.schema import TableDef, value_fits
    names = sorted(cols)
    t = TableDef("s", "t", "syncable", tuple(names[:1]), cols)
    row_key = data.draw(st.dictionaries(st.sampled_from(names + ["zz"]), anything, min_size=1, max_size=3))
    values = data.draw(st.one_of(st.none(), st.dictionaries(st.sampled_from(names + ["zz"]), anything, max_size=4)))
    expect = t.key_fits(row_key) is None and (values is None or all(
        c in t.value_columns and value_fits(cols[c], v) for c, v in values.items()))
    assert t.fits_exactly(row_key, values) == expect
