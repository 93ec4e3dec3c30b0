"""Settling against the signing journal, never signing a receipt (§22.5 cl. 1-2, §22.6): the
resume on open (pending acceptances, a state restored behind its journal or its witness, a copy
older than the journal's compaction floor), one pair after a keystore fault or a rollback the
group commit meets, and the signed statements of the gaps recorded (§22.6 step 4).
docs/sequencer.md "Resume"."""
from __future__ import annotations

import logging
from typing import Callable, Optional

from firmware_bridge import DiscontinuityIdentity, KeystoreError, ReceiptIdentity, SigningBridge
from firmware_bridge.bridge import Status

from agent.sequencer import core, receipts
from agent.sequencer.store import Store
from agent.sequencer.witness import ReceiptWitness

log = logging.getLogger("ssp_agent.sequencer")

Hook = Callable[[str], None]

# Resume (§22.6 step 1) after a rollback: lost epochs settled per SQLite transaction, and gaps
# whose statements of absence are signed per bridge call (one durable commit of the intents,
# one of the outputs): a rollback over N epochs costs ~N/SETTLE_CHUNK + N/STATEMENT_BATCH
# transactions and 2·N/STATEMENT_BATCH journal fsyncs (docs/sequencer.md "Resume").
SETTLE_CHUNK = 4096
STATEMENT_BATCH = 1024



class Settler:
    """The journal's side of a home: ``unsigned`` says a gap was recorded whose statement is not
    signed yet (``sign_statements`` signs it); ``key_name`` is the receipt key in the keystore."""

    def __init__(self, store: Store, bridge: SigningBridge, witness: ReceiptWitness, public_key: bytes,
                 key_name: str, fire: Hook) -> None:
        self.store, self.bridge, self.witness, self.public_key = store, bridge, witness, public_key
        self.key_name, self.fire = key_name, fire
        self.unsigned = False

    def settle(self, gid: bytes, epoch: int, *, cause: str,
               candidate: Optional[tuple[bytes, bytes]] = None) -> None:
        """Bring (group, epoch) in line with the journal, never signing (§22.5 cl. 1-2, §22.6).
        The Commit is our pending one for the pair; ``candidate`` (commit hash, bytes) is a Commit
        offered now, kept only if the journal's receipt names it."""
        ch, message = self.store.pending_row(gid, epoch) or (None, None)
        if ch is None and candidate is not None and self.bridge.status(ReceiptIdentity(gid, epoch)) is Status.RELEASED:
            ch, message = candidate
        state = self.store.group(gid)
        if state is not None and state.current_epoch != epoch:
            self.store.drop_pending(gid, epoch)         # already settled
            return
        status = self.bridge.status(ReceiptIdentity(gid, epoch))
        if status is Status.RELEASED:
            raw = self.bridge.released(ReceiptIdentity(gid, epoch))
            got = receipts.parse_receipt(raw)
            if got.commit_hash != ch:
                message = None                          # not the Commit we hold: its bytes are unknown
            if state is None:
                state = core.GroupState(gid, epoch, None, "bootstrap")
            rh = receipts.receipt_hash(raw)
            new = core.accepted(state, core.Accept(gid, epoch, got.commit_hash, got.previous_receipt_hash), rh)
            self.store.commit_receipt(new, epoch, got.commit_hash, raw, rh, message)
        elif status is Status.OUTCOME_UNKNOWN:
            if state is None:
                state = core.GroupState(gid, epoch, None, "bootstrap")
            self.store.commit_discontinuity(core.receipt_absent(state, epoch), epoch, ch, message, cause)
            self.unsigned = True
        else:
            self.store.drop_pending(gid, epoch)         # never signed: nobody got an answer

    def resume(self) -> None:
        """§22.6 step 1, before serving anything: settle pending acceptances, then make sure no
        group's epoch is behind an identity the journal ever intended to sign (a state restored
        from an older copy: a rollback). Its cost follows what it does, not the rollback's depth
        in transactions (docs/sequencer.md "Resume"): `pending` is read once, the epochs settled
        go to SQLite SETTLE_CHUNK to a transaction (``_Settlement``), and the gaps' statements
        are signed STATEMENT_BATCH to a bridge call (``sign_statements``)."""
        epochs = dict(self.store.current_epochs())              # one query, however many groups
        journal = self._resume_behind_the_floor(epochs)
        pend: dict[bytes, dict[int, tuple[bytes, bytes]]] = {}
        for gid, epoch, h, m, _b in self.store.pending():       # once, however many epochs
            pend.setdefault(gid, {})[epoch] = (h, m)
        run = _Settlement(self.store, self.fire)
        known = set(epochs)
        # a group only the journal knows (the copy is older than the group): its chain is settled
        # from the journal's first entry, never bootstrapped a second time (§22.6 bootstrap)
        forgotten = {gid: jg.lowest for gid, jg in journal.items()
                     if gid not in known and gid not in pend and jg.lowest is not None}
        top = self.bridge.max_receipt_epoch                    # the journal's in-memory index
        for gid in sorted(known | set(pend) | set(forgotten)):
            if gid not in pend and gid not in forgotten and ((t := top(gid)) is None or t < epochs[gid]):
                continue        # nothing the journal knows is ahead: the state is not read (nor cached)
            self._settle_group(gid, pend.get(gid, {}), run, forgotten.get(gid))
        run.finish(all_pending=bool(pend))
        if run.gapped:
            self.unsigned = True
        # a receipt the journal held and the witness may not (a crash between the two): released
        # or not, the witness holds it from now on, so it vouches for the group (§22.5 cl. 2)
        self.witness.note([raw for gid, (e, raw) in sorted(run.taken.items())
                           if (w := self.witness.top.get(gid)) is None or w[0] < e])
        self._resume_witness(epochs)
        self.sign_statements()

    def _resume_witness(self, epochs: dict[bytes, int]) -> None:
        """§22.5 cl. 2 and §22.6 "a restore from backup", after the journal had its say: a group
        whose state is at or below an epoch the witness outside the home holds a receipt for was
        restored with its whole home (the journal too). That receipt was released, and so may be
        every one below it that this home lacks: the group moves past it, chained to it, and the
        epochs between are lost (asked back from members, `receipts_lost`), never signed again
        nor stated absent (a member may hold them). ``epochs``: each group's epoch before this open."""
        for gid, (w, raw) in sorted(self.witness.top.items()):
            state = self.store.group(gid)
            if state is not None and (state.current_epoch > w or state.failed_closed or state.migrated):
                continue
            got = receipts.parse_receipt(raw)
            lost_from = epochs.get(gid, 0)      # the gaps this open recorded above it go too
            new = core.GroupState(gid, w + 1, core.Head(w, receipts.receipt_hash(raw)),
                                  "restored" if state is None else state.origin)
            log.warning("group %s: this home is behind the receipt it released for epoch %d (a restored "
                        "home?); resuming past it", gid.hex(), w)
            self.store.skip_witnessed(new, got.commit_hash, raw, lost_from if lost_from < w else None, {
                "group": gid.hex(), "from": lost_from, "to": w - 1, "witness_epoch": w,
                "store_epoch": None if state is None else state.current_epoch})
            self.unsigned = True       # any gap recorded there keeps its statement round

    def _resume_behind_the_floor(self, epochs: dict[bytes, int]) -> dict:
        """§22.6 step 1 for a state restored from a copy older than the signing journal's
        compaction floor: every epoch of a group up to its floor is spent in the journal, and
        what it was (a receipt released to members, or a stated gap) was recorded in the copy
        that is gone. Stating those epochs absent would contradict the receipts members hold
        (equivocation evidence against an honest sequencer), and signing them
        again is forbidden (§22.5 cl. 1-2): the group jumps to the floor + 1, one transaction a
        group, with the gaps whose statements the journal kept (those bytes, nothing newly
        stated), and the `receipts_lost` event names the epochs it can no longer serve (members
        hold them). The resume then settles from the entry the journal kept there (the last
        released receipt: the head). ``epochs``: every group's committed epoch (and it is updated
        for the groups that jump). Returns the journal's groups (``Journal.receipt_groups``)."""
        journal = self.bridge.receipt_groups()
        for gid, jg in sorted(journal.items()):
            if jg.floor is None or epochs.get(gid, -1) > jg.floor:
                continue             # the usual open: nothing behind the floor, no state read
            state = self.store.group(gid)
            if state is not None and (state.current_epoch > jg.floor or state.failed_closed or state.migrated):
                continue
            stated, unstated = [], []
            lowest = None if state is None else state.current_epoch
            for epoch in sorted(e for e in jg.statements if lowest is None or lowest <= e <= jg.floor):
                raw = next((r for a in jg.statements[epoch]
                            if (r := self.bridge.released(DiscontinuityIdentity(gid, epoch, a))) is not None), None)
                if raw is None:
                    unstated.append(epoch)   # never released: what it would name is gone with the copy
                else:
                    stated.append((epoch, receipts.parse_statement(raw).commit_hash, raw))
            new = core.GroupState(gid, jg.floor + 1, None, "restored" if state is None else state.origin)
            self.store.skip_compacted(new, stated, {
                "group": gid.hex(), "from": lowest, "to": jg.floor, "stated": [e for e, _c, _r in stated],
                "unstated": unstated, "journal_epoch": jg.top})
            epochs[gid] = new.current_epoch
            self.fire("skipped")
        return journal

    def _settle_group(self, gid: bytes, mine: dict[int, tuple[bytes, bytes]], run: "_Settlement",
                      start: Optional[int] = None) -> None:
        """One group's epochs from its ``current_epoch`` up to the journal's highest intended one,
        each as ``settle`` takes it, never signing (§22.5 cl. 1-2, §22.6): a receipt the journal
        holds is adopted byte for byte, an intent without output (or an identity a compaction
        dropped: spent) is a recorded gap, and the first epoch the journal never heard of ends the
        run (never signed: its Commit is decided as usual). ``mine``: the group's pending
        acceptances, epoch -> (commit hash, Commit). ``start``: a group only the journal knows,
        settled from that epoch (the journal's first entry for it)."""
        status = self.bridge.status
        state = self.store.group(gid)
        if state is None and start is not None:
            state = core.GroupState(gid, start, None, "restored")
        elif state is None:
            # a bootstrap acceptance never committed (§22.6 bootstrap): the group starts at the
            # first pending epoch the journal knows; none: nothing was signed, nobody was answered
            start = next((e for e in sorted(mine) if status(ReceiptIdentity(gid, e)) is not Status.ABSENT), None)
            if start is None:
                return
            state = core.GroupState(gid, start, None, "bootstrap")
        top = self.bridge.max_receipt_epoch(gid)             # the journal's in-memory index
        current = state.current_epoch
        if top is None or top < current:
            return
        # the pending acceptance at the current epoch is the crash between intent and commit; an
        # epoch above it the journal knows means the state is older than the journal: a rollback
        beyond = current + 1 if current in mine and status(ReceiptIdentity(gid, current)) is not Status.ABSENT \
            else current
        run.start(state)
        if top >= beyond:
            run.event("rollback", {"group": gid.hex(), "store_epoch": beyond, "journal_epoch": top})
        for e in range(current, top + 1):
            ident = ReceiptIdentity(gid, e)
            st = status(ident)
            ch, message = mine.get(e, (None, None))
            if st is Status.RELEASED:
                raw = self.bridge.released(ident)
                got = receipts.parse_receipt(raw)
                run.receipt(gid, e, got.commit_hash, raw, receipts.receipt_hash(raw),
                            message if got.commit_hash == ch else None, e in mine)   # else its bytes are unknown
            elif st is Status.OUTCOME_UNKNOWN:
                run.gap(gid, e, ch, message, "receipt_absent" if e < beyond else "rollback", e in mine)
            else:
                break            # never signed: the state stays at this epoch

    def sign_statements(self) -> None:
        """§22.6 step 4: every gap this sequencer recorded gets one signed statement of absence,
        through the bridge like a receipt (durable intent, sign, durable bytes, only then stored
        and released), so members can relay it over the mesh and a member holding a receipt for
        that epoch holds proof against it. Never signed differently: a statement the journal
        holds is adopted byte for byte; attempt n is signed (the same payload) only when every
        attempt below it has an intent and no output — never released, so never seen.
        In batches of STATEMENT_BATCH gaps: one ``release_many`` (one durable commit of the
        intents, one of the outputs) and one SQLite transaction storing the batch."""
        protected = receipts.statement_protected(self.public_key)
        after: Optional[tuple[bytes, int]] = None
        skipped = False
        while True:
            gaps = self.store.unsigned_gaps(after, STATEMENT_BATCH)
            if not gaps:
                break
            after = gaps[-1][:2]
            stated: list[tuple[bytes, int, bytes]] = []
            requests, asked = [], []
            for gid, epoch, ch, prev in gaps:
                attempt = 0
                while True:
                    ident = DiscontinuityIdentity(gid, epoch, attempt)
                    st = self.bridge.status(ident)
                    if st is not Status.OUTCOME_UNKNOWN:
                        break
                    attempt += 1        # an intent, no output: never released; the next attempt
                if st is Status.RELEASED:
                    stated.append((gid, epoch, self.bridge.released(ident)))
                elif st is Status.ABSENT:
                    payload = receipts.statement_payload(gid, epoch, ch, prev)
                    requests.append((ident, self.key_name, receipts.sig_structure(protected, payload),
                                     lambda sig, pa=payload: receipts.assemble(protected, pa, sig)))
                    asked.append((gid, epoch))
                else:
                    skipped = True      # being signed by another thread: its round stores it
            if requests:
                try:
                    raws = self.bridge.release_many(requests)
                except KeystoreError as e:
                    # the gaps stay recorded and published unsigned; the next round tries again
                    # (a statement the bridge persisted before the fault is adopted then)
                    if stated:
                        self.store.put_statements(stated)
                    self.store.record_event("statement_unsigned", {"group": asked[0][0].hex(), "epoch": asked[0][1],
                                                                   "count": len(asked), "error": str(e)})
                    return
                stated.extend((gid, epoch, raw) for (gid, epoch), raw in zip(asked, raws))
            if stated:
                self.store.put_statements(stated)
                self.fire("stated")
            if len(gaps) < STATEMENT_BATCH:
                break
        self.unsigned = skipped



class _Settlement:
    """The epochs ``Settler.resume`` settles, written SETTLE_CHUNK to a transaction (``Store.commit_settled``):
    each transaction holds whole epochs with the state they lead to, so a crash between two leaves
    every group's epoch just above a durable receipt or stated gap (§22.5 cl. 3), and the next
    resume goes on from there (the journal is unchanged: nothing here signs)."""

    def __init__(self, store: Store, fire: Hook) -> None:
        self.store, self.fire = store, fire
        self.gapped = False          # a gap recorded: its statement is to be signed
        self.base: dict[bytes, core.GroupState] = {}     # each group's state before this batch
        self.outcomes: dict[bytes, list] = {}            # group -> [(epoch, receipt hash | None)]
        self.receipts: list = []
        self.gaps: list = []
        self.events: list = []
        self.pending_done: list = []
        self.size = 0
        # each group's highest receipt taken back from the journal: for the witness (``Settler.resume``)
        self.taken: dict[bytes, tuple[int, bytes]] = {}

    def start(self, state: core.GroupState) -> None:
        self.base[state.group_id] = state
        self.outcomes[state.group_id] = []

    def event(self, kind: str, detail: dict) -> None:
        self.events.append((kind, detail))

    def receipt(self, gid: bytes, epoch: int, ch: bytes, raw: bytes, rh: bytes, message: Optional[bytes],
                pending: bool) -> None:
        self.receipts.append((gid, epoch, ch, raw, rh, message))
        top = self.taken.get(gid)
        if top is None or epoch > top[0]:
            self.taken[gid] = (epoch, raw)
        self._add(gid, epoch, rh, pending)

    def gap(self, gid: bytes, epoch: int, ch: Optional[bytes], message: Optional[bytes], cause: str,
            pending: bool) -> None:
        self.gaps.append((gid, epoch, ch, message, cause))
        events = self.events
        last = events[-1][1] if events and events[-1][0] == "discontinuity" else None
        if last is not None and last["group"] == gid.hex() and last["last"] == epoch - 1 and last["cause"] == cause:
            last["last"] = epoch          # one event for a run of consecutive gaps
        else:
            events.append(("discontinuity", {"group": gid.hex(), "epoch": epoch, "last": epoch, "cause": cause}))
        self.gapped = True
        self._add(gid, epoch, None, pending)

    def _add(self, gid: bytes, epoch: int, rh: Optional[bytes], pending: bool) -> None:
        self.outcomes[gid].append((epoch, rh))
        if pending:                       # its pending row goes in the transaction that settles it
            self.pending_done.append((gid, epoch))
        self.size += 1
        if self.size >= SETTLE_CHUNK:
            self.flush()

    def flush(self, all_pending: bool = False) -> None:
        states = []
        for gid, done in self.outcomes.items():
            if done:
                states.append(core.settled(self.base[gid], done))
        if not (states or self.events or all_pending):
            return
        self.store.commit_settled(states, self.receipts, self.gaps, self.events, self.pending_done, all_pending)
        for new in states:
            self.base[new.group_id] = new
            self.outcomes[new.group_id] = []
        self.receipts, self.gaps, self.events, self.pending_done, self.size = [], [], [], [], 0
        self.fire("settled")

    def finish(self, all_pending: bool) -> None:
        self.flush(all_pending)


