"""The blind Commit sequencer's pure core (SOVM §22.5–§22.6): no I/O, no clock, no signing.

Per opaque group_id the state is the current accepted epoch (the epoch a Commit must be built in)
and the head of the group's receipt chain. First-Commit-wins (§22.5): accept iff the content is a
Commit built in the current epoch; acceptance advances the epoch in the same atomic commitment
that makes the receipt durable (§22.5 cl. 3; agent/sequencer/store.py), so every other Commit for
that epoch is stale, and is answered with the current head, so its sender can fetch the canonical
Commit, process it, rebuild and retry.

Bootstrap (§22.6): a group is created by explicit registration with its initial epoch, or by the
first Commit observed for an unknown group_id, accepted at its epoch. A group the sequencer has a
record of is not unknown: a retired one is refused, never bootstrapped at an asserted epoch.
Registration and bootstrap start a fresh chain (previous_receipt_hash null)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Union

from agent.core.frozen import fast_init
from agent.sequencer.framing import CONTENT_TYPE_NAMES, Framing

# Stable reason codes of a refusal (docs/sequencer.md, `sequencer submit`).
STALE_EPOCH = "stale_epoch"          # built in an epoch a Commit was already accepted for: rebuild
FUTURE_EPOCH = "future_epoch"        # built in an epoch the sequencer has not reached
NOT_COMMIT = "not_commit"            # a proposal or application message: nothing to sequence
UNPARSEABLE = "unparseable"          # framing refused (agent/sequencer/framing.py)
FAILED_CLOSED = "failed_closed"      # the group is frozen pending audit and migration (§22.6 step 4)
MIGRATED = "migrated"                # the group was handed to another sequencer (§22.6 singularity)
EPOCH_OUT_OF_RANGE = "epoch_out_of_range"  # beyond what the store's signed 64-bit integers hold
DISK_FULL = "disk_full"              # the home's filesystem is short of the space signing needs: retry later
GROUP_LIMIT = "group_limit"          # a new group beyond the groups the operator lets it track (`run --max-groups`)
GROUP_RETIRED = "group_retired"      # state lost and not recovered here: never bootstrapped again (§22.6, §22.10)
STATE_BEHIND = "state_behind"        # members' evidence shows this state behind what was released: held (§22.5 cl. 2)
# What showed it (the `held` entry of `sequencer status`)
BROKER_HEAD = "broker_head"          # the broker retains a receipt of ours at or beyond the state's epoch
COMMIT_AHEAD = "commit_ahead"        # a Commit framed above the epoch, after a resume the witness cannot vouch for

# The framing's epoch is a uint64; the sequencer's SQLite state holds signed 64-bit integers and
# must be able to store E+1 after accepting E.
EPOCH_LIMIT = 2**63          # every epoch the store's signed 64-bit integers hold is below it
MAX_EPOCH = EPOCH_LIMIT - 2


@fast_init
@dataclass(frozen=True)
class Head:
    """The last receipt of a group's chain: its epoch (the Commit's framing epoch) and the BLAKE3
    hash of its exact bytes (the next receipt's previous_receipt_hash)."""

    epoch: int
    receipt_hash: bytes


@fast_init
@dataclass(frozen=True)
class GroupState:
    group_id: bytes
    current_epoch: int
    head: Optional[Head] = None
    origin: str = "registered"   # "registered", "bootstrap", "recovered", "migrated" or "restored" (§22.6)
    discontinuities: tuple[int, ...] = field(default=())  # epochs accepted whose receipt is absent
    failed_closed: bool = False
    migrated: bool = False                           # handed off: this sequencer never serves it again


@fast_init
@dataclass(frozen=True)
class Accept:
    """Sign a receipt for (group_id, epoch) chained to previous_receipt_hash."""

    group_id: bytes
    epoch: int
    commit_hash: bytes
    previous_receipt_hash: Optional[bytes]
    bootstrap: bool = False


@dataclass(frozen=True)
class Reject:
    reason: str
    group_id: Optional[bytes]
    current_epoch: Optional[int]
    head: Optional[Head]
    detail: str = ""


Decision = Union[Accept, Reject]


def register(existing: Optional[GroupState], group_id: bytes, epoch: int) -> GroupState:
    """§22.6 bootstrap by explicit registration; a known group is never re-registered."""
    if existing is not None:
        raise ValueError(f"group {group_id.hex()} is already known (current epoch {existing.current_epoch})")
    if not (1 <= len(group_id) <= 255) or not (0 <= epoch <= MAX_EPOCH):
        raise ValueError(f"group_id must be 1..255 bytes and epoch 0..{MAX_EPOCH}")
    return GroupState(group_id, epoch, None, "registered")


def decide(state: Optional[GroupState], framing: Framing, commit_hash: bytes, retired: bool = False,
           held: bool = False) -> Decision:
    """The first-Commit-wins decision for one framed message (§22.5). ``retired``: this sequencer
    has a record of the group and no state for it (a recovery that did not resume it); ``held``:
    members' evidence showed its state behind what was released."""
    gid = framing.group_id
    if not framing.is_commit:
        name = CONTENT_TYPE_NAMES.get(framing.content_type, str(framing.content_type))
        return reject(NOT_COMMIT, gid, state, f"content_type {name}: only Commits are sequenced")
    if framing.epoch > MAX_EPOCH:
        return reject(EPOCH_OUT_OF_RANGE, gid, state, f"epoch {framing.epoch} > {MAX_EPOCH}")
    if held:
        # §22.5 cl. 2: a pair it cannot establish was never released is treated as signed
        return reject(STATE_BEHIND, gid, state, "members' evidence shows this sequencer's state behind what it "
                                                 "released: the group awaits `sequencer recover` (§22.6)")
    if state is None and retired:
        # §22.6: never resumed from a naked epoch assertion, which a Commit's framing epoch is;
        # §22.10: a genesis reset starts a new group_id
        return reject(GROUP_RETIRED, gid, None, "this sequencer lost this group's state and recovery did not "
                                                 "resume it: only a recovery that converges brings it back")
    if state is None:
        # §22.6: the first Commit-bearing message for an unknown group initialises its tracking
        return Accept(gid, framing.epoch, commit_hash, None, bootstrap=True)
    if state.migrated:
        return reject(MIGRATED, gid, state, "this group is bound to another sequencer now (§22.6 singularity)")
    if state.failed_closed:
        return reject(FAILED_CLOSED, gid, state, "equivocation evidence: the group awaits audit and migration")
    if framing.epoch < state.current_epoch:
        return reject(STALE_EPOCH, gid, state, f"a Commit was already accepted for epoch {framing.epoch}; "
                                                "process the canonical Commit, rebuild and resubmit")
    if framing.epoch > state.current_epoch:
        return reject(FUTURE_EPOCH, gid, state, f"epoch {framing.epoch} is ahead of the accepted epoch "
                                                 f"{state.current_epoch}")
    prev = state.head.receipt_hash if state.head is not None else None
    return Accept(gid, framing.epoch, commit_hash, prev)


def reject(reason: str, gid: bytes, state: Optional[GroupState], detail: str) -> Reject:
    if state is None:
        return Reject(reason, gid, None, None, detail)
    return Reject(reason, gid, state.current_epoch, state.head, detail)


def accepted(state: Optional[GroupState], decision: Accept, receipt_hash: bytes) -> GroupState:
    """The state after the receipt for ``decision`` is durable: epoch E+1, head = that receipt."""
    if state is None:
        state = GroupState(decision.group_id, decision.epoch, None, "bootstrap")
    if decision.epoch != state.current_epoch:
        raise ValueError(f"receipt for epoch {decision.epoch} does not extend a group at {state.current_epoch}")
    # built directly, not with dataclasses.replace: this runs once per receipt (the hot path)
    return GroupState(state.group_id, decision.epoch + 1, Head(decision.epoch, receipt_hash), state.origin,
                      state.discontinuities, state.failed_closed, state.migrated)


def receipt_absent(state: GroupState, epoch: int) -> GroupState:
    """§22.6 'epoch advanced, receipt absent': the Commit for ``epoch`` was accepted and its
    receipt identity may have been signed, but no receipt is durable. The pair is never signed
    again (§22.5 cl. 2): the epoch advances, the gap is recorded, and the head stays at the last
    receipt before it, so the next receipt chains across the gap (step 5)."""
    if epoch != state.current_epoch:
        raise ValueError(f"discontinuity at {epoch} does not extend a group at {state.current_epoch}")
    return replace(state, current_epoch=epoch + 1, discontinuities=state.discontinuities + (epoch,))


def settled(state: GroupState, outcomes: list[tuple[int, Optional[bytes]]]) -> GroupState:
    """The state after a run of consecutive epochs from ``state.current_epoch`` is settled at once
    against the signing journal (§22.6 step 1, resume after a rollback): ``(E, receipt_hash)``
    adopts that receipt as the head (``accepted``), ``(E, None)`` records E's gap and keeps the
    head (``receipt_absent``). The same state as applying those one by one, built once (a run
    of N gaps copied the growing gap tuple N times)."""
    epoch, head, gaps = state.current_epoch, state.head, list(state.discontinuities)
    for e, receipt_hash in outcomes:
        if e != epoch:
            raise ValueError(f"epoch {e} settled does not extend a group at {epoch}")
        if receipt_hash is None:
            gaps.append(e)
        else:
            head = Head(e, receipt_hash)
        epoch = e + 1
    return GroupState(state.group_id, epoch, head, state.origin, tuple(gaps), state.failed_closed, state.migrated)
