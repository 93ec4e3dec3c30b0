"""The member side of Commit submission: a durable queue of membership Commits and the client that
submits them to the sequencer through the broker (SOVM §22.5, §22.7; docs/sequencer.md "Member
side: the Commit queue"). The queue file's SQL is queue_store.py's; this module holds the protocol.

§22.7: while the sequencer is unreachable, Commits queue on the member and data sync goes on (its
own SQLite file and client). A member keeps at most one outstanding Commit per group, so it never
builds epoch E+1 on its own unconfirmed Commit for E. A Commit ends `accepted` (the receipt names
it), `lost` (another won: process it and rebuild, §22.5), `absent` (a §22.6 discontinuity: MLS
tells which won) or `refused`; a resubmitted Commit answered `stale_epoch` is compared with the
receipt for its own epoch, since its first answer may have been lost.

Every receipt is verified before it decides anything. Who may sign it (§22.6 singularity) is the
caller's `signer_for(group_id, epoch)`; a receipt signed by another key is rejected and kept for
attribution, one whose binding does not resolve is held, and both are looked at again only when
the group's binding records change (`binding_state`), so an idle member reads none of them."""
from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Optional

from agent import inbox
from agent.sequencer import receipts
from agent.sequencer.core import (EPOCH_LIMIT, EPOCH_OUT_OF_RANGE, FUTURE_EPOCH, MAX_EPOCH, NOT_COMMIT, STALE_EPOCH,
                                  UNPARSEABLE)
from agent.sequencer.framing import MAX_MESSAGE_BYTES, FramingError, parse_mls_message
from agent.sequencer.member import UNSIGNED_CLAIM
from agent.sequencer.recovery import MAX_OFFERED, MemberEvidence
from agent.sequencer.queue_store import EVENTS_KEPT, KEPT_EVENTS, QueueStore  # noqa: F401 - the retention, for callers

QUEUED, ACCEPTED, LOST, ABSENT, REFUSED = "queued", "accepted", "lost", "absent", "refused"
# a refusal that ends the Commit; any other reason leaves it queued (migrated, failed_closed: the
# group's relay is unavailable until the operator acts, §22.6)
FINAL_REFUSALS = frozenset({NOT_COMMIT, UNPARSEABLE, EPOCH_OUT_OF_RANGE, FUTURE_EPOCH})
ANSWER_ROOT = "sovm-member"
OFFER_TAG = b"e"          # correlation data of an `evidence` request: the tag, then sha256(group_id)
MAX_LOST_RUNS = 4096      # runs in a `lost` record a member reads (the sequencer publishes at most 256)
# The Maximum Packet Size a member announces: one record holds at most one Commit (`accepted`,
# `discontinuity`) and a receipt or statement; the broker drops anything larger for this member
# (docs/sequencer.md "Size limits").
MAX_PACKET_BYTES = MAX_MESSAGE_BYTES + inbox.PACKET_OVERHEAD
# At most one evidence offer a group this often: a broker client publishing `lost` records that
# change every time would otherwise make every member send up to 1 MiB for each (the newest record
# waiting is offered when the time comes).
OFFER_INTERVAL_S = 5.0
MAX_RETRY_AFTER_S = 3600   # a sequencer's `retry_after` beyond this is not honoured (the record's next change is)
RESUBMIT_FIRST_S, RESUBMIT_MAX_S = 2.0, 60.0     # an unanswered Commit is sent again, backing off
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
    """What a `submit` answer (the JSON of cli-contract.md) means for queued Commit ``e``."""
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


# -- the client ------------------------------------------------------------------------------
class CommitClient:
    """Submits the queue's Commits to `sequencer run` through an MQTT 5 broker and records the
    outcomes. One persistent session (client id from the member id, clean_start false): answers
    published while the member was away wait for it. On every (re)connection every queued Commit
    is submitted again, byte for byte; Commits enqueued meanwhile (by another process) are picked
    up from the queue file."""

    RECHECK_S = 2.0                    # held and attributed receipts are looked at again this often

    def __init__(self, q: CommitQueue, settings, on_receipt: Optional[Callable[[bytes], None]] = None,
                 signer_for: Optional[SignerFor] = None, binding_state: Optional[BindingState] = None,
                 node_held: Optional[Callable[[bytes], list]] = None) -> None:
        import paho.mqtt.client as paho
        from paho.mqtt.enums import CallbackAPIVersion
        self.q, self.s = q, settings
        self.key = q.sequencer_key
        self.signer_for = signer_for or fixed_signer(self.key)
        # a signer_for given without its state: every recheck looks at every retained receipt
        self.binding_state = binding_state or (fixed_state(self.key) if signer_for is None else (lambda _g: None))
        self._recheck_at = 0.0
        self.on_receipt = on_receipt
        self.reply_to = f"{ANSWER_ROOT}/{q.member_id}/answers"
        self.inbound: inbox.Inbox[inbox.Delivery] = inbox.Inbox(inbox.BUDGET_BYTES, inbox.delivery_size)
        self.connected = threading.Event()
        self._generation = 0           # connections made; bumped by the network thread
        self._sent_in: dict[bytes, tuple[int, float, float]] = {}   # (connection, next resubmit, wait)
        self._followed: dict[bytes, int] = {}                        # group -> connection it subscribed on
        self._offered: dict[bytes, tuple[bytes, tuple]] = {}          # group -> (`lost` record, receipts offered)
        self._reoffer: dict[bytes, tuple[float, bytes]] = {}          # group -> (when, `lost` record) offered later
        self._offered_at: dict[bytes, float] = {}                     # group -> when it was last offered
        self.node_held = node_held     # group -> what the member node holds of it (sequencing.held_of)
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"sovm-member-{q.member_id}", protocol=paho.MQTTv5)
        if settings.username is not None:
            c.username_pw_set(settings.username, settings.password)
        if settings.tls:
            import ssl
            c.tls_set(ca_certs=settings.ca_file, cert_reqs=ssl.CERT_REQUIRED, tls_version=ssl.PROTOCOL_TLS_CLIENT)
        c.on_connect = self._on_connect
        c.on_disconnect = lambda *a: self.connected.clear()
        c.on_message = self._on_message
        c.reconnect_delay_set(0.2, 5)
        self.client = c
        # deliveries stuck behind dropped oversized publishes come back with a reconnect (inbox.py)
        self.prober = inbox.Prober(c, f"{ANSWER_ROOT}/{q.member_id}/probe")

    def _on_message(self, client, userdata, msg) -> None:
        if not self.prober.on_message(msg):
            self.inbound.put(inbox.delivery(msg))

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            return
        self.prober.restart()
        client.subscribe([(self.reply_to, 1), (self.prober.topic, 1)])
        self._generation += 1
        self.connected.set()

    def start(self) -> None:
        """Connect in the background; an unreachable broker is retried for ever (§22.7: queue)."""
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties
        props = Properties(PacketTypes.CONNECT)
        props.SessionExpiryInterval = int(self.s.session_expiry_s)
        props.MaximumPacketSize = MAX_PACKET_BYTES
        self.client.connect_async(self.s.host, self.s.port, keepalive=30, clean_start=False, properties=props)
        self.client.loop_start()

    def close(self) -> None:
        self.inbound.close()        # paho's thread may wait for room: it must be able to end
        self.client.disconnect()
        self.client.loop_stop()

    def pump(self, wait: float = 0.2) -> None:
        """One step: submit what this connection has not carried yet, handle the answers."""
        gen = self._generation
        if self.connected.is_set():
            # The retained head and recorded gaps of every group this member follows (§22.5: keep
            # receipts; §22.6 step 4: gaps are surfaced to every member alike on the broker)
            for g in self.q.groups():
                if self._followed.get(g) != gen:
                    base = f"{self.s.prefix}/{g.hex()}"
                    self.client.subscribe([(f"{base}/accepted", 1), (f"{base}/discontinuity/+", 1),
                                           (f"{base}/lost", 1)])
                    self._followed[g] = gen
            now = time.monotonic()
            for e in self.q.outstanding():
                sent = self._sent_in.get(e.commit_hash)
                # Again on every connection, and again while unanswered: a request published before
                # the sequencer's session subscribed (a broker that just came up) is dropped by the
                # broker, and a duplicate costs nothing (answered stale_epoch with this Commit's own
                # receipt, which settles it as accepted)
                if sent is None or sent[0] != gen or now >= sent[1]:
                    self._publish("submit", e.group_id, e.message, b"c" + e.commit_hash)
                    self.q.note_submitted(e.commit_hash)
                    wait = RESUBMIT_FIRST_S if sent is None or sent[0] != gen else min(2 * sent[2], RESUBMIT_MAX_S)
                    self._sent_in[e.commit_hash] = (gen, now + wait, wait)
        if self._reoffer:
            self.reoffer_due(time.monotonic())
        if self.connected.is_set():
            act = self.prober.step(time.monotonic())
            if act == inbox.RECONNECT:   # the broker held our in-flight slots: the new connection frees them
                self.q.record_event("deliveries_stuck", {"reconnect": self.prober.watch.reconnects})
            elif act == inbox.Prober.OFF:
                self.q.record_event("delivery_watch_off", {"topic": self.prober.topic})
        if time.monotonic() >= self._recheck_at:
            self._recheck_at = time.monotonic() + self.RECHECK_S
            self.recheck()
        try:
            msg = self.inbound.get(timeout=wait)
        except inbox.Empty:
            return
        self._handle(msg)

    def run(self, stop: threading.Event, until_settled: bool = False, deadline: Optional[float] = None,
            after: Optional[Callable[[], None]] = None) -> bool:
        """Serve until ``stop`` (or, ``until_settled``, until nothing is queued). ``after`` runs
        after every step (the CLI hands new receipts to the node's gossip there). Returns True
        when nothing is left queued."""
        while not stop.is_set():
            if until_settled and not self.q.outstanding():
                return True
            if deadline is not None and time.monotonic() > deadline:
                break
            self.pump()
            if after is not None:
                after()
        return not self.q.outstanding()

    def _publish(self, kind: str, gid: bytes, payload: bytes, corr: bytes) -> None:
        from paho.mqtt.packettypes import PacketTypes
        from paho.mqtt.properties import Properties
        p = Properties(PacketTypes.PUBLISH)
        p.ResponseTopic = self.reply_to
        p.CorrelationData = corr
        self.client.publish(f"{self.s.prefix}/{gid.hex()}/{kind}", payload, qos=1, properties=p)

    def _published(self, msg) -> None:
        """A retained `accepted` head, `discontinuity/E` or `lost` record of a followed group."""
        from agent.core import codec
        parts = msg.topic.split("/")
        if parts[-1] == "lost":
            self._lost(parts[-2], bytes(msg.payload))
            return
        try:
            gid = bytes.fromhex(parts[-2] if parts[-1] == "accepted" else parts[-3])
            body = codec.decode_strict(bytes(msg.payload))
            epoch = body["epoch"]
        except (ValueError, IndexError, KeyError, TypeError, codec.DecodeError):
            return
        if parts[-1] != "accepted":
            self._gap(gid, epoch, body.get("statement") if isinstance(body, dict) else None)
            return
        state = self.binding_state(gid)        # before the verdict (queue_store.keep_unsettled)
        try:
            r, why = check_receipt(bytes(body["receipt"]), self.signer_for)
        except (KeyError, TypeError):
            return
        if r is None or r.group_id != gid or r.epoch != epoch:
            return
        if why in (HELD, ATTRIBUTED):
            self.q.keep_unsettled(r, why, state)
            return
        if why:
            return
        self._head(r)

    def _gap(self, gid: bytes, epoch, raw) -> None:
        """A retained `discontinuity/E` record. §22.6: only a gap the sequencer recorded and signed
        counts, so it is kept only with the bound sequencer's statement for that (group, epoch);
        anything else (anyone allowed to publish on the topic could have written it) is neither a
        gap nor evidence, and is surfaced as such (event `discontinuity_unsigned`)."""
        if type(epoch) is not int or not 0 <= epoch < EPOCH_LIMIT:
            return
        st = None
        if isinstance(raw, bytes):
            try:
                st = receipts.verify_statement(raw)
            except receipts.ReceiptError:
                st = None
        if st is None or st.group_id != gid or st.epoch != epoch:
            self.q.record_event(UNSIGNED_CLAIM, {"group": gid.hex(), "epoch": epoch,
                                                 "detail": "a discontinuity record without the sequencer's signed "
                                                           "statement of it: not a gap, not evidence"})
            return
        signer = self.signer_for(st.group_id, st.epoch)
        if signer.key is not None and st.kid != signer.key:
            return          # not the bound sequencer's statement: the mesh attributes it
        if not signer.unresolved and self.q.keep_gap(gid, epoch):
            self.q.record_event("discontinuity", {"group": gid.hex(), "epoch": epoch})
        # kept and handed to the mesh, where a member holding a receipt for that epoch holds
        # proof against it (§22.6 step 4); one whose binding does not resolve yet is held there
        if self.q.keep_statement(gid, epoch, st.raw) and self.on_receipt:
            self.on_receipt(st.raw)

    def _lost(self, group_hex: str, payload: bytes, now: Optional[float] = None) -> None:
        """The sequencer's `lost` record: the runs of epochs whose receipts its restored state
        lost. This member offers what it holds there (`evidence`, the `sequencer recover` format);
        the sequencer takes only what chains to what it holds (§22.6 step 1). The same receipts
        are not offered again for the same record (a record that changed: the sequencer took
        something, so what chained nowhere before may chain now). At most one offer a group every
        OFFER_INTERVAL_S: a record arriving sooner waits, and only the newest one waiting is offered."""
        runs = parse_lost(payload)
        try:
            gid = bytes.fromhex(group_hex)
        except ValueError:
            return
        self._reoffer.pop(gid, None)        # a newer record (or this one, due again) supersedes it
        if not runs or gid not in self._followed:       # not a record, or nothing missing
            return
        now = time.monotonic() if now is None else now
        last = self._offered_at.get(gid)
        if last is not None and now < last + OFFER_INTERVAL_S:
            self._reoffer[gid] = (last + OFFER_INTERVAL_S, payload)
            return
        also: list = []
        if self.node_held is not None:
            try:
                also = self.node_held(gid)
            except Exception:  # noqa: BLE001 - the node store unreadable right now: offer the queue's
                also = []
        offer = self.q.offer(gid, runs, MAX_OFFERED, also)
        if offer is None:
            return
        key = (payload, offer.receipts + offer.statements)
        if self._offered.get(gid) == key:
            return
        self._offered[gid] = key
        self._offered_at[gid] = now
        doc = {"member": offer.member, "group": gid.hex(), "receipts": [r.hex() for r in offer.receipts],
               "attested_epoch": offer.attested_epoch, "discontinuities": list(offer.discontinuities),
               "statements": [r.hex() for r in offer.statements]}
        self._publish("evidence", gid, json.dumps(doc).encode(), OFFER_TAG + hashlib.sha256(gid).digest())
        self.q.record_event("evidence_offered", {"group": gid.hex(), "receipts": len(offer.receipts),
                                                 "statements": len(offer.statements)})

    def _offer_answered(self, corr: bytes, payload: bytes) -> None:
        gid = next((g for g in self._offered if hashlib.sha256(g).digest() == corr[1:]), None)
        try:
            answer = json.loads(payload)
        except ValueError:
            answer = None
        if gid is None or not isinstance(answer, dict):
            return
        detail = {"group": gid.hex()}
        for k in ("outcome", "refilled", "missing", "error"):
            if isinstance(answer.get(k), (str, int)) and not isinstance(answer.get(k), bool):
                detail[k] = answer[k] if not isinstance(answer[k], str) else answer[k][:200]
        self.q.record_event("evidence_answered", detail)
        after = answer.get("retry_after")
        if type(after) is int and 1 <= after <= MAX_RETRY_AFTER_S and gid in self._offered:
            # the sequencer's evidence allowance was spent (serve.py): the same offer again later,
            # spread over half as long again so that members told together do not come back together
            record, _offer = self._offered.pop(gid)
            self._reoffer[gid] = (time.monotonic() + after * (1 + secrets.randbelow(1000) / 2000), record)

    def reoffer_due(self, now: float) -> None:
        """Offers the sequencer answered `retry_after`, made again once their time came."""
        for gid, (when, record) in list(self._reoffer.items()):
            if now >= when and gid in self._followed:
                self._lost(gid.hex(), record, now)

    def _head(self, r: receipts.Receipt) -> None:
        """A receipt signed by the sequencer allowed at its epoch: kept, and it decides a queued
        Commit at its epoch as a receipt answer would."""
        new = self.q.keep_head(r.group_id, r.epoch, r.raw)
        if new and self.on_receipt:
            self.on_receipt(r.raw)
        for e in self.q.outstanding():                 # a head at a queued Commit's epoch decides it
            if e.group_id == r.group_id and e.epoch == r.epoch:
                out = receipt_outcome(e, {"receipt": r.raw.hex()}, self.signer_for)
                if out.state is not None:
                    self.q.settle(e.commit_hash, out.state, out.reason, out.receipt)

    def recheck(self) -> None:
        """Held and attributed receipts again, of the groups whose binding records changed since
        their receipts were last looked at: a binding that arrived since decides them (§22.6).
        Nothing else changes a verdict, so a group whose binding state is what it was is not read:
        the cost is a row a group with receipts retained, never a row a receipt (attributed ones
        are retained for good)."""
        for gid, seen in self.q.unsettled_groups():
            state = self.binding_state(gid)
            if state is not None and state == seen:
                continue
            for raw, verdict in self.q.unsettled_of(gid):
                r, why = check_receipt(raw, self.signer_for)
                if r is None:
                    continue
                if why in (HELD, ATTRIBUTED):
                    if why != verdict:
                        self.q.keep_unsettled(r, why, state)
                    continue
                self.q.drop_unsettled(raw)
                self.q.record_event("receipt_settled", {"group": r.group_id.hex(), "epoch": r.epoch,
                                                        "was": verdict})
                self._head(r)
            if state is not None:
                # read before the receipts: a binding that arrived while they were looked at
                # makes the next recheck look again
                self.q.note_rechecked(gid, seen, state)

    def _handle(self, msg) -> None:
        if msg.topic != self.reply_to:
            self._published(msg)
            return
        corr = msg.correlation
        if not corr or len(corr) != 33:
            return
        if corr[:1] == OFFER_TAG:
            self._offer_answered(bytes(corr), bytes(msg.payload))
            return
        e = self.q.entry(bytes(corr[1:]))
        if e is None or e.state != QUEUED:
            return                                     # settled already (a duplicate answer)
        try:
            answer = json.loads(msg.payload)
        except ValueError:
            return
        if not isinstance(answer, dict):
            return
        state = self.binding_state(e.group_id)  # before the verdict (queue_store.keep_unsettled)
        out = submit_outcome(e, answer, self.signer_for) if corr[:1] == b"c" \
            else receipt_outcome(e, answer, self.signer_for)
        if out.unsettled is not None:
            # §22.6: signed by a sequencer not bound at that generation (rejected, retained for
            # attribution), or no binding resolves there (held): the Commit stays queued
            self.q.keep_unsettled(*out.unsettled, state)
            self.q.note_reason(e.commit_hash, out.reason or "")
            return
        if out.problem:
            self.q.record_event("bad_answer", {"commit_hash": e.commit_hash.hex(), "problem": out.problem})
            return
        if out.ask_receipt:
            self.q.note_reason(e.commit_hash, STALE_EPOCH)
            self._publish("receipt", e.group_id, str(e.epoch).encode(), b"r" + e.commit_hash)
            return
        if out.state is None:
            self.q.note_reason(e.commit_hash, out.reason or "")
            return
        if self.q.settle(e.commit_hash, out.state, out.reason, out.receipt) and out.receipt and self.on_receipt:
            self.on_receipt(out.receipt)


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


def parse_lost(payload: bytes) -> Optional[list[tuple[int, int]]]:
    """The boundary for a `lost` record from the broker: CBOR {"missing": [[first, last], ...]}
    (0 <= first <= last < EPOCH_LIMIT, at most MAX_LOST_RUNS runs); b"" (cleared): []. None: not one."""
    from agent.core import codec
    if not payload:
        return []
    try:
        body = codec.decode_strict(payload)
    except (codec.DecodeError, ValueError):
        return None
    runs = body.get("missing") if isinstance(body, dict) else None
    if not isinstance(runs, list) or len(runs) > MAX_LOST_RUNS:
        return None
    out = []
    for r in runs:
        if not (isinstance(r, list) and len(r) == 2 and all(type(x) is int for x in r) and 0 <= r[0] <= r[1] < EPOCH_LIMIT):
            return None
        out.append((r[0], r[1]))
    return out


def queue_path(home: Path) -> Path:
    return Path(home) / "commit-queue.db"


def open_queue(home: Path, sequencer_key: Optional[bytes] = None, events_kept: Optional[int] = None) -> CommitQueue:
    home = Path(home)
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    return CommitQueue(queue_path(home), sequencer_key, events_kept)
