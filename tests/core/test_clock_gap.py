"""The HLC inside a gap a wrong clock left (core/clock.py `resume_in_gap`, `jump`): it issues
strictly above everything issued in the gap, never inside [top, spent], and leaves the gap above
`spent` once real time or a peer's HLC reaches its top."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from agent.core.clock import SKEW_BOUND_MS, Hlc

NOW = 1_790_000_000_000
TOP = (NOW + 10 * 365 * 86_400_000, 0)
SPENT = (TOP[0] + 5, 3)
BIG = 2**62


def test_a_jump_beyond_the_skew_bound_names_the_range_it_leaves():
    c = Hlc(physical_ms=NOW, logical=4, ceiling_ms=BIG)
    assert c.jump(NOW + SKEW_BOUND_MS) is None                      # within the bound: no range
    assert c.jump(TOP[0]) == ((NOW, 4), TOP)
    assert Hlc().jump(NOW) == ((0, 0), (NOW, 0))                     # a first tick: everything below it


def test_in_the_gap_ticks_follow_the_wall_clock_and_leave_above_spent():
    c = Hlc.resume_in_gap(BIG, (NOW, 7), TOP, SPENT)
    assert c.tick(NOW - 10) == (NOW, 8)                              # strictly above the start
    assert c.tick(NOW + 5) == (NOW + 5, 0)
    assert c.jump(NOW + 6) is None
    c.observe((TOP[0] + 1, 0), NOW + 6)                              # a peer's HLC reached the top
    assert c.tick(NOW + 6) == (SPENT[0], SPENT[1] + 1) and c.gap_top is None
    d = Hlc.resume_in_gap(BIG, (NOW, 0), TOP, SPENT)
    assert d.tick(TOP[0] + 2) == (SPENT[0], SPENT[1] + 1)            # real time reached the top
    # leaving the gap is a jump above `spent` only, never a range that holds [top, spent]
    e = Hlc.resume_in_gap(BIG, (NOW, 0), TOP, SPENT)
    assert e.jump(TOP[0] + SKEW_BOUND_MS + 10) == (SPENT, (TOP[0] + SKEW_BOUND_MS + 10, 0))


def test_a_used_up_gap_resumes_above_spent():
    c = Hlc.resume_in_gap(BIG, TOP, TOP, SPENT)
    assert c.gap_top is None and c.current() == SPENT


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["tick", "observe"]), st.integers(-10_000, 10 * 365 * 86_400_000 + 50)),
                max_size=40))
def test_no_value_in_top_to_spent_and_strictly_increasing(ops):
    c = Hlc.resume_in_gap(BIG, (NOW, 0), TOP, SPENT)
    issued = []
    for op, dt in ops:
        if op == "tick":
            issued.append(c.tick(NOW + dt))
        else:
            c.observe((NOW + dt, 0), NOW)
    assert issued == sorted(issued) and len(set(issued)) == len(issued)
    assert not any(TOP <= v <= SPENT for v in issued)
