"""agent/core/sending.py, the sender's pure decisions: body splitting and the per-peer body
limit after too_large refusals (provisional, probed back up)."""
from __future__ import annotations

from agent.core.sending import MIN_BODY_LIMIT, PeerLimit, split_sizes


def test_split_sizes_keeps_each_body_within_the_limit_and_the_event_count():
    sizes = [300] * 40
    parts = split_sizes(sizes, 200, 4096, 1000)
    assert parts[0][0] == 0 and parts[-1][1] == 40
    assert all(a < b for a, b in parts) and all(p[1] == q[0] for p, q in zip(parts, parts[1:]))
    assert all(200 + 8 + sum(s + 3 for s in sizes[a:b]) <= 4096 for a, b in parts)
    assert split_sizes(sizes, 200, 10**9, 7)[0] == (0, 7)


def test_peer_limit_halves_on_refusal_and_probes_back_up():
    pl = PeerLimit(limit=65536, probe_at=0.0, wait=30.0, floor_seen=65536)
    pl.refused(100.0, 3600.0)
    assert pl.limit == 32768 and pl.wait == 60.0 and pl.probe_at == 160.0
    assert pl.current(159.0, 65536) == 32768     # time is passed in: no clock read
    assert pl.current(160.0, 65536) == 65536     # the probe: doubled after the wait
    for _ in range(20):
        pl.refused(200.0, 3600.0)
    assert pl.limit == MIN_BODY_LIMIT and pl.wait == 3600.0  # floor, and the wait stops doubling
    pl.answered_ok(size=4096, probe_s=60.0)      # an ok above the lowest limit seen: evidence
    assert pl.wait == 60.0
