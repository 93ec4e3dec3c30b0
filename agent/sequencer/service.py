"""The sequencer: framing → core decision → receipt through the keystore bridge → atomic store
commit → release (SOVM §22.5–§22.6, docs/sequencer.md).

One acceptance, in this order: decide (first-Commit-wins on the stored state, core.py); make the
accepted Commit's bytes durable before any signing intent, so that after a crash the sequencer
knows which Commit an intent was for; release through the bridge (durable intent, sign, durable
receipt: persist-before-release, §22.5 cl. 1-2); commit receipt, epoch E+1 and head in one SQLite
transaction (cl. 3); only then do the receipt bytes leave.

On open, before serving (§22.6 "epoch advanced, receipt absent"), ``_resume`` settles every pending
acceptance against the bridge journal: a receipt there is adopted byte for byte (never re-signed),
an intent alone counts as signed (a recorded discontinuity), nothing there drops the acceptance;
and a store behind its journal is a rollback: surfaced, and every epoch the journal knows is
adopted or recorded as a discontinuity, never signed again."""
from __future__ import annotations

import fcntl
import gc
import logging
import os
import shutil
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Union

from firmware_bridge import (DiscontinuityIdentity, KeystoreError, KeystoreUnavailable, ReceiptIdentity, SigningBridge,
                             open_keystore, with_pin)
from firmware_bridge import keytag
from firmware_bridge.bridge import Status
from firmware_bridge.fsutil import fsync_dir
from firmware_bridge.keystore import KeystoreConfigError, check_config

from agent.core import numbers
from agent.core.frozen import fast_init
from agent.sequencer import core, receipts
from agent.sequencer.framing import FramingError, parse_mls_message
from agent.sequencer.store import STATE_PAGE_BYTES, STATE_WAL_CHECKPOINT_PAGES, Store
from agent.sequencer.witness import ReceiptWitness

log = logging.getLogger("ssp_agent.sequencer")

RECEIPT_KEY = "receipts"          # the key name of the receipt-signing identity in the keystore
DB_NAME, JOURNAL_NAME, LOCK_NAME, PIN_NAME = "sequencer.db", "sign-journal", "sequencer.lock", "keystore.pin"
INIT_RECORD = "init.incomplete"   # an init in progress, or cut short: the key it generates (_receipt_key)
HANDOFF_FORMAT = "sovm-sequencer-handoff-v1"
RUN_LOCK_NAME = "run.lock"        # held exclusively by `sequencer run`, shared by every other verb
# The signing journal is compacted when it grew this much since its last compaction (and on open
# when larger than the second figure): it then holds each group's last receipt and one floor a
# group, not every receipt ever signed (~350 bytes of disk and of memory each: docs/sequencer.md
# "Journal compaction")
JOURNAL_COMPACT_BYTES = 8 * 2**20
# ... or by this many times what the last compaction kept, if more (`_maybe_compact`)
JOURNAL_COMPACT_KEPT_RATIO = 1.0
JOURNAL_OPEN_COMPACT_BYTES = 64 * 2**10

# Free space the home's filesystem keeps beyond the Commits being accepted: below it a Commit is
# refused `disk_full` before anything is written, never cut between its signing intent and its
# receipt (a full disk there became a stated discontinuity on the next start, §22.6). Each Commit
# counts DISK_FACTOR times its bytes (pending row, receipts row, their WAL copies) plus
# DISK_PER_COMMIT (receipt, journal entries, index pages).
# It holds room for the state file's WAL to reach its checkpoint size (store.py) besides 4 MiB.
DISK_RESERVE_BYTES = (4 << 20) + STATE_WAL_CHECKPOINT_PAGES * STATE_PAGE_BYTES
DISK_FACTOR = 4
DISK_PER_COMMIT = 4096

# The cyclic collector of a serving process (`sequencer run`, tune_collector): its youngest
# generation collected every 10 000 net container allocations instead of 700, the older ones at
# the default ratios to it. The group commit allocates several tuples a Commit and keeps its
# batches in flight across steps, so at 700 the collector ran ~250 times per 32 768 Commits and
# promoted the batches to the oldest generation, whose full passes walk every group's cached
# state: 2.8 µs of CPU a Commit, 0.2 µs at 10 000 (measured with gc.callbacks, 1 024 groups).
# What waits for a collection meanwhile is only garbage in reference cycles (refcounting frees
# the rest at once): at most ~10 000 young objects, about a megabyte.
GC_THRESHOLDS = (10_000, 10, 10)

Hook = Callable[[str], None]


def tune_collector() -> None:
    """Set GC_THRESHOLDS for this process (process-wide, as the collector is): `sequencer run`
    calls it when it starts serving, and the benchmark that measures its group commit does too."""
    gc.set_threshold(*GC_THRESHOLDS)


def _disk_need(message: bytes) -> int:
    """What accepting ``message`` may write before its receipt is committed (the disk reserve)."""
    return DISK_FACTOR * len(message) + DISK_PER_COMMIT


class SequencerRefused(Exception):
    """The request was refused (CLI exit 2)."""


class SequencerFault(Exception):
    """A local fault: state or keystore unusable (CLI exit 1)."""


class GroupLimit(SequencerRefused):
    """A new group beyond ``Sequencer.max_groups`` (reason ``group_limit``)."""

    reason = core.GROUP_LIMIT


class SequencerServing(SequencerRefused):
    """A `sequencer run` holds this home: requests go through the broker, reads are read-only."""


@fast_init
@dataclass(frozen=True)
class Accepted:
    group_id: bytes
    epoch: int
    receipt: bytes


@dataclass(frozen=True)
class Rejected:
    reason: str
    group_id: Optional[bytes]
    current_epoch: Optional[int]
    head: Optional[bytes]            # the exact bytes of the chain head's receipt, or None
    detail: str = ""


@dataclass(frozen=True)
class Absent:
    """§22.6: a stated absence, never a new signature."""
    discontinuity: bool
    statement: Optional[bytes] = field(default=None, compare=False)   # the signed statement, when there is one


Answer = Union[Accepted, Rejected]


def _with_pin(conf: dict) -> dict:
    try:
        return with_pin(conf)
    except KeystoreUnavailable as e:
        raise SequencerFault(str(e)) from None


def _lock(home: Path, name: str = LOCK_NAME, how: int = fcntl.LOCK_EX) -> int:
    """One sequencer per home (§22.6 singularity, locally): concurrent verbs queue on this lock."""
    fd = os.open(str(home / name), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how)
    except BlockingIOError:
        os.close(fd)
        raise SequencerServing(f"a `sequencer run` is serving {home}: submit and register through the "
                               "broker (docs/sequencer.md)") from None
    return fd


def serving(home: Path) -> bool:
    """True while a `sequencer run` holds ``home``."""
    try:
        os.close(_lock(Path(home), RUN_LOCK_NAME, fcntl.LOCK_SH | fcntl.LOCK_NB))
    except SequencerServing:
        return True
    except FileNotFoundError:
        return False
    return False


def init(home: Path, keystore: Optional[dict] = None) -> bytes:
    """Create a sequencer home and its receipt key (ES256, generated inside the keystore).
    Returns the 33-byte compressed public key (the registered form, §22.5)."""
    home = Path(home)
    if (home / DB_NAME).exists():
        raise SequencerRefused(f"{home} already holds a sequencer; it is never overwritten")
    try:        # a request that cannot be right is refused before anything is made
        conf = check_config(keystore or {"kind": "software"})
    except KeystoreConfigError as e:
        raise SequencerRefused(str(e)) from None
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = _lock(home)
    try:
        if (home / DB_NAME).exists():
            raise SequencerRefused(f"{home} already holds a sequencer; it is never overwritten")
        if conf.get("kind") == "software":
            conf.setdefault("dir", str(home / "keystore"))
        if "pin" in conf:     # a token PIN goes to a 0600 file, never into the state database
            pfd = os.open(str(home / PIN_NAME), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(pfd, "w") as f:
                f.write(str(conf.pop("pin")))
                f.flush()
                os.fsync(f.fileno())
            conf["pin_file"] = str(home / PIN_NAME)
        try:
            ks = open_keystore(_with_pin(conf))
            try:
                public = _receipt_key(home, ks, conf)
            finally:
                ks.close()
        except BaseException:
            # a failed init leaves no PIN behind (the home is not made: nothing would read it)
            (home / PIN_NAME).unlink(missing_ok=True)
            raise
        store = Store(home / (DB_NAME + ".new"))
        store.set_meta("keystore", conf)
        store.set_meta("receipt_key", {"name": RECEIPT_KEY, "public_key": public.hex()})
        store.close()
        os.replace(home / (DB_NAME + ".new"), home / DB_NAME)   # the home exists only when complete
        fsync_dir(str(home))
        (home / INIT_RECORD).unlink(missing_ok=True)
        fsync_dir(str(home))
        return public
    finally:
        os.close(fd)


def _receipt_key(home: Path, ks, conf: dict) -> bytes:
    """Generate the receipt key, or take up the one an init of this home cut short made (a key
    cannot be taken back off a token or the serial device, and a software key left in the home's
    own keystore was never used: the state that would have used it was never made); any other key
    of that name is still refused (KeyExists). ``INIT_RECORD``: firmware_bridge/keytag.py."""
    kind = conf.get("kind", "")
    public, taken_up = keytag.generate_or_take_up(ks, RECEIPT_KEY, "p256", home / INIT_RECORD, kind,
                                                  keytag.own_directory(conf, home))
    if taken_up:
        log.warning("taking up the receipt key an unfinished init of %s made on the %s keystore", home, kind)
    return public


# Commits per batch of the pipelined group commit: each step costs one journal fsync and one
# SQLite commit whatever the batch's size; batches overlap when at least two are available.
# submit_many splits what it is given into at least MIN_BATCHES batches (of at least
# MIN_CHUNK), so one call overlaps its own signing with the rest.
CHUNK = 256
MIN_CHUNK, MIN_BATCHES = 32, 4
# Resume (§22.6 step 1) after a rollback: lost epochs settled per SQLite transaction, and gaps
# whose statements of absence are signed per bridge call (one durable commit of the intents,
# one of the outputs): a rollback over N epochs costs ~N/SETTLE_CHUNK + N/STATEMENT_BATCH
# transactions and 2·N/STATEMENT_BATCH journal fsyncs (docs/sequencer.md "Resume").
SETTLE_CHUNK = 4096
STATEMENT_BATCH = 1024


class Sequencer:
    def __init__(self, home: Path, *, fault_hook: Optional[Hook] = None, serve: bool = False) -> None:
        """Open a sequencer home and resume (§22.6 step 1) before anything is served.
        ``serve``: for `sequencer run`, which holds the home for its lifetime (a second one waits,
        a standby); other openers share the run lock and are refused (SequencerServing) while a
        run holds it. ``fault_hook`` is the test seam for named crash points; production passes none."""
        self.home = Path(home)
        if not (self.home / DB_NAME).exists():
            if (self.home / INIT_RECORD).exists():
                raise SequencerRefused(f"{self.home} holds no sequencer: its `sequencer init` was cut short; "
                                       "run the same `sequencer init` again to complete it")
            raise SequencerRefused(f"{self.home} holds no sequencer (run `sequencer init` first)")
        # an init killed after its state was in place left its key record: it must not outlive the
        # init (a state lost later is recovered, §22.6, never initialised again on that key)
        try:
            (self.home / INIT_RECORD).unlink()
        except OSError:
            pass
        self._hook = fault_hook
        # at most this many groups tracked: a new one beyond it (the first Commit of an unknown
        # group_id, §22.6 bootstrap, or a registration) is refused `group_limit`; None: no bound
        self.max_groups: Optional[int] = None
        self._unsigned = False          # a gap recorded whose statement is not signed yet
        self.chunk = CHUNK              # Commits per step of the pipelined group commit
        self._lock_fd = None
        self._run_fd = _lock(self.home, RUN_LOCK_NAME, fcntl.LOCK_EX if serve else fcntl.LOCK_SH | fcntl.LOCK_NB)
        self._lock_fd = _lock(self.home)
        self.bridge: Optional[SigningBridge] = None
        try:
            self.store = Store(self.home / DB_NAME)
            meta = self.store.get_meta("receipt_key")
            self.public_key = bytes.fromhex(meta["public_key"])
            self._signing = receipts.Signing(receipts.protected_header(self.public_key))
            ks = open_keystore(_with_pin(self.store.get_meta("keystore")))
            if ks.public_key(RECEIPT_KEY) != self.public_key:
                ks.close()
                raise SequencerFault("the keystore's receipt key is not the one this sequencer was "
                                     "initialised with: wrong token or device attached")
            self.bridge = SigningBridge(ks, str(self.home / JOURNAL_NAME), fault_hook=fault_hook)
            self._compacted_at = 0          # the journal's size after its last compaction
            self.witness = ReceiptWitness(self.public_key)
            self._resume()
            # groups members' evidence showed behind (§22.5 cl. 2): not served until recovered
            self.held: set[bytes] = set(self.store.held())
            self._unproven_at_resume: Optional[set[bytes]] = None
            if self.bridge.journal_stats()["bytes"] > JOURNAL_OPEN_COMPACT_BYTES:
                self.compact_journal()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if getattr(self, "witness", None) is not None:
            self.witness.close()
        if self.bridge is not None:
            self.bridge.close()
            self.bridge.keystore.close()
            self.bridge = None
        if getattr(self, "store", None) is not None:
            self.store.close()
            self.store = None  # type: ignore[assignment]
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if getattr(self, "_run_fd", None) is not None:
            os.close(self._run_fd)
            self._run_fd = None

    def __enter__(self) -> "Sequencer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def group_limit_detail(self) -> str:
        return f"this sequencer tracks at most {self.max_groups} groups (`sequencer run --max-groups`)"

    def disk_room(self) -> int:
        """Bytes the home's filesystem can still give to Commits (its free space less
        DISK_RESERVE_BYTES)."""
        try:
            return shutil.disk_usage(self.home).free - DISK_RESERVE_BYTES
        except OSError:
            return 1 << 62

    def _fire(self, point: str) -> None:
        if self._hook is not None:
            self._hook(point)

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

    def compact_journal(self) -> dict:
        """Drop from the signing journal every receipt the receipts table holds (or whose gap it
        states): below each group's committed epoch (§22.5 cl. 3: the epoch moves only with the
        receipt or the stated gap), except the group's last one; a group frozen on
        equivocation evidence keeps all of its own for the audit. What the journal forgets this
        way stays spent, never signed again (docs/sequencer.md "Journal compaction")."""
        # a gap whose statement is not signed yet keeps its intent (and the receipt before it) in
        # the journal: a state restored past the floor settles it again and states it then
        unstated: dict[bytes, int] = {}
        for gid, epoch, _ch, _prev in self.store.unsigned_gaps():
            unstated.setdefault(gid, epoch)

        def recorded_below(gid: bytes) -> Optional[int]:
            state = self.store.group(gid)
            if state is None or state.failed_closed:
                return None
            return min(state.current_epoch, unstated.get(gid, state.current_epoch))
        stats = self.bridge.compact_receipts(recorded_below)
        self._compacted_at = stats["bytes_after"]
        return stats

    def _maybe_compact(self) -> None:
        # a full compaction rewrites every group's kept entries (~7.6 µs a group; most rewrite
        # only what came since, docs/keystore.md "Compaction"): it waits until the journal grew by
        # what it keeps, at least JOURNAL_COMPACT_BYTES, so its cost per Commit stays bounded
        # however many groups, and the journal (with its in-memory index) within twice its
        # compacted size plus that step ("Journal compaction")
        grown = self.bridge.journal_stats()["bytes"] - self._compacted_at
        if grown >= max(JOURNAL_COMPACT_BYTES, JOURNAL_COMPACT_KEPT_RATIO * self._compacted_at):
            self.compact_journal()

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

    def hold(self, group_id: bytes, evidence: str, detail: dict) -> None:
        """§22.5 cl. 2: members' evidence (``evidence``: core.BROKER_HEAD or core.COMMIT_AHEAD)
        shows this state behind what was released; the group is served nothing that signs until
        `sequencer recover` resumes it from members' receipts (docs/sequencer.md)."""
        if group_id in self.held:
            return
        log.warning("group %s held (%s): this state is behind what was released (a restored machine?); "
                    "run `sequencer recover` with members' evidence", group_id.hex(), evidence)
        self.store.hold(group_id, core.STATE_BEHIND, {"group": group_id.hex(), "evidence": evidence, **detail})
        self.held.add(group_id)

    @property
    def unproven(self) -> set[bytes]:
        """``_unproven`` as it was after this open's resume: read once, when first needed (`run`
        reads it before serving; a one-shot verb only on a Commit framed ahead)."""
        if self._unproven_at_resume is None:
            self._unproven_at_resume = self._unproven()
        return self._unproven_at_resume

    def _unproven(self) -> set[bytes]:
        """The groups whose state the receipt witness does not vouch for after this resume: a
        released receipt (a head) the witness lacks or holds another of, or any group at all when
        the witness holds nothing while this home holds receipts (a witness lost with the old
        machine). The witness proves a home restore only: a whole-machine restore restores it too
        (docs/sequencer.md "Evidence from members on resume")."""
        top = self.witness.top
        out, unreceipted, any_head = set(), set(), False
        for s in self.store.iter_groups():
            if s.failed_closed or s.migrated:
                continue
            if s.head is None:
                unreceipted.add(s.group_id)
                continue
            any_head = True
            w = top.get(s.group_id)
            if w is None or w[0] != s.head.epoch or receipts.receipt_hash(w[1]) != s.head.receipt_hash:
                out.add(s.group_id)
        return out | unreceipted if any_head and not top else out

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
    def _rejected(self, d: core.Decision) -> Rejected:
        assert isinstance(d, core.Reject)
        head = None if d.head is None or d.group_id is None else self.store.receipt(d.group_id, d.head.epoch)
        return Rejected(d.reason, d.group_id, d.current_epoch, head, d.detail)

    def _settle(self, gid: bytes, epoch: int, *, cause: str,
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
            self._unsigned = True
        else:
            self.store.drop_pending(gid, epoch)         # never signed: nobody got an answer

    def _resume(self) -> None:
        """§22.6 step 1, before serving anything: settle pending acceptances, then make sure no
        group's epoch is behind an identity the journal ever intended to sign (a state restored
        from an older copy: a rollback). Its cost follows what it does, not the rollback's depth
        in transactions (docs/sequencer.md "Resume"): `pending` is read once, the epochs settled
        go to SQLite SETTLE_CHUNK to a transaction (``_Settlement``), and the gaps' statements
        are signed STATEMENT_BATCH to a bridge call (``_sign_statements``)."""
        epochs = dict(self.store.current_epochs())              # one query, however many groups
        journal = self._resume_behind_the_floor(epochs)
        pend: dict[bytes, dict[int, tuple[bytes, bytes]]] = {}
        for gid, epoch, h, m, _b in self.store.pending():       # once, however many epochs
            pend.setdefault(gid, {})[epoch] = (h, m)
        run = _Settlement(self)
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
        # a receipt the journal held and the witness may not (a crash between the two): released
        # or not, the witness holds it from now on, so it vouches for the group (§22.5 cl. 2)
        self.witness.note([raw for gid, (e, raw) in sorted(run.taken.items())
                           if (w := self.witness.top.get(gid)) is None or w[0] < e])
        self._resume_witness(epochs)
        self._sign_statements()

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
            self._unsigned = True       # any gap recorded there keeps its statement round

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
            self._fire("skipped")
        return journal

    def _settle_group(self, gid: bytes, mine: dict[int, tuple[bytes, bytes]], run: "_Settlement",
                      start: Optional[int] = None) -> None:
        """One group's epochs from its ``current_epoch`` up to the journal's highest intended one,
        each as ``_settle`` takes it, never signing (§22.5 cl. 1-2, §22.6): a receipt the journal
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

    def _sign_statements(self) -> None:
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
                    requests.append((ident, RECEIPT_KEY, receipts.sig_structure(protected, payload),
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
                self._fire("stated")
            if len(gaps) < STATEMENT_BATCH:
                break
        self._unsigned = skipped


class _Settlement:
    """The epochs ``_resume`` settles, written SETTLE_CHUNK to a transaction (``Store.commit_settled``):
    each transaction holds whole epochs with the state they lead to, so a crash between two leaves
    every group's epoch just above a durable receipt or stated gap (§22.5 cl. 3), and the next
    resume goes on from there (the journal is unchanged: nothing here signs)."""

    def __init__(self, seq: Sequencer) -> None:
        self.seq = seq
        self.base: dict[bytes, core.GroupState] = {}     # each group's state before this batch
        self.outcomes: dict[bytes, list] = {}            # group -> [(epoch, receipt hash | None)]
        self.receipts: list = []
        self.gaps: list = []
        self.events: list = []
        self.pending_done: list = []
        self.size = 0
        # each group's highest receipt taken back from the journal: for the witness (``_resume``)
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
        self.seq._unsigned = True
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
        self.seq.store.commit_settled(states, self.receipts, self.gaps, self.events, self.pending_done, all_pending)
        for new in states:
            self.base[new.group_id] = new
            self.outcomes[new.group_id] = []
        self.receipts, self.gaps, self.events, self.pending_done, self.size = [], [], [], [], 0
        self.seq._fire("settled")

    def finish(self, all_pending: bool) -> None:
        self.flush(all_pending)


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

    def __init__(self, seq: Sequencer, chunk: int) -> None:
        self.seq = seq
        self.chunk = max(1, int(chunk))
        self.queue: deque = deque()     # (tag, framing, message, commit hash), arrival order
        self.queued_bytes = 0           # of the messages in ``queue`` (what a caller bounds its intake by)
        self.signing: deque = deque()   # (accepts, bridge ticket, their pending rowids), oldest first
        self.prepared: list = []        # accepts whose pending rows are durable, no intent yet
        self.prepared_rows: Optional[tuple[int, int]] = None   # their rowid range in `pending`
        self.ready: list = []           # (tag, answer) released by put (unparseable) or a step
        self.batches = 0                # batches accepted (each one signed as a group commit)
        # the groups of the batches decided and not committed yet, and their Commits' _disk_need:
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
        if seq._unsigned:
            seq._sign_statements()
        prepared, prepared_rows = self.prepared, self.prepared_rows
        finishing = self.signing[0] if self.signing and (len(self.signing) >= self.DEPTH or not prepared) else None
        requests = []
        parts, payload = seq._signing.parts, receipts.payload_bytes   # the header parts, once per key
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
            self.in_flight_need -= _disk_need(m)
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
            seq._fire("committed")
        if accepts:
            seq._fire("accepted")
            self.prepared, self.prepared_rows = accepts, rows
            self.batches += 1
        if seq._unsigned:
            seq._sign_statements()
        if done:
            seq._maybe_compact()   # the batch just committed may be dropped from the journal
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
                self.seq._settle(d.group_id, d.epoch, cause="signing_failed")

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
                out.append((tag, seq._rejected(d)))
                continue
            seen.add(f.group_id)
            top = top_epoch(d.group_id)   # the journal's in-memory index
            if top is not None and top >= d.epoch and \
                    seq.bridge.status(ReceiptIdentity(d.group_id, d.epoch)) is not Status.ABSENT:
                # The journal already knows this pair: the state is behind its journal (restored
                # from an older copy). Never signed again (§22.5 cl. 1-2): adopt or record the gap.
                seq.store.record_event("rollback", {"group": d.group_id.hex(), "epoch": d.epoch})
                seq._settle(d.group_id, d.epoch, cause="rollback", candidate=(ch, m))
                raw = seq.store.receipt(d.group_id, d.epoch)
                if raw is not None and receipts.parse_receipt(raw).commit_hash == ch:
                    out.append((tag, Accepted(d.group_id, d.epoch, raw)))   # exactly the persisted bytes
                else:
                    out.append((tag, seq._rejected(core.decide(seq.store.group(d.group_id), f, ch))))
                continue
            if d.bootstrap and seq.max_groups is not None:
                if room is None:
                    booting = sum(x.bootstrap for batch in in_flight for _t, _m, _ch, _s, x in batch)
                    room = seq.max_groups - seq.store.group_count() - booting
                if room <= 0:
                    out.append((tag, seq._rejected(core.Reject(core.GROUP_LIMIT, d.group_id, None, None,
                                                               seq.group_limit_detail()))))
                    continue
                room -= 1
            need = _disk_need(m)
            if space is None:
                space = seq.disk_room() - self.in_flight_need
            if need > space:
                out.append((tag, seq._rejected(core.reject(
                    core.DISK_FULL, d.group_id, state, "the sequencer's disk is short of space: offer it again later"))))
                continue
            space -= need
            accepts.append((tag, m, ch, state, d))
            self.in_flight.add(d.group_id)
            self.in_flight_need += need
        later.extend(queue)
        self.queue = later
        return accepts
