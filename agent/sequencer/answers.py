"""What a sequencer's answer means for a member's queued Commit (SOVM §22.5-§22.6), pure but for
``signer_for``: every receipt is verified before it decides anything. Who may sign it (§22.6
singularity) is the caller's `signer_for(group_id, epoch)`; a receipt signed by another key is
rejected and kept for attribution (ATTRIBUTED), one whose binding does not resolve is held (HELD),
and both are looked at again only when the group's binding records change (`binding_state`). A
resubmitted Commit answered `stale_epoch` is compared with the receipt for its own epoch, since
its first answer may have been lost."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from agent.sequencer import receipts
from agent.sequencer.commit_queue import ABSENT, ACCEPTED, LOST, REFUSED, Entry
from agent.sequencer.core import EPOCH_OUT_OF_RANGE, FUTURE_EPOCH, NOT_COMMIT, STALE_EPOCH, UNPARSEABLE

# a refusal that ends the Commit; any other reason leaves it queued (migrated, failed_closed: the
# group's relay is unavailable until the operator acts, §22.6)
FINAL_REFUSALS = frozenset({NOT_COMMIT, UNPARSEABLE, EPOCH_OUT_OF_RANGE, FUTURE_EPOCH})


# -- who may sign (§22.6 singularity) --------------------------------------------------------
HELD, ATTRIBUTED = "held", "attributed"


@dataclass(frozen=True)
class Signer:
    """Who may sign a group's link at one generation (MLS epoch)."""
    key: Optional[bytes]                # the bound sequencer's key; None: any valid signature
    unresolved: bool = False            # a binding exists and does not resolve here: hold the link


SignerFor = Callable[[bytes, int], Signer]
# What decides a SignerFor's answers for one group, as bytes: equal bytes, equal answers at every
# generation (the CLI: the group's resolved binding records and the fallback key). None: unknown.
BindingState = Callable[[bytes], Optional[bytes]]


def fixed_signer(key: Optional[bytes]) -> SignerFor:
    """One key for every group and epoch (``--sequencer-key``), or any valid signature (None)."""
    return lambda _g, _e: Signer(key)


def fixed_state(key: Optional[bytes]) -> BindingState:
    """The binding state of ``fixed_signer(key)``: never changes."""
    return lambda _g: b"fixed:" + (key or b"")


def check_receipt(raw: bytes, signer_for: SignerFor) -> tuple[Optional[receipts.Receipt], str]:
    """(receipt, "") when valid and signed by the sequencer allowed at its epoch; else (receipt or
    None, why): HELD (binding unresolved), ATTRIBUTED (another signer), or a problem."""
    try:
        r = receipts.verify_receipt(raw)
    except receipts.ReceiptError as ex:
        return None, f"receipt does not verify: {ex}"
    s = signer_for(r.group_id, r.epoch)
    if s.unresolved:
        return r, HELD
    if s.key is not None and r.kid != s.key:
        return r, ATTRIBUTED
    return r, ""


# -- outcomes (pure but for ``signer_for``) -----------------------------------------------------
@dataclass(frozen=True)
class Outcome:
    state: Optional[str]                # a final state, or None: still queued
    reason: Optional[str] = None
    receipt: Optional[bytes] = None
    ask_receipt: bool = False           # ask the sequencer for the receipt of the Commit's epoch
    problem: Optional[str] = None       # an answer that decided nothing, and why (surfaced)
    unsettled: Optional[tuple[receipts.Receipt, str]] = None   # held or attributed: retained, decides nothing


def _verified(raw_hex: Optional[str], e: Entry, signer_for: SignerFor) -> tuple[Optional[receipts.Receipt], str]:
    if not raw_hex:
        return None, "no receipt"
    if not isinstance(raw_hex, str):     # an answer is bytes from outside: anything may stand here
        return None, "receipt does not verify: not hex text"
    try:
        raw = bytes.fromhex(raw_hex)
    except ValueError as ex:
        return None, f"receipt does not verify: {ex}"
    r, why = check_receipt(raw, signer_for)
    if r is not None and r.group_id != e.group_id:
        return None, "receipt for another group"
    return r, why


def _unsettled(r: receipts.Receipt, why: str) -> Outcome:
    return Outcome(None, "binding_unresolved" if why == HELD else "signer_not_bound", unsettled=(r, why))


def submit_outcome(e: Entry, answer: dict, signer_for: SignerFor) -> Outcome:
    """What a `submit` answer (the JSON docs/sequencer.md describes) means for queued Commit ``e``."""
    if "error" in answer:
        return Outcome(None, problem=f"the sequencer answered an error: {answer['error']}")
    if answer.get("accepted") is True:
        r, why = _verified(answer.get("receipt"), e, signer_for)
        if r is not None and why in (HELD, ATTRIBUTED):
            return _unsettled(r, why)
        if r is None or why or r.epoch != e.epoch or r.commit_hash != e.commit_hash:
            return Outcome(None, problem=why or "an acceptance whose receipt does not name this Commit at its epoch")
        return Outcome(ACCEPTED, None, r.raw)
    reason = answer.get("reason")
    if reason == STALE_EPOCH:
        head, why = _verified(answer.get("head"), e, signer_for)
        if head is not None and head.epoch == e.epoch and why in (HELD, ATTRIBUTED):
            return _unsettled(head, why)
        if head is not None and not why and head.epoch == e.epoch:
            # the head is this epoch's receipt: ours (an answer lost, then resubmitted) or the winner's
            return Outcome(ACCEPTED if head.commit_hash == e.commit_hash else LOST, STALE_EPOCH, head.raw)
        return Outcome(None, STALE_EPOCH, ask_receipt=True)     # the head moved on: look up our epoch
    if reason in FINAL_REFUSALS:
        return Outcome(REFUSED, reason)
    return Outcome(None, str(reason))                                # migrated, failed_closed, ...: wait


def receipt_outcome(e: Entry, answer: dict, signer_for: SignerFor) -> Outcome:
    """What a `receipt` answer for the Commit's own epoch means, after a stale answer."""
    if "error" in answer:
        return Outcome(None, problem=f"the sequencer answered an error: {answer['error']}")
    if answer.get("receipt"):
        r, why = _verified(answer["receipt"], e, signer_for)
        if r is not None and r.epoch == e.epoch and why in (HELD, ATTRIBUTED):
            return _unsettled(r, why)
        if r is None or why or r.epoch != e.epoch:
            return Outcome(None, problem=why or "a receipt for another epoch")
        return Outcome(ACCEPTED if r.commit_hash == e.commit_hash else LOST, STALE_EPOCH, r.raw)
    if answer.get("absent") and answer.get("discontinuity"):
        return Outcome(ABSENT, "discontinuity")     # §22.6: a stated absence; MLS tells which Commit won
    # the sequencer holds no receipt nor gap for an epoch it says is past (a recovered suffix or a
    # migration that started there): nothing here says this Commit won
    return Outcome(LOST, "no_receipt")
