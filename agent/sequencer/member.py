"""The member side of sequencing receipts (SOVM §22.5-§22.6). Pure: no I/O.

A member keeps every valid receipt for its group (``ReceiptChain``), compares receipt heads it
hears from other members, and collects equivocation evidence, a pure function of the set of valid
receipts and signed statements it holds, whatever order they arrived in (§22.5): two receipts for
one (group_id, epoch) that are not the same bytes; a receipt whose previous_receipt_hash is not the
hash of the receipt below it across recorded gaps; a signed discontinuity for an epoch the member
holds a valid receipt for.

A discontinuity counts only as the sequencer's signed statement (``add_statement``), checked like
a receipt; a gap claimed without one is neither a gap nor evidence (kept in ``unsigned``, surfaced
as UNSIGNED_CLAIM). The chain takes a receipt only where its predecessor is known; one whose
predecessor is unknown is held (``pending``) and still counts as evidence. A receipt signed by a
key other than the bound sequencer's is not applied; it is retained for attribution (§22.6)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from agent.sequencer.receipts import Receipt, ReceiptError, Statement, receipt_hash, verify_receipt, verify_statement

ACCEPTED, DUPLICATE, EQUIVOCATION, REJECTED, HELD = "accepted", "duplicate", "equivocation", "rejected", "held"
UNSIGNED_CLAIM = "discontinuity_unsigned"     # a gap claimed without the sequencer's signed statement


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
    valid: dict[int, list[Receipt]] = field(default_factory=dict)   # every valid receipt, by epoch
    pending: list[Receipt] = field(default_factory=list)             # valid, predecessor unknown
    unsigned: list[int] = field(default_factory=list)                # epochs of unsigned gap claims

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

    def top_epoch(self) -> Optional[int]:
        """The highest epoch any valid receipt is held for, in the chain or held for its predecessor."""
        return max((e for e, rs in self.valid.items() if rs), default=None)

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
            if r.raw not in self.held:
                self.held.append(r.raw)
            return HELD
        if r.kid != bound:
            self.attributed.append((r.kid, r.raw))  # §22.6: rejected and retained for attribution
            return REJECTED
        same = self.valid.setdefault(r.epoch, [])
        if any(o.raw == r.raw for o in same):
            return DUPLICATE
        before = len(self.evidence)
        # §22.5: every valid receipt counts as evidence, taken into the chain or held for its
        # predecessor, so the verdict does not depend on which of two arrived first
        for o in same:
            self._evidence("double_receipt", r.epoch, (o.raw, r.raw), "two valid receipts for one (group_id, epoch)")
        excluded = bool(same)
        same.append(r)
        st = self.statements.get(r.epoch)
        if st is not None:
            # §22.6: the receipt falsifies the claim: the member keeps its receipt, and the claim
            # is evidence, not a gap
            self.discontinuities.discard(r.epoch)
            self._evidence("discontinuity_contradicted", r.epoch, (r.raw, st.raw),
                           "a valid receipt for an epoch the sequencer declared a discontinuity")
        lower = self._adjacent_below(r.epoch)
        if lower and r.previous_receipt_hash not in {q.receipt_hash for q in lower}:
            self._evidence("divergent_chain", r.epoch, (lower[0].raw, r.raw),
                           f"previous_receipt_hash does not name the receipt for epoch {lower[0].epoch}")
            excluded = True
        seen = len(self.evidence)
        self._check_above(r.epoch, same)
        if excluded or len(self.evidence) > seen:
            return EQUIVOCATION         # kept as evidence, not taken into the chain
        self.pending.append(r)
        self._settle(r)
        if len(self.evidence) > before:
            return EQUIVOCATION
        return ACCEPTED if self.receipts.get(r.epoch) is r else HELD

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
            if st.raw not in self.held_statements:
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
        return self._record_gap(st)

    def claim_discontinuity(self, epoch: int) -> str:
        """A gap claimed without the sequencer's signed statement (a member's word, a broker
        record): §22.6 counts only a gap the sequencer recorded, so it is neither a gap nor
        evidence. Kept in ``unsigned`` to be surfaced (UNSIGNED_CLAIM)."""
        if epoch not in self.unsigned:
            self.unsigned.append(epoch)
        return REJECTED

    def _record_gap(self, st: Statement) -> str:
        before = len(self.evidence)
        here = self.valid.get(st.epoch, [])
        for r in here:
            # §22.6: a member holding a valid receipt for the epoch does not accept the claim
            self._evidence("discontinuity_contradicted", st.epoch, (r.raw, st.raw),
                           "the sequencer declared a discontinuity for an epoch this member holds a receipt for")
        if here:
            return EQUIVOCATION
        lower = self._adjacent_below(st.epoch)
        if lower and st.previous_receipt_hash is not None and \
                st.previous_receipt_hash not in {q.receipt_hash for q in lower}:
            # the statement names the last receipt before the gap: it must be the one held there
            self._evidence("divergent_chain", st.epoch, (lower[0].raw, st.raw),
                           f"the statement of the gap does not name the receipt for epoch {lower[0].epoch}")
        self.discontinuities.add(st.epoch)
        if lower:
            self._check_above(st.epoch, lower)     # the gap joins what is below it to what is above
        self._settle()
        return EQUIVOCATION if len(self.evidence) > before else ACCEPTED

    def _adjacent_below(self, epoch: int) -> Optional[list[Receipt]]:
        """The valid receipts at the nearest epoch below ``epoch`` holding any, every epoch between
        a recorded gap; [] when only gaps (or nothing) lie below epoch 0; None when an epoch
        between has neither (the predecessor is unknown)."""
        e = epoch - 1
        while e >= 0:
            if self.valid.get(e):
                return self.valid[e]
            if e not in self.discontinuities:
                return None
            e -= 1
        return []

    def _check_above(self, epoch: int, below: list[Receipt]) -> None:
        """What is above ``epoch`` across recorded gaps only must name one of ``below`` (the valid
        receipts at ``epoch``, or the last below a new gap): a gap's statement and the next receipt."""
        names = {q.receipt_hash for q in below}
        e = epoch + 1
        while True:
            if self.valid.get(e):
                for u in self.valid[e]:
                    if u.previous_receipt_hash not in names:
                        self._evidence("divergent_chain", e, (below[0].raw, u.raw),
                                       f"the receipt for epoch {e} does not name the one for epoch {below[0].epoch}")
                return
            if e not in self.discontinuities:
                return
            st = self.statements[e]
            if st.previous_receipt_hash is not None and st.previous_receipt_hash not in names:
                self._evidence("divergent_chain", e, (below[0].raw, st.raw),
                               f"the statement of the gap does not name the receipt for epoch {below[0].epoch}")
            e += 1

    def _settle(self, new: Optional[Receipt] = None) -> None:
        """Move held links into the chain while one's predecessor is there (§22.6: a link whose
        predecessor is unknown is held). ``new``: only that link changed, so the others are looked
        at again only once it joined the chain."""
        if new is not None:
            if not self._join(new):
                return
        moved = True
        while moved and self.pending:
            moved = False
            for r in sorted(self.pending, key=lambda x: (x.epoch, x.raw)):
                moved = self._join(r) or moved

    def _join(self, r: Receipt) -> bool:
        """Take ``r`` into the chain if it links: the last receipt below it in the chain, every
        epoch between a recorded gap, is the one it names; below the chain's lowest receipt, a
        link the chain reaches across recorded gaps only anchors it lower."""
        if r.epoch in self.receipts:
            return False
        low = min(self.receipts) if self.receipts else None
        if low is None or r.epoch < low:
            e = r.epoch + 1
            while low is not None and e < low and e in self.discontinuities:
                e += 1
            ok = low is None or e == low
        else:
            e = r.epoch - 1
            while e not in self.receipts and e in self.discontinuities:
                e -= 1
            ok = e in self.receipts and self.receipts[e].receipt_hash == r.previous_receipt_hash
        if ok:
            self.receipts[r.epoch] = r
            self.pending.remove(r)
        return ok

    def _evidence(self, kind: str, epoch: int, raws: tuple[bytes, ...], detail: str) -> None:
        ev = Evidence(kind, self.group_id, epoch, raws, detail)
        if ev not in self.evidence:
            self.evidence.append(ev)


def chain_hash(raw: bytes) -> bytes:
    return receipt_hash(raw)
