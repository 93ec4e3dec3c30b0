"""The exchange state machine, sans-I/O: one set of rules for every link. What a node decides about
its exchanges with its peers, with no byte, clock or store in sight: the window, the cursor's
movement on answers, the body limits. Two drivers call it: agent/runner.py on the MQTT binding
(docs/mqtt.md), and agent/core/session.py on the serial and in-memory links (one `Exchange` per
session, time passed in). What only the MQTT binding decides is agent/core/binding.py's.

- **The window** (§32, docs/mqtt.md "Quiet links"): the bodies in flight to each peer (`pending`,
  or `earlier` when restored from sync_state), where the next starts, how many more may go.
- **Answers**: which answer settles which body, what it proves (`proof`, docs/protocol.md §5),
  which cursor movement it carries (`Settled`, applied through `SyncDriver.confirm`).
- **Giving up**: only on evidence that a body will not be answered; an absent peer gets one window.
- **Body limits** (`BodyLimits`, docs/mqtt.md "Size limits") and **presence** (`Presence`, §31).

A realtime push is a window body sent early and answered like any other (§33), so its answer
moves the cursor exactly as a batch body's does (`core.delivery.answer_moves`)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, TypeAlias

from . import numbers
from .messages import Handshake, ProtocolError, parse_presence
from .records import AckAnswer
from .budget import SurfaceBudget, not_surfaced  # noqa: F401 - re-exported (the runner, the serial port)
from .schedule import OfferPlan, Schedule  # noqa: F401 - re-exported (the drivers)
from .sending import MIN_BODY_LIMIT, PeerLimit

KIND_BATCH, KIND_REALTIME = "batch", "rt"  # a request's `ssp-kind` (docs/mqtt.md)
# A waking peer's pull (docs/mqtt.md "A waking device"): no body; "I have taken in what waited
# for me: send what you hold for me now".
KIND_PULL = "pull"
# What names a body in flight: MQTT's correlation data, or a session link's (direction, counter)
Corr: TypeAlias = bytes | tuple[str, int]


@dataclass
class ExchangeConfig:
    """The exchange's settings, read live (agent/runner.py's RunConfig extends it)."""
    cadence_s: float = 30.0  # batch cycle (§32; kept running under realtime, §33.1)
    realtime: bool = True  # advertise and use realtime mode (§33)
    coalesce_s: float = 0.05  # realtime: gather what is produced within this interval into one push (§33.2)
    flush_cadence_s: float | None = None  # realtime on a fixed cadence instead of at production (§33.3)
    window: int = 4  # bodies in flight per peer
    answer_timeout_s: float = 15.0  # a reachable peer silent this long (doubling) has lost its bodies
    secure: bool = False  # the broker authenticates devices and pins topics (answers are evidence)
    limit_probe_s: float = 60.0  # after a too_large refusal, try twice the reduced body limit this much later
    limit_probe_max_s: float = 3600.0  # the wait before a probe doubles with each refusal, up to this


PRESENCE_LIMIT = 1024  # handshakes kept (`Presence`): fictional sites' presence evicts the oldest
GIVE_UP_DOUBLINGS = 6  # the wait before a give-up doubles with each one, up to 2**6 times


@dataclass
class InFlight:
    """A body sent and not yet answered (or recalled from sync_state.sent_bodies)."""
    peer: bytes
    kind: str
    start: int
    end: int
    seqs: list[int]
    sent: float
    n_backfill: int = 0  # backfill events after the live ones (widening backfill, scope §2)
    backfill: bool = False  # the body carries a share of a backfill job (possibly no events: the walk's end)
    token: Any = None  # the sync layer's confirmation token (live range and backfill rows)
    size: int = 0  # bytes of the body (0: unknown, a body recalled from an earlier process)
    body_hash: bytes | None = None  # BLAKE3 of the body's exact bytes: what a signed acknowledgement names
    heard: int = -1  # messages the link had received when it was sent (-1: an earlier process's body)

    @property
    def total(self) -> int:
        return len(self.seqs) + self.n_backfill

    @classmethod
    def recalled(cls, d: dict) -> "InFlight":
        """A body an earlier process sent, as `PortAdapter.recall` reads it back."""
        return cls(d["peer"], d["kind"], d["start"], d["end"], d["seqs"], 0.0, d["n_backfill"], d["backfill"],
                   d["token"], 0, d.get("body_hash"))


# ---------------------------------------------------------------------- answers
def answered_progress(total: int, proof: AckAnswer | None, processed_text: str | None,
                      rejected: list[int] | None) -> tuple[int, list[int] | None]:
    """(processed, rejected) an `ok` answer to a body of `total` events proves: what the peer
    signed when there is a proof (never the unauthenticated properties then), else the answer's
    `ssp-processed` and `ssp-rejected-at`. Every event but the rejected ones reached a final state:
    with the list, everything counts as processed (the cursor moves past the
    rejected ones, which are re-offered later); without it, `processed` is a prefix."""
    if proof is not None:
        processed = min(total, proof.processed)
        rejected = [i for i in proof.rejected if i < total] or None
    else:
        # the one strict reader: int() also took " 3", "+3", "3_0" and Arabic-Indic digits
        processed = min(total, numbers.uint(processed_text) or 0)
    if rejected is not None:
        processed = total
    return processed, rejected


@dataclass
class Settled:
    """What one answer decided (`Exchange.answer`)."""
    ignored: str | None = None  # why nothing moved (a stats key), or None
    body: InFlight | None = None
    earlier: bool = False  # the body was sent by an earlier process (recalled from the store)
    refused: str | None = None  # the peer refused the body: its reason
    forget: bool = False  # drop the durable record of the body (a refusal on the secure binding)
    processed: int = 0  # events that reached a final state at the peer (an `ok` answer)
    rejected: list[int] | None = None  # indices the peer rejected (then every other one is final)
    then: str | None = None  # "offer": keep the window full; "reset": offer again from the cursor

    @property
    def advances(self) -> bool:
        return self.ignored is None and self.refused is None


# ---------------------------------------------------------------------- body limits
class BodyLimits:
    """The body size each peer gets (docs/mqtt.md "Size limits"). Every node advertises its own
    (`ssp-body-limit` on its retained presence, its bodies and its answers: transport metadata with
    no authority, SSP/1 §32); a sender uses min(its link's maximum, the peer's latest
    advertisement) from the first body, kept in the store (peer_links), so a Pi Zero behind a 1 MiB
    gateway refuses nothing, also after restarts and on sleepers' next wakes. Without ACLs anyone
    can forge an advertisement: one is never taken below `floor` (16 KiB) nor above the link's
    maximum, and the peer's own next message replaces it. After a `too_large` refusal (or silence
    from a reachable peer) the limit is halved provisionally (`PeerLimit`), unless the refusal
    stated the peer's limit."""

    def __init__(self, floor: int, cfg: ExchangeConfig | None = None, stats: Counter | None = None) -> None:
        self.floor = floor
        self.cfg = ExchangeConfig() if cfg is None else cfg
        self.stats = Counter() if stats is None else stats
        self.advertised: dict[bytes, int] = {}  # per keyring peer: the body limit it advertised
        self.peer_limit: dict[bytes, PeerLimit] = {}  # per peer, after too_large refusals (provisional)
        self.told: bytes | None = None  # the peer whose refusal being handled stated its limit
        self.dirty: set[bytes] = set()  # peers whose learned limits are not in the store yet

    def learn(self, peer: bytes, limit: int | None) -> None:
        if limit is None or self.advertised.get(peer) == limit:
            return
        self.advertised[peer] = limit
        self.stats["body_limits_learned"] += 1
        self.dirty.add(peer)

    def top(self, peer: bytes, link_max: int) -> int:
        """The largest body `peer` gets: the link's maximum, under what the peer advertised."""
        adv = self.advertised.get(peer)
        return link_max if adv is None else min(link_max, max(self.floor, adv))

    def limit(self, peer: bytes, now: float, link_max: int) -> int:
        """Bytes per body for `peer` now: `top`, or less after its refusals (probed back up)."""
        top = self.top(peer, link_max)
        pl = self.peer_limit.get(peer)
        if pl is None:
            return top
        lim = pl.current(now, top)
        if lim >= top:
            del self.peer_limit[peer]  # back at the maximum: the reduction is forgotten
            self.dirty.add(peer)
            self.stats["body_limit_recovered"] += 1
            return top
        return lim

    def too_large(self, peer: bytes, now: float, link_max: int, size: int = 0) -> None:
        """A `too_large` refusal of a body of `size` bytes (0: not known) sent to `peer`."""
        if self.told == peer:
            # The refusal stated the peer's limit (learned with the message): the next bodies fit
            # it; nothing to guess by halving.
            self.told = None
            self.stats["body_limit_told"] += 1
            return
        pl = self.peer_limit.get(peer)
        if pl is not None and size > pl.limit:
            # Sent before the reduction (the rest of a window in flight): the same evidence again,
            # not a reason to halve once more per body.
            self.stats["body_limit_refusal_stale"] += 1
            return
        if pl is None:
            top = self.top(peer, link_max)
            pl = self.peer_limit[peer] = PeerLimit(top, now, self.cfg.limit_probe_s / 2, top)
        pl.refused(now, self.cfg.limit_probe_max_s)
        self.dirty.add(peer)
        self.stats["body_limit_reduced"] += 1

    def answered_ok(self, peer: bytes, size: int) -> None:
        pl = self.peer_limit.get(peer)
        if pl is not None:
            pl.answered_ok(size, self.cfg.limit_probe_s)

    def restore(self, peer: bytes, advertised: int | None, state: dict | None, now: float, wall_ms: int) -> None:
        """What the store kept of `peer` (sync_state.peer_links), read back."""
        if advertised is not None:
            self.advertised[peer] = int(advertised)
        if state:
            pl = PeerLimit.from_json(state, now, wall_ms)
            if pl is not None:
                self.peer_limit[peer] = pl

    def take_dirty(self, now: float, wall_ms: int) -> list[tuple[bytes, int | None, dict | None]]:
        """(peer, advertised, limit state) for each peer whose limits changed since the last call."""
        out = []
        for peer in sorted(self.dirty):
            pl = self.peer_limit.get(peer)
            out.append((peer, self.advertised.get(peer), pl.to_json(now, wall_ms) if pl else None))
        self.dirty.clear()
        return out


# ---------------------------------------------------------------------- presence
class Presence:
    """Present peers' handshakes (retained presence, §31 on MQTT), newest presence last. Bounded:
    anyone with broker access can publish a presence per made-up site, so past `limit` the oldest
    site not in the keyring goes (counted)."""

    def __init__(self, limit: int = PRESENCE_LIMIT, stats: Counter | None = None) -> None:
        self.limit = limit
        self.caps: dict[bytes, Handshake] = {}
        self.stats = Counter() if stats is None else stats
        self.refused_last: dict[bytes, int] = {}  # site -> hash of the refused payload last surfaced

    def received(self, site: bytes, payload: bytes, member: Callable[[bytes], bool]) -> ProtocolError | None:
        """A retained presence (it reaches every node at every start): the site's handshake, or it
        left (an empty payload), or its boundary refuses it and the site counts as absent. Returns
        the refusal to surface: once per site and payload (a retained one comes back at every
        reconnect), the memory of them bounded (presence topics of fictional sites)."""
        try:
            hs = parse_presence(payload, site)
        except ProtocolError as e:
            self.left(site)
            self.stats["refused_presence"] += 1
            key = hash(payload)
            if self.refused_last.get(site) == key:
                return None
            if len(self.refused_last) >= 1024:
                self.refused_last.clear()
            self.refused_last[site] = key
            return e
        if hs is None:
            self.left(site)
        else:
            self.arrived(site, hs, member)
        return None

    def __contains__(self, site: bytes) -> bool:
        return site in self.caps

    def left(self, site: bytes) -> None:
        """The site left (an empty retained presence), or its presence was refused: absent."""
        self.caps.pop(site, None)

    def arrived(self, site: bytes, hs: Handshake, member: Callable[[bytes], bool]) -> None:
        if not hs.understood:
            # A handshake that does not understand this version is no realtime partner (§31).
            hs = Handshake(hs.site_id, hs.have_max_hlc, False, hs.secure_channel, hs.rtt_ms, False)
        self.caps.pop(site, None)  # re-inserted: the order is the order of the last presence
        self.caps[site] = hs
        if len(self.caps) > self.limit:
            old = next((s for s in self.caps if not member(s)), None)
            if old is not None:
                del self.caps[old]
                self.stats["presence_evicted"] += 1

    def realtime(self, site: bytes) -> bool:
        hs = self.caps.get(site)
        return bool(hs is not None and hs.supports_realtime)


# ---------------------------------------------------------------------- the window
@dataclass
class Exchange:
    """The sender side of one node's exchanges with its peers (all of them on MQTT; the one peer
    of a session link)."""
    cfg: ExchangeConfig = field(default_factory=ExchangeConfig)
    limits: BodyLimits = field(default_factory=lambda: BodyLimits(16 * 1024))
    presence: Presence = field(default_factory=Presence)
    stats: Counter = field(default_factory=Counter)

    pending: dict[Corr, InFlight] = field(default_factory=dict)  # correlation -> body sent by this process
    earlier: dict[bytes, dict[Corr, int]] = field(default_factory=dict)  # per peer: corr -> end, earlier process
    earlier_top: dict[bytes, int] = field(default_factory=dict)  # per peer: the highest sent_bodies id among those
    sent_upto: dict[bytes, int] = field(default_factory=dict)  # per peer: highest seq offered in flight
    silent_since: dict[bytes, float] = field(default_factory=dict)  # per peer: reachable since, bodies unanswered
    give_ups: Counter = field(default_factory=Counter)  # per peer: give-ups since its last answer
    heard: set[bytes] = field(default_factory=set)  # peers a request came from in this process
    # Pulls (docs/mqtt.md "A waking device"). As the receiver: per peer, its current connection
    # (`ssp-conn`) and the link's receipt number of the first message of it; the settled answers
    # and the last give-up a pull caused (a forged pull without ACLs gets at most one per wait).
    conn_first: dict[bytes, tuple[str, int]] = field(default_factory=dict)
    settled: Counter = field(default_factory=Counter)
    pull_gave_up: dict[bytes, tuple[int, float]] = field(default_factory=dict)
    # As the puller: correlation -> peer of each pull not answered yet, peers that answered one
    # (online now), and peers that said they hold more (pulled again once their bodies are answered).
    pulls: dict[bytes, bytes] = field(default_factory=dict)
    pull_live: set[bytes] = field(default_factory=set)
    repull: set[bytes] = field(default_factory=set)

    # ------------------------------------------------------------ the window
    def in_flight(self, peer: bytes) -> int:
        return sum(1 for p in self.pending.values() if p.peer == peer) + len(self.earlier.get(peer, ()))

    def backfill_in_flight(self, peer: bytes) -> bool:
        """At most one body carrying backfill rows is out per peer: the next rows are selected from
        the durable row cursor, which moves only when that body is answered."""
        return any(p.peer == peer and p.backfill for p in self.pending.values())

    def is_in_flight(self, peer: bytes, corr: Corr | None) -> bool:
        p = self.pending.get(corr) if corr is not None else None
        return (p is not None and p.peer == peer) or corr in self.earlier.get(peer, ())

    def room(self, peer: bytes) -> int:
        return self.cfg.window - self.in_flight(peer)

    def plan_offer(self, peer: bytes, kind: str, cursor: int, limit: int, bodies: int | None = None,
                   force: bool = False, records_pending: Callable[[], bool] = lambda: False) -> OfferPlan:
        """Up to `bodies` (default: the window's room) bodies to `peer`, from where the window in
        flight ends (or the durable `cursor`). Records the peer has not answered for (never
        delivered to it on this path) are worth a body of their own, when nothing is in flight;
        at most a quarter of the peer's body limit of them per body, the rest follow in the next
        bodies (each answer marks what its body carried as delivered)."""
        n = self.room(peer) if bodies is None else bodies
        force = force or (not self.in_flight(peer) and records_pending())
        return OfferPlan(peer, kind, self.start_at(peer, cursor), max(n, 0), limit, max(256, limit // 4), force)

    def may_carry_backfill(self, peer: bytes, kind: str) -> bool:
        """Widening backfill rides batch bodies only, after the live tail (live first), one such
        body in flight per peer."""
        return kind == KIND_BATCH and not self.backfill_in_flight(peer)

    def realtime_peers(self, member: Callable[[bytes], bool]) -> list[bytes]:
        """Keyring peers present with realtime mode (§33: both advertised it), in presence order."""
        if not self.cfg.realtime:
            return []
        return [p for p, hs in self.presence.caps.items() if hs.supports_realtime and member(p)]

    def push_targets(self, member: Callable[[bytes], bool]) -> list[bytes]:
        """Who gets a realtime body now: the realtime peers with room in their window. On this
        binding a push is a window body sent early (same selection and meta, answered), so it
        moves the cursor like a batch body; the batch cycle keeps running underneath (§33.1)."""
        return [p for p in self.realtime_peers(member) if self.room(p) > 0]

    def start_at(self, peer: bytes, cursor: int) -> int:
        """Where the next body to `peer` starts: after the window in flight, or, with nothing in
        flight, the durable cursor (which may have moved back: a rehydration request resets it)."""
        if not self.in_flight(peer):
            self.sent_upto.pop(peer, None)
            return cursor
        return max(cursor, self.sent_upto.get(peer, 0))

    def batch_room(self, peer: bytes) -> int:
        """Bodies a batch cycle sends `peer`: what its window has room for, after what is out. A
        full window waits for answers (or evidence of a loss) however many cycles pass (quiet
        links); an empty one starts again from the durable cursor."""
        out = self.in_flight(peer)
        if out >= self.cfg.window:
            return 0
        if not out:
            self.sent_upto.pop(peer, None)
        return self.cfg.window - out

    def sent(self, corr: Corr, body: InFlight) -> None:
        self.pending[corr] = body
        self.sent_upto[body.peer] = body.end

    def restore(self, row_id: int, corr: bytes, peer: bytes, end: int, cursor: int, backfill: bool) -> None:
        """A body an earlier process sent and nobody answered yet (not given up, not older than a
        session lasts): in flight for this process too, unless the cursor already covers it."""
        if end > cursor or backfill:
            self.earlier.setdefault(peer, {})[corr] = end
            self.earlier_top[peer] = max(self.earlier_top.get(peer, 0), row_id)
            self.sent_upto[peer] = max(self.sent_upto.get(peer, 0), end)

    def reset(self, peer: bytes) -> None:
        """Offer again from the durable cursor (after a refusal, or an answer that processed only a
        prefix). The bodies still in flight keep their slots until answered or given up, so the
        peer never has more than one window waiting (quiet links)."""
        self.sent_upto.pop(peer, None)

    def give_up(self, peer: bytes) -> None:
        """The bodies in flight to `peer` will not be answered: none of them counts as in flight any
        more; their ranges are offered again. (The caller makes it durable: sync_state.)"""
        for c in [c for c, p in self.pending.items() if p.peer == peer]:
            del self.pending[c]
        self.sent_upto.pop(peer, None)
        self.earlier.pop(peer, None)
        self.earlier_top.pop(peer, None)
        self.silent_since.pop(peer, None)

    # ------------------------------------------------------------ evidence of a loss
    def wait_s(self, peer: bytes) -> float:
        return self.cfg.answer_timeout_s * 2 ** min(self.give_ups[peer], GIVE_UP_DOUBLINGS)

    def expire(self, now: float, link_max: int) -> list[bytes]:
        """The peers whose bodies in flight are given up on now (the caller makes it durable): the
        peer was reachable (present, or a request from it arrived) and silent for `wait_s` since.
        An absent peer's bodies wait in its broker session: its absence is no evidence of a loss.

        A broker drops, without a word, a PUBLISH larger than the Maximum Packet Size the peer
        announced: silence from a reachable peer may mean our bodies are too
        large for it. So a give-up also halves, provisionally like a refusal, what it gets, when
        its bodies were larger than the advertised floor."""
        out = []
        for peer in sorted({p.peer for p in self.pending.values()} | {p for p, c in self.earlier.items() if c}):
            since = self.silent_since.get(peer)
            if since is None:
                if peer not in self.presence:
                    continue
                since = self.silent_since[peer] = now
            if now - since >= self.wait_s(peer):
                self.stats["unanswered"] += 1
                self.give_ups[peer] += 1
                big = max((p.size for p in self.pending.values() if p.peer == peer), default=0)
                if big > self.limits.floor:
                    self.limits.too_large(peer, now, link_max)
                    self.stats["body_limit_reduced_by_silence"] += 1
                self.give_up(peer)
                out.append(peer)
        return out

    def reachable(self, peer: bytes, now: float) -> None:
        """`peer` is reachable now (a request from it arrived; on a point-to-point link, the link is
        up): the wait for the answers to its bodies in flight runs from now, unless it runs already."""
        if self.in_flight(peer) and peer not in self.silent_since:
            self.silent_since[peer] = now

    def lost_while_away(self) -> list[bytes]:
        """A `sync --once` wake, after taking in what waited for it: the peers whose bodies from an
        earlier wake were not answered although the peer was online since (a request from it
        waited for us, or its retained presence is there). Their answers, sent as it takes each
        body, would have been among what waited: lost. Given up on here (the caller makes it
        durable). A peer that connected a moment ago costs one window of duplicates at most."""
        out = [p for p, c in self.earlier.items() if c and (p in self.heard or p in self.presence)]
        for peer in out:
            self.stats["unanswered"] += 1
            self.give_up(peer)
        return out

    def note_message(self, kind: str, who: bytes | None, now: float, *, member: bool, empty: bool = False,
                     dup: bool = False, advertised: int | None = None, told_too_large: bool = False) -> None:
        """What a message tells the send schedule before it is handled. `kind`: req | ans |
        presence; `who`: its sender (the presence's site); `member`: a keyring site other than
        this node; `advertised`: its `ssp-body-limit`; `told_too_large`: a too_large refusal that
        states the limit. A request shows the peer reachable now; its presence leaving ends the
        wait. An answer counts once it settled a body (`answered`): an unproven one, which anyone
        reading the topic can forge, is no evidence of anything."""
        if who is not None and member:
            if kind != "presence" or not empty:
                self.limits.learn(who, advertised)
            if kind == "ans" and told_too_large:
                self.limits.told = who
        if kind == "req" and who is not None and not dup:
            self.heard.add(who)
            self.reachable(who, now)
        elif kind == "presence" and empty and who is not None:
            self.silent_since.pop(who, None)  # it left: what it did not answer waits in its session

    # ------------------------------------------------------------ answers
    def lookup(self, corr: Corr | None, recalled: dict | None = None) -> tuple[InFlight | None, bool]:
        """The body an answer names: sent by this process, else `recalled` from the store (an
        earlier process, or one this process gave up on). (body or None, whether earlier)."""
        p = self.pending.get(corr) if corr else None
        if p is None and recalled is not None:
            return InFlight.recalled(recalled), True
        return p, False

    def answer(self, corr: Corr | None, sender: bytes | None, body: InFlight | None, earlier: bool, *,
               status: str | None, reason: str | None, processed_text: str | None,
               rejected: list[int] | None, proof: Callable[[InFlight], AckAnswer | None], now: float,
               link_max: int) -> Settled:
        """Decide what an answer proves. `body`, `earlier`: from `lookup`. `proof`: finds the peer's
        signed acknowledgement of the body in the answer (`answer_proof`), asked only for an `ok`
        answer when the binding is not secure: without the broker's ACLs an answer is evidence
        only with it (docs/protocol.md §5); anything else may be a reader of the topic answering
        first, so it is counted and ignored, the body stays in flight (the peer's own answer still
        settles it) and it is re-offered after the answer timeout."""
        if body is None:
            self.stats["unknown_answers"] += 1  # replayed, forged, or forgotten long ago: ignored
            return Settled("unknown_answers")
        if sender != body.peer:
            self.stats["answers_from_wrong_sender"] += 1  # not the addressee's answer topic: ignored
            return Settled("answers_from_wrong_sender", body, earlier)
        ok = status == "ok"
        ack = None
        if ok and not self.cfg.secure:
            ack = proof(body)
            if ack is None:
                self.stats["answers_unproven"] += 1
                return Settled("answers_unproven", body, earlier)
        if not earlier:
            assert corr is not None  # `body` is what `lookup` found in flight under it
            del self.pending[corr]
        else:
            self.stats["earlier_answers"] += 1
        self.stats["answers"] += 1
        peer = body.peer
        if not ok:
            reason = reason or "?"
            self.stats[f"push_rejected:{reason}"] += 1
            if reason == "too_large":  # the peer's body limit may be below ours: halve what we send it
                self.limits.too_large(peer, now, link_max, body.size)
            if not earlier:
                self.reset(peer)
            # Unauthenticated without the ACLs: a forged refusal must not make the peer's real
            # answer (which may follow) unknown; the durable record stays then, so that answer,
            # signed, is still taken (as an earlier one). The range is re-offered meanwhile.
            return Settled(None, body, earlier, refused=reason, forget=self.cfg.secure)
        processed, rej = answered_progress(body.total, ack, processed_text, rejected)
        self.stats["events_acknowledged"] += processed - len(rej or ())
        self.limits.answered_ok(peer, body.size)
        then = None
        if not earlier:
            # After an earlier body's answer the next batch cycle sends the window after the cursor
            # (at once after the settle of a wake): offering per earlier answer would re-send ranges
            # whose answers are still in the queue behind this one.
            if processed < body.total:
                self.reset(peer)
                then = "reset"
            else:
                then = "offer"  # keep the window full while there is more (catch-up)
        return Settled(None, body, earlier, processed=processed, rejected=rej, then=then)

    def answered(self, peer: bytes | None, corr: Corr | None, *, still_recorded: bool,
                 refused: bool) -> int | None:
        """After an answer to a body in flight was handled: a body it settled (taken as proven, or
        refused) is out of flight, and the peer is not silent. An answer that was ignored (unproven,
        a replay) settles nothing: the body keeps its slot and the wait goes on. `still_recorded`:
        the store still holds the body (its answer was not taken).

        Returns a sent_bodies id when the bodies an earlier process sent the peer, up to it, are to
        be given up (durably) and the window offered again: the peer answered a body this process
        sent, and every earlier body went before it in its session's queue, which the broker
        delivers in order; those still unanswered were lost (sent while it had no session, or a
        broker restart without persistence)."""
        if peer is None or corr is None:
            return None
        upto = None
        if corr in self.earlier.get(peer, ()):
            if still_recorded and not refused:
                return None
            del self.earlier[peer][corr]
        elif corr in self.pending:
            return None
        elif self.earlier.get(peer):
            self.stats["unanswered"] += 1
            self.earlier.pop(peer)
            self.sent_upto.pop(peer, None)
            upto = self.earlier_top.get(peer, 0)
        self.heard.add(peer)
        self.silent_since.pop(peer, None)
        self.give_ups[peer] = 0
        self.settled[peer] += 1
        return upto

    # ------------------------------------------------------------ pulls (docs/mqtt.md "A waking device")
    def note_conn(self, peer: bytes, conn: str | None, seq: int) -> None:
        """A message from keyring peer `peer` on its connection `conn` (`ssp-conn`), the link's
        `seq`-th: the first one of a connection marks where that connection starts."""
        if conn and self.conn_first.get(peer, ("",))[0] != conn:
            self.conn_first[peer] = (conn[:64], seq)

    def pulled(self, peer: bytes, conn: str | None, seq: int, now: float) -> bool:
        """`peer` pulled: it has taken in everything that waited for it, and answered it (its
        answers precede its pull; one publisher's messages reach this node in order). A body in
        flight to it that was sent before this node received the first message of the peer's
        current connection, or by an earlier process, was then lost (sent while the peer had no
        session, or lost with a broker restart): give up on the window (True; the caller makes
        it durable and offers again). A body sent since is on its way. Without ACLs a forged pull
        gives up at most once per `answer_timeout_s` unless the peer settled an answer since."""
        first = self.conn_first.get(peer)
        cut = first[1] if first is not None and conn and first[0] == conn else seq
        lost = bool(self.earlier.get(peer)) or any(p.peer == peer and p.heard < cut for p in self.pending.values())
        if not lost:
            return False
        last = self.pull_gave_up.get(peer)
        if (not self.cfg.secure and last is not None and last[0] == self.settled[peer]
                and now - last[1] < self.cfg.answer_timeout_s):
            self.stats["pull_give_up_held"] += 1
            return False
        self.pull_gave_up[peer] = (self.settled[peer], now)
        self.stats["unanswered"] += 1
        self.stats["pull_give_ups"] += 1
        self.give_up(peer)
        return True

    def pull_sent(self, corr: bytes, peer: bytes) -> None:
        self.pulls[corr] = peer
        self.repull.discard(peer)

    def pull_answered(self, corr: bytes | None, sender: bytes | None, more: bool) -> tuple[bool, int | None]:
        """An answer to a pull: (whether it answers one of ours, a sent_bodies id up to which the
        bodies an earlier process sent the peer are given up, as in `answered`: the peer answered
        this process's pull after every body sent before it, so those still unanswered were
        lost). `more`: it holds more for us than it just sent (pull again once they are in)."""
        if corr is None:
            return False, None
        peer = self.pulls.get(corr)
        if peer is None or peer != sender:
            return False, None
        del self.pulls[corr]
        self.pull_live.add(peer)
        if more:
            self.repull.add(peer)
        upto = None
        if self.earlier.get(peer):
            self.stats["unanswered"] += 1
            self.earlier.pop(peer)
            self.sent_upto.pop(peer, None)
            upto = self.earlier_top.get(peer, 0)
        self.heard.add(peer)
        return True, upto

    def pulls_waiting(self) -> bool:
        """A wake waits for the answer to its pull from a peer that is online (present, or it
        answered a pull already), and to pull again from one that holds more."""
        live = set(self.presence.caps) | self.pull_live
        return bool(self.repull) or any(p in live for p in self.pulls.values())

    def waiting_on(self, present: Iterable[bytes] | None = None) -> list[bytes]:
        """Peers with bodies in flight from this process that are present (a wake waits for them)."""
        return sorted({q.peer for q in self.pending.values()} & set(self.presence.caps if present is None else present))


__all__ = ["Exchange", "ExchangeConfig", "Schedule", "SurfaceBudget", "OfferPlan",
           "KIND_BATCH", "KIND_REALTIME", "KIND_PULL", "InFlight", "Settled", "BodyLimits", "Presence", "answered_progress",
           "PRESENCE_LIMIT", "GIVE_UP_DOUBLINGS", "MIN_BODY_LIMIT"]
