"""Recovery after sequencer state loss (SOVM §22.6 "State loss", steps 1-5). Pure: no I/O.

A sequencer that lost its epoch state never resumes from a naked member epoch assertion. Members
submit their retained receipt chains (or suffixes) with an attestation of their current MLS epoch
(step 1). ``assess`` verifies every receipt's signature against the sequencer bound at its
generation, hash-chain continuity and the consistency of each member's head with its attested
epoch (step 2), and decides:

- ``Resume``: all usable evidence converges on one chain (every member's head lies on it and the
  chain is continuous, across recorded discontinuities only, up to its highest receipt) — the
  sequencer resumes CAS at head.epoch + 1 and chains its next receipt to that head (step 3);
- ``FailClosed``: two receipts for one (group_id, epoch), divergent chains, or a discontinuity
  contradicted by a receipt — proof of prior equivocation (step 4): the group is frozen for audit
  and migration;
- ``NotConverged``: the usable evidence does not reach one head without a hole nobody recorded;
  nothing is resumed (ask more members, or rule on it);
- ``GenesisReset``: no usable receipt evidence survives (step 5): the domain genesis reset of
  §22.10, never invented history.

``refill`` is the same evidence used the other way round, for a sequencer that kept its state but
lost stretches of its receipts table (a state restored past the journal's compaction floor,
docs/sequencer.md "Resume": event ``receipts_lost``): it takes back only receipts (and signed
statements of gaps) that chain, link by link, to the receipts it still holds on either side of a
lost stretch, and fails closed on any receipt or statement that contradicts them.

How a member's epoch attestation is authenticated (MLS: e.g. an exported secret or a signed
statement) is the caller's to check before evidence reaches ``assess``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from agent.sequencer.member import Evidence, ReceiptChain
from agent.sequencer.receipts import Receipt, ReceiptError, Statement, verify_receipt, verify_statement


@dataclass(frozen=True)
class MemberEvidence:
    member: str
    receipts: tuple[bytes, ...]
    attested_epoch: int                     # the member's current MLS epoch
    discontinuities: tuple[int, ...] = ()   # gaps the sequencer recorded and surfaced
    statements: tuple[bytes, ...] = ()      # the sequencer's signed statements of those gaps (§22.6 step 4)


@dataclass(frozen=True)
class Resume:
    head: Receipt
    current_epoch: int
    receipts: tuple[Receipt, ...]           # the verified chain, ascending
    discontinuities: tuple[int, ...]
    unusable: tuple[str, ...] = ()          # members whose evidence was not usable, and why
    statements: dict = field(default_factory=dict)   # gap epoch -> the bound sequencer's signed statement


@dataclass(frozen=True)
class FailClosed:
    evidence: tuple[Evidence, ...]


@dataclass(frozen=True)
class NotConverged:
    reason: str
    unusable: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenesisReset:
    unusable: tuple[str, ...] = ()


@dataclass(frozen=True)
class Refill:
    """What ``refill`` takes back: receipts and gap statements on a chain verified link by link
    from a receipt held on either side of a lost stretch; ``unverified``: epochs of the stretches
    the evidence offered something for that is not on such a chain (a hole between: not taken)."""

    receipts: tuple[Receipt, ...]
    statements: tuple[Statement, ...]
    unverified: tuple[int, ...]
    unusable: tuple[str, ...] = ()


@dataclass(frozen=True)
class Refilled:
    """What the sequencer took back (``refill``) and how many lost epochs still have neither a
    receipt nor a recorded gap."""

    refill: Refill
    missing: int


Outcome = Union[Resume, FailClosed, NotConverged, GenesisReset]


def assess(group_id: bytes, evidence: list[MemberEvidence], bindings: dict[int, bytes]) -> Outcome:
    union = ReceiptChain(group_id, bindings=dict(bindings))
    unusable: list[str] = []
    heads: list[int] = []
    for ev in evidence:
        own = ReceiptChain(group_id, bindings=dict(bindings))
        for e in ev.discontinuities:
            own.claim_discontinuity(e)
            union.claim_discontinuity(e)
        for raw in ev.receipts:
            own.add(raw)
            union.add(raw)
        for raw in ev.statements:
            # checked as a member checks a relayed statement: signature, the sequencer bound at its
            # epoch (a stranger's is not adopted), one statement per gap, the receipt it names
            # (after the receipts: it must name the last one before the gap)
            own.add_statement(raw)
            union.add_statement(raw)
        if union.equivocation or own.equivocation:
            return FailClosed(tuple(union.evidence) + tuple(own.evidence))
        if not own.receipts:
            # step 2 / "never a naked epoch assertion": no verifiable receipt, no evidence
            unusable.append(f"{ev.member}: no receipt verifies under the bound sequencer")
            continue
        head = own.head()
        if head.epoch + 1 != ev.attested_epoch:
            unusable.append(f"{ev.member}: head epoch {head.epoch} inconsistent with attested epoch "
                            f"{ev.attested_epoch}")
            continue
        heads.append(head.epoch)
    if not heads:
        return GenesisReset(tuple(unusable))
    top = union.head()
    # continuity: from the lowest usable head to the top, every epoch has a receipt or a recorded gap
    low = min(heads)
    missing = [e for e in range(low, top.epoch + 1) if e not in union.receipts and e not in union.discontinuities]
    if missing:
        return NotConverged(f"epochs {missing[:5]} between the members' heads have neither a receipt nor "
                            "a recorded discontinuity", tuple(unusable))
    if top.epoch not in heads:
        return NotConverged(f"no member attests the highest receipt (epoch {top.epoch})", tuple(unusable))
    chain = tuple(union.receipts[e] for e in sorted(union.receipts))
    gaps = tuple(sorted(union.discontinuities))
    stated = {e: union.statements[e].raw for e in gaps if e in union.statements}
    return Resume(top, top.epoch + 1, chain, gaps, tuple(unusable), stated)


def refill(group_id: bytes, lost: list[tuple[int, int]], held: dict[int, bytes], stated: dict[int, bytes],
           evidence: list[MemberEvidence], bindings: dict[int, bytes]) -> Union[Refill, FailClosed]:
    """Receipts (and signed gap statements) of the lost stretches ``lost`` [(first, last)] that
    members' evidence gives back, verified against what the sequencer holds: ``held`` (epoch ->
    its receipt bytes) and ``stated`` (epoch -> its gap statements) around and inside them.

    Each receipt and statement must verify under the sequencer bound at its epoch (§22.6
    singularity). From the held receipt just above a stretch the chain is walked down (a receipt
    at E is taken when its hash is the previous_receipt_hash expected there; a gap at E when a
    signed statement for E names that same receipt: the chain continues across it, §22.6 step 5),
    and from the held receipt just below it up (a receipt whose previous_receipt_hash names the
    last one taken); the walk stops at a hole. Two different receipts or statements for one epoch,
    a receipt beside a statement, or a receipt where the chain expects another: FailClosed
    (§22.6 step 4), whoever holds which."""
    bound = ReceiptChain(group_id, bindings=dict(bindings)).bound_key
    rx: dict[int, Receipt] = {}
    st: dict[int, Statement] = {}
    found: list[Evidence] = []
    unusable: list[str] = []

    def keep(pool: dict, item, what: str, same) -> None:
        # the evidence kinds of member.py: double_receipt, double_statement
        old = pool.get(item.epoch)
        if old is not None and not same(old, item):
            found.append(Evidence(f"double_{what}", group_id, item.epoch, (old.raw, item.raw),
                                  f"two different {what}s for one (group_id, epoch)"))
        elif old is None:
            pool[item.epoch] = item

    def usable(offered: list, verify, what: str):
        # under the sequencer bound at its epoch, for this group: else named unusable, not taken
        for raw, who in offered:
            try:
                item = verify(raw)
            except ReceiptError as e:
                unusable.append(f"{who}: a {what} does not verify ({e})")
                continue
            if item.group_id != group_id or bound(item.epoch) != item.kid:
                unusable.append(f"{who}: the {what} for epoch {item.epoch} is not the bound sequencer's for this group")
                continue
            yield item

    for r in usable([(raw, "ours") for raw in held.values()] +
                    [(raw, ev.member) for ev in evidence for raw in ev.receipts], verify_receipt, "receipt"):
        keep(rx, r, "receipt", lambda a, b: a.raw == b.raw)
    for s in usable([(raw, "ours") for raw in stated.values()] +
                    [(raw, ev.member) for ev in evidence for raw in ev.statements], verify_statement, "statement"):
        keep(st, s, "statement", lambda a, b: a.payload_key == b.payload_key)
    for e in sorted(set(rx) & set(st)):
        found.append(Evidence("discontinuity_contradicted", group_id, e, (rx[e].raw, st[e].raw),
                              "a receipt for an epoch the sequencer stated a gap for"))
    taken_r: dict[int, Receipt] = {}
    taken_s: dict[int, Statement] = {}

    def walk(epochs, anchor: Receipt, down: bool) -> Optional[int]:
        """Take epochs in order while each links to the last taken (``anchor``: a held receipt to
        start); the last epoch taken, or None. Down: a receipt's hash is the previous hash named
        above it; up: a receipt names the hash below it. A gap's statement names the same receipt
        the chain does across it (§22.6 step 5)."""
        link = anchor.previous_receipt_hash if down else anchor.receipt_hash
        reached = None
        for e in epochs:
            r, s = rx.get(e), st.get(e)
            if r is not None:
                if (r.receipt_hash if down else r.previous_receipt_hash) != link:
                    found.append(Evidence("divergent_chain", group_id, e, (anchor.raw, r.raw),
                                          f"the receipt for epoch {e} is not the one the chain names"))
                    break
                taken_r[e] = anchor = r
                link = r.previous_receipt_hash if down else r.receipt_hash
            elif s is None or s.previous_receipt_hash != link:
                break                                   # a hole: nothing below it is verified
            else:
                taken_s[e] = s
            reached = e
        return reached

    for first, last in lost:
        low = last + 1
        if last + 1 in held and last + 1 in rx:
            got = walk(range(last, first - 1, -1), rx[last + 1], down=True)
            low = low if got is None else got
        if first - 1 in held and first - 1 in rx:
            walk(range(first, low), rx[first - 1], down=False)
    if found:
        return FailClosed(tuple(found))
    in_lost = [e for e in set(rx) | set(st) if any(a <= e <= b for a, b in lost)]
    fresh_r = tuple(taken_r[e] for e in sorted(taken_r) if e not in held)
    fresh_s = tuple(taken_s[e] for e in sorted(taken_s) if e not in stated)
    unverified = tuple(sorted(e for e in in_lost if e not in taken_r and e not in taken_s))
    return Refill(fresh_r, fresh_s, unverified, tuple(unusable))
