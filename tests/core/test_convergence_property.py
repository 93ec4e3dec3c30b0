"""§13.5: materialized state is a pure function of the delivered event set (and of equal
horizons). Random histories over several sites, random delivery orders with duplicates."""
from __future__ import annotations

import itertools
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings, strategies as st

from agent.node import Node

from .helpers import NOW, READINGS, T, manifest, peers
from tests.soak import sample

SITES = peers(3)
TABLES = READINGS
VALUE = st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False, width=64))
NOTE = st.one_of(st.none(), st.text(max_size=3))
RAW = st.one_of(st.none(), st.binary(max_size=3))


@st.composite
def histories(draw):
    """A list of signed events: per site distinct HLCs (§13.5: no reuse), physical times
    drawn from a tiny range so equal-physical-time conflicts and site tiebreaks are common."""
    n = draw(st.integers(min_value=1, max_value=24))
    used: set[tuple[int, int, int]] = set()
    out = []
    for _ in range(n):
        site = draw(st.integers(0, len(SITES) - 1))
        p = NOW + draw(st.integers(0, 3))
        l = draw(st.integers(0, 2))
        if (site, p, l) in used:
            continue
        used.add((site, p, l))
        key = {"device": "d", "seq": draw(st.integers(0, 2))}
        if draw(st.integers(0, 4)) == 0:
            out.append(SITES[site].event(T, key, None, (p, l), delete=True))
            continue
        values = {}
        for col, strat in (("temp", VALUE), ("note", NOTE), ("raw", RAW)):
            if draw(st.booleans()):
                values[col] = draw(strat)
        if draw(st.integers(0, 5)) == 0:
            values["unknown_col"] = 1  # a column no replica has
        out.append(SITES[site].event(T, key, values, (p, l)))
    return out


@st.composite
def deliveries(draw, events):
    """A delivery: a permutation with duplicates, cut into batches."""
    order = draw(st.permutations(events))
    dups = draw(st.lists(st.sampled_from(events), max_size=4)) if events else []
    seq = list(order) + dups
    seq = draw(st.permutations(seq))
    cuts = sorted(draw(st.lists(st.integers(0, len(seq)), max_size=3)))
    batches, last = [], 0
    for c in cuts + [len(seq)]:
        batches.append(seq[last:c])
        last = c
    return batches


def _replica(root: Path, i: int, horizon) -> Node:
    node, _ = Node.init(root / f"r{i}", manifest(SITES, tables=TABLES))
    if horizon is not None:
        node.raise_horizon(T, horizon)
    return node


def _run(data, horizon=None, replicas=3):
    events = data.draw(histories())
    with tempfile.TemporaryDirectory() as d:
        nodes = [_replica(Path(d), i, horizon) for i in range(replicas)]
        try:
            for node in nodes:
                for batch in data.draw(deliveries(events)):
                    node.apply_batch(batch, NOW + 10)
            dumps = [n.dump() for n in nodes]
            logs = [sorted(e["event_id"] for e in n.log_entries()) for n in nodes]
        finally:
            for n in nodes:
                n.close()
    for a, b in itertools.combinations(range(replicas), 2):
        assert dumps[a] == dumps[b]
        assert logs[a] == logs[b]
    return dumps


@settings(max_examples=sample(20, 60), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_replicas_converge_whatever_the_delivery_order(data):
    _run(data)


@settings(max_examples=sample(15, 45), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_replicas_with_equal_nonzero_horizons_converge(data):
    # The horizon sits inside the drawn HLC range, so some events fall below it on every replica.
    _run(data, horizon=(NOW + 2, 0))
