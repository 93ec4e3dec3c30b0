"""Lost receipts come back over the broker, without an operator (docs/sequencer.md "Taking back
receipts a restored state lost").

A `sequencer.db` restored past the journal's compaction floor lost stretches of receipts
(`receipts_lost`). Before: they came back only from evidence files an operator gathered from
members (`commits evidence`, `sequencer recover`). Now `sequencer run` publishes, retained, what it
still misses (`PREFIX/GROUP/lost`), every member's `commits run` answers with the receipts it holds
in those stretches (`PREFIX/GROUP/evidence`), and the sequencer takes back what chains link by
link to what it holds (recovery.refill, as `sequencer recover` does). The evidence request is a
boundary a hostile broker client reaches: one function classifies its bytes
(recovery.parse_evidence), and only refill ever acts on it (never a recovery of a group this
sequencer holds no state for)."""
from __future__ import annotations

import json
import signal
import subprocess
import time
import types
from contextlib import contextmanager
from typing import Iterator

import cbor2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.sequencer import client, commit_queue, receipts, recovery, serve, service
from test_restore_past_compaction import BACKUP_AT, GROUPS, LAST, compacted_history, msg
from test_run_broker import Member
from tests.cli_cmd import agent_cmd, agent_env
from tests.waiting import HANG_S


def doc(**over) -> bytes:
    d = {"member": "m", "receipts": [], "attested_epoch": 3, "discontinuities": [], "statements": []}
    d.update(over)
    return json.dumps(d).encode()


# -- the boundary: evidence bytes ------------------------------------------------------------

def test_parse_evidence_reads_the_file_format_and_refuses_anything_else():
    ok = recovery.parse_evidence(doc(receipts=["00ff"], discontinuities=[4], statements=["aa"], group="ab"))
    assert ok == recovery.MemberEvidence("m", (b"\x00\xff",), 3, (4,), (b"\xaa",))
    assert recovery.parse_evidence(doc(), group_id=b"\xab") is not None       # no group named: any
    bad = [b"", b"\xff\xfe", b"[]", b"null", b"1e999999", doc(member=3), doc(receipts="00"),
           doc(receipts=["zz"]), doc(receipts=[1]), doc(attested_epoch="3"), doc(attested_epoch=-1),
           doc(attested_epoch=True), doc(attested_epoch=2 ** 64), doc(discontinuities=[-1]),
           doc(discontinuities=["1"]), doc(statements=[None]), doc(group="zz"),
           json.dumps({"receipts": []}).encode(), b"{" * 100_000]
    for b in bad:
        with pytest.raises(recovery.EvidenceError) as e:
            recovery.parse_evidence(b)
        assert e.value.reason == "bad_evidence", b[:40]
    with pytest.raises(recovery.EvidenceError):       # another group's file
        recovery.parse_evidence(doc(group="ab"), group_id=b"\xcd")
    with pytest.raises(recovery.EvidenceError):       # more items than the boundary takes
        recovery.parse_evidence(doc(receipts=["00"] * 11), max_items=10)


JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                       lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=16), c, max_size=6),
                       max_leaves=20)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(st.binary(max_size=300), JSONISH.map(lambda v: json.dumps(v).encode()),
                 st.dictionaries(st.sampled_from(["member", "receipts", "attested_epoch", "discontinuities",
                                                  "statements", "group"]), JSONISH).map(lambda v: json.dumps(v).encode())))
def test_parse_evidence_fuzz_classifies_every_input(data):
    try:
        got = recovery.parse_evidence(data, max_items=64)
    except recovery.EvidenceError as e:
        assert e.reason == "bad_evidence"
        return
    assert isinstance(got, recovery.MemberEvidence)


def test_parse_lost_reads_the_record_and_refuses_anything_else():
    assert client.parse_lost(b"") == []                                   # cleared: nothing missing
    assert client.parse_lost(cbor2.dumps({"missing": [[40, 40], [5, 29]]})) == [(40, 40), (5, 29)]
    for bad in (b"\xff", cbor2.dumps([]), cbor2.dumps({"missing": [[3, 2]]}), cbor2.dumps({"missing": [[-1, 2]]}),
                cbor2.dumps({"missing": [[1, 2 ** 63]]}), cbor2.dumps({"missing": [[1]]}),
                cbor2.dumps({"missing": [[True, 2]]}), cbor2.dumps({"missing": [[1, 2]] * (client.MAX_LOST_RUNS + 1)}),
                cbor2.dumps({"lost": [[1, 2]]}), cbor2.dumps({"missing": [[1.0, 2]]})):
        assert client.parse_lost(bad) is None, bad


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=200), JSONISH.map(cbor2.dumps),
                 st.lists(st.lists(st.integers(), max_size=3), max_size=5).map(lambda v: cbor2.dumps({"missing": v}))))
def test_parse_lost_fuzz_never_raises(data):
    got = client.parse_lost(data)
    assert got is None or all(0 <= a <= b < 2 ** 63 for a, b in got)


# -- the member's offer and the sequencer's refill, without a broker --------------------------

def test_a_member_offers_only_what_it_holds_in_the_lost_stretches_top_first(tmp_path, monkeypatch):
    home, got, _ = compacted_history(tmp_path, monkeypatch)
    g = GROUPS[1]
    q = commit_queue.open_queue(tmp_path / "member")
    try:
        for e in range(0, LAST + 1):
            q.keep_head(g, e, got[(g, e)])
        assert q.offer(g, [(10, 19)], limit=4) == recovery.MemberEvidence(
            q.member_id, tuple(got[(g, e)] for e in (19, 18, 17, 16)), LAST + 1, (), ())
        off = q.offer(g, [(10, 12), (40, 41)], limit=100)
        assert off.receipts == tuple(got[(g, e)] for e in (41, 40, 12, 11, 10))
        assert q.offer(g, [(LAST + 5, LAST + 9)], limit=100) is None        # holds nothing there
        assert q.offer(GROUPS[2], [(10, 12)], limit=100) is None            # nothing of that group
    finally:
        q.close()


def test_offered_evidence_refills_and_never_recovers_a_group_without_state(tmp_path, monkeypatch):
    home, got, _ = compacted_history(tmp_path, monkeypatch)
    g = GROUPS[1]
    with service.Sequencer(home) as s:
        assert s.lost(g) == [(BACKUP_AT, LAST - 1, LAST - BACKUP_AT)] and s.missing(g) == [(BACKUP_AT, LAST - 1)]
        offer = recovery.MemberEvidence("m", tuple(got[(g, e)] for e in range(LAST - 1, 29, -1)), LAST + 1)
        out = s.refill_offered(g, offer)
        assert isinstance(out, recovery.Refilled) and len(out.refill.receipts) == LAST - 30
        assert s.lost(g) == [(BACKUP_AT, LAST - 1, 30 - BACKUP_AT)]
        assert s.missing(g) == [(BACKUP_AT, 29)]
        assert s.receipt(g, 30) == got[(g, 30)]
        # a group this sequencer never knew: refused, nothing changes (never a recovery from an offer)
        unknown = b"\x42" * 16
        for gid in (unknown,):
            with pytest.raises(service.SequencerRefused):
                s.refill_offered(gid, offer)
            assert s.store.group(gid) is None
        # a hole at 20 in the next offer: taken down from 30 to 21 and up from the copy's epoch 4 to 19
        s.refill_offered(g, recovery.MemberEvidence("m", tuple(got[(g, e)] for e in range(29, BACKUP_AT - 1, -1)
                                                               if e != 20), 30))
        assert s.missing(g) == [(20, 20)] and s.lost(g) == [(BACKUP_AT, LAST - 1, 1)]
        s.refill_offered(g, recovery.MemberEvidence("m", (got[(g, 20)],), 30))
        assert s.lost(g) == [] and s.missing(g) == []
        with pytest.raises(service.SequencerRefused):
            s.refill_offered(g, offer)
        # several runs, highest first, at most the limit asked for; the stretch's edges count
        with s.store._tx():
            s.store.conn.execute("DELETE FROM receipts WHERE group_id = ? AND epoch IN (?, ?, ?, ?, ?)",
                                 (g, BACKUP_AT, 10, 11, 30, LAST - 1))
        assert s.missing(g) == [(LAST - 1, LAST - 1), (30, 30), (10, 11), (BACKUP_AT, BACKUP_AT)]
        assert s.missing(g, limit=2) == [(LAST - 1, LAST - 1), (30, 30)]


# -- through the broker ------------------------------------------------------------------------

def _lost_records(m) -> Iterator[tuple[str, bytes]]:
    """(topic, payload) of the `lost` records a test_run_broker.Member (subscribed to them) hears."""
    while True:
        topic, body, _retain = m.published.get(timeout=HANG_S)
        if topic.endswith("/lost"):
            yield topic, body


def _status(home) -> dict:
    p = subprocess.run([*agent_cmd(), "--home", str(home), "sequencer", "status"], capture_output=True, text=True,
                       env=agent_env())
    assert p.returncode == 0, p.stderr
    return {g["group"]: g for g in json.loads(p.stdout)["groups"]}


def _wait_lost(home, g: bytes, missing: int, within: float = 60) -> list:
    """Group ``g``'s `receipts_lost` in `sequencer status`, polled until its first stretch misses
    ``missing`` epochs (or ``within`` seconds passed)."""
    deadline = time.monotonic() + within
    while True:
        lost = _status(home)[g.hex()].get("receipts_lost")
        if (lost and lost[0]["missing"] == missing) or time.monotonic() > deadline:
            return lost
        time.sleep(0.5)


def test_members_give_lost_receipts_back_over_the_broker(tmp_path, monkeypatch, broker):
    """Through the installed command: `sequencer run` on the restored home publishes what it lost;
    a member's `commits run` (which heard every head of group 1 but epoch 40) answers with its
    receipts, and the sequencer takes back all but the member's hole, with no operator. A hostile
    client's evidence (garbage, oversized, a forged group, another group's receipts) is answered
    with an error or nothing taken, and the server goes on."""
    home, got, _ = compacted_history(tmp_path, monkeypatch)
    g = GROUPS[1]
    with service.Sequencer(home) as s:
        key = s.public_key
    member_home = tmp_path / "member"
    q = commit_queue.open_queue(member_home, key)
    try:
        for e in range(0, LAST + 1):
            if e != 40:
                q.keep_head(g, e, got[(g, e)])
        q.enqueue(msg(g, LAST + 1))               # the member follows group 1 (its next Commit)
    finally:
        q.close()
    seq = subprocess.Popen([*agent_cmd(), "--home", str(home), "sequencer", "run", "--broker", broker.url],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env())
    mem = None
    mallory = None
    try:
        assert json.loads(seq.stdout.readline())["sequencer_key"] == key.hex()
        mallory = Member(broker.port, "mallory")
        mallory.c.subscribe([("sovm-seq/+/lost", 1)])
        records = _lost_records(mallory)
        # what the sequencer misses, retained, for every group that lost receipts
        seen = {}
        deadline = time.monotonic() + HANG_S
        while len(seen) < len(GROUPS) and time.monotonic() < deadline:
            topic, body = next(records)
            seen[topic] = cbor2.loads(body)
        assert seen[f"sovm-seq/{g.hex()}/lost"] == {"missing": [[BACKUP_AT, LAST - 1]]}
        # hostile evidence first: each answered, nothing taken, the server goes on
        t = f"sovm-seq/{g.hex()}/evidence"
        assert mallory.request(t, b"\xff garbage")["error"].startswith("bad_evidence")
        assert "too large" in mallory.request(t, b" " * (serve.MAX_EVIDENCE_BYTES + 1))["error"]
        assert "error" in mallory.request("sovm-seq/zz/evidence", doc())
        assert "error" in mallory.request(f"sovm-seq/{'42' * 16}/evidence", doc())
        other = json.dumps({"member": "mallory", "receipts": [got[(GROUPS[2], 30)].hex()],
                            "attested_epoch": 1}).encode()
        ans = mallory.request(t, other)
        assert ans["outcome"] == "refilled" and ans["refilled"] == 0 and ans["unusable"], ans
        # the member answers on its own
        mem = subprocess.Popen([*agent_cmd(), "--home", str(member_home), "commits", "run", "--broker", broker.url],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env())
        lost = _wait_lost(home, g, 1)
        assert lost == [{"from": BACKUP_AT, "to": LAST - 1, "missing": 1}], lost
        # the retained record follows: only the hole is still missing
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline:
            topic, body = next(records)
            if topic == f"sovm-seq/{g.hex()}/lost" and cbor2.loads(body) == {"missing": [[40, 40]]}:
                break
        else:
            pytest.fail("the lost record was not republished")
        # the member's queue records what it offered and what the sequencer said
        deadline = time.monotonic() + HANG_S
        while time.monotonic() < deadline:
            p = subprocess.run([*agent_cmd(), "--home", str(member_home), "commits", "status"],
                               capture_output=True, text=True, env=agent_env())
            kinds = [e["kind"] for e in json.loads(p.stdout)["events"]]
            if "evidence_answered" in kinds:
                break
            time.sleep(0.5)
        answered = [e for e in json.loads(p.stdout)["events"] if e["kind"] == "evidence_answered"]
        assert answered and answered[0]["outcome"] == "refilled", answered
    finally:
        for p in (mem, seq):
            if p is not None:
                p.send_signal(signal.SIGTERM)
                p.wait(20)
        if mallory is not None:
            mallory.close()
    assert seq.returncode == 0, seq.stderr.read()
    with service.Sequencer(home) as s:
        assert s.receipt(g, 41) == got[(g, 41)] and s.receipt(g, 39) == got[(g, 39)]
        assert s.receipt(g, 40) == service.Absent(discontinuity=False)
        assert s.receipt(GROUPS[2], 30) == service.Absent(discontinuity=False)     # nobody offered it
        assert not s.store.group(g).failed_closed


def test_recover_reads_evidence_files_through_the_same_boundary(tmp_path, monkeypatch):
    """`sequencer recover` refuses a malformed evidence file (exit 2, nothing printed, the reason
    named) before anything is opened for writing: the boundary the broker's requests go through."""
    home, got, _ = compacted_history(tmp_path, monkeypatch)
    with service.Sequencer(home) as s:
        key = s.public_key.hex()
    for i, bad in enumerate((b"{", doc(attested_epoch="3"), doc(receipts=["zz"]), doc(member=""))):
        f = tmp_path / f"bad{i}.json"
        f.write_bytes(bad)
        p = subprocess.run([*agent_cmd(), "--home", str(home), "sequencer", "recover", "--group", GROUPS[1].hex(),
                            "--binding", f"0:{key}", str(f)], capture_output=True, text=True, env=agent_env())
        assert p.returncode == 2 and p.stdout == "" and "bad_evidence" in p.stderr, (bad, p.stderr)
    with service.Sequencer(home) as s:
        assert s.lost(GROUPS[1]) == [(BACKUP_AT, LAST - 1, LAST - BACKUP_AT)]      # nothing changed


def test_refill_offered_fuzz_takes_nothing_from_forged_bytes(tmp_path, monkeypatch):
    """Whatever bytes a broker client puts in an evidence document's receipts and statements
    (random, or a real receipt with bytes flipped), the refill answers with what it took: nothing,
    and raises nothing."""
    home, got, _ = compacted_history(tmp_path, monkeypatch)
    g = GROUPS[1]
    real = got[(g, LAST - 1)]

    def flipped(t):
        i, b = t
        i %= len(real)
        return real[:i] + bytes([real[i] ^ (b or 1)]) + real[i + 1:]
    items = st.lists(st.one_of(st.binary(max_size=300), st.tuples(st.integers(0, 10 ** 6), st.integers(0, 255)).map(flipped)),
                     max_size=6)
    with service.Sequencer(home) as s:
        @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
        @given(items, items)
        def one(rx, stated):
            out = s.refill_offered(g, recovery.MemberEvidence("mallory", tuple(rx), 1, (), tuple(stated)))
            assert isinstance(out, recovery.Refilled) and out.refill.receipts == () and out.refill.statements == ()
        one()
        assert s.lost(g) == [(BACKUP_AT, LAST - 1, LAST - BACKUP_AT)] and not s.store.group(g).failed_closed


def test_receipts_the_member_node_heard_through_the_mesh_are_offered_too(tmp_path, monkeypatch, broker):
    """A member whose Commit queue holds none of the lost receipts, but whose node heard them as
    receipt-head records gossiped over the mesh (agent/sequencing.py), offers those: `commits run`
    reads them from the node's store (read-only, beside the node) and the sequencer takes back
    every epoch (before: only what the queue held was offered, so nothing here)."""
    home, got, g, member_home = _member_node_heard(tmp_path, monkeypatch)
    seq = subprocess.Popen([*agent_cmd(), "--home", str(home), "sequencer", "run", "--broker", broker.url],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env())
    mem = None
    try:
        json.loads(seq.stdout.readline())
        mem = subprocess.Popen([*agent_cmd(), "--home", str(member_home), "commits", "run", "--broker", broker.url],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env())
        lost = _wait_lost(home, g, 0)
        assert lost == [{"from": BACKUP_AT, "to": LAST - 1, "missing": 0}], lost
    finally:
        for p in (mem, seq):
            if p is not None:
                p.send_signal(signal.SIGTERM)
                p.wait(20)
    with service.Sequencer(home) as s:
        assert all(s.receipt(g, e) == got[(g, e)] for e in range(LAST + 1))


def _member_node_heard(tmp_path, monkeypatch):
    """The restored sequencer home, and a member home whose node heard group 1's receipts from
    epoch BACKUP_AT - 1 on over the mesh (gossiped receipt heads), and whose Commit queue follows
    the group but holds none of them."""
    from agent import sequencing
    from agent.node import Node
    from agent.simpeer import manifest_text, readings_table
    home, got, _ = compacted_history(tmp_path, monkeypatch)
    g = GROUPS[1]
    with service.Sequencer(home) as s:
        key = s.public_key
    member_home = tmp_path / "member"
    node, _ = Node.init(member_home, manifest_text(bytes(16), readings_table(retention="telemetry")))
    try:
        now = int(time.time() * 1000)
        for e in range(BACKUP_AT - 1, LAST + 1):        # what the mesh carried to this node
            assert sequencing.gossip(node, got[(g, e)], now + e)["gossiped"]
    finally:
        node.close()
    q = commit_queue.open_queue(member_home, key)
    try:
        q.enqueue(msg(g, LAST + 1))                     # follows group 1; its queue holds no receipt
        assert q.offer(g, [(BACKUP_AT, LAST - 1)], 100) is None
    finally:
        q.close()
    return home, got, g, member_home


def test_commits_evidence_includes_what_the_member_node_heard(tmp_path, monkeypatch):
    """The operator's evidence file holds the receipts the member node heard over the mesh beside
    the queue's (before: only the queue's, so this member had nothing to give: exit 2)."""
    home, got, g, member_home = _member_node_heard(tmp_path, monkeypatch)
    p = subprocess.run([*agent_cmd(), "--home", str(member_home), "commits", "evidence", "--group", g.hex()],
                       capture_output=True, text=True, env=agent_env())
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["receipts"] == [got[(g, e)].hex() for e in range(BACKUP_AT - 1, LAST + 1)]
    assert doc["attested_epoch"] == LAST + 1
    with service.Sequencer(home) as s:
        out = s.recover(g, [recovery.parse_evidence(p.stdout.encode())], {0: s.public_key})
        assert out.missing == 0 and len(out.refill.receipts) == LAST - BACKUP_AT


def test_a_frozen_group_takes_no_more_offers_and_its_lost_record_is_cleared(tmp_path, monkeypatch):
    """Evidence that the key signed two receipts for one lost epoch freezes the group (as
    `sequencer recover` does); from then on an offer for it is refused, and `sequencer run`'s
    retained `lost` record for it is cleared (an empty message): members stop offering."""
    from firmware_bridge import ReceiptIdentity
    from test_hostile_requests import msg as request, server

    home, got, _ = compacted_history(tmp_path, monkeypatch)
    g = GROUPS[1]
    with service.Sequencer(home) as s:
        srv, answers = server(s)
        srv._publish_lost(g)
        assert srv.client.published[-1] == (f"sovm-seq/{g.hex()}/lost", cbor2.dumps({"missing": [[BACKUP_AT, LAST - 1]]}))
        # a second receipt for lost epoch 30 under this sequencer's own key (signed here through
        # the bridge under another identity: what an equivocating sequencer would have released)
        prev = receipts.parse_receipt(got[(g, 29)]).receipt_hash
        tbs, assemble = s.signing.parts(receipts.payload_bytes(g, 30, b"\x07" * 32, prev))
        other = s.bridge.release_many([(ReceiptIdentity(b"\x99" + g, 30), service.RECEIPT_KEY, tbs, assemble)])[0]
        offer = json.dumps({"member": "m", "receipts": [got[(g, e)].hex() for e in range(LAST - 1, 30, -1)]
                            + [other.hex()], "attested_epoch": LAST + 1}).encode()
        srv.handle(request(f"sovm-seq/{g.hex()}/evidence", offer))
        assert answers[-1]["outcome"] == "fail_closed", answers[-1]
        assert s.store.group(g).failed_closed
        assert srv.client.published[-1] == (f"sovm-seq/{g.hex()}/lost", b"")          # cleared
        srv.handle(request(f"sovm-seq/{g.hex()}/evidence", offer))
        assert "no receipts lost here" in answers[-1]["error"]
        with pytest.raises(service.SequencerRefused):
            s.refill_offered(g, recovery.parse_evidence(offer))


@contextmanager
def member_holding_every_head(tmp_path, monkeypatch) -> Iterator[tuple[client.CommitClient, bytes]]:
    """A member's client (its broker client a FakeClient) whose queue holds every receipt of
    group 1 (a restored sequencer lost some of them); it follows no group yet."""
    from test_hostile_requests import FakeClient
    _home, got, _ = compacted_history(tmp_path, monkeypatch)
    g = GROUPS[1]
    q = commit_queue.open_queue(tmp_path / "member")
    try:
        for e in range(LAST + 1):
            q.keep_head(g, e, got[(g, e)])
        c = client.CommitClient(q, serve.BrokerSettings("127.0.0.1", 1))
        c.client = FakeClient()
        yield c, g
    finally:
        q.close()


def test_a_member_offers_nothing_for_a_group_it_does_not_follow(tmp_path, monkeypatch):
    """A `lost` record retained for a group this member never queued a Commit for (a broker
    client may publish one anywhere) makes it offer nothing, whatever it holds of that group."""
    from test_hostile_requests import msg as record
    with member_holding_every_head(tmp_path, monkeypatch) as (c, g):
        lost = cbor2.dumps({"missing": [[BACKUP_AT, LAST - 1]]})
        c._handle(record(f"sovm-seq/{g.hex()}/lost", lost))
        assert c.client.published == []                       # not followed: nothing offered
        c._followed[g] = 1
        c._handle(record(f"sovm-seq/{g.hex()}/lost", lost))
        assert [t for t, _p in c.client.published] == [f"sovm-seq/{g.hex()}/evidence"]
        c._handle(record(f"sovm-seq/{g.hex()}/lost", lost))   # the same record again: not offered again
        assert len(c.client.published) == 1


def test_evidence_past_the_allowance_is_answered_retry_after_and_submits_go_on(tmp_path, monkeypatch):
    """Evidence is read and checked within an allowance shared by every member (serve.py
    EVIDENCE_BYTES_PER_S): a flood of full requests for a group with lost receipts gets its burst
    checked, every other request answered `retry_after` unread, and a Commit among them is still
    sequenced. Before: every request was parsed and verified (about 70 ms each), so one client
    allowed on `evidence` kept the loop busy."""
    from test_hostile_requests import msg as request, server
    home, got, _ = compacted_history(tmp_path, monkeypatch)
    g = GROUPS[1]
    with service.Sequencer(home) as s:
        srv, answers = server(s)
        now = [1000.0]
        srv.clock = lambda: now[0]
        # every receipt but epoch 40's: the group keeps missing one, so every request is read
        body = json.dumps({"member": "m", "receipts": [got[(g, e)].hex() for e in range(LAST - 1, BACKUP_AT - 1, -1)
                                                       if e != 40], "attested_epoch": LAST + 1}).encode()
        full = body + b" " * (serve.MAX_EVIDENCE_BYTES - len(body))       # a full request
        fresh = bytes.fromhex("e1" * 16)
        flood = [request(f"sovm-seq/{g.hex()}/evidence", full, mid=i) for i in range(40)]
        flood.insert(20, request(f"sovm-seq/{fresh.hex()}/submit", msg(fresh, 7), mid=99))
        srv.handle_many(flood)
        checked = [a for a in answers if "outcome" in a]
        busy = [a for a in answers if "retry_after" in a]
        assert len(checked) == serve.EVIDENCE_BURST_BYTES // serve.MAX_EVIDENCE_BYTES == 2, answers[:3]
        assert len(busy) == 38 and all(a["retry_after"] == 2 for a in busy), busy[:2]
        assert [a["accepted"] for a in answers if "accepted" in a] == [True]
        # once the allowance filled again, the same request is read and checked
        now[0] += 2
        srv.handle(request(f"sovm-seq/{g.hex()}/evidence", full))
        assert answers[-1].get("outcome") == "refilled", answers[-1]


def test_a_member_told_retry_after_offers_the_same_again_then(tmp_path, monkeypatch):
    """A member whose offer was answered `retry_after` offers it again once that time came (and
    not before); any other answer ends it, and a newer `lost` record supersedes it."""
    import hashlib
    monkeypatch.setattr(client, "OFFER_INTERVAL_S", 0.0)     # the interval has its own test below

    from test_hostile_requests import msg as record
    with member_holding_every_head(tmp_path, monkeypatch) as (c, g):
        c._followed[g] = 1
        lost = cbor2.dumps({"missing": [[BACKUP_AT, LAST - 1]]})
        c._handle(record(f"sovm-seq/{g.hex()}/lost", lost))
        assert len(c.client.published) == 1
        corr = client.OFFER_TAG + hashlib.sha256(g).digest()
        t0 = time.monotonic()
        c._offer_answered(corr, json.dumps({"error": "evidence: busy", "retry_after": 4}).encode())
        c.reoffer_due(t0 + 3.9)
        assert len(c.client.published) == 1                       # not yet
        c.reoffer_due(t0 + 4 * 1.5 + 1)
        assert len(c.client.published) == 2 and c.client.published[1] == c.client.published[0]
        c.reoffer_due(t0 + 100)
        assert len(c.client.published) == 2                       # once
        c._offer_answered(corr, json.dumps({"outcome": "refilled", "refilled": 3}).encode())
        c.reoffer_due(t0 + 1000)
        assert len(c.client.published) == 2
        # told busy, then a newer record came: only the newer one is offered
        c._offer_answered(corr, json.dumps({"error": "busy", "retry_after": 1}).encode())
        newer = cbor2.dumps({"missing": [[BACKUP_AT, LAST - 2]]})
        c._lost(g.hex(), newer, t0 + 20)          # as _handle does, on this test's clock
        assert len(c.client.published) == 3
        c.reoffer_due(t0 + 10_000)
        assert len(c.client.published) == 3
        # a hostile retry_after (not an int in 1..3600) is not honoured
        for bad in (0, -1, 10**9, "5", 2.5, True):
            c._offer_answered(corr, json.dumps({"error": "busy", "retry_after": bad}).encode())
            c.reoffer_due(t0 + 10**10)
        assert len(c.client.published) == 3


def test_lost_records_that_change_every_time_get_one_offer_an_interval(tmp_path, monkeypatch):
    """A broker client publishing a different `lost` record for a followed group 100 times in a
    row makes the member offer once at once and once more, with the newest record, when
    OFFER_INTERVAL_S has passed. Before: one offer (up to 1 MiB) for every record."""
    from test_hostile_requests import msg as record
    with member_holding_every_head(tmp_path, monkeypatch) as (c, g):
        c._followed[g] = 1
        t0 = time.monotonic()
        # all within one interval however slow the machine: the member's clock stands still
        monkeypatch.setattr(client, "time", types.SimpleNamespace(monotonic=lambda: t0))
        for i in range(100):
            c._handle(record(f"sovm-seq/{g.hex()}/lost", cbor2.dumps({"missing": [[BACKUP_AT, LAST - 1 - i % 2]]})))
        monkeypatch.setattr(client, "time", time)
        assert len(c.client.published) == 1
        c.reoffer_due(t0 + client.OFFER_INTERVAL_S + 1)
        assert len(c.client.published) == 2
        newest = json.loads(c.client.published[1][1])
        assert max(receipts.parse_receipt(bytes.fromhex(r)).epoch for r in newest["receipts"]) == LAST - 2, newest
        c.reoffer_due(t0 + 100)
        assert len(c.client.published) == 2
