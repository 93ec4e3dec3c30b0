"""The pure first-Commit-wins core (SOVM §22.5-§22.6), agent/sequencer/core.py."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from agent.sequencer import core
from agent.sequencer.framing import CT_COMMIT, CT_PROPOSAL, Framing

G = b"\x11" * 16


def commit(epoch, gid=G, ct=CT_COMMIT):
    return Framing(1, 2, gid, epoch, ct)


def test_registration_then_first_commit_wins_and_the_loser_gets_the_head():
    s = core.register(None, G, 5)
    a = core.decide(s, commit(5), b"A" * 32)
    assert isinstance(a, core.Accept) and a.previous_receipt_hash is None and not a.bootstrap
    s = core.accepted(s, a, b"r5" * 16)
    b = core.decide(s, commit(5), b"B" * 32)
    assert isinstance(b, core.Reject) and b.reason == core.STALE_EPOCH
    assert (b.current_epoch, b.head) == (6, core.Head(5, b"r5" * 16))
    c = core.decide(s, commit(6), b"C" * 32)
    assert isinstance(c, core.Accept) and c.previous_receipt_hash == b"r5" * 16


def test_register_twice_refused():
    s = core.register(None, G, 0)
    with pytest.raises(ValueError):
        core.register(s, G, 0)


def test_future_and_non_commit_rejected_with_current_state():
    s = core.register(None, G, 3)
    f = core.decide(s, commit(4), b"x" * 32)
    assert isinstance(f, core.Reject) and f.reason == core.FUTURE_EPOCH and f.current_epoch == 3
    p = core.decide(s, commit(3, ct=CT_PROPOSAL), b"x" * 32)
    assert isinstance(p, core.Reject) and p.reason == core.NOT_COMMIT
    u = core.decide(None, commit(3, ct=CT_PROPOSAL), b"x" * 32)
    assert isinstance(u, core.Reject) and u.current_epoch is None


def test_first_commit_observed_initialises_an_unknown_group():
    a = core.decide(None, commit(42), b"A" * 32)
    assert isinstance(a, core.Accept) and a.bootstrap and a.epoch == 42 and a.previous_receipt_hash is None
    s = core.accepted(None, a, b"h" * 32)
    assert (s.current_epoch, s.origin) == (43, "bootstrap")


def test_receipt_absent_advances_records_and_chains_across_the_gap():
    s = core.accepted(core.register(None, G, 0), core.Accept(G, 0, b"c" * 32, None), b"h0" * 16)
    s = core.receipt_absent(s, 1)
    assert s.current_epoch == 2 and s.discontinuities == (1,) and s.head == core.Head(0, b"h0" * 16)
    a = core.decide(s, commit(2), b"d" * 32)
    assert isinstance(a, core.Accept) and a.previous_receipt_hash == b"h0" * 16


def test_failed_closed_group_accepts_nothing():
    from dataclasses import replace
    s = replace(core.register(None, G, 0), failed_closed=True)
    r = core.decide(s, commit(0), b"c" * 32)
    assert isinstance(r, core.Reject) and r.reason == core.FAILED_CLOSED


def test_a_held_group_accepts_nothing_known_or_not():
    """§22.5 cl. 2: a group members' evidence showed behind what was released is not served, at
    its epoch or any other, and an unknown held group is not bootstrapped by its first Commit."""
    s = core.register(None, G, 3)
    for e in (2, 3, 4):
        r = core.decide(s, commit(e), b"c" * 32, held=True)
        assert isinstance(r, core.Reject) and r.reason == core.STATE_BEHIND and r.current_epoch == 3
    r = core.decide(None, commit(7), b"c" * 32, held=True)
    assert isinstance(r, core.Reject) and r.reason == core.STATE_BEHIND and r.current_epoch is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 6)), max_size=60))
def test_property_at_most_one_accept_per_group_epoch(submissions):
    """Any interleaving of Commits over a few groups: one acceptance per (group, epoch), epochs
    accepted contiguously from the first, each chained to the previous receipt."""
    states: dict = {}
    won: dict = {}
    for n, (g, e) in enumerate(submissions):
        gid = bytes([g + 1]) * 4
        d = core.decide(states.get(gid), commit(e, gid), n.to_bytes(32, "big"))
        if isinstance(d, core.Accept):
            assert (gid, e) not in won
            prev = won.get((gid, e - 1))
            assert d.previous_receipt_hash == (None if prev is None else prev)
            won[(gid, e)] = n.to_bytes(32, "big")
            states[gid] = core.accepted(states.get(gid), d, won[(gid, e)])
