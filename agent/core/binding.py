"""What the MQTT binding's loop decides beside the exchange itself, sans-I/O (docs/mqtt.md), so that
agent/runner.py stays a thin adapter:

- **The wire of a request and of its answer**: user property names, the frame meta, what a
  request carries and what an answer or a refusal says (`request_properties`, `answer_properties`).
- **Body size** (`body_fit`): how many selected events fit one body under the peer's limit.
- **A `sync --once` wake** (`OnceWake`): take in what waited, offer, wait for present peers'
  answers, one last look; when the one-shot exchange is complete.
- **Answers and what they prove** (`answer_proof`, docs/protocol.md §5): the peer's signed
  acknowledgement, the only evidence on a binding without the broker's ACLs.
- **Receiving** (docs/apply.md "Bounds"): refusals before parsing (`request_refusal`), signed
  acknowledgements owed and when they are signed, released ones served again (`ReleasedAcks`),
  and the order in which what arrived is handled (`Intake`).
- **When the loop is next due** (`next_due`): the earliest of the exchange's deadlines and the
  runner's periodic jobs; the runtime loop sleeps until then unless something arrives."""
from __future__ import annotations

import json
from collections import Counter, deque
from typing import Any, Callable, Iterable, Sequence

from . import numbers, reasons
from .exchange import KIND_BATCH, KIND_PULL, KIND_REALTIME, PRESENCE_LIMIT, Exchange, InFlight, Schedule
from .messages import ProtocolError, parse_body
from .incoming import split_records
from .records import ACK, MAX_ACK_ANSWERS, AckAnswer, RecordError, verify_ack
from .sending import first_body

# What the intake (`Intake`) holds waiting before the runner takes nothing more from its link: the
# 64 MiB the Receive Maximum was meant to bound (docs/mqtt.md "Memory bound"), now held to in bytes.
INTAKE_BUDGET_BYTES = 64 * 1024 * 1024

NEVER = float("inf")


def next_due(ex: Exchange, schedule: Schedule, now: float, *, connected: bool,
             others: Iterable[float | None] = ()) -> float:
    """The monotonic time at which the exchange next has something to do without being told
    (`now` or earlier: at once; NEVER: only when something arrives). `connected`: the batch cycle
    waits for the connection (whose arrival wakes the loop); `others`: further deadlines of the
    caller (None: none), e.g. its periodic jobs and grouped acknowledgements."""
    cfg = ex.cfg
    due = [schedule.next_batch if connected else NEVER]
    if cfg.realtime:
        if cfg.flush_cadence_s:
            due.append(schedule.next_flush)
        elif schedule.produced_at is not None:
            due.append(schedule.produced_at + cfg.coalesce_s)   # the coalesced push (§33.2)
    due.append(expiry_due(ex, now))
    due.extend(t for t in others if t is not None)
    return min(due)


def expiry_due(ex: Exchange, now: float) -> float:
    """When `Exchange.expire` next gives up on a peer: a reachable peer's wait (`wait_s`) after it
    became reachable with bodies unanswered; a present peer whose wait has not started yet starts
    it at the next `expire` (so: now). An absent peer's bodies wait for it (no deadline: its
    presence or a message from it wakes the loop)."""
    due = NEVER
    for peer in {p.peer for p in ex.pending.values()} | {p for p, c in ex.earlier.items() if c}:
        since = ex.silent_since.get(peer)
        if since is None:
            if peer in ex.presence:
                due = min(due, now)
            continue
        due = min(due, since + ex.wait_s(peer))
    return due


# ---------------------------------------------------------------------- the wire (docs/mqtt.md)
# user property names (all values are text)
P_KIND, P_FROM, P_START, P_END, P_COUNT, P_PART = "ssp-kind", "ssp-from", "ssp-start", "ssp-end", "ssp-count", "ssp-part"
P_STATUS, P_REASON, P_PROCESSED = "ssp-status", "ssp-reason", "ssp-processed"
# The indices of the answered body's events the receiver rejected, comma-separated; absent when none was. A
# sender that gets it counts every other event as processed.
P_REJECTED_AT = "ssp-rejected-at"
P_META = "ssp-meta"  # the frame meta (docs/protocol.md §1) as compact JSON: {s, e, d, g, x}
# A request property (transport metadata, no authority): "1" asks the receiver for a signed
# acknowledgement (`sovm/ssp-ack-v1`, docs/protocol.md §5) in its answer. Stripping it only makes
# the sender's cursor stay (fail closed); adding it only costs the receiver a grouped signature.
P_ACK = "ssp-ack"
# On everything a node publishes: a random name of its current broker connection (transport
# metadata, no authority). A receiver takes the first message of a connection as where it starts
# (a pull, docs/mqtt.md "A waking device").
P_CONN = "ssp-conn"
# On the answer to a pull: "1" when the answerer holds more for the puller than it just sent.
P_MORE = "ssp-more"

# The body size estimate (`body_fit`): the answer-independent envelope of a body beyond its empty
# encoding (CBOR headers of the events array and of each event, counted generously), and the JSON
# quoting and comma of each policy-gap table name in the meta.
BODY_SLACK = 96
GAP_COST = 3


def encode_meta(start: int, end: int, seqs: Sequence[int], gaps: Iterable[str] = (), extra: int = 0) -> str:
    """The frame meta as a user property value (docs/protocol.md §1: a binding with native
    metadata maps the frame onto it). Compact: about two bytes per event."""
    d, prev = [], start
    for q in seqs:
        d.append(q - prev)
        prev = q
    return json.dumps({"s": start, "e": end, "d": d, "g": sorted(gaps), "x": extra}, separators=(",", ":"))


def meta_cost(start: int, seqs: Sequence[int]) -> list[int]:
    """Bytes each event adds to `encode_meta` (a delta and a comma), for the size budget."""
    out, prev = [], start
    for q in seqs:
        out.append(len(str(q - prev)) + 1)
        prev = q
    return out


def encode_indices(indices: Sequence[int]) -> str:
    return ",".join(str(i) for i in indices)


def decode_indices(text: str, total: int) -> list[int] | None:
    """`encode_indices` read strictly (`core.numbers`): distinct indices below `total`, else
    None (ignored)."""
    if not text:
        return []
    out = numbers.uint_list(text, max_items=total, max_value=total - 1) if total > 0 else None
    return out if out is not None and len(set(out)) == len(out) else None


def ack_requested(secure: bool) -> bool:
    """Whether a request asks for the receiver's signed acknowledgement: always, unless the
    binding is secure (the broker authenticates devices and pins topics, so an answer on the
    sender's answer topic is itself evidence). Without it an answer may be anyone's who reads the
    topic, and only the signed acknowledgement of the exact body moves the cursor (docs/protocol.md §5)."""
    return not secure


def request_properties(kind: str, start: int, end: int, seqs: Sequence[int], gaps: Iterable[str],
                       n_backfill: int, n_events: int, secure: bool) -> dict[str, str]:
    """The user properties of one request (a batch body or a realtime push): its kind, the range
    and count, the frame meta, and the acknowledgement request (`ack_requested`)."""
    user = {P_KIND: kind, P_START: str(start), P_END: str(end), P_COUNT: str(n_events), P_PART: "1/1",
            P_META: encode_meta(start, end, seqs, gaps, n_backfill)}
    if ack_requested(secure):
        user[P_ACK] = "1"
    return user


def asks_signed_ack(props: dict) -> bool:
    """The request asked for a signed acknowledgement (`P_ACK`); whether one is owed is
    `signed_ack_owed`'s (the sender must be a member other than this node)."""
    return props.get(P_ACK) == "1"


def answer_properties(request: dict, counts: Counter | dict, processed: int, n_outcomes: int,
                      rejected_at: Sequence[int]) -> dict[str, str]:
    """The user properties of an `ok` answer to `request` (its properties): how many of its events
    were processed to a final state, the outcome counts, the request's range echoed, and the
    indices of the rejected events (absent when none was)."""
    user = {P_STATUS: "ok", P_PROCESSED: str(processed), P_COUNT: str(n_outcomes),
            P_START: request.get(P_START, ""), P_END: request.get(P_END, ""),
            "ssp-applied": str(counts.get("applied", 0)), "ssp-duplicate": str(counts.get("duplicate", 0)),
            "ssp-dropped": str(counts.get("dropped", 0)), "ssp-rejected": str(counts.get("rejected", 0))}
    if rejected_at:
        user[P_REJECTED_AT] = encode_indices(rejected_at)
    return user


def pull_answer_properties(more: bool) -> dict[str, str]:
    """The user properties of the answer to a pull, published after the bodies it caused."""
    return {P_STATUS: "ok", P_MORE: "1" if more else "0"}


def refusal_properties(request: dict, reason: str) -> dict[str, str]:
    """The user properties of the answer refusing `request` (nothing of it processed)."""
    return {P_STATUS: "rejected", P_REASON: reason, P_PROCESSED: "0",
            P_START: request.get(P_START, ""), P_END: request.get(P_END, "")}


# ---------------------------------------------------------------------- body size
def body_fit(events: Sequence[bytes], start: int, seqs: Sequence[int], n_backfill: int, gaps: Iterable[str],
             empty_body: int, limit: int, max_events: int) -> int | None:
    """How many of the selected `events` (the live ones, `seqs` after `start`, then `n_backfill`
    backfill events) go in one body of at most `limit` bytes: the first part that fits
    (`sending.first_body`), or None when all of them do. `empty_body`: the bytes of this body with
    no events (the records it carries, the watermarks). The meta rides in the same packet, so its
    bytes count: per event its delta (`meta_cost`), per policy-gap table its name."""
    cost = meta_cost(start, seqs) + [0] * n_backfill
    sizes = [len(e) + c for e, c in zip(events, cost)]
    return first_body(sizes, empty_body + BODY_SLACK + sum(len(g) + GAP_COST for g in gaps), limit, max_events)


# ---------------------------------------------------------------------- a one-shot wake
class OnceWake:
    """The order of a `sync --once` wake (docs/mqtt.md "A waking device"), driven by the caller:
    `next(now, ...)` says what to do now, the caller does it and asks again, until DONE.

    1. TAKE (wait `wait` seconds for messages) until what the broker held for this node is in:
       everything it held is delivered before our own presence, published right after SUBSCRIBE,
       comes back (a broker delivers to one client in order), so the echo ends the intake: DRAIN
       what is already queued (until a pump takes nothing). A broker that never echoes (an ACL
       that drops our presence) falls back to `settle_s` without a message.
    2. OFFER, once: give up on the bodies an earlier wake sent that were lost while away
       (`Exchange.lost_while_away`), then the batch cycle.
    3. AWAIT (take messages for `wait` seconds, expire) while bodies are in flight to present peers.
    4. LAST_LOOK: take what is already here without waiting, until a look takes nothing (what a
       peer sent before answering our pull is all here once the answer is: it is handled before the
       wake ends); then DONE. What arrives later waits in the broker for the next wake (the session
       is persistent).
    `timeout_s` bounds the intake and the wait for answers; the offer and the last look always run
    (the last look for at most another `timeout_s`)."""
    TAKE, DRAIN, OFFER, AWAIT, LAST_LOOK, DONE = "take", "drain", "offer", "await", "last_look", "done"
    INTAKE_WAIT_S, ANSWER_WAIT_S = 0.01, 0.05

    def __init__(self, now: float, settle_s: float = 0.5, timeout_s: float = 20.0) -> None:
        self.settle_s, self.timeout_s = settle_s, timeout_s
        self.deadline = now + timeout_s
        self.idle_since = now
        self.phase = self.TAKE
        self.wait = 0.0
        self._pumped = False

    def next(self, now: float, *, echoed: bool, took: int = 0, waiting: bool = False) -> str:
        """`echoed`: our presence came back; `took`: messages the last TAKE, DRAIN or AWAIT handled;
        `waiting`: bodies are in flight to present peers (`Exchange.waiting_on`)."""
        if self.phase == self.TAKE:
            if self._pumped:   # after a TAKE: a message restarts the settle, quiet ends it
                if took:
                    self.idle_since = now
                elif now - self.idle_since >= self.settle_s:
                    return self._go(self.OFFER)
            if now >= self.deadline:
                return self._go(self.OFFER)
            if echoed:
                return self._go(self.DRAIN, pump=True)
            return self._go(self.TAKE, self.INTAKE_WAIT_S)
        if self.phase == self.DRAIN:
            return self._go(self.DRAIN, pump=True) if took else self._go(self.OFFER)
        if self.phase == self.OFFER:   # offered: now the answers
            self.phase, self._pumped = self.AWAIT, False
        if self.phase == self.AWAIT:
            if (self._pumped and not waiting) or now >= self.deadline:
                return self._go(self.LAST_LOOK, pump=True)
            return self._go(self.AWAIT, self.ANSWER_WAIT_S)
        if self.phase == self.LAST_LOOK and self._pumped and took and now < self.deadline + self.timeout_s:
            return self._go(self.LAST_LOOK, pump=True)
        self.phase = self.DONE
        return self.DONE

    def _go(self, phase: str, wait: float | None = None, pump: bool = False) -> str:
        """Enter `phase`; `wait` (or `pump`): the caller takes messages before asking again."""
        self.phase, self.wait = phase, wait or 0.0
        self._pumped = wait is not None or pump
        return phase


# ---------------------------------------------------------------------- answers (their proof)
MAX_ACKS_LOOKED_AT = 4  # acknowledgement records checked per answer (`answer_proof`)


def answer_proof(p: InFlight, payload: bytes, mesh_id: bytes, self_site: bytes,
                 entry_of: Callable[[bytes], Any], stats: Counter | None = None) -> AckAnswer | None:
    """The peer's signed answer for body `p` in an answer's `records` (an AckAnswer), or None: a
    `sovm/ssp-ack-v1` record that verifies under the peer's keyring entry (`entry_of`, not
    retired), is addressed to this node and names the BLAKE3 of the exact body sent, with as many
    events as it held (docs/protocol.md §5). A replay of a genuine acknowledgement is the truth
    about these very bytes, so it is harmless; a record for another body, by another signer or
    for another node moves nothing."""
    stats = Counter() if stats is None else stats
    if p.body_hash is None:
        stats["answers_unprovable"] += 1  # recalled from a process that kept no hash
        return None
    try:
        # An honest answer carries one: a few are looked at, so a forged answer stuffed with
        # records costs at most MAX_ACKS_LOOKED_AT signature checks.
        raws = split_records(parse_body(payload).records, [ACK])[0][:MAX_ACKS_LOOKED_AT]
    except ProtocolError:
        return None
    for raw in raws:
        try:
            ack = verify_ack(raw, mesh_id, entry_of)
        except RecordError as e:
            stats[f"ack_refused:{e.reason}"] += 1
            continue
        if ack.issuer != p.peer or ack.subject != self_site:
            stats["ack_misaddressed"] += 1
            continue
        a = ack.answer_for(p.body_hash)
        if a is not None and a.count == p.total:
            return a
    return None


# ---------------------------------------------------------------------- receiving (requests, acknowledgements)
def request_refusal(size: int, body_limit: int, kind: str, sender: bytes | None,
                    realtime_established: bool) -> tuple[str, str] | None:
    """(reason, detail) when a request is refused before its bytes are parsed, else None: larger
    than this node's body limit, an unknown kind, an inbox topic naming no sender, or a realtime
    body without mutual realtime mode (§33: rejected, not dropped, so it surfaces as a protocol
    error). The reason codes are agent/core/reasons.py's."""
    if size > body_limit:
        return reasons.TOO_LARGE, f"{size} bytes > body limit {body_limit}"
    if kind not in (KIND_BATCH, KIND_REALTIME, KIND_PULL):
        return reasons.UNKNOWN_KIND, kind[:40]
    if sender is None:
        return reasons.BAD_TOPIC, "an inbox topic must name its sender"
    if kind == KIND_REALTIME and not realtime_established:
        return reasons.REALTIME_NOT_ESTABLISHED, sender.hex()
    return None


def signed_ack_owed(asked: bool, sender: bytes | None, member: bool, self_site: bytes) -> bool:
    """Whether an `ok` answer waits for this node's signed acknowledgement (docs/protocol.md §5):
    the sender asked (`ssp-ack: 1`: its binding does not authenticate answers, so it moves its
    cursor only on one), and it is a site this node trusts, other than itself (a body under any
    other name signs nothing)."""
    return asked and member and sender is not None and sender != self_site


def ack_due(owed: int, last_signed: float, now: float, interval_s: float, force: bool = False) -> bool:
    """Whether the signed acknowledgement owed to one sender (docs/protocol.md §5) is signed now:
    when a record is full (MAX_ACK_ANSWERS bodies), when `interval_s` passed since its last one
    (0: every pump), or when forced (closing: the bodies are applied and committed)."""
    return force or owed >= MAX_ACK_ANSWERS or now - last_signed >= interval_s


def ack_wait(last_signed: Iterable[float], now: float, interval_s: float) -> float:
    """How long the loop may wait for messages while acknowledgements are owed: not past the
    earliest one's interval."""
    return max(0.0, min(last_signed) + interval_s - now)


class ReleasedAcks:
    """Acknowledgement records already released, kept to answer a replay (docs/protocol.md §5). A record
    states, for each body it names, the BLAKE3 of the exact bytes
    received, the processed count and the rejected indices. When the same sender sends the same
    bytes again and this node's processing of them comes out the same (`AckAnswer` equal: same
    hash, processed, count and rejected indices), the record already released states exactly what
    is true of this delivery too, so it is served again instead of signing a new one: a member
    replaying a body no longer buys a signature and two journal fsyncs per replay. Any other
    outcome (an event now rejected, or applied where it was held) misses and is signed afresh. The
    records are valid only under the signing key they were made with: `key` (this node's own
    keyring entry) changing drops them all. Bounded: `per_sender` answers per sender (least
    recently used goes first), `senders` senders."""

    def __init__(self, per_sender: int = 64, senders: int = 64) -> None:
        self.per_sender, self.senders = per_sender, senders
        self._key: Any = None
        self._by_sender: dict[bytes, dict[AckAnswer, bytes]] = {}

    def _check_key(self, key: Any) -> None:
        if key != self._key:
            self._by_sender.clear()
            self._key = key

    def get(self, sender: bytes, answer: AckAnswer, key: Any) -> bytes | None:
        self._check_key(key)
        kept = self._by_sender.get(sender)
        if not kept:
            return None
        raw = kept.pop(answer, None)
        if raw is not None:
            kept[answer] = raw  # most recently used last
        return raw

    def put(self, sender: bytes, answers: Iterable[AckAnswer], raw: bytes, key: Any) -> None:
        self._check_key(key)
        kept = self._by_sender.pop(sender, None)
        if kept is None:
            kept = {}
            while len(self._by_sender) >= self.senders:
                del self._by_sender[next(iter(self._by_sender))]  # the least recently signed-for sender
        self._by_sender[sender] = kept
        for a in answers:
            kept.pop(a, None)
            kept[a] = raw
        while len(kept) > self.per_sender:
            del kept[next(iter(kept))]

    def __len__(self) -> int:
        return sum(len(k) for k in self._by_sender.values())


class Intake:
    """The order in which what arrived is handled (docs/apply.md
    "Bounds"). Answers, and presence of keyring sites, are handled at once. Requests from keyring
    sites wait in one queue per sender and are handled one per sender in turn (`turn`), so a body
    never waits behind more than one body of each other member already here (a member keeping 200
    bodies unanswered held every other member's bodies back). Messages from any other site (which a
    rogue client with broker access can publish at will, under fictional names) wait in `others`,
    and at most `others_per_step` of them are handled per pump (`others_due`), so an honest body
    never waits behind a whole flood. Presence among those is acknowledged on arrival (the
    broker's Receive Maximum does not bound it): past `presence_limit` waiting, the oldest waiting
    presence goes (counted). Items are the caller's; only their `kind` (req | ans | presence) is
    read, and their size through `size`.

    Bounded in bytes: what waits here holds `held` bytes, and the caller takes nothing more from
    its link while `full()` (at `budget`): the link's own bounded queue then fills and the broker is
    pushed back on. The broker's Receive Maximum does not bound it (QoS 0 is not counted, and
    mosquitto 2.0.11 was seen delivering past it), so a flood waits within the budget, not in it
    all (docs/apply.md "Bounds")."""

    def __init__(self, presence_limit: int = PRESENCE_LIMIT, stats: Counter | None = None,
                 budget: int = INTAKE_BUDGET_BYTES, size: Callable[[Any], int] = lambda _item: 0) -> None:
        self.presence_limit = presence_limit
        self.stats = Counter() if stats is None else stats
        self.budget, self._size = budget, size
        self.held = 0  # bytes of what waits (members' and others')
        self.members: dict[bytes, deque] = {}  # requests from keyring sites, per sender, not yet handled
        self.others: deque = deque()  # from sites not in the keyring, not yet handled
        self.others_presence = 0  # of which presence messages

    def waiting(self) -> bool:
        return bool(self.members or self.others)

    def full(self) -> bool:
        """Whether what waits holds the budget: take nothing more until some of it is handled."""
        return self.held >= self.budget

    def take(self, item: Any, kind: str, sender: bytes | None, *, from_member: bool) -> bool:
        """Queue `item`, or return True: handle it now. `from_member`: the request's sender (the
        presence's site) is in the keyring."""
        if kind == "req" and from_member:
            assert sender is not None  # a keyring site
            self.members.setdefault(sender, deque()).append(item)
            self.held += self._size(item)
            return False
        if kind == "ans" or (kind != "req" and from_member):
            return True
        if kind == "presence":
            self.others_presence += 1
            if self.others_presence > self.presence_limit:
                self._drop_oldest_presence()
        self.others.append(item)
        self.held += self._size(item)
        return False

    def turn(self) -> list:
        """One turn: the oldest waiting request of each member sender."""
        out = []
        for sender in list(self.members):
            q = self.members[sender]
            out.append(q.popleft())
            self.held -= self._size(out[-1])
            if not q:
                del self.members[sender]
        return out

    def others_due(self, per_step: int) -> list:
        out = []
        for _ in range(min(len(self.others), per_step)):
            o = self.others.popleft()
            self.held -= self._size(o)
            if o.kind == "presence":
                self.others_presence -= 1
            out.append(o)
        return out

    def _drop_oldest_presence(self) -> None:
        for i, o in enumerate(self.others):
            if o.kind == "presence":
                del self.others[i]
                self.held -= self._size(o)
                self.others_presence -= 1
                self.stats["others_presence_dropped"] += 1
                return


__all__ = ["NEVER", "next_due", "expiry_due", "OnceWake", "body_fit", "ack_requested", "asks_signed_ack",
           "request_properties", "answer_properties", "refusal_properties", "encode_meta", "meta_cost",
           "encode_indices", "decode_indices", "P_KIND", "P_FROM", "P_START", "P_END", "P_COUNT", "P_PART",
           "P_STATUS", "P_REASON", "P_PROCESSED", "P_REJECTED_AT", "P_META", "P_ACK", "P_CONN", "P_MORE", "KIND_BATCH",
           "KIND_PULL", "pull_answer_properties",
           "MAX_ACKS_LOOKED_AT", "answer_proof", "request_refusal", "signed_ack_owed", "ack_due", "ack_wait",
           "ReleasedAcks", "Intake"]
