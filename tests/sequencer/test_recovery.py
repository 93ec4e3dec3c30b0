"""Recovery after sequencer state loss (SOVM §22.6 steps 1-5): converging
evidence resumes; divergent chains and double receipts fail closed; no evidence goes to the
genesis reset; a naked epoch assertion is never enough."""
from __future__ import annotations

import shutil

import pytest

from agent.sequencer import member, receipts, recovery, service
from agent.sequencer.framing import encode_private_message

from test_member import G, RogueSequencer
from tests.cli_cmd import agent_cmd, agent_env



def history(tmp_path, n=6):
    """A real sequencer accepts n Commits; returns (home, key, receipts)."""
    home = tmp_path / "old"
    service.init(home)
    with service.Sequencer(home) as s:
        s.register(G, 0)
        rx = [s.submit(encode_private_message(G, e)).receipt for e in range(n)]
        return home, s.public_key, rx


def ev(name, rx, attested, gaps=(), statements=()):
    if statements:
        return recovery.MemberEvidence(name, tuple(rx), attested, tuple(gaps), tuple(statements))
    return recovery.MemberEvidence(name, tuple(rx), attested, tuple(gaps))


def test_converging_evidence_resumes_and_the_next_receipt_chains_to_the_recovered_head(tmp_path):
    home, key, rx = history(tmp_path)
    shutil.rmtree(home)                                  # state lost, key and all
    new_home = tmp_path / "new"
    new_key = service.init(new_home)
    with service.Sequencer(new_home) as s:
        out = s.recover(G, [ev("a", rx, 6), ev("b", rx[3:], 6), ev("c", rx[:4], 4)], {0: key, 6: new_key})
        assert isinstance(out, recovery.Resume) and out.current_epoch == 6 and out.head.raw == rx[5]
        assert s.store.group(G).current_epoch == 6 and s.receipt(G, 5) == rx[5]
        assert isinstance(s.submit(encode_private_message(G, 5, ciphertext=b"late")), service.Rejected)
        nxt = s.submit(encode_private_message(G, 6)).receipt
    r = receipts.verify_receipt(nxt, new_key)
    assert r.previous_receipt_hash == receipts.receipt_hash(rx[5])
    c = member.ReceiptChain(G, bindings={0: key, 6: new_key})
    for raw in rx + [nxt]:
        assert c.add(raw) == member.ACCEPTED


def test_double_receipts_fail_closed_and_the_group_stays_frozen(tmp_path):
    rs = RogueSequencer()
    base = rs.chain(3)
    other = rs.sign(2, b"other commit", receipts.receipt_hash(base[1]))
    home = tmp_path / "new"
    service.init(home)
    with service.Sequencer(home) as s:
        out = s.recover(G, [ev("a", base, 3), ev("b", base[:2] + [other], 3)], {0: rs.kid})
        assert isinstance(out, recovery.FailClosed) and out.evidence[0].kind == "double_receipt"
        st = s.store.group(G)
        assert st.failed_closed
        r = s.submit(encode_private_message(G, st.current_epoch))
        assert isinstance(r, service.Rejected) and r.reason == "failed_closed"
        assert [e["kind"] for e in s.store.events()] == ["equivocation"]
        with pytest.raises(service.SequencerRefused):
            s.recover(G, [ev("a", base, 3)], {0: rs.kid})


def test_divergent_chains_fail_closed():
    rs = RogueSequencer()
    a = rs.chain(4)
    fork2 = rs.sign(2, b"fork", receipts.receipt_hash(a[1]))
    fork3 = rs.sign(3, b"fork3", receipts.receipt_hash(fork2))
    out = recovery.assess(G, [ev("a", a, 4), ev("b", [fork3], 4)], {0: rs.kid})
    assert isinstance(out, recovery.FailClosed)       # two receipts for epoch 3
    out = recovery.assess(G, [ev("a", a[:3], 3), ev("b", [a[0], a[1], fork2], 3)], {0: rs.kid})
    assert isinstance(out, recovery.FailClosed)


def test_a_discontinuity_claimed_over_a_held_receipt_fails_closed():
    rs = RogueSequencer()
    a = rs.chain(4)
    stated = rs.statement(2, receipts.receipt_hash(a[1]))
    out = recovery.assess(G, [ev("a", a, 4), ev("b", [a[0], a[1]], 2, gaps=[2], statements=[stated])], {0: rs.kid})
    assert isinstance(out, recovery.FailClosed) and out.evidence[0].kind == "discontinuity_contradicted"
    # §22.6: a claim without the sequencer's signed statement is neither a gap nor evidence: named
    out = recovery.assess(G, [ev("a", a, 4), ev("b", [a[0], a[1]], 2, gaps=[2])], {0: rs.kid})
    assert isinstance(out, recovery.Resume) and out.current_epoch == 4 and out.unsigned == (("b", 2),)


def test_recorded_gap_continuous_on_both_sides_resumes():
    rs = RogueSequencer()
    r0 = rs.sign(0, b"c0", None)
    r1 = rs.sign(1, b"c1", receipts.receipt_hash(r0))
    r3 = rs.sign(3, b"c3", receipts.receipt_hash(r1))        # epoch 2: receipt absent, recorded
    gap = rs.statement(2, receipts.receipt_hash(r1))
    out = recovery.assess(G, [ev("a", [r0, r1, r3], 4, gaps=[2], statements=[gap]), ev("b", [r1, r3], 4, gaps=[2])],
                          {0: rs.kid})
    assert isinstance(out, recovery.Resume) and out.current_epoch == 4 and out.discontinuities == (2,)
    assert out.statements == {2: gap} and out.unsigned == ()      # b's claim is the gap a holds the statement of


def test_a_recovered_gap_keeps_the_old_sequencers_signed_statement(tmp_path):
    """§22.6 step 4: a gap recovered from members' evidence is served and handed on with the signed
    statement the members hold (verified under the sequencer bound at its epoch, as the member
    library does), exactly as a gap this sequencer recorded itself; one signed by a stranger is
    not adopted, and a statement contradicting a member's chain fails closed."""
    rs, stranger = RogueSequencer(), RogueSequencer()
    r0 = rs.sign(0, b"c0", None)
    r1 = rs.sign(1, b"c1", receipts.receipt_hash(r0))
    gap = rs.statement(2, receipts.receipt_hash(r1), commit=b"c2")
    r3 = rs.sign(3, b"c3", receipts.receipt_hash(r1))
    home = tmp_path / "new"
    new_key = service.init(home)
    with service.Sequencer(home) as s:
        out = s.recover(G, [ev("a", [r0, r1, r3], 4, gaps=[2], statements=[gap]),
                            ev("b", [r1, r3], 4, gaps=[2], statements=[stranger.statement(2, None)])],
                        {0: rs.kid, 4: new_key})
        assert isinstance(out, recovery.Resume) and out.statements == {2: gap}
        assert s.receipt(G, 2) == service.Absent(discontinuity=True) and s.receipt(G, 2).statement == gap
        assert [g["statements"] for g in s.status()["groups"] if g["group"] == G.hex()] == [{"2": gap.hex()}]
        package = s.handoff(G)                              # and it transfers on migration
    assert package["statements"] == {"2": gap.hex()}
    wrong = rs.statement(2, receipts.receipt_hash(r0))      # names another receipt than epoch 1's
    out = recovery.assess(G, [ev("a", [r0, r1, r3], 4, gaps=[2], statements=[wrong])], {0: rs.kid})
    assert isinstance(out, recovery.FailClosed) and out.evidence[0].kind == "divergent_chain"


def test_no_usable_evidence_goes_to_genesis_reset_never_a_naked_epoch(tmp_path):
    rs, stranger = RogueSequencer(), RogueSequencer()
    home = tmp_path / "new"
    service.init(home)
    with service.Sequencer(home) as s:
        out = s.recover(G, [ev("a", [], 7), ev("b", stranger.chain(2), 2)], {0: rs.kid})
        assert isinstance(out, recovery.GenesisReset) and len(out.unusable) == 2
        assert s.store.group(G) is None                  # nothing invented
        assert s.store.events()[-1]["kind"] == "recovery_refused"


def test_inconsistent_attestation_and_holes_do_not_converge():
    rs = RogueSequencer()
    a = rs.chain(5)
    out = recovery.assess(G, [ev("a", a, 9)], {0: rs.kid})   # head 4 but attests epoch 9
    assert isinstance(out, recovery.GenesisReset)
    out = recovery.assess(G, [ev("a", a[:2], 2), ev("b", a[4:], 5)], {0: rs.kid})
    assert isinstance(out, recovery.NotConverged)           # epochs 2-3: nobody holds them


def test_recover_verb(tmp_path):
    import json
    import subprocess
    home_old, key, rx = history(tmp_path, 4)
    shutil.rmtree(home_old)
    home = tmp_path / "new"

    def cli(*args):
        return subprocess.run([*agent_cmd(), "--home", str(home), "sequencer", *args],
                              capture_output=True, text=True, env=agent_env())
    new_key = json.loads(cli("init").stdout)["sequencer_key"]
    f = tmp_path / "alice.json"
    f.write_text(json.dumps({"member": "alice", "receipts": [r.hex() for r in rx], "attested_epoch": 4}))
    empty = tmp_path / "bob.json"
    empty.write_text(json.dumps({"member": "bob", "receipts": [], "attested_epoch": 9}))
    p = cli("recover", "--group", G.hex(), "--binding", f"0:{key.hex()}", "--binding", f"4:{new_key}", str(empty))
    assert p.returncode == 2 and json.loads(p.stdout)["outcome"] == "genesis_reset"
    p = cli("recover", "--group", G.hex(), "--binding", f"0:{key.hex()}", str(f), str(empty))
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["outcome"] == "resume" and out["current_epoch"] == 4 and out["head"] == rx[3].hex()
    assert json.loads(cli("status").stdout)["groups"][0]["origin"] == "recovered"


def test_recover_verb_takes_the_members_statements(tmp_path):
    import json
    import subprocess
    rs = RogueSequencer()
    r0 = rs.sign(0, b"c0", None)
    gap = rs.statement(1, receipts.receipt_hash(r0))
    r2 = rs.sign(2, b"c2", receipts.receipt_hash(r0))
    home = tmp_path / "new"

    def cli(*args):
        return subprocess.run([*agent_cmd(), "--home", str(home), "sequencer", *args],
                              capture_output=True, text=True, env=agent_env())
    assert cli("init").returncode == 0
    f = tmp_path / "alice.json"
    f.write_text(json.dumps({"member": "alice", "receipts": [r0.hex(), r2.hex()], "attested_epoch": 3,
                             "discontinuities": [1], "statements": [gap.hex()]}))
    p = cli("recover", "--group", G.hex(), "--binding", f"0:{rs.kid.hex()}", str(f))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["statements"] == [1]
    assert json.loads(cli("status").stdout)["groups"][0]["statements"] == {"1": gap.hex()}
