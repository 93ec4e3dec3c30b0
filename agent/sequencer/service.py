"""The sequencer's verbs (SOVM §22.5–§22.6, docs/sequencer.md): ``Sequencer`` is an opened
``Home`` (home.py: files, locks, resume on open, compaction, disk reserve) whose Commits go
through the pipelined group commit (pipeline.py), with registration, receipts and status,
recovery and refill from members' evidence (§22.6 steps 1-5) and migration (hand-off, adopt).
``Reader`` reads the committed state beside a running `sequencer run`.

The names callers use from the parts are re-exported here; a setting is changed (a test's
monkeypatch) in the module that reads it: home.JOURNAL_*, resume.SETTLE_CHUNK/STATEMENT_BATCH."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator, Optional, Union

from agent.core import numbers
from agent.sequencer import core, receipts
from agent.sequencer.replies import (Absent, Accepted, Answer, GroupLimit, Rejected, SequencerFault,
                                     SequencerRefused, SequencerServing)
from agent.sequencer.home import (DB_NAME, DISK_FACTOR, DISK_PER_COMMIT, DISK_RESERVE_BYTES,
                                  INIT_RECORD, JOURNAL_NAME, LOCK_NAME, PIN_NAME, RECEIPT_KEY, RUN_LOCK_NAME, Home,
                                  Hook, init, serving)
from agent.sequencer.pipeline import CHUNK, GC_THRESHOLDS, MIN_BATCHES, MIN_CHUNK, GroupCommit, tune_collector
from agent.sequencer.store import Store

HANDOFF_FORMAT = "sovm-sequencer-handoff-v1"

__all__ = ["Absent", "Accepted", "Answer", "GroupLimit", "Rejected", "SequencerFault", "SequencerRefused",
           "SequencerServing", "DB_NAME", "DISK_FACTOR", "DISK_PER_COMMIT", "DISK_RESERVE_BYTES", "INIT_RECORD",
           "JOURNAL_NAME", "LOCK_NAME", "PIN_NAME", "RECEIPT_KEY", "RUN_LOCK_NAME", "init", "serving", "CHUNK",
           "GC_THRESHOLDS", "GroupCommit", "tune_collector", "HANDOFF_FORMAT", "Sequencer", "Reader"]


class Sequencer(Home):
    def __init__(self, home: Path, *, fault_hook: Optional[Hook] = None, serve: bool = False) -> None:
        """Open a sequencer home (``Home``: resumed before anything is served)."""
        self.chunk = CHUNK              # Commits per step of the pipelined group commit
        super().__init__(home, fault_hook=fault_hook, serve=serve)

    # -- verbs -----------------------------------------------------------------------------
    def register(self, group_id: bytes, epoch: int) -> None:
        if group_id in self.held:
            raise SequencerRefused(f"{core.STATE_BEHIND}: group {group_id.hex()} is held: members' evidence shows "
                                   "this state behind what was released; run `sequencer recover` (§22.6)")
        if self.store.group(group_id) is None and self.store.retired(group_id) is not None:
            # §22.6: a group whose state was lost comes back only by a recovery that converges
            raise SequencerRefused(f"{core.GROUP_RETIRED}: group {group_id.hex()} lost its state here and recovery "
                                   "did not resume it; a genesis reset uses a new group_id (§22.10)")
        try:
            state = core.register(self.store.group(group_id), group_id, epoch)
        except ValueError as e:
            raise SequencerRefused(str(e)) from None
        if self.max_groups is not None and self.store.group_count() >= self.max_groups:
            raise GroupLimit(f"group_limit: {self.group_limit_detail()}")
        self.store.register(state)

    def submit(self, message: bytes) -> Answer:
        return self.submit_many([message])[0]

    def submit_many(self, messages: list[bytes]) -> list[Answer]:
        """Sequence a batch of MLSMessages (any groups), answers in order, through the pipelined
        group commit (``GroupCommit``). First-Commit-wins is exactly the order of ``messages``:
        a group's Commits are decided in arrival order, each once every earlier one of that group
        is committed."""
        answers: list[Optional[Answer]] = [None] * len(messages)
        gc = self.group_commit(min(self.chunk, max(MIN_CHUNK, -(-len(messages) // MIN_BATCHES))))
        for i, m in enumerate(messages):
            gc.put(i, m)
        for i, ans in gc.drain():
            answers[i] = ans
        return answers  # type: ignore[return-value]

    def group_commit(self, chunk: Optional[int] = None) -> "GroupCommit":
        """The pipelined group commit over this sequencer (docs/sequencer.md): ``put`` Commits as
        they arrive, ``step`` to advance, take the answers each step released."""
        return GroupCommit(self, chunk or self.chunk)

    def receipt(self, group_id: bytes, epoch: int) -> Union[bytes, Absent]:
        return _receipt(self.store, group_id, epoch)

    def commit(self, group_id: bytes, epoch: int) -> Optional[bytes]:
        """The canonical Commit for (group, epoch), for a sender told to rebuild."""
        return self.store.commit_message(group_id, epoch)

    def status(self, stream: bool = False) -> dict:
        # the journal's size and entries: bounded by the groups once compacted ("Journal compaction")
        return dict(_status(self.store, stream), keystore=self.bridge.keystore.describe(),
                    journal=self.bridge.journal_stats())

    def recover(self, group_id: bytes, evidence: list, bindings: dict[int, bytes]):
        """§22.6 state loss, steps 1-5, for a group this sequencer holds no state for (or holds
        frozen). Returns the recovery outcome; the state changes only on Resume (the chain is
        adopted and CAS resumes at head.epoch + 1) and FailClosed (the group is frozen)."""
        from agent.sequencer import recovery
        state = self.store.group(group_id)
        if group_id in self.held and state is not None and not (state.failed_closed or state.migrated):
            return self._recover_held(group_id, state, evidence, bindings)
        if state is not None and not state.failed_closed:
            lost = self.store.lost_stretches(group_id).get(group_id)
            if lost:
                return self._refill(group_id, state, lost, evidence, bindings)
            raise SequencerRefused(f"group {group_id.hex()} has state here (epoch {state.current_epoch}); "
                                   "recovery is for a sequencer that lost it")
        out = recovery.assess(group_id, evidence, bindings)
        if isinstance(out, recovery.Resume):
            if state is not None:
                raise SequencerRefused(f"group {group_id.hex()} is frozen on equivocation evidence: audit and "
                                       "migrate it (§22.6 step 4); evidence that converges now does not unfreeze it")
            self.held.discard(group_id)         # a held group this home never knew: restore_group lifts it
            head = out.head
            new = core.GroupState(group_id, out.current_epoch, core.Head(head.epoch, head.receipt_hash),
                                  "recovered", out.discontinuities)
            self.store.restore_group(new, [(r.epoch, r.commit_hash, r.raw, r.receipt_hash) for r in out.receipts],
                                     list(out.discontinuities),
                                     {"group": group_id.hex(), "head_epoch": head.epoch,
                                      "members": len(evidence), "unusable": list(out.unusable)},
                                     # the gaps' signed statements the members held (§22.6 step 4):
                                     # served and handed on as this sequencer's own gaps' are
                                     statements=dict(out.statements))
        elif isinstance(out, recovery.FailClosed):
            top = max((ev.epoch for ev in out.evidence), default=0)
            self.store.fail_closed(group_id, top + 1, {
                "group": group_id.hex(),
                "evidence": [{"kind": ev.kind, "epoch": ev.epoch, "receipts": [r.hex() for r in ev.receipts]}
                             for ev in out.evidence]})
        else:
            detail = {"group": group_id.hex(), "outcome": type(out).__name__,
                      "reason": getattr(out, "reason", "no usable receipt evidence: domain genesis reset (§22.10)"),
                      "unusable": list(out.unusable)}
            if state is None:
                # §22.6: a record of the group stays, so no Commit bootstraps it at an asserted epoch
                self.store.retire(group_id, type(out).__name__, detail)
            else:
                self.store.record_event("recovery_refused", detail)
        return out

    def _recover_held(self, group_id: bytes, state: core.GroupState, evidence: list, bindings: dict[int, bytes]):
        """§22.6 steps 1-5 for a group held on members' evidence (``hold``): this home's state is
        behind what was released, so the members' chain is taken as for a lost state, and resumes
        the group only where it reaches at least this home's epoch and agrees with every receipt
        this home holds (one that differs is two receipts for one pair: failed closed, step 4)."""
        from agent.sequencer import member, recovery
        out = recovery.assess(group_id, evidence, bindings)
        detail = {"group": group_id.hex(), "outcome": type(out).__name__, "unusable": list(out.unusable)}
        if isinstance(out, recovery.Resume):
            for r in out.receipts:
                mine = self.store.receipt(group_id, r.epoch)
                if mine is not None and mine != r.raw:
                    ev = member.Evidence("double_receipt", group_id, r.epoch, (mine, r.raw),
                                         "this home's receipt and the members' differ")
                    self.store.fail_closed(group_id, state.current_epoch, {
                        "group": group_id.hex(), "evidence": [{"kind": ev.kind, "epoch": ev.epoch,
                                                               "receipts": [x.hex() for x in ev.receipts]}]})
                    self.held.discard(group_id)
                    return recovery.FailClosed((ev,), out.unsigned)
            if out.current_epoch < state.current_epoch:
                self.store.record_event("recovery_refused", dict(detail, reason="the members' head is behind "
                                                                 "this home's own state: more evidence is needed"))
                raise SequencerRefused(f"{core.STATE_BEHIND}: the evidence for group {group_id.hex()} reaches epoch "
                                       f"{out.current_epoch}, behind this home's {state.current_epoch}: gather the "
                                       "members whose receipts reach the head the broker retains")
            head = out.head
            gaps = tuple(sorted(set(state.discontinuities) | set(out.discontinuities)))
            new = core.GroupState(group_id, out.current_epoch, core.Head(head.epoch, head.receipt_hash),
                                  state.origin, gaps)
            self.store.restore_group(new, [(r.epoch, r.commit_hash, r.raw, r.receipt_hash) for r in out.receipts],
                                     list(out.discontinuities), dict(detail, head_epoch=head.epoch, members=len(evidence),
                                                                     held_from=state.current_epoch),
                                     statements=dict(out.statements))
            self.held.discard(group_id)
            if head.kid == self.public_key:
                # released by this key: the witness outside the home vouches for the head from here on
                self.witness.note([head.raw])
        elif isinstance(out, recovery.FailClosed):
            top = max((ev.epoch for ev in out.evidence), default=0)
            self.store.fail_closed(group_id, max(top + 1, state.current_epoch), {
                "group": group_id.hex(),
                "evidence": [{"kind": ev.kind, "epoch": ev.epoch, "receipts": [r.hex() for r in ev.receipts]}
                             for ev in out.evidence]})
            self.held.discard(group_id)
        else:
            # still held: nothing here resumes it from a naked assertion (§22.6)
            self.store.record_event("recovery_refused", dict(detail, reason=getattr(
                out, "reason", "no usable receipt evidence: domain genesis reset (§22.10)")))
        return out

    def lost(self, group_id: bytes) -> list[tuple[int, int, int]]:
        """The stretches of ``group_id``'s receipts a resume named lost (`receipts_lost`) that still
        miss epochs: [(first, last, missing)] (what `sequencer run` publishes on ``lost``)."""
        out = []
        for first, last in self.store.lost_stretches(group_id).get(group_id, []):
            missing = self.store.missing_between(group_id, first, last)
            if missing:
                out.append((first, last, missing))
        return out

    def missing(self, group_id: bytes, limit: int = 256) -> list[tuple[int, int]]:
        """The runs of lost epochs ``group_id`` still misses, highest first, at most ``limit``."""
        out: list[tuple[int, int]] = []
        for first, last in sorted(self.store.lost_stretches(group_id).get(group_id, []), reverse=True):
            out += self.store.missing_ranges(group_id, first, last, limit - len(out))
            if len(out) >= limit:
                break
        return out

    def refill_offered(self, group_id: bytes, evidence) -> "object":
        """One member's evidence offered over the broker (`sequencer run`, topic ``evidence``):
        only ever a refill of receipts this sequencer signed and lost (verified under its own key,
        link by link to what it holds, recovery.refill), never a recovery of a group it holds no
        state for: that needs evidence an operator authenticated (`sequencer recover`)."""
        state = self.store.group(group_id)
        if state is None or state.failed_closed:
            raise SequencerRefused(f"group {group_id.hex()} has no receipts lost here")
        lost = [(a, b) for a, b, _m in self.lost(group_id)]
        if not lost:
            raise SequencerRefused(f"group {group_id.hex()} has no receipts lost here")
        return self._refill(group_id, state, lost, [evidence], {0: self.public_key})

    def _refill(self, group_id: bytes, state: core.GroupState, lost: list[tuple[int, int]], evidence: list,
                bindings: dict[int, bytes]):
        """The receipts a resume named lost (`receipts_lost`) taken back from members' retained
        chains (recovery.refill: only what chains link by link to a receipt held on either side);
        contradicting evidence freezes the group as in recovery (§22.6 step 4)."""
        from agent.sequencer import recovery
        held: dict[int, bytes] = {}
        stated: dict[int, bytes] = {}
        for first, last in lost:
            rx, st = self.store.held_between(group_id, max(first - 1, 0), last + 1)
            held.update(rx)
            stated.update(st)
        out = recovery.refill(group_id, lost, held, stated, evidence, bindings)
        if isinstance(out, recovery.FailClosed):
            self.store.fail_closed(group_id, state.current_epoch, {
                "group": group_id.hex(),
                "evidence": [{"kind": ev.kind, "epoch": ev.epoch, "receipts": [r.hex() for r in ev.receipts]}
                             for ev in out.evidence]})
            return out
        missing = sum(self.store.missing_between(group_id, a, b) for a, b in lost) - len(out.receipts) - len(out.statements)
        if out.receipts or out.statements:
            self.store.refill(group_id, [(r.epoch, r.commit_hash, r.raw, r.receipt_hash) for r in out.receipts],
                              [(st.epoch, st.commit_hash, st.raw) for st in out.statements],
                              {"group": group_id.hex(), "receipts": len(out.receipts),
                               "gaps": [st.epoch for st in out.statements], "missing": missing,
                               "members": len(evidence), "unverified": list(out.unverified[:20])})
        return recovery.Refilled(out, missing)

    def handoff(self, group_id: bytes) -> dict:
        """§22.6 migration, old side: the accepted epoch, the receipt-chain head (exact bytes) and
        the recorded discontinuities, with the generation from which the new binding takes effect.
        The group is marked migrated in the same step: from now on this sequencer refuses its
        Commits (the old and new sequencer never operate concurrently for one group)."""
        state = self.store.group(group_id)
        if state is None:
            raise SequencerRefused(f"group {group_id.hex()} is unknown here")
        if state.migrated:
            raise SequencerRefused(f"group {group_id.hex()} was already handed off")
        if state.failed_closed:
            raise SequencerRefused(f"group {group_id.hex()} is frozen on equivocation evidence: audit it first "
                                   "and recover it on the new sequencer (§22.6 step 4)")
        head = None if state.head is None else self.store.receipt(group_id, state.head.epoch)
        package = {"format": HANDOFF_FORMAT, "group": group_id.hex(), "current_epoch": state.current_epoch,
                   "generation": state.current_epoch, "head": None if head is None else head.hex(),
                   "discontinuities": list(state.discontinuities), "from_key": self.public_key.hex(),
                   # the signed statements of the gaps (§22.6 step 4: they transfer on migration)
                   "statements": {str(e): raw.hex() for (g, e), raw in sorted(self.store.statements().items())
                                  if g == group_id}}
        self.store.mark_migrated(group_id, {"group": group_id.hex(), "generation": state.current_epoch})
        return package

    def adopt(self, package: dict) -> core.GroupState:
        """§22.6 migration, new side: verify the old sequencer's head and take the group over; the
        first receipt here chains to the old sequencer's last (one chain, not a second one)."""
        try:
            gid, epoch, gaps, from_key, head_raw, stated = _handoff_fields(package)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise SequencerRefused(f"not a hand-off package: {e}") from None
        for e, raw in stated.items():
            try:
                st = receipts.verify_statement(raw, from_key)
            except receipts.ReceiptError as ex:
                raise SequencerRefused(f"a hand-off statement does not verify under the old sequencer's key: {ex}") from None
            if st.group_id != gid or st.epoch != e or e not in gaps:
                raise SequencerRefused(f"the hand-off statement for epoch {e} is not one of the group's recorded gaps")
        if self.store.group(gid) is not None:
            raise SequencerRefused(f"group {gid.hex()} already has state here")
        head = None
        if head_raw is not None:
            try:
                r = receipts.verify_receipt(head_raw, from_key)
            except receipts.ReceiptError as e:
                raise SequencerRefused(f"the hand-off head does not verify under the old sequencer's key: {e}") from None
            if r.group_id != gid or not (r.epoch < epoch and all(e in gaps for e in range(r.epoch + 1, epoch))):
                raise SequencerRefused("the hand-off head is not the head of that group at that epoch")
            head = core.Head(r.epoch, r.receipt_hash)
            chain = [(r.epoch, r.commit_hash, r.raw, r.receipt_hash)]
        else:
            chain = []
        new = core.GroupState(gid, epoch, head, "migrated", gaps)
        self.store.restore_group(new, chain, list(gaps), {"group": gid.hex(), "generation": epoch,
                                                           "from_key": from_key.hex()}, kind="migrated_in",
                                 statements=stated)
        return new

    # -- helpers ---------------------------------------------------------------------------


def _handoff_fields(package: object) -> tuple:
    """The one reader of a hand-off package (bytes from outside: a file an operator carries):
    (group_id, current_epoch, gaps, from_key, head bytes | None, {gap epoch: statement}). Every
    number is a JSON integer in the store's range, every gap below the epoch. Raises ValueError
    (or KeyError/TypeError/AttributeError for a wrong shape)."""
    if not isinstance(package, dict) or package.get("format") != HANDOFF_FORMAT:
        raise ValueError(f"format must be {HANDOFF_FORMAT}")
    gid = bytes.fromhex(package["group"])
    epoch = package["current_epoch"]
    if not 1 <= len(gid) <= 255:
        raise ValueError("group must be 1..255 bytes in hex")
    if type(epoch) is not int or not 0 <= epoch <= core.MAX_EPOCH:
        raise ValueError(f"current_epoch must be an integer 0..{core.MAX_EPOCH}")
    gaps = package.get("discontinuities", [])
    if not isinstance(gaps, list) or not all(type(e) is int and 0 <= e < epoch for e in gaps):
        raise ValueError("discontinuities must be epochs below current_epoch")
    from_key = bytes.fromhex(package["from_key"])
    head_raw = None if package.get("head") is None else bytes.fromhex(package["head"])
    stated = {}
    given = package.get("statements")
    if given is not None and not isinstance(given, dict):
        raise ValueError("statements must be an object: gap epoch -> statement hex")
    for e, h in (given or {}).items():
        n = numbers.uint(e)
        if n is None:
            raise ValueError("statements are keyed by gap epoch in decimal")
        stated[n] = bytes.fromhex(h)
    return gid, epoch, tuple(sorted(set(gaps))), from_key, head_raw, stated


def _receipt(store: Store, group_id: bytes, epoch: int) -> Union[bytes, Absent]:
    """The persisted receipt bytes, or a stated absence (§22.6); an epoch the store's 64-bit
    integers cannot hold is refused (it has no receipt, and SQLite would raise)."""
    if not (0 <= epoch < core.EPOCH_LIMIT):
        raise SequencerRefused(f"epoch must be 0..{core.EPOCH_LIMIT - 1}, got {epoch}")
    raw = store.receipt(group_id, epoch)
    if raw is not None:
        return raw
    return Absent(store.is_discontinuity(group_id, epoch), store.statement(group_id, epoch))


def _status(store: Store, stream: bool = False) -> dict:
    """`sequencer status`; ``stream``: "groups" is an iterator read as it is consumed (the CLI
    prints it group by group: 100 000 groups took 233 MB resident as one list)."""
    groups = _group_entries(store)
    return {"sequencer_key": store.get_meta("receipt_key")["public_key"],
            "groups": groups if stream else list(groups),
            "events": store.events(), "layout_version": store.layout_version(),
            # groups members' evidence showed behind what was released: `sequencer recover` them
            "held": [{"group": g.hex(), **d} for g, d in store.held().items()]}


def _group_entries(store: Store) -> Iterator[dict]:
    stated = store.statements()
    lost = store.lost_stretches()
    for s in store.iter_groups():
        gid = s.group_id
        if gid in lost:       # receipts a restored state lost, until members give them back
            extra = {"receipts_lost": [{"from": a, "to": b, "missing": store.missing_between(gid, a, b)}
                                       for a, b in lost[gid]]}
        else:
            extra = {}
        yield {"group": gid.hex(), "current_epoch": s.current_epoch, "origin": s.origin,
               "head": None if s.head is None else {"epoch": s.head.epoch, "receipt_hash": s.head.receipt_hash.hex()},
               "discontinuities": list(s.discontinuities),
               "statements": {str(e): stated[(gid, e)].hex() for e in s.discontinuities if (gid, e) in stated},
               "failed_closed": s.failed_closed,
               "migrated": s.migrated} | extra


class Reader:
    """Read-only access beside a running `sequencer run` (which resumed before serving, §22.6
    step 1): the committed state only, never a signature."""

    def __init__(self, home: Path) -> None:
        self.store = Store(Path(home) / DB_NAME, readonly=True)

    def receipt(self, group_id: bytes, epoch: int) -> Union[bytes, Absent]:
        return _receipt(self.store, group_id, epoch)

    def status(self, stream: bool = False) -> dict:
        conf = self.store.get_meta("keystore") or {}
        return dict(_status(self.store, stream), keystore={"kind": conf.get("kind")}, serving=True)

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
