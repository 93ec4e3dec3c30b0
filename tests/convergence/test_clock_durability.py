"""A local HLC is above every HLC the node has applied or issued,
in the same process or after a restart, a crash or a restore of the home (§12 step 5, §13.5,
docs/protocol.md §0), and a local write never vanishes below a horizon."""
from __future__ import annotations

import shutil

import pytest

from agent.node import Node, NodeError

from ..core.helpers import NOW, T, make_node, peers


def _own_hlcs(node):
    return [tuple(map(int, e["hlc"].split("."))) for e in node.log_entries() if e["site_id"] == node.site_id.hex()]


def test_observed_hlc_survives_a_restart(tmp_path):
    """Item 1: a peer's event 60 s ahead (inside the skew bound) is applied by one process; the
    next process's write to the same row must carry a higher HLC and win LWW everywhere."""
    (b,) = peers(1)
    home = tmp_path / "a"
    node = make_node(home, [b])
    ahead = (NOW + 60_000, 0)
    out = node.apply_batch([b.event(T, {"device": "d", "seq": 1}, {"temp": 1.0}, ahead)], NOW)
    assert out[0].status == "applied"
    node.close()
    node = Node.open(home)  # a new CLI verb: a new process
    node.write(T, {"device": "d", "seq": 1}, {"temp": 2.0}, now=NOW + 1)
    mine = _own_hlcs(node)[-1]
    rows = node.dump()[T]
    node.close()
    assert mine > ahead, (mine, ahead)
    assert rows[0]["values"]["temp"] == 2.0  # the causally later local edit wins


def test_observed_hlc_survives_eviction_of_the_observed_event(tmp_path):
    """The observed high-water mark is kept even when the event that carried it is evicted."""
    (b,) = peers(1)
    home = tmp_path / "a"
    node = make_node(home, [b])
    ahead = (NOW + 60_000, 5)
    node.apply_batch([b.event(T, {"device": "d", "seq": 1}, {"temp": 1.0}, ahead)], NOW)
    node.evict_table(T, (NOW + 60_001, 0))  # everything up to it evicted (horizon at the clock)
    node.close()
    node = Node.open(home)
    node.write(T, {"device": "d", "seq": 2}, {"temp": 2.0}, now=NOW + 2)
    mine = _own_hlcs(node)[-1]
    node.close()
    assert mine > (NOW + 60_001, 0)


def test_restore_from_a_copy_inside_one_ceiling_window_reissues_nothing(tmp_path):
    """Item 2: a copy of the home taken seconds before (inside one ceiling window) is restored;
    no HLC released after the copy may be issued again, whatever the wall clock says."""
    home = tmp_path / "n"
    node = make_node(home, peers(1))
    node.write(T, {"device": "d", "seq": 0}, {"temp": 1.0}, now=NOW)
    node.close()
    shutil.copytree(home, tmp_path / "copy")
    node = Node.open(home)
    for i in range(1, 6):  # same millisecond: logical counters after the copy
        node.write(T, {"device": "d", "seq": i}, {"temp": 1.0}, now=NOW)
    released = set(_own_hlcs(node))
    node.close()
    shutil.rmtree(home)
    shutil.copytree(tmp_path / "copy", home)
    node = Node.open(home)
    for i in range(10, 16):
        node.write(T, {"device": "d", "seq": i}, {"temp": 2.0}, now=NOW)
    new = _own_hlcs(node)
    node.close()
    after_restore = [h for h in new if h not in {(NOW, 0)}]
    assert not (set(after_restore) & released), sorted(set(after_restore) & released)
    assert min(after_restore) > max(released)


def test_restore_with_the_witness_ahead_of_the_journal_after_a_crash(tmp_path):
    """Restored copy plus a wall clock that went back: the witness outside the home bounds it."""
    home = tmp_path / "n"
    node = make_node(home, peers(1))
    node.write(T, {"device": "d", "seq": 0}, {"temp": 1.0}, now=NOW)
    node.close()
    shutil.copytree(home, tmp_path / "copy")
    node = Node.open(home)
    node.write(T, {"device": "d", "seq": 1}, {"temp": 1.0}, now=NOW + 3_000)
    released = max(_own_hlcs(node))
    node.close()
    shutil.rmtree(home)
    shutil.copytree(tmp_path / "copy", home)
    node = Node.open(home)
    node.write(T, {"device": "d", "seq": 2}, {"temp": 1.0}, now=NOW + 1)
    new = _own_hlcs(node)[-1]
    node.close()
    assert new > released


@pytest.mark.parametrize("writes", [True, False])
def test_frequent_restarts_do_not_drag_the_clock_ahead(tmp_path, writes):
    """A CLI write every second (or a crash loop of opens) keeps the clock at the wall clock."""
    home = tmp_path / "n"
    make_node(home, peers(1)).close()
    for i in range(60):
        node = Node.open(home)
        if writes:
            node.write(T, {"device": "d", "seq": i}, {"temp": 1.0}, now=NOW + i * 1000)
        node.close()
    node = Node.open(home)
    node.write(T, {"device": "d", "seq": 999}, {"temp": 1.0}, now=NOW + 60_000)
    last = _own_hlcs(node)[-1]
    node.close()
    assert last[0] <= NOW + 60_000 + 100, last  # no drift towards the 300 s skew bound


def test_horizon_above_the_clock_is_refused(tmp_path):
    """Item 6: a horizon above the node's clock would swallow every later local write."""
    home = tmp_path / "n"
    node = make_node(home, peers(1))
    node.write(T, {"device": "d", "seq": 0}, {"temp": 1.0}, now=NOW)
    with pytest.raises(NodeError):
        node.evict_table(T, (NOW + 10 * 86_400_000, 0), now=NOW)
    node.close()


def test_a_local_write_is_in_the_log_or_fails(tmp_path):
    """Item 6: a write that does not land in the log never reports success."""
    home = tmp_path / "n"
    node = make_node(home, peers(1))
    node.evict_table(T, (NOW, 0), now=NOW)
    node.close()
    node = Node.open(home)
    eid = node.write(T, {"device": "d", "seq": 1}, {"temp": 1.0}, now=NOW - 3_600_000)  # wall clock went back
    ids = {e["event_id"] for e in node.log_entries()}
    node.close()
    assert eid.hex() in ids
