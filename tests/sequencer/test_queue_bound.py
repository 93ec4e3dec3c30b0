"""A member's Commit queue on a small device running for months (docs/sequencer.md "Member side:
the Commit queue", "Cost", "Events: what is kept"): what it does while idle, and what it keeps of
its event log, must not grow with its history.

1. The recheck of held and attributed receipts (§22.6: a receipt signed by a sequencer not bound
   at that generation is rejected and *retained for attribution*; a link whose binding cannot be
   resolved is *held*). Both stay in ``unsettled``; attributed ones for good. Only a change of a
   group's binding records can change their verdicts, so a recheck while no binding changed reads
   none of them: the same SQLite instructions on the queue, and no receipt checked, with 40 or 400
   retained. A binding that arrives settles its group's held receipts (only that group's rows are
   read), and every attributed receipt stays kept and visible.
2. The ``events`` log (one row per outcome, per hand-over to gossip, ...) keeps a bounded tail,
   and never drops an attribution record (``receipt_attributed``) or a ``discontinuity``.
3. ``ssp-agent commits status`` (the real CLI on a real queue file) prints a bounded recent tail by
   default, ``--limit N`` or ``--all`` for more, in the same format.

Work is counted, not timed (as tests/sequencer/test_queue_cost.py): SQLite's progress handler
counts the virtual-machine instructions one call runs on the queue's connection, and the signer
look-ups (a read of the node's store and a signature check each) are counted by the test's signer.
"""
from __future__ import annotations

import json
import sqlite3

import pytest

from agent.sequencer import answers, client, commit_queue, receipts, serve
from tests.sequencer.test_commit_queue import agent
from tests.sequencer.test_member import RogueSequencer
from tests.sequencer.test_queue_cost import GROUPS, SLACK, _commit, instructions
from tests.waiting import HANG_S

SMALL, BIG = 40, 400            # retained unsettled receipts
G, H = GROUPS[0], GROUPS[1]     # G: held (its binding is not resolvable yet); H: attributed
S1, S2 = RogueSequencer(), RogueSequencer()   # S1 signs everything; H is bound to S2


class Bindings:
    """What the member node's binding records say, changeable by the test (a binding arriving),
    and how often they were consulted (each look-up reads the node's store in the CLI)."""

    def __init__(self) -> None:
        self.bound = {H: S2.kid}          # G: records exist, none resolves (held)
        self.lookups = 0

    def signer_for(self, gid: bytes, epoch: int) -> answers.Signer:
        self.lookups += 1
        if gid in self.bound:
            return answers.Signer(self.bound[gid])
        return answers.Signer(None, unresolved=True)

    def state(self, gid: bytes) -> bytes:
        return self.bound.get(gid, b"unresolved")


def queue_with_unsettled(path, n: int) -> commit_queue.CommitQueue:
    """``n`` receipts by S1 retained: half held for G, half attributed for H (S2 is bound there)."""
    q = commit_queue.CommitQueue(path)
    q.store.conn.execute("PRAGMA synchronous=OFF")      # building history fast; the counts are the point
    for i in range(n):
        gid = G if i % 2 == 0 else H
        raw = S1.sign(i, b"c%d" % i, None, gid=gid)
        r = receipts.verify_receipt(raw)
        assert q.keep_unsettled(r, answers.HELD if gid == G else answers.ATTRIBUTED)
    q.enqueue(_commit(G, n + 1, b"out"))                 # one Commit outstanding (a pump has work)
    return q


def make_client(q: commit_queue.CommitQueue, b: Bindings) -> client.CommitClient:
    return client.CommitClient(q, serve.BrokerSettings.from_url("mqtt://127.0.0.1:1"),
                               signer_for=b.signer_for, binding_state=b.state)


@pytest.fixture
def two(tmp_path):
    qs = [queue_with_unsettled(tmp_path / f"q{n}.db", n) for n in (SMALL, BIG)]
    yield qs
    for q in qs:
        q.close()


def test_a_recheck_while_no_binding_changed_reads_no_retained_receipt(two):
    cost, lookups = [], []
    for q in two:
        b = Bindings()
        c = make_client(q, b)
        try:
            c.recheck()                     # the first looks (nothing known of what decided them)
            b.lookups = 0
            cost.append(instructions(q, c.recheck))
            lookups.append(b.lookups)
        finally:
            c.client.loop_stop()
        # nothing changed: every receipt still retained with its verdict
        got = q.unsettled()
        assert len(got) == len(two[0].unsettled()) * (len(got) // len(two[0].unsettled()))
        assert {v for _r, v in got} == {answers.HELD, answers.ATTRIBUTED}
    assert lookups == [0, 0], f"receipts checked again with no binding changed: {lookups}"
    assert cost[1] <= cost[0] + SLACK, \
        f"a recheck: {cost[0]} SQLite instructions with {SMALL} retained receipts, {cost[1]} with {BIG}"


def test_a_pump_step_with_the_recheck_due_does_not_grow_with_retained_receipts(two):
    """The whole step of `commits run` when the 2 s recheck falls due, connected, nothing new."""
    cost = []
    for q in two:
        b = Bindings()
        c = make_client(q, b)
        c.connected.set()
        try:
            c.pump(wait=0)                  # subscribes, submits, first recheck
            c._recheck_at = 0.0             # due again
            cost.append(instructions(q, lambda c=c: c.pump(wait=0)))
        finally:
            c.client.loop_stop()
    assert cost[1] <= cost[0] + SLACK, \
        f"a pump step: {cost[0]} SQLite instructions with {SMALL} retained receipts, {cost[1]} with {BIG}"


def test_a_binding_that_arrives_settles_its_groups_held_receipts_and_attributed_ones_stay(tmp_path):
    q = queue_with_unsettled(tmp_path / "q.db", 20)
    b = Bindings()
    c = make_client(q, b)
    try:
        c.recheck()
        assert len(q.unsettled()) == 20
        b.bound[G] = S1.kid                 # the binding for G arrives (through the node's records)
        b.lookups = 0
        c.recheck()
        # only G's ten held receipts were looked at again: settled, kept as heads
        assert b.lookups == 10
        left = q.unsettled()
        assert len(left) == 10 and {v for _r, v in left} == {answers.ATTRIBUTED}
        assert all(receipts.parse_receipt(r).group_id == H for r, _v in left)
        assert sorted(e for g, e, _r in q.heads() if g == G) == list(range(0, 20, 2))
        assert sum(e["kind"] == "receipt_settled" for e in q.events()) == 10
        # H's binding changes (a fork: nothing resolves there): its attributed receipts are held now
        del b.bound[H]
        b.lookups = 0
        c.recheck()
        assert b.lookups == 10 and {v for _r, v in q.unsettled()} == {answers.HELD}
    finally:
        c.client.loop_stop()
        q.close()


def test_a_recheck_after_a_restart_reads_nothing_when_no_binding_changed(tmp_path):
    """What decided the retained receipts is kept in the queue file: a `commits send` started
    again (every few minutes from a timer) does not check every retained receipt again."""
    q = queue_with_unsettled(tmp_path / "q.db", 20)
    b = Bindings()
    c = make_client(q, b)
    c.recheck()
    c.client.loop_stop()
    q.close()
    q = commit_queue.CommitQueue(tmp_path / "q.db")
    c = make_client(q, b)
    try:
        b.lookups = 0
        c.recheck()
        assert b.lookups == 0 and len(q.unsettled()) == 20
    finally:
        c.client.loop_stop()
        q.close()


# -- the event log ---------------------------------------------------------------------------------
KEEP = 50


def queue_with_outcomes(path, outcomes: int, keep: int | None = KEEP, attributed: int = 3) -> commit_queue.CommitQueue:
    """``outcomes`` Commits settled, each receipt handed to gossip (an event each), and
    ``attributed`` receipts from an unbound signer among them; a discontinuity heard."""
    q = commit_queue.CommitQueue(path, events_kept=keep)
    q.store.conn.execute("PRAGMA synchronous=OFF")
    for i in range(outcomes):
        g, epoch = GROUPS[i % len(GROUPS)], i // len(GROUPS)
        e = q.enqueue(_commit(g, epoch, b"h%d" % i))
        q.settle(e.commit_hash, commit_queue.ACCEPTED, None, b"\xd2receipt %d" % i)
        q.mark_gossiped(q.ungossiped())
        q.record_event("gossiped", {"receipts": 1, "via": "node"})
        if i % (outcomes // attributed) == 0 and i // (outcomes // attributed) < attributed:
            r = receipts.verify_receipt(S1.sign(epoch, b"x%d" % i, None, gid=g))
            q.keep_unsettled(r, answers.ATTRIBUTED)
        if i == 1:
            q.keep_gap(g, epoch)
            q.record_event("discontinuity", {"group": g.hex(), "epoch": epoch})
    return q


def events_rows(path) -> list[tuple[int, str]]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("SELECT seq, kind FROM events ORDER BY seq").fetchall()
    finally:
        conn.close()


def test_the_event_log_keeps_a_bounded_tail_and_every_attribution_record(tmp_path):
    path = tmp_path / "q.db"
    q = queue_with_outcomes(path, 600)
    try:
        last = q.events()[-1]["seq"]
    finally:
        q.close()
    rows = events_rows(path)
    kinds = [k for _s, k in rows]
    assert kinds.count("receipt_attributed") == 3 and kinds.count("discontinuity") == 1
    assert len(rows) <= KEEP + 4, f"{len(rows)} events kept after 600 outcomes (retention {KEEP})"
    # the tail is the most recent, without a hole
    routine = [s for s, k in rows if k not in ("receipt_attributed", "discontinuity")]
    assert routine[-1] == last and routine == list(range(routine[0], last + 1))[-len(routine):]
    assert len(routine) == KEEP
    # what the events told is still in the tables: every Commit, its receipt, the gap
    q = commit_queue.CommitQueue(path)
    try:
        assert len(q.entries()) == 600 and all(e.receipt for e in q.entries())
        assert len(q.gaps()) == 1
        assert [v for _r, v in q.unsettled()] == [answers.ATTRIBUTED] * 3
    finally:
        q.close()


def test_the_default_retention_bounds_the_log_too(tmp_path):
    path = tmp_path / "q.db"
    q = queue_with_outcomes(path, commit_queue.EVENTS_KEPT + 200, keep=None)
    q.close()
    assert len(events_rows(path)) <= commit_queue.EVENTS_KEPT + 4


def test_adding_an_event_does_not_grow_with_the_evidence_kept(tmp_path):
    """Pruning runs with every event: its cost must not grow with the attribution records it
    skips (they are never pruned)."""
    cost = []
    for n in (SMALL, BIG):
        q = commit_queue.CommitQueue(tmp_path / f"e{n}.db", events_kept=10)
        q.store.conn.execute("PRAGMA synchronous=OFF")
        try:
            for i in range(n):
                q.record_event("receipt_attributed", {"i": i})
                q.record_event("gossiped", {"i": i})
            cost.append(instructions(q, lambda q=q: q.record_event("gossiped", {"i": -1})))
        finally:
            q.close()
    assert cost[1] <= cost[0] + SLACK, f"adding an event: {cost[0]} instructions with {SMALL} kept, {cost[1]} with {BIG}"


# -- `commits status`, the real CLI ----------------------------------------------------------------
def test_commits_status_prints_a_bounded_recent_tail_and_more_on_request(tmp_path):
    home = tmp_path / "m"
    home.mkdir()
    q = queue_with_outcomes(home / "commit-queue.db", 300, keep=None)
    for i in range(120):                       # heads heard for one group, one an epoch
        q.keep_head(GROUPS[0], 1000 + i, b"\xd2head %d" % i)
    q.enqueue(_commit(GROUPS[1], 5000, b"queued"))
    every = q.events()
    entries = q.entries()
    q.close()

    def status(*args) -> tuple[dict, int]:
        p = agent(home, "commits", "status", *args, check=0)
        return json.loads(p.stdout), len(p.stdout)

    st, size = status()
    n = commit_queue.STATUS_TAIL
    assert [e["seq"] for e in st["events"]] == [e["seq"] for e in every[-n:]]
    assert st["events"][-1] == every[-1]                 # the same format, the latest last
    # every queued Commit, then the most recent settled ones, in queue order
    assert [c["commit_hash"] for c in st["commits"]] == [e.commit_hash.hex() for e in entries[-n:]]
    assert st["commits"][-1]["state"] == "queued"
    # each group's most recent heads
    assert [h["epoch"] for h in st["heads"]] == list(range(1120 - n, 1120))
    assert st["omitted"] == {"commits": len(entries) - n, "heads": 120 - n, "events": len(every) - n}
    assert len(st["unsettled"]) == 3                     # attribution records: all of them, always
    small, _ = status("--limit", "5")
    assert [e["seq"] for e in small["events"]] == [e["seq"] for e in every[-5:]]
    assert len(small["commits"]) == 5
    full, full_size = status("--all")
    assert full["events"] == every and len(full["commits"]) == len(entries)
    assert full["omitted"] == {"commits": 0, "heads": 0, "events": 0}
    assert size < full_size / 3, (size, full_size)
    # bounded: many more outcomes, the same default output size
    q = commit_queue.CommitQueue(home / "commit-queue.db")
    for i in range(200):
        e = q.enqueue(_commit(GROUPS[2], 9000 + i, b"more%d" % i))
        q.settle(e.commit_hash, commit_queue.ACCEPTED, None, b"\xd2receipt more %d" % i)
    q.close()
    later, later_size = status()
    # the queued Commit is older than the 50 most recent now, and still printed, first
    assert [len(later[k]) for k in ("commits", "heads", "events")] == [n + 1, n, n]
    assert later["commits"][0]["state"] == "queued" and later["omitted"]["commits"] == st["omitted"]["commits"] + 199
    assert later_size < 2 * size, (size, later_size)



# -- the binding state the CLI gives the recheck: the member node's binding records ----------------
def test_the_binding_state_of_a_node_changes_when_a_binding_arrives_and_only_for_its_group(tmp_path):
    """agent/sequencing.py binding_state, read from a real node's store (as `commits run` reads it,
    beside the node): unchanged while nothing about the group's bindings changes (receipts and
    other groups' bindings arriving included), changed when a binding for the group arrives."""
    from agent import sequencing
    from agent.node import Node
    from tests.sequencer.test_gossip import converge
    from tests.sync.helpers import NOW, mesh
    nodes = mesh(tmp_path, 3, authority=0)
    try:
        n0, n1, n2 = nodes
        path = n2.home / Node.STORE_FILE
        before_g, before_h = sequencing.binding_state(path, G), sequencing.binding_state(path, H)
        raw = S1.sign(0, b"c0", None, gid=G)
        assert sequencing.gossip(n1, raw, NOW)["verdict"] == "held"
        sequencing.bind(n0, H, S2.kid, 0, NOW)              # another group's binding
        t = converge(nodes, [(1, 2), (0, 2)], NOW)
        assert sequencing.binding_state(path, G) == before_g
        assert sequencing.binding_state(path, H) != before_h
        sequencing.bind(n0, G, S1.kid, 0, NOW)              # G's binding arrives
        converge(nodes, [(0, 2)], t + 1000)
        after = sequencing.binding_state(path, G)
        assert after != before_g and sequencing.bound_signer(path, G, 0) == (True, S1.kid)
        assert sequencing.binding_state(path, G) == after   # the same records, the same state
    finally:
        for n in nodes:
            n.close()


def test_the_binding_state_is_read_again_only_after_the_node_committed_something(tmp_path, monkeypatch):
    """sequencing.BindingStates, what `commits run` asks every 2 s per group with retained receipts:
    while the node's store is idle, one `data_version` question and no read of the binding records
    (their signature checks included); after a commit the records are read again, and a binding
    that arrived is seen. The read is counted by wrapping the real function (it still runs)."""
    from agent import sequencing
    from agent.node import Node
    from tests.sequencer.test_gossip import converge
    from tests.sync.helpers import NOW, mesh
    reads = []
    real = sequencing.binding_state

    def counted(path, gid):
        reads.append(gid)
        return real(path, gid)
    monkeypatch.setattr(sequencing, "binding_state", counted)
    nodes = mesh(tmp_path, 2, authority=0)
    states = sequencing.BindingStates(nodes[1].home / Node.STORE_FILE)
    try:
        n0, n1 = nodes
        first = states(G)
        for _ in range(5):
            assert states(G) == first and states(H) == states(H)
        assert reads == [G, H], reads                       # idle: each group read once, then never
        sequencing.bind(n0, G, S1.kid, 0, NOW)
        converge(nodes, [(0, 1)], NOW)                       # the binding arrives: committed to n1's store
        reads.clear()
        assert states(G) != first and reads == [G]
        assert states(G) == real(nodes[1].home / Node.STORE_FILE, G) and reads == [G]
    finally:
        states.close()
        for n in nodes:
            n.close()


def test_a_receipt_kept_under_other_bindings_than_its_group_was_last_looked_at_under_is_looked_at_again(tmp_path):
    """Two processes on one queue (`commits send` beside `commits run`): a receipt whose verdict
    was reached under binding state X, kept after the group was noted as looked at under Y, makes
    the next recheck look at the group again; one kept under Y does not."""
    q = queue_with_unsettled(tmp_path / "q.db", 6)
    b = Bindings()
    c = make_client(q, b)
    try:
        c.recheck()
        b.lookups = 0
        r = receipts.verify_receipt(S1.sign(100, b"late", None, gid=G))
        q.keep_unsettled(r, answers.HELD, b.state(G))          # decided under the state noted
        c.recheck()
        assert b.lookups == 0
        r = receipts.verify_receipt(S1.sign(101, b"later", None, gid=G))
        q.keep_unsettled(r, answers.HELD, b"an older state")    # decided before a binding changed
        c.recheck()
        assert b.lookups == 5                                  # G's five held receipts, once
        b.lookups = 0
        c.recheck()
        assert b.lookups == 0
    finally:
        c.client.loop_stop()
        q.close()


def test_a_running_commits_run_settles_a_held_receipt_when_the_missing_binding_arrives(tmp_path, monkeypatch):
    """The whole wiring with real processes (`sequencer run`, `commits run` on mosquitto, the
    member node's store): the member node holds only the second binding record of group K (from
    generation 5), not its genesis (from 0, the sequencer S): S's receipt for epoch 0 is held, the
    Commit stays queued. The genesis record then arrives in the node's store (another process, as
    sync would bring it): the running `commits run` notices the node's commit (data_version),
    reads K's binding records again, and the held receipt settles the Commit as accepted."""
    import os
    import subprocess
    import time
    from agent.core.records import record_hash
    from agent.node import Node, now_ms
    from agent.sequencer.framing import encode_private_message
    from agent.store import db, sequencing as seqstore
    from agent.transport.broker import Broker
    from tests.cli_cmd import agent_cmd, agent_env
    from tests.sequencer.test_commit_queue import spawn, stop
    from tests.sync.helpers import MESH, TABLES
    monkeypatch.setenv("SSP_AGENT_WITNESS_DIR", str(tmp_path / "w"))
    env = agent_env(dict(os.environ))
    K = bytes.fromhex("e7" * 16)

    def j(home, *args):
        p = subprocess.run([*agent_cmd(), "--home", str(home), *map(str, args)], capture_output=True, text=True,
                           env=env)
        assert p.returncode == 0, (args, p.stdout, p.stderr)
        return json.loads(p.stdout.splitlines()[-1]) if p.stdout.strip() else None

    def until(home, test, limit=HANG_S):
        end = time.monotonic() + limit
        while True:
            st = j(home, "commits", "status")
            if test(st) or time.monotonic() > end:
                return st
            time.sleep(0.3)

    auth_dir = tmp_path / "authority"
    auth = j(tmp_path / "unused", "authority", "create", "--out", auth_dir)
    man = tmp_path / "mesh.toml"
    man.write_text(f'mesh_id = "{MESH.hex()}"\nauthorities = ["{auth["site_id"]}"]\n'
                   f'[[peers]]\nsite_id = "{auth["site_id"]}"\npublic_key = "{auth["public_key"]}"\n' + TABLES)
    b, x, s = tmp_path / "b", tmp_path / "x", tmp_path / "s"
    j(b, "init", "--manifest", man)
    j(x, "init", "--manifest", man)                          # where the authority issues K's bindings
    key = j(s, "sequencer", "init")["sequencer_key"]
    j(s, "sequencer", "register", "--group", K.hex(), "--epoch", "0")
    genesis = j(x, "sequencing", "bind", "--group", K.hex(), "--sequencer-key", key, "--generation", "0",
                "--authority-key", auth_dir)["record_hash"]
    j(x, "sequencing", "bind", "--group", K.hex(), "--sequencer-key", S2.kid.hex(), "--generation", "5",
      "--authority-key", auth_dir)
    conn = db.connect_readonly(x / Node.STORE_FILE)
    try:
        recs = {record_hash(raw).hex(): raw for raw in seqstore.raws(conn, K, "binding")}
    finally:
        conn.close()
    later = [raw for h, raw in recs.items() if h != genesis]
    assert len(recs) == 2 and len(later) == 1

    def noted(path) -> bool:
        c = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            return c.execute("SELECT count(*) FROM unsettled_groups WHERE bindings IS NOT NULL").fetchone()[0] == 1
        finally:
            c.close()

    def give_b(raw):
        node = Node.open(b)
        try:
            assert node.apply_records([raw], now_ms())["sequencing"]["stored"] == 1
        finally:
            node.close()
    give_b(later[0])                                          # b: a chain whose genesis has not arrived
    f = tmp_path / "k0.mls"
    f.write_bytes(encode_private_message(K, 0, ciphertext=b"k" * 16))
    j(b, "commits", "queue", f)
    broker = Broker(workdir=tmp_path / "broker").start()
    seqp = member = None
    try:
        seqp, _ = spawn(s, "sequencer", "run", "--broker", broker.url)
        member, _ = spawn(b, "commits", "run", "--broker", broker.url)
        # the held receipt and the Commit's reason are two writes of the member: wait for both
        st = until(b, lambda st: st["unsettled"] and st["commits"][0]["reason"] == "binding_unresolved")
        assert [u["verdict"] for u in st["unsettled"]] == ["held"], st
        assert st["commits"][0]["state"] == "queued" and st["commits"][0]["reason"] == "binding_unresolved"
        # the recheck has looked at it under the bindings b holds now (so what follows is the
        # recheck noticing a change, not its first look)
        end = time.monotonic() + 60
        while not noted(b / "commit-queue.db") and time.monotonic() < end:
            time.sleep(0.2)
        assert noted(b / "commit-queue.db")
        give_b(recs[genesis])                                 # the genesis arrives
        # (a resubmission answered with the head may settle the Commit first: the held receipt
        # itself is settled by the recheck only)
        st = until(b, lambda st: st["commits"][0]["state"] != "queued" and not st["unsettled"])
        assert st["commits"][0]["state"] == "accepted" and st["unsettled"] == [], st
        assert [e["was"] for e in st["events"] if e["kind"] == "receipt_settled"] == ["held"]
    finally:
        if member is not None:
            stop(member)
        if seqp is not None:
            stop(seqp)
        broker.close()
