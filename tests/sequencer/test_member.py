"""The member-side validator (agent/sequencer/member.py; SOVM §22.5-§22.6),
including the malicious sequencer that double-signs for two member sets and then declares a
discontinuity. The malicious sequencer signs with its own P-256 key outside any bridge (test-only:
an honest sequencer cannot be made to do this)."""
from __future__ import annotations

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from agent.sequencer import member, receipts, service
from agent.sequencer.framing import encode_private_message
from firmware_bridge.ec import der_to_raw, public_key_compressed

G = bytes.fromhex("f6" * 16)


class RogueSequencer:
    def __init__(self) -> None:
        self.sk = ec.generate_private_key(ec.SECP256R1())
        self.kid = public_key_compressed(self.sk.public_key())

    def sign(self, epoch: int, commit: bytes, prev: bytes | None, gid: bytes = G) -> bytes:
        payload = receipts.payload_bytes(gid, epoch, receipts.commit_hash(commit), prev)
        protected, tbs = receipts.to_be_signed(self.kid, payload)
        return receipts.assemble(protected, payload, der_to_raw(self.sk.sign(tbs, ec.ECDSA(hashes.SHA256()))))

    def statement(self, epoch: int, prev: bytes | None, gid: bytes = G, commit: bytes | None = None) -> bytes:
        """A signed discontinuity statement (receipts.py) for ``epoch``."""
        payload = receipts.statement_payload(gid, epoch, None if commit is None else receipts.commit_hash(commit), prev)
        protected = receipts.statement_protected(self.kid)
        tbs = receipts.sig_structure(protected, payload)
        return receipts.assemble(protected, payload, der_to_raw(self.sk.sign(tbs, ec.ECDSA(hashes.SHA256()))))

    def chain(self, n: int) -> list[bytes]:
        out, prev = [], None
        for e in range(n):
            out.append(self.sign(e, b"commit%d" % e, prev))
            prev = receipts.receipt_hash(out[-1])
        return out


def chain_of(rs: RogueSequencer) -> member.ReceiptChain:
    return member.ReceiptChain(G, rs.kid)


def test_an_honest_chain_is_accepted_in_any_order_and_duplicates_are_quiet():
    rs = RogueSequencer()
    rx = rs.chain(6)
    c = chain_of(rs)
    for raw in [rx[3], rx[0], rx[5], rx[1], rx[2], rx[4], rx[2]]:
        # a link whose predecessor has not arrived yet is held, then taken when it has
        assert c.add(raw) in (member.ACCEPTED, member.DUPLICATE, member.HELD)
    assert not c.equivocation and c.head().raw == rx[5] and sorted(c.receipts) == list(range(6)) and not c.pending


def test_receipts_from_a_real_sequencer(seq):
    seq.register(G, 0)
    c = member.ReceiptChain(G, seq.public_key)
    for e in range(4):
        assert c.add(seq.submit(encode_private_message(G, e)).receipt) == member.ACCEPTED
    assert not c.equivocation


def test_two_receipts_for_one_epoch_are_equivocation():
    rs = RogueSequencer()
    rx = rs.chain(3)
    c = chain_of(rs)
    for raw in rx:
        c.add(raw)
    other = rs.sign(2, b"another commit", receipts.receipt_hash(rx[1]))
    assert c.add(other) == member.EQUIVOCATION
    assert c.evidence[0].kind == "double_receipt" and set(c.evidence[0].receipts) == {rx[2], other}


def test_a_resigned_receipt_for_the_same_commit_is_still_a_fork():
    rs = RogueSequencer()
    rx = rs.chain(2)
    c = chain_of(rs)
    c.add(rx[0])
    c.add(rx[1])
    again = rs.sign(1, b"commit1", receipts.receipt_hash(rx[0]))   # ECDSA: new nonce, new bytes
    assert again != rx[1] and c.add(again) == member.EQUIVOCATION


def test_divergent_chains_are_equivocation():
    rs = RogueSequencer()
    rx = rs.chain(3)
    c = chain_of(rs)
    c.add(rx[0])
    c.add(rx[1])
    fork = rs.sign(2, b"commit2", receipts.receipt_hash(rs.sign(1, b"x", None)))
    assert c.add(fork) == member.EQUIVOCATION and c.evidence[0].kind == "divergent_chain"


def test_a_recorded_discontinuity_continuous_on_both_sides_is_a_durability_gap():
    rs = RogueSequencer()
    r0 = rs.sign(0, b"c0", None)
    r2 = rs.sign(2, b"c2", receipts.receipt_hash(r0))      # chains over epoch 1 to the last before it
    c = chain_of(rs)
    c.add(r0)
    assert c.add(r2) == member.HELD                        # a gap is stated, not inferred
    # §22.6: a gap claimed without the sequencer's signed statement is neither a gap nor evidence
    assert c.claim_discontinuity(1) == member.REJECTED and c.unsigned == [1]
    assert 1 not in c.discontinuities and not c.equivocation and 2 not in c.receipts
    assert c.add_statement(rs.statement(1, receipts.receipt_hash(r0))) == member.ACCEPTED
    assert not c.equivocation and c.head().raw == r2 and c.held == [] and not c.pending
    # a gap the chain does not respect: the receipt after it names something else
    c2 = chain_of(rs)
    c2.add(r0)
    c2.add_statement(rs.statement(1, receipts.receipt_hash(r0)))
    bad = rs.sign(2, b"c2", receipts.receipt_hash(rs.sign(1, b"c1", receipts.receipt_hash(r0))))
    assert c2.add(bad) == member.EQUIVOCATION


def test_malicious_sequencer_double_signs_then_declares_a_discontinuity():
    """§22.6: receipt A to one member set, B to another for the same epoch, then the epoch is
    declared a discontinuity and the chain continues. Every member holding A or B flags
    equivocation; a member holding neither cannot check the claim and accepts the gap."""
    rs = RogueSequencer()
    base = rs.chain(3)                                      # epochs 0..2, seen by everyone
    a = rs.sign(3, b"commit A", receipts.receipt_hash(base[2]))
    b = rs.sign(3, b"commit B", receipts.receipt_hash(base[2]))
    after = rs.sign(4, b"commit 4", receipts.receipt_hash(base[2]))   # chains across the "gap"
    set_a, set_b, bystander = chain_of(rs), chain_of(rs), chain_of(rs)
    for c in (set_a, set_b, bystander):
        for raw in base:
            c.add(raw)
    set_a.add(a)
    set_b.add(b)
    st = rs.statement(3, receipts.receipt_hash(base[2]))
    for c in (set_a, set_b, bystander):
        c.add_statement(st)
        c.add(after)
    assert set_a.equivocation and set_a.evidence[0].kind == "discontinuity_contradicted"
    assert set_b.equivocation and set_b.evidence[0].kind == "discontinuity_contradicted"
    assert not bystander.equivocation and bystander.head().raw == after
    # §22.6: the members holding A or B keep their receipt for 3 in the chain; the claim is evidence
    assert set_a.receipts[3].raw == a and 3 not in set_a.discontinuities
    # gossip of heads: the bystander later hears B from a member of set_b
    assert bystander.observe_head(b) == member.EQUIVOCATION


def test_signed_statements_double_signing_then_a_declared_discontinuity():
    """The same attack with the sequencer's signed statement of the gap (add_statement): the
    evidence carries both the member's receipt and the statement, each signed by the bound
    sequencer: proof, not a member's word. A statement from an unbound signer is attributed, one
    whose binding is unknown is held, one naming another predecessor is a divergent chain."""
    rs = RogueSequencer()
    base = rs.chain(3)
    a = rs.sign(3, b"commit A", receipts.receipt_hash(base[2]))
    st = rs.statement(3, receipts.receipt_hash(base[2]))
    after = rs.sign(4, b"commit 4", receipts.receipt_hash(base[2]))
    holder, bystander = chain_of(rs), chain_of(rs)
    for c in (holder, bystander):
        for raw in base:
            c.add(raw)
    holder.add(a)
    assert holder.add_statement(st) == member.EQUIVOCATION
    assert [(e.kind, e.receipts) for e in holder.evidence] == [("discontinuity_contradicted", (a, st))]
    assert bystander.add_statement(st) == member.ACCEPTED and bystander.add(after) == member.ACCEPTED
    assert bystander.add_statement(st) == member.DUPLICATE and not bystander.equivocation
    assert bystander.add(a) == member.EQUIVOCATION          # a receipt for the stated gap, heard later
    assert bystander.evidence[0].receipts == (a, st)
    other = RogueSequencer()
    c = chain_of(rs)
    assert c.add_statement(other.statement(3, None)) == member.REJECTED and c.attributed
    unbound = member.ReceiptChain(G)
    assert unbound.add_statement(st) == member.HELD
    unbound.bind(0, rs.kid)
    assert 3 in unbound.discontinuities and not unbound.held_statements
    c = chain_of(rs)
    for raw in base:
        c.add(raw)
    assert c.add_statement(rs.statement(3, receipts.receipt_hash(base[1]))) == member.EQUIVOCATION
    assert c.evidence[0].kind == "divergent_chain"


@pytest.mark.parametrize("variant", ["from_a", "from_b"])
def test_malicious_sequencer_chaining_from_one_copy(variant):
    rs = RogueSequencer()
    base = rs.chain(3)
    a = rs.sign(3, b"commit A", receipts.receipt_hash(base[2]))
    b = rs.sign(3, b"commit B", receipts.receipt_hash(base[2]))
    after = rs.sign(4, b"commit 4", receipts.receipt_hash(a if variant == "from_a" else b))
    holders = {"a": chain_of(rs), "b": chain_of(rs), "none": chain_of(rs)}
    for name, c in holders.items():
        for raw in base:
            c.add(raw)
        if name != "none":
            c.add(a if name == "a" else b)
        c.add_statement(rs.statement(3, receipts.receipt_hash(base[2])))
        c.add(after)
    assert holders["a"].equivocation and holders["b"].equivocation
    assert holders["none"].equivocation     # the receipt after the gap does not name the last before it


def test_a_receipt_from_an_unbound_signer_is_rejected_and_retained():
    bound, rotated_out = RogueSequencer(), RogueSequencer()
    c = chain_of(bound)
    raw = rotated_out.sign(0, b"c0", None)
    assert c.add(raw) == member.REJECTED
    assert c.attributed == [(rotated_out.kid, raw)] and not c.receipts and not c.equivocation


def test_the_sequencer_service_never_gives_members_two_receipts(tmp_path):
    """An honest sequencer restarted many times: members that keep everything see no evidence."""
    home = tmp_path / "s"
    service.init(home)
    c = None
    for round_ in range(3):
        with service.Sequencer(home) as s:
            if c is None:
                s.register(G, 0)
                c = member.ReceiptChain(G, s.public_key)
            for e in range(round_ * 3, round_ * 3 + 3):
                c.add(s.submit(encode_private_message(G, e)).receipt)
                c.add(s.receipt(G, e))
    assert not c.equivocation and len(c.receipts) == 9


def test_migration_binding_by_generation_rotated_out_signer_attributed_unknown_binding_held():
    """§22.6: old sequencer bound from 0, new from 3; the new one's first receipt chains to the
    old one's last. A receipt by the old one at generation >= 3 is rejected and retained; with no
    binding for a generation the link is held until the binding arrives."""
    old, new = RogueSequencer(), RogueSequencer()
    rx = old.chain(3)
    r3 = new.sign(3, b"c3", receipts.receipt_hash(rx[2]))
    late_old = old.sign(4, b"c4", receipts.receipt_hash(r3))
    c = member.ReceiptChain(G, bindings={0: old.kid})
    for raw in rx:
        assert c.add(raw) == member.ACCEPTED
    assert c.add(r3) == member.REJECTED and c.attributed[-1] == (new.kid, r3)   # not yet bound: old key rules
    c.bind(3, new.kid)
    assert c.add(r3) == member.ACCEPTED
    assert c.add(late_old) == member.REJECTED and c.attributed[-1] == (old.kid, late_old)
    assert not c.equivocation
    unbound = member.ReceiptChain(G, bindings={5: new.kid})
    assert unbound.add(rx[0]) == member.HELD and unbound.held == [rx[0]]
    unbound.bind(0, old.kid)
    assert unbound.held == [] and 0 in unbound.receipts


def test_two_bindings_at_one_generation_surface_and_hold():
    a, b = RogueSequencer(), RogueSequencer()
    c = member.ReceiptChain(G, bindings={0: a.kid})
    c.bind(0, b.kid)
    assert c.binding_forks == [(0, a.kid, b.kid)]
    assert c.add(a.sign(0, b"c0", None)) == member.HELD
