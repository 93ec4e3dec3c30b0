"""Replays of convergence failures the Histories state machine found, as plain steps
(so they run on every test run, whatever Hypothesis' example database holds)."""
from __future__ import annotations

from .test_histories import Histories


def test_restore_after_eviction_loses_own_events():
    """Falsifying example of 2026-12-03 ("node 1 differs from node 0 after quiescence"). Node 1 is
    restored from a copy holding one own event (a CLI write); since the copy it signed a delete of
    {device b, seq 3} at the same HLC as node 0's CLI write of that row, and eviction removed the
    old own event, so it held one own event again. The restored node never gets its delete back
    (§32.1 drops own events; docs/apply.md "A restored home asks for what it lost"), so it must be
    left out of the final agreement: counting its own events missed that, comparing the events
    signed since the copy does not. Nodes 0 and 2 must still agree."""
    state = Histories()
    state.setup(limit=2, n=3)
    try:
        for step in STEPS:
            step(state)
            state.watermarks_claim_only_what_is_held()
        assert 1 in state.lost_own, "node 1 lost its own delete to the restore"
    except BaseException:
        state.teardown()
        raise
    state.teardown()


STEPS = [
    lambda s: s.clock_jump(i=0, jump=0),
    lambda s: s.evict_everywhere(back=1789),
    lambda s: s.snapshot(i=4),
    lambda s: s.exchange(cut=47, drop=0.0, dup=0.3, i=4, j=0, reorder=0.0, seed=1),
    lambda s: s.write(delete=False, dev='a', i=3, notes=False, seq=3, v=2.9617488882827264e+16),
    lambda s: s.cli_write(dev='b', i=4, seq=0, v=-2),
    lambda s: s.vouch_outsider(),
    lambda s: s.clock_jump(i=3, jump=90000),
    lambda s: s.snapshot(i=4),
    lambda s: s.snapshot(i=1),
    lambda s: s.evict_everywhere(back=1479),
    lambda s: s.evict_everywhere(back=1032),
    lambda s: s.retire_outsider(back=38),
    lambda s: s.write(delete=False, dev='a', i=2, notes=False, seq=2, v=None),
    lambda s: s.restore(k=1),
    lambda s: s.snapshot(i=0),
    lambda s: s.write(delete=True, dev='b', i=3, notes=True, seq=3, v=6.971299286587802e+16),
    lambda s: s.exchange(cut=173, drop=0.0, dup=0.3, i=3, j=4, reorder=0.5, seed=32781),
    lambda s: s.write(delete=True, dev='b', i=4, notes=False, seq=3, v=None),
    lambda s: s.write(delete=True, dev='b', i=2, notes=True, seq=3, v=None),
    lambda s: s.cli_write(dev='b', i=0, seq=3, v=1),
    lambda s: s.exchange(cut=105, drop=0.0, dup=0.3, i=3, j=4, reorder=0.0, seed=532),
    lambda s: s.evict_everywhere(back=76),
    lambda s: s.restore(k=1),
    lambda s: s.snapshot(i=3),
    lambda s: s.clock_jump(i=1, jump=0),
    lambda s: s.restore(k=0),
    lambda s: s.outsider_event(i=2, seq=3, v=-3),
    lambda s: s.cli_write(dev='b', i=0, seq=2, v=-5),
]
