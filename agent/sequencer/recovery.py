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

How a member's epoch attestation is authenticated (MLS: e.g. an exported secret or a signed
statement) is the caller's to check before evidence reaches ``assess``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from agent.sequencer.member import Evidence, ReceiptChain
from agent.sequencer.receipts import Receipt


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
