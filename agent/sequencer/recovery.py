"""Recovery after sequencer state loss (SOVM §22.6 "State loss", steps 1-5). Pure: no I/O.

A sequencer that lost its epoch state never resumes from a naked member epoch assertion. Members
submit their retained receipt chains with an attestation of their current MLS epoch (step 1);
``assess`` verifies every receipt against the sequencer bound at its generation, the hash chain
and each member's head against its attested epoch (step 2), and decides ``Resume`` (all evidence
converges on one chain: resume at head.epoch + 1, step 3), ``FailClosed`` (proof of equivocation:
frozen for audit and migration, step 4), ``NotConverged`` (a hole nobody recorded: nothing
resumed) or ``GenesisReset`` (no usable evidence: the §22.10 reset, step 5).

``refill`` uses the same evidence for a sequencer that kept its state but lost stretches of its
receipts (docs/sequencer.md "Resume"): it takes back only what chains, link by link, to the
receipts it still holds, and fails closed on anything that contradicts them. How a member's epoch
attestation is authenticated is the caller's to check before evidence reaches ``assess``."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Union

from agent.sequencer.core import EPOCH_LIMIT
from agent.sequencer.member import UNSIGNED_CLAIM, Evidence, ReceiptChain
from agent.sequencer.receipts import (Receipt, ReceiptError, Statement, parse_receipt, parse_statement,
                                      verify_receipt, verify_statement)


@dataclass(frozen=True)
class MemberEvidence:
    member: str
    receipts: tuple[bytes, ...]
    attested_epoch: int                     # the member's current MLS epoch
    discontinuities: tuple[int, ...] = ()   # gaps the member says the sequencer recorded: a claim only
    # the sequencer's signed statements of those gaps (§22.6 step 4): what makes a gap count
    statements: tuple[bytes, ...] = ()


BAD_EVIDENCE = "bad_evidence"


class EvidenceError(ValueError):
    """Evidence bytes that are not a member's evidence document. ``reason`` is a stable code."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"{BAD_EVIDENCE}: {detail}")
        self.reason = BAD_EVIDENCE
        self.detail = detail


MAX_MEMBER_NAME = 256
MAX_OFFERED = 1024      # receipts and statements in one evidence request over the broker (`lost`)


def parse_evidence(data: Union[bytes, str], group_id: Optional[bytes] = None,
                   max_items: Optional[int] = None) -> MemberEvidence:
    """The one boundary for a member's evidence, from a file (`sequencer recover`) or a broker
    client (`sequencer run`, topic ``evidence``): JSON ``{"member", "receipts": [hex],
    "attested_epoch", "discontinuities": [epochs], "statements": [hex], "group": hex}`` (the last
    three optional). ``group_id``: a document naming another group is refused; ``max_items``: at
    most that many receipts and statements together. Signatures are not checked here (refill and
    assess do). Raises EvidenceError, and nothing else."""
    try:
        doc = json.loads(data)
    except (ValueError, RecursionError) as e:        # bad UTF-8 or JSON; nesting beyond the parser's depth
        raise EvidenceError(f"not JSON ({str(e)[:80]})") from None
    if not isinstance(doc, dict):
        raise EvidenceError("not a JSON object")
    member = doc.get("member")
    if not isinstance(member, str) or not member or len(member) > MAX_MEMBER_NAME:
        raise EvidenceError(f"\"member\" must be a name of 1 to {MAX_MEMBER_NAME} characters")
    epoch = doc.get("attested_epoch")
    if not _epoch(epoch):
        raise EvidenceError("\"attested_epoch\" must be an epoch (an integer from 0 to 2^63 - 1)")

    def hexes(key: str) -> tuple[bytes, ...]:
        v = doc.get(key, [])
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise EvidenceError(f"\"{key}\" must be a list of hex strings")
        try:
            return tuple(bytes.fromhex(x) for x in v)
        except ValueError:
            raise EvidenceError(f"\"{key}\" holds a string that is not hex") from None
    rx, stated = hexes("receipts"), hexes("statements")
    gaps = doc.get("discontinuities", [])
    if not isinstance(gaps, list) or not all(_epoch(e) for e in gaps):
        raise EvidenceError("\"discontinuities\" must be a list of epochs")
    if max_items is not None and len(rx) + len(stated) > max_items:
        raise EvidenceError(f"{len(rx) + len(stated)} receipts and statements; at most {max_items} at once")
    named = doc.get("group")
    if named is not None:
        try:
            named = bytes.fromhex(named) if isinstance(named, str) else None
        except ValueError:
            named = None
        if named is None:
            raise EvidenceError("\"group\" must be the group_id in hex")
        if group_id is not None and named != group_id:
            raise EvidenceError(f"the evidence is for group {named.hex()}, not {group_id.hex()}")
    return MemberEvidence(member, rx, epoch, tuple(gaps), stated)


def _epoch(v: object) -> bool:
    return type(v) is int and 0 <= v < EPOCH_LIMIT


@dataclass(frozen=True)
class Resume:
    head: Receipt
    current_epoch: int
    receipts: tuple[Receipt, ...]           # the verified chain, ascending
    discontinuities: tuple[int, ...]
    unusable: tuple[str, ...] = ()          # members whose evidence was not usable, and why
    statements: dict = field(default_factory=dict)   # gap epoch -> the bound sequencer's signed statement
    unsigned: tuple[tuple[str, int], ...] = ()   # (member, epoch): gap claims with no signed statement


@dataclass(frozen=True)
class FailClosed:
    evidence: tuple[Evidence, ...]
    unsigned: tuple[tuple[str, int], ...] = ()   # (member, epoch): gap claims with no signed statement


@dataclass(frozen=True)
class NotConverged:
    reason: str
    unusable: tuple[str, ...] = ()
    unsigned: tuple[tuple[str, int], ...] = ()   # (member, epoch): gap claims with no signed statement


@dataclass(frozen=True)
class GenesisReset:
    unusable: tuple[str, ...] = ()
    unsigned: tuple[tuple[str, int], ...] = ()   # (member, epoch): gap claims with no signed statement


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
    claims: list[tuple[str, int]] = []
    heads: list[int] = []

    def unsigned() -> tuple[tuple[str, int], ...]:
        # §22.6: only a gap the sequencer recorded and signed counts; a member's word for one is
        # neither a gap nor evidence, and is named as such (UNSIGNED_CLAIM)
        return tuple((m, e) for m, e in claims if e not in union.statements)
    for ev in evidence:
        own = ReceiptChain(group_id, bindings=dict(bindings))
        for raw in ev.receipts:
            own.add(raw)
            union.add(raw)
        for raw in ev.statements:
            # checked as a member checks a relayed statement: signature, the sequencer bound at its
            # epoch (a stranger's is not adopted), one statement per gap, the receipt it names
            own.add_statement(raw)
            union.add_statement(raw)
        claims += [(ev.member, e) for e in sorted(set(ev.discontinuities))]
        if union.equivocation or own.equivocation:
            return FailClosed(tuple(union.evidence) + tuple(own.evidence), unsigned())
        top_own = own.top_epoch()
        if top_own is None:
            # step 2 / "never a naked epoch assertion": no verifiable receipt, no evidence
            unusable.append(f"{ev.member}: no receipt verifies under the bound sequencer")
            continue
        if top_own + 1 != ev.attested_epoch:
            unusable.append(f"{ev.member}: head epoch {top_own} inconsistent with attested epoch "
                            f"{ev.attested_epoch}")
            continue
        heads.append(top_own)
    if not heads:
        return GenesisReset(tuple(unusable), unsigned())
    # every valid receipt, in the chain or held for a predecessor below the members' heads: with
    # no evidence, one a epoch, each linked to its neighbours wherever they are both known
    held = {e: rs[0] for e, rs in union.valid.items() if rs}
    top = held[max(held)]
    # continuity: from the lowest usable head to the top, every epoch has a receipt or a recorded gap
    low = min(heads)
    missing = [e for e in range(low, top.epoch + 1) if e not in held and e not in union.discontinuities]
    if missing:
        return NotConverged(f"epochs {missing[:5]} between the members' heads have neither a receipt nor "
                            "a recorded discontinuity", tuple(unusable), unsigned())
    if top.epoch not in heads:
        return NotConverged(f"no member attests the highest receipt (epoch {top.epoch})", tuple(unusable),
                            unsigned())
    chain = tuple(held[e] for e in sorted(held))
    gaps = tuple(sorted(union.discontinuities))
    stated = {e: union.statements[e].raw for e in gaps}
    return Resume(top, top.epoch + 1, chain, gaps, tuple(unusable), stated, unsigned())


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

    # what the sequencer holds was verified when it was signed or taken: parsed, not verified
    # again (a long stretch would cost a signature check per held receipt per offer)
    for r in [parse_receipt(raw) for raw in held.values()] + list(usable(
            [(raw, ev.member) for ev in evidence for raw in ev.receipts], verify_receipt, "receipt")):
        keep(rx, r, "receipt", lambda a, b: a.raw == b.raw)
    for s in [parse_statement(raw) for raw in stated.values()] + list(usable(
            [(raw, ev.member) for ev in evidence for raw in ev.statements], verify_statement, "statement")):
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


def answer(group_id: bytes, out) -> dict:
    """The JSON `sequencer recover` prints for an outcome, and `sequencer run` answers an
    ``evidence`` request with (docs/sequencer.md "Recovery after state loss")."""
    g = group_id.hex()
    doc = _answer(g, out)
    if getattr(out, "unsigned", ()):
        # §22.6: named, never counted as a gap nor as evidence
        doc["unsigned_claims"] = [{"member": m, "epoch": e, "reason": UNSIGNED_CLAIM} for m, e in out.unsigned[:50]]
    return doc


def _answer(g: str, out) -> dict:
    if isinstance(out, Refilled):
        # a group that kept its state but lost receipts (`receipts_lost`): what members gave back
        r = out.refill
        return {"outcome": "refilled", "group": g, "refilled": len(r.receipts),
                "epochs": [x.epoch for x in r.receipts][:50], "gaps": [x.epoch for x in r.statements],
                "missing": out.missing, "unverified": list(r.unverified[:50]), "unusable": list(r.unusable[:50])}
    if isinstance(out, Resume):
        return {"outcome": "resume", "group": g, "current_epoch": out.current_epoch, "head": out.head.raw.hex(),
                "discontinuities": list(out.discontinuities), "statements": sorted(out.statements),
                "unusable": list(out.unusable)}
    if isinstance(out, FailClosed):
        return {"outcome": "fail_closed", "group": g, "evidence": [{"kind": e.kind, "epoch": e.epoch} for e in out.evidence]}
    if isinstance(out, NotConverged):
        return {"outcome": "not_converged", "group": g, "reason": out.reason, "unusable": list(out.unusable)}
    return {"outcome": "genesis_reset", "group": g, "unusable": list(out.unusable)}


def succeeded(out) -> bool:
    """Exit 0 of `sequencer recover`: resumed, or a refill that took something or has nothing left
    to take."""
    if isinstance(out, Refilled):
        return bool(out.refill.receipts or out.refill.statements or not out.missing)
    return isinstance(out, Resume)
