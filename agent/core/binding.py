"""What the MQTT binding's loop decides beside the exchange itself, sans-I/O (issue 13 leftovers:
what kept agent/runner.py more than a thin adapter).

- **The wire of a request and of its answer** (docs/mqtt.md): the user property names, the frame
  meta (`encode_meta`), what a request carries (`request_properties`, including whether it asks
  for a signed acknowledgement: `ack_requested`) and what an answer or a refusal says
  (`answer_properties`, `refusal_properties`).
- **Body size** (`body_fit`): how many of the selected events fit one body under the peer's limit,
  counting the empty body, the meta and the records it carries.
- **A `sync --once` wake** (`OnceWake`): what is done first (take in what waited, until our own
  presence comes back or a quiet settle), then give up on what was lost while away and offer, then
  wait for present peers' answers, then one last look; when the one-shot exchange is complete.
- **When the loop is next due** (`next_due`): the earliest of the exchange's own deadlines (the
  batch cycle, a coalesced or fixed-cadence realtime push, the answer timeout of a reachable
  peer, grouped acknowledgements) and the runner's periodic jobs. The runtime loop
  (agent/runtime.py) sleeps until then unless something arrives (a message, a control request,
  serial bytes, the log growing), instead of looking every 50 ms.
"""
from __future__ import annotations

import json
from collections import Counter
from typing import Iterable, Sequence

from .exchange import KIND_BATCH, Exchange, Schedule
from .sending import first_body

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
# The indices of the answered body's events the receiver rejected, comma-separated (issue 10
# item 4); absent when none was. A sender that gets it counts every other event as processed.
P_REJECTED_AT = "ssp-rejected-at"
P_META = "ssp-meta"  # the frame meta (docs/protocol.md §1) as compact JSON: {s, e, d, g, x}
# A request property (transport metadata, no authority): "1" asks the receiver for a signed
# acknowledgement (`sovm/ssp-ack-v1`, docs/protocol.md §5) in its answer. Stripping it only makes
# the sender's cursor stay (fail closed); adding it only costs the receiver a grouped signature.
P_ACK = "ssp-ack"

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
    """`encode_indices` read strictly: distinct indices below `total`, else None (ignored)."""
    if not text:
        return []
    parts = text.split(",")
    if len(parts) > total or not all(p.isdigit() and len(p) <= 9 for p in parts):
        return None
    out = [int(p) for p in parts]
    return out if len(set(out)) == len(out) and all(i < total for i in out) else None


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
    `exchange.signed_ack_owed`'s (the sender must be a member other than this node)."""
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
    """The order of a `sync --once` wake (docs/mqtt.md "Sleeping devices"), driven by the caller:
    `next(now, ...)` says what to do now, the caller does it and asks again, until DONE.

    1. TAKE (wait `wait` seconds for messages) until what the broker held for this node is in:
       everything it held is delivered before our own presence, published right after SUBSCRIBE,
       comes back (a broker delivers to one client in order), so the echo ends the intake: DRAIN
       what is already queued (until a pump takes nothing). A broker that never echoes (an ACL
       that drops our presence) falls back to `settle_s` without a message.
    2. OFFER, once: give up on the bodies an earlier wake sent that were lost while away
       (`Exchange.lost_while_away`), then the batch cycle.
    3. AWAIT (take messages for `wait` seconds, expire) while bodies are in flight to present peers.
    4. LAST_LOOK: take what is already here without waiting; then DONE. What arrives later waits in
       the broker for the next wake (the session is persistent).
    `timeout_s` bounds the intake and the wait for answers; the offer and the last look always run."""
    TAKE, DRAIN, OFFER, AWAIT, LAST_LOOK, DONE = "take", "drain", "offer", "await", "last_look", "done"
    INTAKE_WAIT_S, ANSWER_WAIT_S = 0.01, 0.05

    def __init__(self, now: float, settle_s: float = 0.5, timeout_s: float = 20.0) -> None:
        self.settle_s = settle_s
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
                return self._go(self.LAST_LOOK)
            return self._go(self.AWAIT, self.ANSWER_WAIT_S)
        self.phase = self.DONE
        return self.DONE

    def _go(self, phase: str, wait: float | None = None, pump: bool = False) -> str:
        """Enter `phase`; `wait` (or `pump`): the caller takes messages before asking again."""
        self.phase, self.wait = phase, wait or 0.0
        self._pumped = wait is not None or pump
        return phase


__all__ = ["NEVER", "next_due", "expiry_due", "OnceWake", "body_fit", "ack_requested", "asks_signed_ack",
           "request_properties", "answer_properties", "refusal_properties", "encode_meta", "meta_cost",
           "encode_indices", "decode_indices", "P_KIND", "P_FROM", "P_START", "P_END", "P_COUNT", "P_PART",
           "P_STATUS", "P_REASON", "P_PROCESSED", "P_REJECTED_AT", "P_META", "P_ACK", "KIND_BATCH"]
