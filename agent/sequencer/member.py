"""The member side of sequencing receipts (SOVM §22.5-§22.6; issue 14 item 7). Pure: no I/O.

A member keeps every valid receipt for its group (``ReceiptChain``), compares receipt heads it
hears from other members (gossip through the control group or the broker: the transport is the
caller's), and collects **equivocation evidence**:

- two valid receipts for one (group_id, epoch) that are not the same bytes (different commit
  hashes, or one Commit signed twice: either way two chains fork there, §22.5);
- a receipt whose previous_receipt_hash is not the hash of the last receipt the member holds
  before it, where the epochs between are not all recorded discontinuities (divergent chains);
- a discontinuity claimed for an epoch the member holds a valid receipt for (§22.6: the claim is
  falsified by that receipt; accepting it would accept an assertion over cryptographic proof).

A discontinuity arrives as the sequencer's signed statement (``add_statement``; receipts.py), from
the sequencer, the broker or relayed by any member over the mesh: it is checked like a receipt
(signature, the sequencer bound at its epoch) before it counts as recorded by the sequencer.

A recorded discontinuity is accepted as a durability gap only where the sequencer recorded it and
the chain is continuous on both sides: the first receipt after the gap names the last receipt
before it. A receipt signed by a key other than the bound sequencer's is not applied; it is
retained for attribution (§22.6 singularity).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from agent.sequencer.receipts import Receipt, ReceiptError, Statement, receipt_hash, verify_receipt, verify_statement

ACCEPTED, DUPLICATE, EQUIVOCATION, REJECTED, HELD = "accepted", "duplicate", "equivocation", "rejected", "held"


@dataclass(frozen=True)
class Evidence:
    """Proof (or a member's own contradiction) of sequencer equivocation, with the bytes."""

    kind: str              # "double_receipt", "divergent_chain", "discontinuity_contradicted"
    group_id: bytes
    epoch: int
    receipts: tuple[bytes, ...]
    detail: str = ""


@dataclass
class ReceiptChain:
    group_id: bytes
    sequencer_key: Optional[bytes] = None            # bound from generation (epoch) 0, when given
    receipts: dict[int, Receipt] = field(default_factory=dict)
    discontinuities: set[int] = field(default_factory=set)
    evidence: list[Evidence] = field(default_factory=list)
    attributed: list[tuple[bytes, bytes]] = field(default_factory=list)   # (signer kid, raw) not applied
    held: list[bytes] = field(default_factory=list)
    # §22.6 singularity: generation (MLS epoch) from which a binding takes effect -> the bound
    # sequencer's 33-byte compressed key
    bindings: dict[int, bytes] = field(default_factory=dict)
    binding_forks: list[tuple[int, bytes, bytes]] = field(default_factory=list)
    statements: dict[int, Statement] = field(default_factory=dict)   # signed discontinuity statements
    held_statements: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.sequencer_key is not None and 0 not in self.bindings:
            self.bindings[0] = bytes(self.sequencer_key)

    def bind(self, from_epoch: int, key: bytes) -> None:
        """A control-plane binding of a sequencer to this group from ``from_epoch`` (migration).
        Two bindings at one generation are a fork of the binding record: surfaced, not resolved
        here (contested hand-offs are resolved where hand-offs are recorded)."""
        old = self.bindings.get(from_epoch)
        if old is not None and old != key:
            self.binding_forks.append((from_epoch, old, bytes(key)))
            return
        self.bindings[from_epoch] = bytes(key)
        waiting, self.held = self.held, []
        stated, self.held_statements = self.held_statements, []
        for raw in stated:
            self.add_statement(raw)
        for raw in waiting:
            self.add(raw)

    def bound_key(self, epoch: int) -> Optional[bytes]:
        """The sequencer bound at generation ``epoch``, or None when no binding resolves it."""
        gens = [g for g in self.bindings if g <= epoch]
        if not gens or any(f[0] <= epoch for f in self.binding_forks):
            return None
        return self.bindings[max(gens)]

    @property
    def equivocation(self) -> bool:
        return bool(self.evidence)

    def head(self) -> Optional[Receipt]:
        return self.receipts[max(self.receipts)] if self.receipts else None

    def add(self, raw: bytes) -> str:
        """Keep one receipt (from the sequencer or gossiped by a member)."""
        try:
            r = verify_receipt(raw)
        except ReceiptError:
            return REJECTED
        if r.group_id != self.group_id:
            return REJECTED
        bound = self.bound_key(r.epoch)
        if bound is None:
            # §22.6: the binding in force at this link's generation cannot be resolved: hold the
            # link, neither apply nor reject it (and manufacture no equivocation verdict)
            self.held.append(r.raw)
            return HELD
        if r.kid != bound:
            self.attributed.append((r.kid, r.raw))  # §22.6: rejected and retained for attribution
            return REJECTED
        held = self.receipts.get(r.epoch)
        if held is not None:
            if held.raw == r.raw:
                return DUPLICATE
            self._evidence("double_receipt", r.epoch, (held.raw, r.raw),
                           "two valid receipts for one (group_id, epoch)")
            return EQUIVOCATION
        if r.epoch in self.discontinuities:
            st = self.statements.get(r.epoch)
            self._evidence("discontinuity_contradicted", r.epoch, (r.raw,) + (() if st is None else (st.raw,)),
                           "a valid receipt for an epoch the sequencer declared a discontinuity")
            return EQUIVOCATION
        verdict = self._check_links(r)
        if verdict == ACCEPTED:
            self.receipts[r.epoch] = r
        return verdict

    def observe_head(self, raw: bytes) -> str:
        """A receipt head gossiped by another member: contradicts ours, or is simply kept."""
        return self.add(raw)

    def add_statement(self, raw: bytes) -> str:
        """The sequencer's signed statement of a gap (§22.6 step 4), from anyone who relays it:
        checked as a receipt is (signature; the sequencer bound at its epoch: else held, or
        rejected and attributed), then claimed. Two statements saying the same (a token's
        randomised signature) are one; two that differ are the sequencer contradicting itself."""
        try:
            st = verify_statement(raw)
        except ReceiptError:
            return REJECTED
        if st.group_id != self.group_id:
            return REJECTED
        bound = self.bound_key(st.epoch)
        if bound is None:
            self.held_statements.append(st.raw)
            return HELD
        if st.kid != bound:
            self.attributed.append((st.kid, st.raw))
            return REJECTED
        known = self.statements.get(st.epoch)
        if known is not None:
            if known.payload_key == st.payload_key:
                return DUPLICATE
            self._evidence("double_statement", st.epoch, (known.raw, st.raw),
                           "two different discontinuity statements for one (group_id, epoch)")
            return EQUIVOCATION
        self.statements[st.epoch] = st
        return self.claim_discontinuity(st.epoch, st)

    def claim_discontinuity(self, epoch: int, statement: Optional[Statement] = None) -> str:
        """The sequencer's stated gap at ``epoch`` (surfaced to every member alike, §22.6 step 4).
        A member holding a valid receipt for that epoch does not accept it: the claim is
        falsified by the receipt, equivocation evidence (with both byte strings when signed)."""
        held = self.receipts.get(epoch)
        if held is not None:
            self._evidence("discontinuity_contradicted", epoch,
                           (held.raw,) + (() if statement is None else (statement.raw,)),
                           "the sequencer declared a discontinuity for an epoch this member holds a receipt for")
            return EQUIVOCATION
        if statement is not None and statement.previous_receipt_hash is not None:
            # the statement names the last receipt before the gap: it must be the one this member
            # holds there (every epoch between a recorded gap), or the chains diverge
            below = [e for e in self.receipts if e < epoch]
            if below:
                p = max(below)
                if all(e in self.discontinuities for e in range(p + 1, epoch)) and \
                        self.receipts[p].receipt_hash != statement.previous_receipt_hash:
                    self._evidence("divergent_chain", epoch, (self.receipts[p].raw, statement.raw),
                                   f"the statement of the gap does not name the receipt for epoch {p}")
                    return EQUIVOCATION
        self.discontinuities.add(epoch)
        # a receipt already kept after the gap must chain across it to the last one before it
        later = [e for e in self.receipts if e > epoch]
        if later and self._check_links(self.receipts[min(later)], replace=True) == EQUIVOCATION:
            return EQUIVOCATION
        waiting, self.held = self.held, []
        for raw in waiting:          # receipts held for want of this record
            if self.add(raw) == EQUIVOCATION:
                return EQUIVOCATION
        return ACCEPTED

    def _check_links(self, r: Receipt, replace: bool = False) -> str:
        # the predecessor: the last receipt below r.epoch, every epoch between a recorded gap
        below = [e for e in self.receipts if e < r.epoch]
        if below:
            p = max(below)
            gaps_ok = all(e in self.discontinuities for e in range(p + 1, r.epoch))
            expected = self.receipts[p].receipt_hash
            if gaps_ok and r.previous_receipt_hash != expected:
                self._evidence("divergent_chain", r.epoch, (self.receipts[p].raw, r.raw),
                               f"previous_receipt_hash does not name the receipt for epoch {p}")
                return EQUIVOCATION
            if not gaps_ok and r.previous_receipt_hash == expected and not replace:
                # it chains over epochs that are neither receipted nor (yet) recorded gaps: held
                # until the sequencer's discontinuity record arrives (a gap is stated, not inferred)
                self.held.append(r.raw)
                return HELD
        above = [e for e in self.receipts if e > r.epoch]
        if above and not replace:
            n = min(above)
            if all(e in self.discontinuities for e in range(r.epoch + 1, n)) and \
                    self.receipts[n].previous_receipt_hash != r.receipt_hash:
                self._evidence("divergent_chain", n, (r.raw, self.receipts[n].raw),
                               f"the receipt for epoch {n} does not name this one")
                return EQUIVOCATION
        return ACCEPTED

    def _evidence(self, kind: str, epoch: int, raws: tuple[bytes, ...], detail: str) -> None:
        self.evidence.append(Evidence(kind, self.group_id, epoch, raws, detail))


def chain_hash(raw: bytes) -> bytes:
    return receipt_hash(raw)
