"""HLC: order, tick/observe, and durability across restarts, wall-clock jumps and restores."""
from __future__ import annotations

import shutil

import pytest

from agent.core.clock import CEILING_WINDOW_MS, ClockError, Hlc, beyond_skew
from agent.node import Node

from .helpers import NOW, T, make_node, peers


def test_tick_is_strictly_monotonic_even_when_wall_clock_goes_back():
    c = Hlc(ceiling_ms=NOW + 10**6)
    seen = [c.tick(NOW), c.tick(NOW), c.tick(NOW - 5000), c.tick(NOW + 1)]
    assert seen == sorted(seen) and len(set(seen)) == 4
    assert seen[2] == (NOW, 2)


def test_observe_then_tick_is_above_remote():
    c = Hlc(ceiling_ms=NOW + 10**6)
    c.observe((NOW + 50, 7), NOW)
    assert c.tick(NOW) == (NOW + 50, 8)


def test_tick_refuses_to_pass_the_durable_ceiling():
    c = Hlc(ceiling_ms=NOW)
    assert c.needs_ceiling(NOW + 1) == NOW + 1 + CEILING_WINDOW_MS
    with pytest.raises(ClockError):
        c.tick(NOW + 1)


def test_resume_starts_above_the_ceiling():
    c = Hlc.resume(NOW, None)  # an earlier run may have issued (NOW, anything)
    assert c.current() == (NOW + 1, 0)
    c.set_ceiling(NOW + 10)
    assert c.tick(NOW - 10) == (NOW + 1, 1)


def test_skew_bound():
    assert not beyond_skew(NOW + 300_000, NOW)
    assert beyond_skew(NOW + 300_001, NOW)


def _own_hlcs(node):
    return [tuple(map(int, e["hlc"].split("."))) for e in node.log_entries() if e["site_id"] == node.site_id.hex()]


def test_restart_with_wall_clock_moved_back_issues_no_old_hlc(tmp_path):
    node = make_node(tmp_path / "n", peers(1))
    for i in range(5):
        node.write(T, {"device": "d", "seq": i}, {"temp": 1.0}, now=NOW)
    before = _own_hlcs(node)
    node.close()
    node = Node.open(tmp_path / "n")
    node.write(T, {"device": "d", "seq": 9}, {"temp": 2.0}, now=NOW - 3_600_000)  # clock an hour back
    after = _own_hlcs(node)
    node.close()
    assert after[-1] > max(before)
    assert len(set(after)) == len(after)


def test_restore_of_older_state_directory_issues_no_old_hlc(tmp_path):
    home = tmp_path / "n"
    node = make_node(home, peers(1))
    node.write(T, {"device": "d", "seq": 0}, {"temp": 1.0}, now=NOW)
    node.close()
    shutil.copytree(home, tmp_path / "backup")
    node = Node.open(home)
    # Run ahead of the wall clock (an observed peer clock), well past the first ceiling.
    for i in range(1, 4):
        node.write(T, {"device": "d", "seq": i}, {"temp": 1.0}, now=NOW + i * 2 * CEILING_WINDOW_MS)
    released = _own_hlcs(node)
    node.close()
    shutil.rmtree(home)
    shutil.copytree(tmp_path / "backup", home)  # the state directory restored from the older copy
    node = Node.open(home)
    node.write(T, {"device": "d", "seq": 7}, {"temp": 1.0}, now=NOW)  # wall clock back at NOW too
    new = _own_hlcs(node)[-1]
    node.close()
    assert new > max(released), (new, max(released))


def test_many_restarts_do_not_run_the_clock_ahead(tmp_path):
    home = tmp_path / "n"
    make_node(home, peers(1)).close()
    for i in range(5):
        node = Node.open(home)
        node.write(T, {"device": "d", "seq": i}, {"temp": 1.0}, now=NOW)
        node.close()
    node = Node.open(home)
    hlcs = _own_hlcs(node)
    node.close()
    assert len(set(hlcs)) == 5 and hlcs == sorted(hlcs)
    assert hlcs[-1][0] == NOW  # resumed exactly above the journal, not a window ahead per restart
