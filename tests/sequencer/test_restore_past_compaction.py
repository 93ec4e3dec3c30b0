"""A sequencer whose state (`sequencer.db`) is restored from a copy older than its signing journal's
compaction floor (docs/sequencer.md "Resume: before anything is served").

The journal forgets, at compaction, every receipt below each group's last one: the receipts table
held them. A copy from before that compaction lacks them too, so neither side can say what those
epochs were. They were receipts released to members (or gaps with released statements, which the
journal keeps). Before the fix the resume stated each of them absent, a gap with a signed
statement of absence: every member holding one of those receipts then holds a receipt and a
signed statement that contradict each other, equivocation evidence against an honest sequencer
(§22.6 step 4, the member rule, docs/sequencer.md); and a group the copy never knew was not looked
at, so its next Commit bootstrapped a second chain beside the one members hold (§22.6 bootstrap,
§22.5 cl. 1-2).

Now: a group at or below its journal floor jumps to the floor (event `receipts_lost`; the
statements the journal still holds for that range are adopted byte for byte, nothing is stated
that was not), then settles from the entry the journal kept (its last released receipt, adopted
as the head), as any rollback does; a group only the journal knows is settled from the journal.
"""
from __future__ import annotations

import shutil

import pytest

from agent.sequencer import home as seq_home, member, receipts, service
from agent.sequencer.framing import encode_private_message
from bridge_helpers import parse_journal
from firmware_bridge import DiscontinuityIdentity, ReceiptIdentity, Status
from firmware_bridge.identity import decode_identity
from firmware_bridge.journal import INTENT, Journal

GROUPS = [bytes([0xB0 + i]) * 16 for i in range(3)]
BACKUP_AT = 5
LAST = 60


def msg(g: bytes, epoch: int, tag: bytes = b"") -> bytes:
    return encode_private_message(g, epoch, 3, ciphertext=b"c" * 32 + tag)


def run(s: service.Sequencer, groups: list, first: int, last: int, got: dict) -> None:
    for e in range(first, last + 1):
        for g, ans in zip(groups, s.submit_many([msg(g, e) for g in groups])):
            assert isinstance(ans, service.Accepted), (g.hex(), e, ans)
            got[(g, e)] = ans.receipt


def restore(home, backup) -> None:
    for suffix in ("-wal", "-shm"):
        (home / (service.DB_NAME + suffix)).unlink(missing_ok=True)
    shutil.copy(backup, home / service.DB_NAME)


def outputs(home) -> list:
    return [decode_identity(rec[1]) for rec in parse_journal(str(home / service.JOURNAL_NAME)) if rec[0] == 2]


def members(s: service.Sequencer, got: dict) -> dict:
    """One member a group, holding every receipt released (as members do: they keep them)."""
    chains = {}
    for (g, e), raw in sorted(got.items(), key=lambda kv: kv[0][1]):
        chain = chains.setdefault(g, member.ReceiptChain(g, sequencer_key=s.public_key))
        # a receipt after a gap is held until the gap's statement reaches the member
        assert chain.add(raw) in (member.ACCEPTED, member.HELD)
    return chains


def surfaced_to(chains: dict, s: service.Sequencer) -> None:
    """What the sequencer surfaces to every member alike: its statements, and its recorded gaps."""
    for (g, e), raw in s.store.statements().items():
        if g in chains:
            chains[g].add_statement(raw)
    for g, e, _m in s.store.discontinuities():
        if g in chains:
            chains[g].claim_discontinuity(e)


def compacted_history(tmp_path, monkeypatch, *, gap: bool = False):
    """Every group through epochs 0..LAST, the state copied at BACKUP_AT, the journal compacted
    past it. ``gap``: group 0's epoch 10 is an unknown outcome (an intent, no output: a crash
    between intent and persist), so a stated gap with its signed statement."""
    monkeypatch.setattr(seq_home, "JOURNAL_COMPACT_BYTES", 4 * 1024)
    home = tmp_path / "s"
    service.init(home)
    got: dict = {}
    with service.Sequencer(home) as s:
        for g in GROUPS:
            s.register(g, 0)
        run(s, GROUPS, 0, BACKUP_AT - 1, got)
    shutil.copy(home / service.DB_NAME, tmp_path / "backup.db")
    with service.Sequencer(home) as s:
        run(s, GROUPS, BACKUP_AT, 9, got)
    statement = None
    if gap:
        j = Journal(str(home / service.JOURNAL_NAME))
        j.commit([(INTENT, ReceiptIdentity(GROUPS[0], 10).encode(), service.RECEIPT_KEY)])
        j.close()
    with service.Sequencer(home) as s:
        if gap:
            statement = s.receipt(GROUPS[0], 10).statement
            assert statement is not None
            run(s, GROUPS[1:], 10, 10, got)
        else:
            run(s, GROUPS, 10, 10, got)
        run(s, GROUPS, 11, LAST, got)
        s.compact_journal()            # once more: each group's last receipt is all that stays
        assert s.bridge.journal_stats()["compactions"] >= 2
    restore(home, tmp_path / "backup.db")
    return home, got, statement


def test_a_state_restored_past_a_compaction_never_states_a_released_receipt_absent(tmp_path, monkeypatch):
    home, got, _ = compacted_history(tmp_path, monkeypatch)
    with service.Sequencer(home) as s:
        chains = members(s, got)
        surfaced_to(chains, s)
        for g in GROUPS:
            assert not chains[g].equivocation, chains[g].evidence       # failed before: 5..59 stated absent
            st = s.store.group(g)
            assert st.current_epoch == LAST + 1 and st.discontinuities == ()
            assert st.head.epoch == LAST and s.receipt(g, LAST) == got[(g, LAST)]   # adopted byte for byte
            for e in range(BACKUP_AT, LAST):
                ans = s.receipt(g, e)
                assert ans == service.Absent(discontinuity=False) and ans.statement is None
                assert s.bridge.status(ReceiptIdentity(g, e)) is Status.OUTCOME_UNKNOWN   # spent: never signed
            stale = s.submit(msg(g, 30, b"again"))
            assert isinstance(stale, service.Rejected) and stale.reason == "stale_epoch" and stale.head == got[(g, LAST)]
        lost = [e for e in s.store.events() if e["kind"] == "receipts_lost"]
        assert sorted((e["group"], e["from"], e["to"]) for e in lost) == sorted(
            (g.hex(), BACKUP_AT, LAST - 1) for g in GROUPS)
        nxt = s.submit(msg(GROUPS[1], LAST + 1))
        assert chains[GROUPS[1]].add(nxt.receipt) == member.ACCEPTED      # the one chain, continued
    stated = [i for i in outputs(home) if isinstance(i, DiscontinuityIdentity)]
    assert stated == []
    assert sorted(i.epoch for i in outputs(home) if isinstance(i, ReceiptIdentity)) == [LAST] * len(GROUPS) + [LAST + 1]


def test_a_statement_the_journal_kept_is_adopted_and_nothing_else_is_stated(tmp_path, monkeypatch):
    home, got, statement = compacted_history(tmp_path, monkeypatch, gap=True)
    g = GROUPS[0]
    with service.Sequencer(home) as s:
        chains = members(s, got)
        assert chains[g].add_statement(statement) == member.ACCEPTED   # relayed over the mesh before the restore
        assert not chains[g].held
        surfaced_to(chains, s)
        assert not any(c.equivocation for c in chains.values()), [c.evidence for c in chains.values()]
        assert s.store.group(g).discontinuities == (10,)
        ans = s.receipt(g, 10)
        assert ans.discontinuity and ans.statement == statement           # byte for byte, not signed again
        assert s.store.statements() == {(g, 10): statement}
        lost = {e["group"]: e for e in s.store.events() if e["kind"] == "receipts_lost"}
        assert lost[g.hex()]["stated"] == [10]
    assert [(i.group_id, i.epoch) for i in outputs(home) if isinstance(i, DiscontinuityIdentity)] == [(g, 10)]


def journal_only_group(tmp_path, monkeypatch, last: int, *, compact: bool):
    """A home whose state is restored from a copy taken before group x was registered; x then ran
    epochs 0..last (the journal compacted past them when ``compact``). -> (home, x, receipts)."""
    monkeypatch.setattr(seq_home, "JOURNAL_COMPACT_BYTES", 4 * 1024 if compact else 1 << 30)
    home = tmp_path / "s"
    service.init(home)
    with service.Sequencer(home) as s:
        s.register(GROUPS[0], 0)
    shutil.copy(home / service.DB_NAME, tmp_path / "backup.db")
    got: dict = {}
    x = GROUPS[2]
    with service.Sequencer(home) as s:
        s.register(x, 0)
        run(s, [x], 0, last, got)
        if compact:
            s.compact_journal()
    restore(home, tmp_path / "backup.db")
    return home, x, got


def test_a_group_only_the_journal_knows_is_not_bootstrapped_again(tmp_path, monkeypatch):
    """The copy is older than the group: the journal holds its chain (uncompacted here); its next
    Commit must continue that chain, not start a second one at any epoch."""
    home, x, got = journal_only_group(tmp_path, monkeypatch, 10, compact=False)
    with service.Sequencer(home) as s:
        st = s.store.group(x)
        assert st is not None and st.current_epoch == 11 and st.head.epoch == 10   # failed before: None
        for e in range(11):
            assert s.receipt(x, e) == got[(x, e)]
        ans = s.submit(msg(x, 0, b"fork"))
        assert isinstance(ans, service.Rejected) and ans.reason == "stale_epoch"
        chain = members(s, got)[x]
        assert chain.add(s.submit(msg(x, 11)).receipt) == member.ACCEPTED
        assert any(e["kind"] == "rollback" and e["group"] == x.hex() for e in s.store.events())


def test_a_compacted_group_only_the_journal_knows_jumps_to_its_floor(tmp_path, monkeypatch):
    home, x, got = journal_only_group(tmp_path, monkeypatch, LAST, compact=True)
    with service.Sequencer(home) as s:
        st = s.store.group(x)
        assert st.current_epoch == LAST + 1 and s.receipt(x, LAST) == got[(x, LAST)] and st.discontinuities == ()
        assert isinstance(s.submit(msg(x, 7, b"fork")), service.Rejected)
        chain = members(s, got)[x]
        surfaced_to({x: chain}, s)
        assert chain.add(s.submit(msg(x, LAST + 1)).receipt) == member.ACCEPTED and not chain.equivocation
        lost = [e for e in s.store.events() if e["kind"] == "receipts_lost"]
        # where the group started, nobody here knows: the copy never had it, the journal forgot it
        assert [(e["group"], e["from"], e["to"]) for e in lost] == [(x.hex(), None, LAST - 1)]


class Boom(Exception):
    pass


def test_a_fault_in_the_jump_leaves_a_state_the_next_open_completes(tmp_path, monkeypatch):
    """The jump is one transaction a group ("skipped" fires after each): a fault after the first
    leaves one group jumped and the others behind; the next open does the rest, the same way."""
    home, got, _ = compacted_history(tmp_path, monkeypatch)
    hits = {"n": 0}

    def hook(point: str) -> None:
        if point == "skipped":
            hits["n"] += 1
            if hits["n"] == 1:
                raise Boom(point)
    with pytest.raises(Boom):
        service.Sequencer(home, fault_hook=hook)
    with service.Sequencer(home) as s:
        chains = members(s, got)
        surfaced_to(chains, s)
        for g in GROUPS:
            assert not chains[g].equivocation
            assert s.store.group(g).current_epoch == LAST + 1 and s.store.group(g).discontinuities == ()
        assert len([e for e in s.store.events() if e["kind"] == "receipts_lost"]) == len(GROUPS)
    assert [i for i in outputs(home) if isinstance(i, DiscontinuityIdentity)] == []


def test_compaction_keeps_the_last_receipt_before_a_run_of_gaps():
    """The entry compaction keeps for a group is its last released receipt at or below the
    committed epoch - 1, with the gap intents after it: a state restored past the floor adopts
    that receipt as its head (the next receipt chains to it, a statement of the gaps names it).
    Before: the entry of epoch committed - 1 only, a gap's intent when the group ended on gaps,
    and the head was lost."""
    import tempfile
    from firmware_bridge.journal import RELEASED
    with tempfile.TemporaryDirectory() as d:
        j = Journal(d + "/j")
        g = GROUPS[0]
        recs = []
        for e in range(0, 51):
            recs += [(INTENT, ReceiptIdentity(g, e).encode(), "receipts"), (RELEASED, ReceiptIdentity(g, e).encode(), b"r%d" % e)]
        recs += [(INTENT, ReceiptIdentity(g, e).encode(), "receipts") for e in range(51, 56)]
        j.commit(recs)
        j.compact(None, set, lambda gid: 56 if gid == g else None)
        states = {e: j.state(ReceiptIdentity(g, e).encode()) for e in range(0, 57)}
        j.close()
    assert states[50] == "released" and all(states[e] == "intent" for e in range(51, 56))
    assert all(states[e] == "spent" for e in range(0, 50)) and states[56] == "absent"


# -- taking the lost receipts back from members (`sequencer recover` on a group with state) -------

def ev(name: str, raws: list, attested: int, statements: tuple = ()) -> "recovery.MemberEvidence":
    from agent.sequencer import recovery
    return recovery.MemberEvidence(name, tuple(raws), attested, (), tuple(statements))


def test_members_chains_give_back_the_lost_receipts_byte_for_byte(tmp_path, monkeypatch):
    from agent.sequencer import recovery
    home, got, _ = compacted_history(tmp_path, monkeypatch)
    g = GROUPS[0]
    with service.Sequencer(home) as s:
        key = {0: s.public_key}
        # one member holds the newer half: taken from the head down, link by link
        out = s.recover(g, [ev("m1", [got[(g, e)] for e in range(30, LAST + 1)], LAST + 1)], key)
        assert isinstance(out, recovery.Refilled), out
        assert [r.epoch for r in out.refill.receipts] == list(range(30, LAST)) and out.missing == 25
        # another the older part, with a hole at 12: taken up from epoch 4 (the copy's) to 11, and
        # down from 30 to 13; 12 stays lost
        older = [got[(g, e)] for e in range(0, 30) if e != 12]
        out = s.recover(g, [ev("m2", older, 30)], key)
        assert [r.epoch for r in out.refill.receipts] == [e for e in range(BACKUP_AT, 30) if e != 12]
        assert out.missing == 1 and out.refill.unverified == ()
        for e in range(0, LAST + 1):
            assert s.receipt(g, e) == (got[(g, e)] if e != 12 else service.Absent(discontinuity=False))
        st = s.store.group(g)
        assert st.current_epoch == LAST + 1 and st.head.epoch == LAST and st.discontinuities == ()
        nxt = s.submit(msg(g, LAST + 1))
        assert receipts.parse_receipt(nxt.receipt).previous_receipt_hash == receipts.receipt_hash(got[(g, LAST)])
        events = [e for e in s.store.events() if e["kind"] == "receipts_refilled"]
        assert [(e["receipts"], e["missing"]) for e in events] == [(30, 25), (24, 1)]
        # the other groups untouched: still lost
        assert s.receipt(GROUPS[1], 30) == service.Absent(discontinuity=False)
    # nothing signed: the journal's outputs are the heads and the one new receipt
    assert sorted(i.epoch for i in outputs(home) if isinstance(i, ReceiptIdentity)) == [LAST] * len(GROUPS) + [LAST + 1]


def test_a_lost_gap_comes_back_with_its_statement_and_the_chain_runs_across_it(tmp_path, monkeypatch):
    """Group 0's epoch 10 was a gap with a signed statement; with the statement removed from what
    the journal re-adopted, a member's copy of it brings it back, and the walk crosses it."""
    home, got, statement = compacted_history(tmp_path, monkeypatch, gap=True)
    g = GROUPS[0]
    with service.Sequencer(home) as s:
        s.store.conn.execute("DELETE FROM statements")          # as if the journal had not kept it
        s.store.conn.execute("DELETE FROM discontinuities")
        s.store.conn.commit()
        s.store._cache.clear()
        chain = [got[(g, e)] for e in range(0, LAST + 1) if e != 10]
        out = s.recover(g, [ev("m1", chain, LAST + 1, (statement,))], {0: s.public_key})
        assert [x.epoch for x in out.refill.statements] == [10] and out.missing == 0
        assert s.receipt(g, 10).statement == statement and s.store.group(g).discontinuities == (10,)
        assert s.receipt(g, 9) == got[(g, 9)] and s.receipt(g, 11) == got[(g, 11)]


def test_hostile_evidence_is_not_taken_back(tmp_path, monkeypatch):
    """A receipt signed by another key, one for another group, bytes that are no receipt: not taken
    (named unusable), and nothing for the epochs they claim."""
    from test_member import RogueSequencer
    home, got, _ = compacted_history(tmp_path, monkeypatch)
    g = GROUPS[0]
    rogue = RogueSequencer()
    forged = rogue.sign(LAST - 1, b"x", receipts.parse_receipt(got[(g, LAST - 2)]).receipt_hash, gid=g)
    with service.Sequencer(home) as s:
        offered = [forged, got[(GROUPS[1], 40)], b"\xa0" * 27, got[(g, LAST - 2)]]
        out = s.recover(g, [ev("mallory", offered, LAST + 1)], {0: s.public_key})
        assert out.refill.receipts == () and out.refill.unverified == (LAST - 2,)   # a hole at 59 above it
        assert len(out.refill.unusable) == 3 and out.missing == LAST - BACKUP_AT
        assert s.receipt(g, LAST - 1) == service.Absent(discontinuity=False)
        assert not s.store.group(g).failed_closed


def test_a_statement_of_absence_for_a_receipt_the_sequencer_holds_fails_closed(tmp_path, monkeypatch):
    """Evidence that this sequencer signed two things for one epoch (here: a statement of absence
    for an epoch whose receipt the chain above names) freezes the group (§22.6 step 4)."""
    from agent.sequencer import recovery
    home, got, _ = compacted_history(tmp_path, monkeypatch)
    g = GROUPS[0]
    with service.Sequencer(home) as s:
        # the sequencer's own key signs a contradicting statement (an equivocating sequencer)
        from firmware_bridge import DiscontinuityIdentity as D
        protected = receipts.statement_protected(s.public_key)
        payload = receipts.statement_payload(g, LAST - 1, None, receipts.parse_receipt(got[(g, LAST - 2)]).receipt_hash)
        bad = s.bridge.release(D(g, LAST - 1, 0), service.RECEIPT_KEY, receipts.sig_structure(protected, payload),
                               lambda sig: receipts.assemble(protected, payload, sig))
        out = s.recover(g, [ev("m1", [got[(g, LAST - 1)]], LAST + 1, (bad,))], {0: s.public_key})
        assert isinstance(out, recovery.FailClosed) and s.store.group(g).failed_closed
        assert isinstance(s.submit(msg(g, LAST + 1)), service.Rejected)


def test_recover_verb_refills_through_the_installed_command(tmp_path, monkeypatch):
    import json
    import subprocess

    from tests.cli_cmd import agent_cmd, agent_env
    home, got, _ = compacted_history(tmp_path, monkeypatch)
    g = GROUPS[2]
    with service.Sequencer(home) as s:       # the resume (jump) happens here
        key = s.public_key.hex()
    f = tmp_path / "alice.json"
    f.write_text(json.dumps({"member": "alice", "receipts": [got[(g, e)].hex() for e in range(LAST + 1)],
                             "attested_epoch": LAST + 1}))

    def cli(*args):
        return subprocess.run([*agent_cmd(), "--home", str(home), "sequencer", *args],
                              capture_output=True, text=True, env=agent_env())
    p = cli("receipt", "--group", g.hex(), "--epoch", "30")
    assert json.loads(p.stdout) == {"receipt": None, "absent": True, "discontinuity": False}
    groups = {x["group"]: x for x in json.loads(cli("status").stdout)["groups"]}
    assert groups[g.hex()]["receipts_lost"] == [{"from": BACKUP_AT, "to": LAST - 1, "missing": LAST - BACKUP_AT}]
    p = cli("recover", "--group", g.hex(), "--binding", f"0:{key}", str(f))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert (out["outcome"], out["refilled"], out["missing"]) == ("refilled", LAST - BACKUP_AT, 0)
    p = cli("receipt", "--group", g.hex(), "--epoch", "30")
    assert json.loads(p.stdout) == {"receipt": got[(g, 30)].hex()}
    groups = {x["group"]: x for x in json.loads(cli("status").stdout)["groups"]}
    assert groups[g.hex()]["receipts_lost"][0]["missing"] == 0
    p = cli("recover", "--group", g.hex(), "--binding", f"0:{key}", str(f))     # again: nothing left to take
    assert p.returncode == 0 and json.loads(p.stdout)["refilled"] == 0


def test_a_second_receipt_for_a_lost_epoch_fails_closed(tmp_path, monkeypatch):
    """A valid receipt of this sequencer's key for a lost epoch that is not the one the held chain
    names (the key signed two receipts for epoch 59: equivocation) freezes the group instead of
    being taken back."""
    from agent.sequencer import recovery
    home, got, _ = compacted_history(tmp_path, monkeypatch)
    g = GROUPS[0]
    with service.Sequencer(home) as s:
        prev = receipts.receipt_hash(got[(g, LAST - 2)])
        payload = receipts.payload_bytes(g, LAST - 1, receipts.commit_hash(b"another commit"), prev)
        protected = receipts.protected_header(s.public_key)
        # signed under an identity never used, so the bridge signs: the key equivocates
        other = s.bridge.release(ReceiptIdentity(g, 10**6), service.RECEIPT_KEY, receipts.sig_structure(protected, payload),
                                 lambda sig: receipts.assemble(protected, payload, sig))
        assert receipts.verify_receipt(other, s.public_key).epoch == LAST - 1
        out = s.recover(g, [ev("m1", [got[(g, LAST - 2)], other], LAST + 1)], {0: s.public_key})
        assert isinstance(out, recovery.FailClosed), out
        assert [e.kind for e in out.evidence] == ["divergent_chain"] and s.store.group(g).failed_closed
        assert s.receipt(g, LAST - 1) == service.Absent(discontinuity=False)
    # both receipts for epoch 59 side by side (one member each): two receipts for one epoch
    out = recovery.refill(g, [(BACKUP_AT, LAST - 1)], {LAST: got[(g, LAST)]}, {},
                          [ev("m1", [got[(g, LAST - 1)]], LAST + 1), ev("m2", [other], LAST + 1)],
                          {0: receipts.parse_receipt(other).kid})
    assert isinstance(out, recovery.FailClosed) and out.evidence[0].kind == "double_receipt"
    assert set(out.evidence[0].receipts) == {got[(g, LAST - 1)], other}


def test_a_members_queue_exports_the_evidence_that_refills_the_sequencer(tmp_path, monkeypatch):
    """The operator's loop, through the installed command: on a member, `commits evidence` prints
    (and with --out writes, 0600) the receipts its Commit queue holds for the group (its own
    Commits' outcomes and the heads it heard on the broker), its gaps and statements; on the
    sequencer, `sequencer recover` with that file takes the lost receipts back."""
    import json
    import subprocess

    from agent.sequencer import commit_queue
    from tests.cli_cmd import agent_cmd, agent_env
    home, got, _ = compacted_history(tmp_path, monkeypatch)
    g = GROUPS[1]
    member_home = tmp_path / "member"
    q = commit_queue.open_queue(member_home)
    try:
        for e in range(0, LAST + 1):
            if e != 40:                       # the member missed one head: a hole
                q.keep_head(g, e, got[(g, e)])
        q.keep_head(GROUPS[0], 3, got[(GROUPS[0], 3)])       # another group's: not in this file
    finally:
        q.close()

    def cli(h, *args):
        return subprocess.run([*agent_cmd(), "--home", str(h), *args], capture_output=True, text=True, env=agent_env())
    out_file = tmp_path / "member.json"
    p = cli(member_home, "commits", "evidence", "--group", g.hex(), "--out", str(out_file))
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert json.loads(out_file.read_text()) == doc and (out_file.stat().st_mode & 0o777) == 0o600
    assert doc["receipts"] == [got[(g, e)].hex() for e in range(LAST + 1) if e != 40]
    assert doc["attested_epoch"] == LAST + 1 and doc["group"] == g.hex()
    p = cli(member_home, "commits", "evidence", "--group", (b"\x77" * 16).hex())
    assert p.returncode == 2 and json.loads(p.stdout)["receipts"] == []     # nothing held for it
    for bad in (["--group", "zz"], ["--group", g.hex(), "--attested-epoch", "-1"]):   # refused, nothing printed
        p = cli(member_home, "commits", "evidence", *bad)
        assert p.returncode == 2 and p.stdout == "" and p.stderr, (bad, p.stdout)
    with service.Sequencer(home) as s:
        key = s.public_key.hex()
    p = cli(home, "sequencer", "recover", "--group", g.hex(), "--binding", f"0:{key}", str(out_file))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    # down from the head to 41, up from the copy's epoch 4 to 39: all but the hole
    assert (out["outcome"], out["refilled"], out["missing"]) == ("refilled", LAST - BACKUP_AT - 1, 1)
    with service.Sequencer(home) as s:
        assert s.receipt(g, 41) == got[(g, 41)] and s.receipt(g, 39) == got[(g, 39)]
        assert s.receipt(g, 40) == service.Absent(discontinuity=False)
