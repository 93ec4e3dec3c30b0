"""The member's Commit queue costs the same however long its history (docs/sequencer.md "Member
side: the Commit queue", "Cost"): settled Commits, their receipts, the heads heard and what was
gossiped are kept for good (the member's evidence, §22.6), so nothing run on every pump step may
read them all.

Work is counted, not timed: SQLite's progress handler called on every virtual-machine instruction
(``set_progress_handler(..., 1)``) counts the instructions one call runs on the queue's own
connection. A scan of a table runs a few instructions per row; an index seek runs one whatever
the table's size. Each call is measured on two queues that differ only in history (settled
Commits, heads kept, all of it already gossiped): the same count on both, within a few
instructions, or the call grows with history.
"""
from __future__ import annotations

import pytest

from agent.sequencer import client, commit_queue, receipts, serve
from agent.sequencer.framing import encode_private_message

GROUPS = [bytes([0x40 + i]) * 16 for i in range(4)]
SMALL, BIG = 40, 400          # settled Commits of history
SLACK = 8                     # instructions: what a B-tree's depth may add, never a per-row cost


def _commit(gid: bytes, epoch: int, tag: bytes) -> bytes:
    return encode_private_message(gid, epoch, ciphertext=tag * 4)


def queue_with_history(path, settled: int) -> commit_queue.CommitQueue:
    """``settled`` Commits accepted across GROUPS, each receipt also kept as the group's head and
    handed to gossip; then one Commit outstanding in each of the first two groups."""
    q = commit_queue.CommitQueue(path)
    q.store.conn.execute("PRAGMA synchronous=OFF")      # building history fast; the counts are the point
    for i in range(settled):
        g, epoch = GROUPS[i % len(GROUPS)], i // len(GROUPS)
        e = q.enqueue(_commit(g, epoch, b"h%d" % i))
        raw = b"\xd2receipt %d" % i
        assert q.settle(e.commit_hash, commit_queue.ACCEPTED, None, raw)
        q.keep_head(g, epoch, raw)
    q.mark_gossiped(q.ungossiped())
    top = settled // len(GROUPS) + 1
    for g in GROUPS[:2]:
        q.enqueue(_commit(g, top, b"out"))
    assert q.ungossiped() == [] and len(q.outstanding()) == 2
    return q


def count_instructions(conn, call) -> int:
    """SQLite virtual-machine instructions ``call()`` runs on ``conn`` (the progress handler)."""
    n = [0]

    def step() -> int:
        n[0] += 1
        return 0
    conn.set_progress_handler(step, 1)
    try:
        call()
    finally:
        conn.set_progress_handler(None, 1)
    return n[0]


def instructions(q: commit_queue.CommitQueue, call) -> int:
    return count_instructions(q.store.conn, call)


@pytest.fixture
def queues(tmp_path):
    small, big = queue_with_history(tmp_path / "small.db", SMALL), queue_with_history(tmp_path / "big.db", BIG)
    yield small, big
    small.close()
    big.close()


def _enqueue_next(q: commit_queue.CommitQueue) -> None:
    q.enqueue(_commit(GROUPS[3], 10_000, b"new"))


CALLS = {
    # every pump step while connected: the groups to follow (defect: SELECT DISTINCT over commits)
    "groups": lambda q: q.groups(),
    # every pump step while connected: what is queued, in queue order. Version 1 sorted the queued
    # rows in a temporary B-tree, but found them through the partial index one_outstanding (at most
    # one a group): flat already. The index commits_in_order that enqueue needs made SQLite walk
    # every Commit in order instead (1635 instructions at 400): hence queued_in_order (partial)
    "outstanding": lambda q: q.outstanding(),
    # `commits queue` (defect: max(queued_seq) without an index)
    "enqueue": _enqueue_next,
    # GossipFeeder.flush after every pump step (defect: every commit, head, statement and gossiped row)
    "ungossiped": lambda q: q.ungossiped(),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_a_call_of_every_pump_step_does_not_grow_with_the_queues_history(queues, name):
    small, big = queues
    cost = [instructions(q, lambda q=q: CALLS[name](q)) for q in (small, big)]
    assert cost[1] <= cost[0] + SLACK, \
        f"{name}: {cost[0]} SQLite instructions with {SMALL} settled Commits, {cost[1]} with {BIG}"


def test_a_pump_step_while_connected_does_not_grow_with_the_queues_history(queues):
    """The whole step `commits run` repeats (CommitClient.pump, then GossipFeeder.flush's read),
    connected, with nothing new to send or handle."""
    small, big = queues
    cost = []
    for q in (small, big):
        c = client.CommitClient(q, serve.BrokerSettings.from_url("mqtt://127.0.0.1:1"))
        c.connected.set()                     # never connected: what it publishes stays in paho's queue
        c.pump(wait=0)                        # the first step subscribes and submits the queued Commits
        c._recheck_at = float("inf")          # the 2 s recheck of held receipts is not the step measured

        def step(c=c, q=q) -> None:
            c.pump(wait=0)
            q.ungossiped()
        cost.append(instructions(q, step))
        c.client.loop_stop()
    assert cost[1] <= cost[0] + SLACK, f"{cost[0]} SQLite instructions with {SMALL} settled Commits, {cost[1]} with {BIG}"


def test_the_gossip_outbox_still_hands_over_each_receipt_once(tmp_path):
    """What the incremental read must keep: a receipt held twice (a Commit's outcome that is also
    the group's head) is handed over once; one already handed over is not handed over again when it
    is heard again; a statement is handed over too."""
    q = commit_queue.CommitQueue(tmp_path / "q.db")
    try:
        g = GROUPS[0]
        e = q.enqueue(_commit(g, 0, b"a"))
        raw = b"\xd2receipt a"
        q.settle(e.commit_hash, commit_queue.ACCEPTED, None, raw)
        q.keep_head(g, 0, raw)
        assert q.ungossiped() == [raw]
        q.mark_gossiped([raw])
        assert q.ungossiped() == []
        q.keep_head(g, 0, raw)                               # heard again
        q.keep_head(g, 1, b"\xd2receipt b")
        q.keep_statement(g, 2, b"\xd2statement 2")
        assert q.ungossiped() == [b"\xd2receipt b", b"\xd2statement 2"]
        q.mark_gossiped([b"\xd2receipt b"])
        assert q.ungossiped() == [b"\xd2statement 2"]
        assert receipts.receipt_hash(raw)                    # the key gossip marks by
    finally:
        q.close()
