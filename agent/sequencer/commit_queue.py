"""The member's durable queue of membership Commits (SOVM §22.7; docs/sequencer.md "Member side:
the Commit queue"): the protocol's view of the queue file, whose SQL is queue_store.py's.

§22.7: while the sequencer is unreachable, Commits queue on the member and data sync goes on (its
own SQLite file and client). A member keeps at most one outstanding Commit per group, so it never
builds epoch E+1 on its own unconfirmed Commit for E. A Commit ends `accepted` (the receipt names
it), `lost` (another won: process it and rebuild, §22.5), `absent` (a §22.6 discontinuity: MLS
tells which won) or `refused`. The queue also keeps what the broker publishes for the member's
groups (heads, gaps, statements) and the receipts held or attributed (answers.py)."""
from __future__ import annotations

import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from agent.sequencer import receipts
from agent.sequencer.core import MAX_EPOCH
from agent.sequencer.framing import FramingError, parse_mls_message
from agent.sequencer.recovery import MemberEvidence
from agent.sequencer.queue_store import EVENTS_KEPT, KEPT_EVENTS, QueueStore  # noqa: F401 - the retention, for callers

QUEUED, ACCEPTED, LOST, ABSENT, REFUSED = "queued", "accepted", "lost", "absent", "refused"
STATUS_TAIL = 50          # `commits status` prints this many recent Commits, heads a group, events (--all: every one)


class QueueRefused(Exception):
    """An enqueue refused (CLI exit 2): not a Commit, or the group already has one outstanding."""


@dataclass(frozen=True)
class Entry:
    commit_hash: bytes
    group_id: bytes
    epoch: int
    message: bytes
    state: str
    reason: Optional[str]
    receipt: Optional[bytes]
    submissions: int

    def as_json(self) -> dict:
        return {"commit_hash": self.commit_hash.hex(), "group": self.group_id.hex(), "epoch": self.epoch,
                "state": self.state, "reason": self.reason,
                "receipt": None if self.receipt is None else self.receipt.hex(), "submissions": self.submissions}


class CommitQueue:
    """The durable queue: the protocol's view of the queue file (queue_store.py holds its SQL)."""

    def __init__(self, path: Path, sequencer_key: Optional[bytes] = None, events_kept: Optional[int] = None) -> None:
        self.path = Path(path)
        self.store = QueueStore(self.path)
        try:
            # the client's own name on the broker (persistent session, answer topic); the event
            # log's retention, kept in the file when given (queue_store.EVENTS_KEPT otherwise)
            self.store.init_meta(secrets.token_hex(8), None if sequencer_key is None else sequencer_key.hex(),
                                 events_kept)
        except BaseException:
            self.store.close()
            raise

    def close(self) -> None:
        self.store.close()

    @property
    def member_id(self) -> str:
        return str(self.store.meta("member_id"))

    @property
    def sequencer_key(self) -> Optional[bytes]:
        v = self.store.meta("sequencer_key")
        return None if v is None else bytes.fromhex(v)

    # -- the queue -------------------------------------------------------------------------
    def enqueue(self, message: bytes) -> Entry:
        message = bytes(message)
        try:
            f = parse_mls_message(message)
        except FramingError as e:
            raise QueueRefused(f"not an MLSMessage: {e}") from None
        if not f.is_commit:
            raise QueueRefused("only Commits are sequenced (content_type is not commit)")
        if f.epoch > MAX_EPOCH:      # the sequencer refuses it (epoch_out_of_range); the store cannot hold it
            raise QueueRefused(f"epoch {f.epoch} is beyond what a sequencer sequences (at most {MAX_EPOCH})")
        ch = receipts.commit_hash(message)
        out = self.store.add_queued(ch, f.group_id, f.epoch, message)   # the same bytes again: one entry
        if out is not None:
            raise QueueRefused(f"group {f.group_id.hex()} already has a Commit outstanding (epoch {out}): "
                               "wait for its outcome (§22.7: no divergent offline membership histories)")
        return self.entry(ch)

    def entry(self, commit_hash: bytes) -> Optional[Entry]:
        row = self.store.commit(commit_hash)
        return None if row is None else _entry(row)

    def outstanding(self) -> list[Entry]:
        return [_entry(r) for r in self.store.outstanding()]

    def entries(self) -> list[Entry]:
        return [_entry(r) for r in self.store.commits()]

    def events(self) -> list[dict]:
        return self.store.events()

    def status(self, limit: Optional[int] = STATUS_TAIL) -> dict:
        """What `commits status` prints: every queued Commit and the ``limit`` most recent ones,
        each group's ``limit`` most recent heads, the ``limit`` most recent events (None: all of
        each), every retained unsettled receipt (attribution evidence, §22.6) and discontinuity;
        ``omitted`` says how many were left out of each list."""
        commits, oc = self.store.commits_tail(limit)
        heads, oh = self.store.heads_tail(limit)
        events, oe = self.store.events_tail(limit)
        return {"member_id": self.member_id, "commits": [_entry(r).as_json() for r in commits],
                "unsettled": [{"verdict": v, "receipt": r.hex()} for r, v in self.unsettled()],
                "heads": [{"group": g.hex(), "epoch": e, "receipt": r.hex()} for g, e, r in heads],
                "discontinuities": [{"group": g.hex(), "epoch": e} for g, e in self.gaps()], "events": events,
                "omitted": {"commits": oc, "heads": oh, "events": oe}}

    def note_submitted(self, commit_hash: bytes) -> None:
        self.store.note_submitted(commit_hash)

    def settle(self, commit_hash: bytes, state: str, reason: Optional[str], receipt: Optional[bytes]) -> bool:
        """Record an outcome for a queued Commit (only a queued one: an outcome is final)."""
        return self.store.settle(commit_hash, state, reason, receipt)

    def note_reason(self, commit_hash: bytes, reason: str) -> None:
        self.store.note_reason(commit_hash, reason)

    # -- what the broker publishes for the member's groups -----------------------------------
    def groups(self) -> list[bytes]:
        """The groups this member follows: every group it ever queued a Commit for."""
        return self.store.groups()

    def keep_head(self, group_id: bytes, epoch: int, receipt: bytes) -> bool:
        return self.store.keep_head(group_id, epoch, receipt)

    def keep_gap(self, group_id: bytes, epoch: int) -> bool:
        return self.store.keep_gap(group_id, epoch)

    def keep_statement(self, group_id: bytes, epoch: int, statement: bytes) -> bool:
        return self.store.keep_statement(group_id, epoch, statement)

    def statements(self) -> list[tuple[bytes, int, bytes]]:
        return self.store.statements()

    def heads(self) -> list[tuple[bytes, int, bytes]]:
        return self.store.heads()

    def gaps(self) -> list[tuple[bytes, int]]:
        return self.store.gaps()

    def receipts_held(self) -> list[bytes]:
        """Every receipt this member holds: its Commits' outcomes and the heads it heard, then the
        sequencer's signed discontinuity statements it heard (§22.6 step 4)."""
        out = self.store.receipts() + [r for _g, _e, r in self.heads()]
        out += [r for _g, _e, r in self.statements()]
        return list(dict.fromkeys(out))

    def evidence(self, group_id: bytes, attested_epoch: Optional[int] = None, also: Iterable[bytes] = ()) -> dict:
        """This member's evidence for one group, in the file format `sequencer recover` reads
        (docs/sequencer.md "Recovery after state loss"): every receipt it holds for the group, the
        gaps it recorded, the signed statements it heard. ``also``: receipts and statements held
        elsewhere (the member node's, agent/sequencing.held_of), merged in. ``attested_epoch``:
        the member's current MLS epoch (its MLS client knows it); None: one above the highest
        receipt held."""
        rx, gaps, stated = self.store.held_of(group_id)
        rx = {raw: e for e, raw in rx}
        stated = {raw: None for raw in stated}
        for raw in map(bytes, also):
            got = _epoch_of(raw)
            if got is not None:
                (stated if got[1] else rx).setdefault(raw, got[0])
        if attested_epoch is None:
            attested_epoch = max(rx.values(), default=-1) + 1
        ordered = sorted(rx.items(), key=lambda kv: (kv[1], kv[0]))
        return {"member": self.member_id, "group": group_id.hex(), "receipts": [r.hex() for r, _e in ordered],
                "attested_epoch": attested_epoch, "discontinuities": gaps, "statements": [r.hex() for r in stated]}

    def offer(self, group_id: bytes, stretches: list[tuple[int, int]], limit: int,
              also: Iterable[bytes] = ()) -> Optional["MemberEvidence"]:
        """What this member holds in the stretches the sequencer lost (its ``lost`` record): at
        most ``limit`` receipts and statements, the highest epochs first (the sequencer walks down
        from the receipt above a stretch; what it takes, it stops asking for). ``also``: receipts
        and statements held elsewhere (the member node's, agent/sequencing.held_of). None when it
        holds nothing there."""
        held: list[bytes] = []
        gaps: list[int] = []
        for first, last in stretches:
            r, g, s = self.store.held_in(group_id, first, last, limit)
            held += r + s
            gaps += g
        ranked = []
        for raw in dict.fromkeys([*held, *map(bytes, also)]):
            got = _epoch_of(raw)
            if got is not None and any(a <= got[0] <= b for a, b in stretches):
                ranked.append((got[0], got[1], raw))
        ranked = sorted(ranked, key=lambda x: (-x[0], x[1], x[2]))[:limit]
        if not ranked:
            return None
        top = self.store.top_held(group_id)    # attested as `evidence` does by default: one above it
        return MemberEvidence(self.member_id, tuple(raw for _e, st, raw in ranked if not st),
                              (-1 if top is None else top) + 1, tuple(sorted(set(gaps))),
                              tuple(raw for _e, st, raw in ranked if st))

    def ungossiped(self) -> list[bytes]:
        """What the member holds and has not yet handed to its node's gossip, in the order it was
        kept (read after every pump step: the store's outbox, never the whole history)."""
        return self.store.ungossiped()

    def mark_gossiped(self, raws: list[bytes]) -> None:
        self.store.mark_gossiped(raws)

    def keep_unsettled(self, r: receipts.Receipt, verdict: str, decided_under: Optional[bytes] = None) -> bool:
        """A receipt held (binding unresolved) or attributed (signer not bound): retained, surfaced
        once per verdict (§22.6: rejected and retained for attribution / held). ``decided_under``:
        the group's binding state read before the verdict (queue_store.keep_unsettled)."""
        return self.store.keep_unsettled(r.raw, r.group_id, r.epoch, verdict, r.kid, decided_under)

    def unsettled(self) -> list[tuple[bytes, str]]:
        return self.store.unsettled()

    def drop_unsettled(self, raw: bytes) -> None:
        self.store.drop_unsettled(raw)

    def unsettled_groups(self) -> list[tuple[bytes, Optional[bytes]]]:
        return self.store.unsettled_groups()

    def unsettled_of(self, group_id: bytes) -> list[tuple[bytes, str]]:
        return self.store.unsettled_of(group_id)

    def note_rechecked(self, group_id: bytes, seen: Optional[bytes], bindings: bytes) -> None:
        self.store.note_rechecked(group_id, seen, bindings)

    def record_event(self, kind: str, detail: dict) -> None:
        self.store.record_event(kind, detail)


def _entry(row) -> Entry:
    ch, g, e, m, st, reason, rc, n = row
    return Entry(bytes(ch), bytes(g), e, bytes(m), st, reason, None if rc is None else bytes(rc), n)


def _epoch_of(raw: bytes) -> Optional[tuple[int, bool]]:
    """(epoch, is a statement) of a receipt or a discontinuity statement; None: neither."""
    try:
        return receipts.parse_receipt(raw).epoch, False
    except receipts.ReceiptError:
        pass
    try:
        return receipts.parse_statement(raw).epoch, True
    except receipts.ReceiptError:
        return None


def queue_path(home: Path) -> Path:
    return Path(home) / "commit-queue.db"


def open_queue(home: Path, sequencer_key: Optional[bytes] = None, events_kept: Optional[int] = None) -> CommitQueue:
    home = Path(home)
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    return CommitQueue(queue_path(home), sequencer_key, events_kept)
