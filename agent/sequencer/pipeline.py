"""The pipelined group commit (docs/sequencer.md "Pipelined group commit"; §22.5 cl. 1-3): Commits
decided in batches of distinct groups, first-Commit-wins in arrival order, each batch's receipts
signed through the keystore bridge while the batch before it commits, answers released only once
their receipts and epochs are committed. It works on an opened ``Home`` through its public
interface (home.py)."""
from __future__ import annotations

import gc
from collections import deque
from typing import Optional

from firmware_bridge import KeystoreError, ReceiptIdentity
from firmware_bridge.bridge import Status

from agent.sequencer import core, receipts
from agent.sequencer.replies import Accepted, Rejected
from agent.sequencer.framing import FramingError, parse_mls_message
from agent.sequencer.home import RECEIPT_KEY, Home, disk_need

# Commits per batch of the pipelined group commit: each step costs one journal fsync and one
# SQLite commit whatever the batch's size; batches overlap when at least two are available.
# submit_many splits what it is given into at least MIN_BATCHES batches (of at least
# MIN_CHUNK), so one call overlaps its own signing with the rest.
CHUNK = 256
MIN_CHUNK, MIN_BATCHES = 32, 4

# The cyclic collector of a serving process (`sequencer run`, tune_collector): its youngest
# generation collected every 10 000 net container allocations instead of 700, the older ones at
# the default ratios to it. The group commit allocates several tuples a Commit and keeps its
# batches in flight across steps, so at 700 the collector ran ~250 times per 32 768 Commits and
# promoted the batches to the oldest generation, whose full passes walk every group's cached
# state: 2.8 µs of CPU a Commit, 0.2 µs at 10 000 (measured with gc.callbacks, 1 024 groups).
# What waits for a collection meanwhile is only garbage in reference cycles (refcounting frees
# the rest at once): at most ~10 000 young objects, about a megabyte.
GC_THRESHOLDS = (10_000, 10, 10)


def tune_collector() -> None:
    """Set GC_THRESHOLDS for this process (process-wide, as the collector is): `sequencer run`
    calls it when it starts serving, and the benchmark that measures its group commit does too."""
    gc.set_threshold(*GC_THRESHOLDS)


class GroupCommit:
    """The pipelined group commit (docs/sequencer.md "Pipelined group commit"; §22.5 cl. 1-3).

    Commits are taken in batches of at most ``chunk`` Commits for distinct groups; up to ``DEPTH``
    batches are at the keystore at once (intents durable, being signed). One step:

      1. journal   one commit (one fsync): the outputs of the oldest batch at the keystore (once
                   DEPTH are there, or nothing else is left) and the intents of the batch whose
                   pending rows are durable; then that batch's signing starts (the software
                   keystore signs in its own process, beside this one; the batch queued behind the
                   one being signed keeps it busy while this process journals)
      2. decide    the next batch, first-Commit-wins on committed state: a group with a batch in
                   flight waits for a later step (its Commits keep their arrival order)
      3. SQLite    one transaction (one fsync): the receipts and epoch advances of the batch whose
                   outputs step 1 persisted, and the pending rows of the batch step 2 accepted
      4. answers   of the batch step 3 committed, released only now

    So per Commit the order is the unpipelined one — pending durable, intent durable, signature,
    output durable, receipt and epoch committed, answer released — and each fsync is shared by two
    batches. While the keystore signs, this process commits the batch before and prepares the next.
    """

    DEPTH = 2

    def __init__(self, seq: Home, chunk: int) -> None:
        self.seq = seq
        self.chunk = max(1, int(chunk))
        self.queue: deque = deque()     # (tag, framing, message, commit hash), arrival order
        self.queued_bytes = 0           # of the messages in ``queue`` (what a caller bounds its intake by)
        self.signing: deque = deque()   # (accepts, bridge ticket, their pending rowids), oldest first
        self.prepared: list = []        # accepts whose pending rows are durable, no intent yet
        self.prepared_rows: Optional[tuple[int, int]] = None   # their rowid range in `pending`
        self.ready: list = []           # (tag, answer) released by put (unparseable) or a step
        self.batches = 0                # batches accepted (each one signed as a group commit)
        # the groups of the batches decided and not committed yet, and their Commits' disk_need:
        # kept as batches are decided and committed, not gathered from the batches every step
        self.in_flight: set = set()
        self.in_flight_need = 0

    def put(self, tag: object, message: bytes) -> None:
        try:
            f = parse_mls_message(message)
        except FramingError as e:
            self.ready.append((tag, Rejected(core.UNPARSEABLE, None, None, None, str(e))))
            return
        m = bytes(message)
        self.queue.append((tag, f, m, receipts.commit_hash(m)))
        self.queued_bytes += len(m)

    def busy(self) -> bool:
        return bool(self.queue or self.signing or self.prepared or self.ready)

    def drain(self) -> list:
        out = []
        while True:
            out.extend(self.step())
            if not self.busy():
                return out

    def step(self) -> list:
        """One step (see the class); returns the (tag, answer) pairs it released."""
        seq = self.seq
        if seq.statements_due:
            seq.sign_statements()
        prepared, prepared_rows = self.prepared, self.prepared_rows
        finishing = self.signing[0] if self.signing and (len(self.signing) >= self.DEPTH or not prepared) else None
        requests = []
        parts, payload = seq.signing.parts, receipts.payload_bytes   # the header parts, once per key
        for _t, _m, ch, _s, d in prepared:
            tbs, assemble = parts(payload(d.group_id, d.epoch, ch, d.previous_receipt_hash))
            requests.append((ReceiptIdentity(d.group_id, d.epoch), RECEIPT_KEY, tbs, assemble))
        try:
            raws, ticket = seq.bridge.release_pipelined(None if finishing is None else finishing[1], requests)
        except KeystoreError:
            # some receipts may be persisted, others intended only, others never asked for: each
            # pair is settled against the journal, never re-signed (§22.5 cl. 2, §22.6). A batch
            # still at the keystore is finished first (its claims dropped, what it signed persisted).
            failed = []
            if finishing is not None:      # release_pipelined finished it as far as it got
                self.signing.popleft()
                failed = finishing[0]
            self._abandon(failed)
            raise
        if finishing is not None:
            self.signing.popleft()
        if prepared:
            self.signing.append((prepared, ticket, prepared_rows))
        self.prepared, self.prepared_rows = [], None
        try:
            return self._commit(finishing, raws)
        except BaseException:
            # a local fault (a full disk, an I/O error): drop the claims of every batch still at
            # the keystore, persisting what it signed, so this process can go on; every pair in
            # flight keeps its pending row and is settled against the journal when its group is
            # next decided (the state is behind its journal) or on the next open (§22.6 step 1)
            self._drop_in_flight()
            raise

    def _commit(self, finishing, raws) -> list:
        """Steps 2-4 of a step (see the class)."""
        seq = self.seq
        finished = [] if finishing is None else finishing[0]
        in_flight = [finished] + [batch for batch, _tk, _r in self.signing]   # decided, not committed
        out, self.ready = self.ready, []
        accepts = self._decide(in_flight, out)
        for _t, m, _ch, _s, d in finished:    # committed below (a fault drops every batch in flight)
            self.in_flight.discard(d.group_id)
            self.in_flight_need -= disk_need(m)
        done = []
        receipt_hash, accepted = receipts.receipt_hash, core.accepted
        for (tag, m, ch, state, d), raw in zip(finished, raws or []):
            rh = receipt_hash(raw)
            done.append((accepted(state, d, rh), d.epoch, ch, raw, rh, m))
            out.append((tag, Accepted(d.group_id, d.epoch, raw)))
        # outside the home, durable before any of them is released (a restore of the whole home
        # must not sign these pairs again, §22.5 cl. 2)
        seq.witness.note([raw for _n, _e, _c, raw, _h, _m in done])
        if done or accepts:
            # §22.5 cl. 3 for the finished batch; the next batch's pending rows before its intents
            rows = seq.store.commit_step(done, [(d.group_id, d.epoch, ch, m, d.bootstrap) for _t, m, ch, _s, d in accepts],
                                         None if finishing is None else finishing[2])
        if done:
            seq.fire("committed")
        if accepts:
            seq.fire("accepted")
            self.prepared, self.prepared_rows = accepts, rows
            self.batches += 1
        if seq.statements_due:
            seq.sign_statements()
        if done:
            seq.maybe_compact()   # the batch just committed may be dropped from the journal
        return out

    def _drop_in_flight(self) -> list:
        """Finish every batch still at the keystore as far as it got (what verified is persisted,
        its claims dropped) and forget every batch in flight; returns their accepts."""
        batches = [b for b, _tk, _r in self.signing] + [self.prepared]
        tickets = [tk for _b, tk, _r in self.signing]
        self.signing, self.prepared, self.prepared_rows = deque(), [], None
        self.in_flight, self.in_flight_need = set(), 0
        for tk in tickets:
            try:
                self.seq.bridge.release_pipelined(tk, [])
            except Exception:   # noqa: BLE001 - the fault being raised says what happened
                pass
        return batches

    def _abandon(self, failed: list) -> None:
        """After a keystore failure: ``_drop_in_flight``, then settle every pair in flight
        (``failed``: the batch the failing step was finishing) against the journal."""
        for batch in [failed] + self._drop_in_flight():
            for _t, _m, _ch, _s, d in batch:
                self.seq.settle(d.group_id, d.epoch, cause="signing_failed")

    def _decide(self, in_flight: list, out: list) -> list:
        """The next batch from the queue: at most ``chunk`` Commits for distinct groups none of
        which is in flight (``in_flight``: the batches decided and not committed yet, whose
        groups and disk need ``self.in_flight`` and ``self.in_flight_need`` hold),
        first-Commit-wins on each group's committed state; the rest keeps its order for a later
        step. Rejections are answered at once (their head is committed). The group bound and the
        disk reserve count what is in flight too, looked at once a step, when first needed."""
        seq = self.seq
        group, decide, top_epoch = seq.store.group, core.decide, seq.bridge.max_receipt_epoch
        accepts, later = [], deque()
        # the groups in flight, and those accepted in this step: their later Commits wait their turn
        seen = set(self.in_flight)
        queue, limit = self.queue, self.chunk
        room = None              # new groups this batch may still create (seq.max_groups), counted once
        space = None             # bytes of disk this batch may still take (DISK_RESERVE_BYTES kept)
        while queue:
            item = queue.popleft()
            tag, f, m, ch = item
            if f.group_id in seen:
                later.append(item)
                continue
            if len(accepts) >= limit:
                later.append(item)
                later.extend(queue)
                queue.clear()
                break
            self.queued_bytes -= len(m)     # decided now, whatever the outcome (the rest stays in ``later``)
            state = group(f.group_id)
            d = decide(state, f, ch, state is None and seq.store.retired(f.group_id) is not None,
                       f.group_id in seq.held)
            if type(d) is not core.Accept:
                if d.reason == core.FUTURE_EPOCH and f.group_id in seq.unproven:
                    # a member ahead of a state the witness cannot vouch for: evidence it is
                    # behind what was released (§22.5 cl. 2), not a member to send away
                    seq.hold(f.group_id, core.COMMIT_AHEAD, {"epoch": f.epoch, "current_epoch": state.current_epoch})
                    d = decide(state, f, ch, False, True)
                out.append((tag, seq.rejected(d)))
                continue
            seen.add(f.group_id)
            top = top_epoch(d.group_id)   # the journal's in-memory index
            if top is not None and top >= d.epoch and \
                    seq.bridge.status(ReceiptIdentity(d.group_id, d.epoch)) is not Status.ABSENT:
                # The journal already knows this pair: the state is behind its journal (restored
                # from an older copy). Never signed again (§22.5 cl. 1-2): adopt or record the gap.
                seq.store.record_event("rollback", {"group": d.group_id.hex(), "epoch": d.epoch})
                seq.settle(d.group_id, d.epoch, cause="rollback", candidate=(ch, m))
                raw = seq.store.receipt(d.group_id, d.epoch)
                if raw is not None and receipts.parse_receipt(raw).commit_hash == ch:
                    out.append((tag, Accepted(d.group_id, d.epoch, raw)))   # exactly the persisted bytes
                else:
                    out.append((tag, seq.rejected(core.decide(seq.store.group(d.group_id), f, ch))))
                continue
            if d.bootstrap and seq.max_groups is not None:
                if room is None:
                    booting = sum(x.bootstrap for batch in in_flight for _t, _m, _ch, _s, x in batch)
                    room = seq.max_groups - seq.store.group_count() - booting
                if room <= 0:
                    out.append((tag, seq.rejected(core.Reject(core.GROUP_LIMIT, d.group_id, None, None,
                                                               seq.group_limit_detail()))))
                    continue
                room -= 1
            need = disk_need(m)
            if space is None:
                space = seq.disk_room() - self.in_flight_need
            if need > space:
                out.append((tag, seq.rejected(core.reject(
                    core.DISK_FULL, d.group_id, state, "the sequencer's disk is short of space: offer it again later"))))
                continue
            space -= need
            accepts.append((tag, m, ch, state, d))
            self.in_flight.add(d.group_id)
            self.in_flight_need += need
        later.extend(queue)
        self.queue = later
        return accepts
