"""Nodes syncing through a real mosquitto: convergence, an offline node catching up, a broker
SIGKILLed mid-sync, realtime pushes and their absence without the capability."""
from __future__ import annotations

import time

from .helpers import event_ids, make_nodes, pulls_answered, runner, step_until, write


def _close(rs, nodes):
    for r in rs:
        r.close()
    for n in nodes:
        n.close()


def test_three_nodes_converge(broker, tmp_path):
    nodes = make_nodes(tmp_path, 3)
    rs = [runner(n, broker) for n in nodes]
    try:
        for k, n in enumerate(nodes):
            for i in range(20):
                write(n, i, device=f"dev{k}")
            write(n, 1000, device="shared")  # the same row written on every node: merge decides
        all_ids = set().union(*(event_ids(n) for n in nodes))
        assert len(all_ids) == 63
        assert step_until(rs, lambda: all(event_ids(n) == all_ids for n in nodes))
        dumps = [n.dump() for n in nodes]
        assert dumps[0] == dumps[1] == dumps[2]
        assert len(dumps[0]["app.readings"]) == 61
    finally:
        _close(rs, nodes)


def test_offline_node_catches_up(broker, tmp_path):
    a, b, c = nodes = make_nodes(tmp_path, 3)
    ra, rb, rc = runner(a, broker), runner(b, broker), runner(c, broker)
    try:
        write(a, 0)
        assert step_until([ra, rb, rc], lambda: len(event_ids(c)) == 1)
        rc.close()  # c goes offline; its session and mailbox stay on the broker
        for i in range(1, 40):
            write(a, i, "a")
            write(b, i, "b")
        want = event_ids(a) | event_ids(b)
        assert step_until([ra, rb], lambda: event_ids(a) == event_ids(b) == want)
        assert not (want <= event_ids(c))
        rc = runner(c, broker)
        assert step_until([ra, rb, rc], lambda: event_ids(c) == want, 30)
        assert a.dump() == b.dump() == c.dump()
        assert rc.stats["applied"] >= 78
        # every cursor toward c ended where c answered: nothing left behind
        assert step_until([ra, rb, rc], lambda: ra.sync.backlog(c.site_id) == 0 and rb.sync.backlog(c.site_id) == 0)
    finally:
        _close([ra, rb, rc], nodes)


def test_broker_sigkill_mid_sync(broker, tmp_path):
    a, b, c = nodes = make_nodes(tmp_path, 3)
    rs = [runner(n, broker, max_events=50, window=2) for n in nodes]
    answered: dict = {}
    # Record, for every cursor advance, that an answer for that range had arrived.
    for r in rs:
        orig = r.sync.advance

        def spy(peer, start, seqs, end, processed, token=None, rejected=None, _o=orig, _r=r):
            before = _r.sync.cursor(peer)
            moved = _o(peer, start, seqs, end, processed, token=token, rejected=rejected)
            after = _r.sync.cursor(peer)
            answered.setdefault((_r.node.site_id, peer), []).append((before, after, start, end, processed, len(seqs)))
            return moved
        r.sync.advance = spy
    try:
        for i in range(300):
            write(a, i, "a")
        for i in range(200):
            write(b, i, "b")
        for r in rs:
            r.step(0.01)
        broker.kill()  # queued bodies and answers are lost
        for i in range(300, 400):
            write(a, i, "a")  # the nodes keep producing while the broker is down
        write(c, 0, "c")
        time.sleep(0.5)
        for r in rs:
            r.step(0.01)
        broker.start()
        want = event_ids(a) | event_ids(b) | event_ids(c)
        assert step_until(rs, lambda: all(event_ids(n) == want for n in nodes), 60)
        assert a.dump() == b.dump() == c.dump()
        # cursors never advanced past what a peer answered for (an answer to a body sent again
        # after a loss may come after the cursor passed it: it moves nothing)
        for (_me, _peer), moves in answered.items():
            for before, after, start, end, processed, n in moves:
                assert after == before or (start <= before and after <= end)
        for r in rs:
            for p in r.sync.peers():
                assert r.sync.cursor(p) <= r.node.conn.execute("SELECT max(seq) FROM events").fetchone()[0]
    finally:
        _close(rs, nodes)


def test_realtime_push_without_waiting_for_batch(broker, tmp_path):
    a, b = nodes = make_nodes(tmp_path, 2)
    ra, rb = runner(a, broker, cadence_s=3600), runner(b, broker, cadence_s=3600)
    try:
        assert step_until([ra, rb], lambda: b.site_id in ra.caps and a.site_id in rb.caps, 5)
        assert step_until([ra, rb], lambda: pulls_answered([ra, rb]), 30)
        for r in (ra, rb):
            r.step(0.01)  # the first batch cycle runs at start; the next one is an hour away
        eid = write(a, 1, "rt")
        assert step_until([ra, rb], lambda: eid in event_ids(b), 5)
        # pushed, not carried by a batch cycle (the next one is an hour away), however long it took
        assert ra.stats["pushed_rt"] >= 1 and ra.stats["batch_cycles"] == 1
        # answered like any push: the durable cursor advanced
        assert step_until([ra, rb], lambda: ra.sync.backlog(b.site_id) == 0, 5)
    finally:
        _close([ra, rb], nodes)


def test_no_unsolicited_push_without_capability(broker, tmp_path):
    a, b, c = nodes = make_nodes(tmp_path, 3)
    ra = runner(a, broker, cadence_s=3600)
    rb = runner(b, broker, cadence_s=3600, realtime=False)  # b advertises supports_realtime: false
    rc = runner(c, broker, cadence_s=3600)
    try:
        assert step_until([ra, rb, rc], lambda: {b.site_id, c.site_id} <= set(ra.caps), 5)
        assert step_until([ra, rb, rc], lambda: pulls_answered([ra, rb, rc]), 30)
        assert ra.caps[b.site_id].supports_realtime is False
        eid = write(a, 1, "x")
        assert step_until([ra, rb, rc], lambda: eid in event_ids(c), 5)  # c has realtime: pushed
        t_end = time.monotonic() + 1.5
        while time.monotonic() < t_end:
            for r in (ra, rb, rc):
                r.step(0.01)
        assert eid not in event_ids(b)  # b waits for the batch cycle
        assert rb.stats["bodies_received"] == 0
        # b (realtime off) pushes nothing unsolicited either
        eid2 = write(b, 2, "y")
        t_end = time.monotonic() + 1.0
        while time.monotonic() < t_end:
            for r in (ra, rb, rc):
                r.step(0.01)
        assert rb.stats["pushed_rt"] == 0 and eid2 not in event_ids(a)
        # the batch cycle still delivers
        ra.batch_cycle(); rb.batch_cycle()
        assert step_until([ra, rb, rc], lambda: eid in event_ids(b) and eid2 in event_ids(a), 10)
    finally:
        _close([ra, rb, rc], nodes)
