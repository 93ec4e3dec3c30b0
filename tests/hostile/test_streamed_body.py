"""The streamed body parse (a mailbox import reads the events from the body's
bytes as they apply) is the whole-body parse: on generated, mutated and random bodies it returns
the same body (the same events, in order) or refuses with the same reason."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from agent.core.messages import BodyEvents, ProtocolError, parse_body, parse_body_streamed

from . import strategies as S

pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")


def _outcome(parse, data):
    try:
        b = parse(data)
    except ProtocolError as e:
        return ("refused", e.reason)
    return ("body", b.from_site_id, b.have_max_hlc, list(b.events), b.records, b.applied_watermarks)


@settings(max_examples=600, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(S.hostile(S.body_bytes()))
def test_streamed_parse_is_the_whole_body_parse(data):
    assert _outcome(parse_body_streamed, data) == _outcome(parse_body, data)


def test_streamed_events_are_read_from_the_bytes_in_windows():
    from agent.simpeer import SimPeer
    p = SimPeer(S.MESH)
    evs = [p.event("app.readings", {"device": "d", "seq": i}, {"note": "x" * (i * 40)}, (1, i)) for i in range(40)]
    body = parse_body_streamed(p.body(evs))
    assert isinstance(body.events, BodyEvents) and len(body.events) == 40
    assert list(body.events) == evs
    windows = list(body.events.windows(4000))
    assert [e for w in windows for e in w] == evs
    assert all(sum(map(len, w)) <= 4000 or len(w) == 1 for w in windows) and len(windows) > 1
