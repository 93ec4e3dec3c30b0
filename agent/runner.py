"""The node's MQTT loop: `ssp-agent run` (always on) and `ssp-agent sync --once` (wake, sync, sleep);
docs/mqtt.md says what it does on the wire.

A thin adapter: the protocol decisions (the window of bodies in flight, giving up, body limits,
presence, when and what to send) are the pure exchange state machine's (agent/core/exchange.py),
the same on every link, and what only the MQTT binding adds is agent/core/binding.py's. This
module moves messages (MqttLink), time (passed in) and rows (sync_state, through
`agent.sync_port.PortAdapter` on the path `mqtt`) in and out of them; agent/runtime.py drives it
through `step` and sleeps until `next_due`.

One thread owns the node (SQLite); the MQTT link's network thread only enqueues what arrives. A
received body is applied in one transaction through the one apply path, answered, and only then
acked to the broker. Sent bodies are kept in `sync_state.sent_bodies` until answered, so an answer
that waited in the broker while this process was gone still moves the cursor. Received streams
move watermarks only on a secure binding (`--secure-binding`, docs/mqtt.md)."""
from __future__ import annotations

import logging
import queue
from collections import Counter, deque
from typing import Any, Callable

from .core.exchange import (GIVE_UP_DOUBLINGS, KIND_PULL, PRESENCE_LIMIT, BodyLimits, Exchange,
                            InFlight, Presence, Schedule)
from .core.binding import MAX_ACKS_LOOKED_AT  # noqa: F401 - re-exported (tests, benches)
from .core.binding import (P_ACK, P_CONN, P_MORE, Intake, OnceWake,  # noqa: F401 - P_ACK
                           answer_properties, answer_proof, asks_signed_ack, body_fit, next_due,
                           pull_answer_properties, refusal_properties, request_properties, request_refusal,
                           signed_ack_owed)
from .core.messages import ProtocolError, parse_body
from .core.records import AckAnswer, record_hash as body_hash
from .core.sending import PeerLimit  # noqa: F401 - the too-large back-off (pure); re-exported
from .core.session import parse_meta_text
from .core.reasons import UNCLASSIFIED
from .faults import LOCAL_FAULTS, describe
from .outcomes import counts
from .store import eventlog, sync_state as st
from .mqtt_acks import SignedAnswers
from .mqtt_names import ExchangeNames
from .mqtt_rows import RunnerRows
from .mqtt_config import PULL_EXPIRY_S, PUMP_BUDGET_S, RunConfig, dumps_summary, settings_from_env  # noqa: F401
from .mqtt_surface import (LOSS_WINDOW_S, LOSSES_SURFACED_PER_WINDOW, REFUSAL_WINDOW_S,  # noqa: F401 - re-exported
                           REFUSALS_SURFACED_PER_WINDOW, Surfacing)
from .timesource import SYSTEM, Clock
from .sync_tokens import Offer  # noqa: F401 - defined below the runner (no import circle); re-exported
from .transport.mqtt import (KIND_BATCH, KIND_REALTIME, P_KIND, P_META, P_REJECTED_AT, ADVERTISED_FLOOR,
                             P_BODY_LIMIT, P_REASON, P_STATUS, P_PROCESSED, Inbound, MqttLink, MqttSettings, inbound_size,
                             decode_indices, parse_body_limit)

PATH = "mqtt"  # the transport path: one durable cursor per (peer, path) in sync_state

log = logging.getLogger("ssp_agent.runner")


_Pending = InFlight  # a body in flight (agent/core/exchange.py); the old name, for benches and tests


class Runner(ExchangeNames):
    def __init__(self, node, settings: MqttSettings, config: RunConfig | None = None, port=None,
                 clock: Clock = SYSTEM) -> None:
        from .sync_port import PortAdapter
        self.node = node
        # The one source of time (monotonic for the exchange's deadlines, wall for what is stored):
        # neither this loop nor its link reads a clock of its own.
        self.clock = clock
        node.long_running = True   # its first large body starts the apply worker (applypipeline.Pipeline.WORKER_RUN_BATCH)
        self.cfg = config or RunConfig()
        self.settings = settings
        self.max_events = self.cfg.max_events or settings.max_events
        # The sync layer on path "mqtt"; `secure` only when the broker pins topics to devices.
        self.sync = port or PortAdapter(node, path=PATH, secure=self.cfg.secure, batch_limit=self.max_events,
                                        now=clock.wall_ms)
        _adopt_private_cursors(node)
        self.link = MqttLink(settings, node.mesh_id, node.site_id,
                             presence_payload=lambda: self.sync.handshake(self.cfg.realtime), clock=clock,
                             members=lambda: list(self.node.keyring))
        self._unsaved: list = []  # bodies published, not yet in sync_state.sent_bodies
        self.last_eviction: dict | None = None
        self._next_evict = 0.0
        self._next_clock = 0.0
        self.clock_state: dict | None = None
        self._next_links_save = 0.0
        self.stats: Counter = Counter()
        # The protocol decisions (window in flight, answers, give-ups, body limits, presence) are
        # the pure exchange state machine's (agent/core/exchange.py); this class moves messages,
        # time and rows in and out. It counts into the runner's stats.
        self.ex = Exchange(self.cfg, BodyLimits(ADVERTISED_FLOOR, self.cfg, self.stats),
                           Presence(PRESENCE_LIMIT, self.stats), self.stats)
        self.rejections: deque = deque(maxlen=1000)  # (reason, detail) of refused inbound messages
        # the order what arrived is handled in (pump), bounded in bytes
        self.intake = Intake(PRESENCE_LIMIT, self.stats, size=inbound_size)
        self.surfacing = Surfacing(node, self.stats, clock, PATH)  # refusals and broker losses, bounded
        self._next_dropped_log = 0.0  # answers left out are logged once a window (`_answer_left_out`)
        self.acks = SignedAnswers(node, self.stats, clock, self.cfg)  # answers owed a signed acknowledgement
        self._next_body: tuple | None = None  # (payload, its parse) of the body named to the node next
        self._pulled_on = 0  # the link connection (generation) `run` last pulled its peers on
        self._denied_told = False  # the broker's refusal of our publishes was logged
        # Writes before this runner started are the batch cycle's; realtime pushes follow new ones.
        self._scanned = self._local_top = eventlog.top(node.conn)
        self.schedule = Schedule(self.cfg, self._local_top)
        self.rows = RunnerRows(node.conn, clock, PATH)  # sent bodies and learned limits in sync_state
        self._load_in_flight()
        self._load_limits()

    @property
    def _owed(self) -> dict[bytes, list]:
        """Answers waiting for their sender's signed acknowledgement (`SignedAnswers.owed`)."""
        return self.acks.owed

    @_owed.setter
    def _owed(self, owed: dict[bytes, list]) -> None:
        self.acks.owed = owed

    # -------------------------------------------------------------- lifecycle
    def start(self, connect_timeout: float = 10.0, should_stop=None) -> bool:
        """Connect; True once connected within `connect_timeout`. `should_stop`: a predicate that
        ends the wait early (`run` told to stop while it connects)."""
        self.link.start()
        if should_stop is None:
            return self.link.wait_connected(connect_timeout)
        deadline = self.clock.mono() + connect_timeout
        while not self.link.wait_connected(max(0.0, min(0.2, deadline - self.clock.mono()))):
            if should_stop() or self.clock.mono() >= deadline:
                return False
        return True

    def close(self) -> None:
        self._save_links()
        if self._owed:
            self._answer_owed(force=True)  # applied and committed: answer before going
        self.link.close()
        self.surfacing.losses(self.link.losses)
        self.surfacing.close()

    # -------------------------------------------------------------- the loop
    def step(self, timeout: float = 0.05) -> None:
        """One turn: take in what arrived, expire unanswered bodies, run due cycles and pushes."""
        self.pump(timeout)
        now = self.clock.mono()
        if self.link.losses:
            self.surfacing.losses(self.link.losses)
        if self.link.denied and not self._denied_told:
            self._denied_told = True   # once: it needs a human (docs/mqtt.md, the ACLs)
            log.warning("the broker refuses this node's publishes (Not authorized) as %s: nothing it sends is "
                        "delivered; a device logs in as its own site_id %s (docs/mqtt.md)",
                        self.settings.username or "anonymous", self.node.site_id.hex())
        self.link.follow_members()   # a keyring that grew: its new members' presence (settings.presence)
        self._expire(now)
        if self._pull_due():
            self.pull_all()
        if self.schedule.batch_due(now, self.link.connected.is_set()):
            self.batch_cycle()
        if self.cfg.realtime:
            self._realtime(now)
        if self.ex.limits.dirty and now >= self._next_links_save:
            self._save_links()
        if self.cfg.eviction_interval_s and now >= self._next_evict:
            self._next_evict = now + self.cfg.eviction_interval_s
            self.evict()
        if now >= self._next_clock:
            # docs/apply.md "Clocks without an RTC": keep the evidence fresh while the clock is trusted
            self._next_clock = now + 60.0
            try:
                self.clock_state = self.node.note_clock()
            except Exception as e:  # noqa: BLE001 - a clock check must never stop the sync loop
                log.warning("clock check failed: %s", e)

    def next_due(self, now: float) -> float:
        """When this runner next has something to do without being told (monotonic; `now` or
        earlier: at once): `core.binding.next_due` over the exchange and this runner's own jobs.
        What arrives (a message, a lost connection, the connection's SUBACK) wakes the loop
        through `link.wake`; a write in this process, through `notify_produced`."""
        if self.intake.waiting() or not self.link.inbound.empty() or self.link.losses:
            return now   # a pump left work behind (its budget), or the network thread queued some
        others = [self._next_clock, self._next_evict if self.cfg.eviction_interval_s else None,
                  self._next_links_save if self.ex.limits.dirty else None]
        if self._owed:
            others.append(now + self.acks.wait(now))
        return next_due(self.ex, self.schedule, now, connected=self.link.connected.is_set(), others=others)

    def evict(self) -> dict | None:
        """The profile's eviction job (agent/jobs.py, shared with the runtime loop), its report kept."""
        from .jobs import evict
        rep = evict(self.node, self.stats)
        if rep is not None:
            self.last_eviction = rep
        return rep

    def run(self, should_stop: Callable[[], bool] = lambda: False) -> None:
        while not should_stop():
            self.step()

    def pump(self, timeout: float = 0.0, max_items: int = 10_000) -> int:
        """Handle what arrived, in the order `binding.Intake` decides (members' requests one per
        sender in turn, others bounded per call). Both the link's queue and the intake are bounded
        in bytes: nothing more is taken from the link while the intake is full, so the link's
        network thread waits and the broker holds the rest back (before: bounded only by the
        Receive Maximum, which counts no QoS 0 publish: a flood filled gigabytes). A call
        returns after about PUMP_BUDGET_S of handling even while bodies keep coming (a flood kept
        it, and the loop's expiry and cycles, busy for as long as it lasted)."""
        n = got = 0
        intake = self.intake
        wait = 0.0 if intake.waiting() else timeout
        if self._owed:  # answers wait for their grouped acknowledgement: not longer than its interval
            wait = min(wait, self.acks.wait(self.clock.mono()))
        keyring = self.node.keyring
        budget_end = self.clock.mono() + wait + PUMP_BUDGET_S
        while True:
            while got < max_items and not intake.full():
                try:
                    m = self.link.inbound.get(timeout=wait) if wait > 0 else self.link.inbound.get_nowait()
                except queue.Empty:
                    break
                wait = 0
                got += 1
                who = m.sender if m.kind == "req" else m.site
                if intake.take(m, m.kind, who, from_member=who in keyring):
                    self._handle(m)
                    n += 1
            if not intake.members:
                break
            for m in intake.turn():
                self._handle(m)
                n += 1
            if got >= max_items or self.clock.mono() >= budget_end:
                break  # the loop's other duties (expiry, cycles, eviction) run under any flood
        for o in intake.others_due(self.cfg.others_per_step):
            self._handle(o)
            n += 1
        if self._owed:
            self._answer_owed()
        return n

    def _handle(self, m: Inbound) -> None:
        """Handle one message. Whatever its handling raises past the boundary parsers is this
        message's fault (agent/faults.py): refused and surfaced, the loop goes on; a local fault
        (store, keystore, disk) still stops the node."""
        try:
            self._dispatch(m)
        except LOCAL_FAULTS:
            raise
        except Exception as e:  # noqa: BLE001 - the net under the boundaries (docs/protocol.md §11)
            self._unhandled(m, e)

    def _unhandled(self, m: Inbound, e: Exception) -> None:
        """A message whose handling raised: counted, logged with its traceback, surfaced
        (`unclassified`); a request is answered `rejected` and acked (never redelivered), an answer
        and a presence were acked on arrival."""
        self.stats["unhandled_messages"] += 1
        log.warning("handling a %s message from %s raised", m.kind, (m.sender or m.site).hex(), exc_info=e)
        detail = describe(e)
        if m.kind == "req":
            return self._reject(m, UNCLASSIFIED, detail)
        self.surfacing.refusal("mqtt_answer" if m.kind == "ans" else "presence", UNCLASSIFIED, detail,
                              m.sender if m.kind == "ans" else m.site)

    def _dispatch(self, m: Inbound) -> None:
        self._note_link(m)
        if m.kind == "req":
            self._on_request(m)
        elif m.kind == "ans" and m.correlation in self.ex.pulls:
            self._on_pull_answer(m)
        elif m.kind == "ans":
            was = self.ex.is_in_flight(m.sender, m.correlation)
            self._on_answer(m)
            self.ex.limits.told = None
            if was:
                self._note_answered(m)
        else:
            self._on_presence(m)

    # -------------------------------------------------------------- receiving
    def _reject(self, m: Inbound, reason: str, detail: str = "") -> None:
        """Refuse a request: surfaced with its reason (`ssp-agent events`, kind `refused`), answered,
        and acknowledged, so the broker never redelivers it (a poison message redelivered
        after every restart kept a node down)."""
        self.stats["rejected_bodies"] += 1
        self.stats[f"rejected:{reason}"] += 1
        self.rejections.append((reason, detail))
        self.surfacing.refusal("mqtt_request", reason, detail, m.sender)
        self._answer(m, b"", refusal_properties(m.props, reason), courtesy=True)

    def _answer(self, m: Inbound, body: bytes, user: dict[str, str], courtesy: bool) -> None:
        """Answer a request, then acknowledge it to the broker (never redelivered). A courtesy (a
        refusal's answer, or one to a sender outside the keyring: nothing it is owed moves) is left
        out while the link's publishes wait for the broker's acknowledgements at their bound: under
        a flood they wait behind it, paho holding each (docs/mqtt.md "Memory bound")."""
        if courtesy and self.link.unacked.full():
            self._answer_left_out()
        elif self.link.answer(m, body, user):
            self.stats["answers_sent"] += 1
        self.link.ack(m)

    def _answer_left_out(self) -> None:
        """Counted (`courtesy_answers_dropped`); logged at most once a window."""
        self.stats["courtesy_answers_dropped"] += 1
        now = self.clock.mono()
        if now >= self._next_dropped_log:
            self._next_dropped_log = now + REFUSAL_WINDOW_S
            log.warning("answers to refused or unknown senders left out while %d publishes wait for the broker "
                        "(%d so far; the requests are still acknowledged)",
                        self.link.unacked.pending(), self.stats["courtesy_answers_dropped"])

    def _on_pull(self, m: Inbound) -> None:
        """A peer pulls (docs/mqtt.md "A waking device"): it has taken in and answered what waited
        for it. What was sent to it before its connection began and is still unanswered was lost:
        given up on (`Exchange.pulled`) and sent again from the durable cursor (SQLite is the
        outbox), then the pull is answered, after those bodies (the broker keeps one publisher's
        order), saying whether more follows."""
        peer = m.sender
        if peer is None or peer not in self.node.keyring or peer == self.node.site_id:
            self.stats["pulls_ignored"] += 1
            self.link.ack(m)
            return
        self.stats["pulls_answered"] += 1
        if self.ex.pulled(peer, m.props.get(P_CONN), m.seq, self.clock.mono()):
            self._gave_up(peer)
        if peer in self.sync.peers():
            self.offer(peer, KIND_BATCH)
        # The answer carries our presence (the §31 handshake): a peer that never receives our
        # retained presence (a broker cluster's other node, docs/scale.md) learns it from traffic.
        self._answer(m, self.sync.handshake(self.cfg.realtime), pull_answer_properties(self.ex.room(peer) <= 0),
                     courtesy=False)

    def _on_pull_answer(self, m: Inbound) -> None:
        """The answer to our pull: the peer's bodies for us came before it. Earlier bodies to it
        still unanswered were lost (`Exchange.pull_answered`): sent again."""
        self.link.ack(m)
        ok, upto = self.ex.pull_answered(m.correlation, m.sender, m.props.get(P_MORE) == "1")
        if not ok:
            return
        self.stats["pull_answers"] += 1
        if m.payload:
            # the answerer's presence, from an answer to this connection's pull: it is online now,
            # whether or not its retained presence reaches us
            self._on_presence(m, m.sender)
        if upto is not None:
            self._gave_up(m.sender, upto)
            self.offer(m.sender, KIND_BATCH)

    def pull_all(self) -> None:
        """Pull every peer (docs/mqtt.md "A waking device"): after this connection's intake, so that
        a peer under `run` sends again what this node missed while it had no session, or what the
        broker lost."""
        self._pulled_on = self.link.generation
        self.ex.pulls.clear()   # an earlier connection's pulls: their answers no longer matter
        for peer in self.sync.peers():
            self.ex.pull_sent(self.link.pull(peer, PULL_EXPIRY_S), peer)
        self.stats["pulls_sent"] += 1

    def _pull_due(self) -> bool:
        """`run`: pull once per connection, once what the broker held for us (everything before
        our presence came back) has been handled and answered."""
        link = self.link
        return (link.generation != self._pulled_on and link.connected.is_set() and link.presence_echo.is_set()
                and not self.intake.waiting() and link.inbound.empty() and not self._owed)

    def _repull(self) -> None:
        """A `sync --once` wake pulls again from a peer that said it holds more, once the bodies it
        sent before its answer are answered (their answers then precede the pull)."""
        for peer in sorted(self.ex.repull):
            if not self.intake.members.get(peer) and peer not in self._owed:
                self.ex.pull_sent(self.link.pull(peer, PULL_EXPIRY_S), peer)

    def _on_request(self, m: Inbound) -> None:
        if m.props.get(P_KIND) == KIND_PULL:
            return self._on_pull(m)   # no body: nothing to apply
        self.stats["bodies_received"] += 1
        if m.dup:
            self.stats["redelivered"] += 1
        size = max(len(m.payload), m.oversize)  # the link keeps no payload over the limit (oversize)
        refusal = request_refusal(size, self.settings.body_limit_bytes, m.props.get(P_KIND, KIND_BATCH), m.sender,
                                  self.cfg.realtime and self.ex.presence.realtime(m.sender))
        if refusal is not None:
            return self._reject(m, *refusal)
        try:
            # Every byte from outside goes through its boundary parser, which refuses with a
            # ProtocolError and nothing else (agent/core/classify.py): the meta, then the body.
            meta = parse_meta_text(m.props[P_META]) if P_META in m.props else None
            # A realtime body here is a window body sent early (same selection and meta, answered):
            # the stream rules are those of a batch body.
            parsed = self._name_next(m)
            body, outs, processed = self.sync.receive(m.payload, meta=meta, sender=m.sender, parsed=parsed)
        except ProtocolError as e:
            return self._reject(m, e.reason, e.detail)
        # Committed: now answer, then ack (a crash before the ack means redelivery and duplicates).
        c = counts(outs)
        for k, v in c.items():
            self.stats[k] += v
        reasons = Counter(o.reason for o in outs if o.status not in ("applied", "duplicate"))
        for r, v in reasons.items():
            self.stats[f"event:{r}"] += v
        rejected = [i for i, o in enumerate(outs) if o.status == "rejected"]
        user = answer_properties(m.props, c, processed, len(outs), rejected)
        extra: tuple = ()
        if signed_ack_owed(asks_signed_ack(m.props), m.sender, m.sender in self.node.keyring, self.node.site_id):
            answered = AckAnswer(body_hash(m.payload), processed, len(outs), tuple(rejected))
            kept = self.acks.kept(m.sender, answered)
            if kept is None:
                # Signing persists through the bridge, so the answers of this pump are grouped, one
                # record per sender (`_answer_owed`).
                self.acks.owe(m.sender, m, user, answered)
                return
            # The same bytes from the same sender, processed to the same outcome: the record
            # already released states exactly that (docs/protocol.md §5); no new signature.
            self.stats["acks_reserved"] += 1
            extra = (kept,)
        self._answer(m, self.sync.answer_body(m.sender, extra), user, courtesy=m.sender not in self.node.keyring)

    def _name_next(self, m: Inbound):
        """This body's parse if it was parsed early, and name the next body waiting from the same
        sender to the node (`Node.prepare_next`): the apply workers prepare its first chunks while
        this one ends (last chunk, row writes, commit, answer) instead of idling, and its apply
        does not start by waiting for them (docs/apply.md "A `run` receiving bodies"). Only when
        no other member's bodies wait: with several senders the next body handled may be
        another's, and what was prepared for a body that does not come next is dropped."""
        early, self._next_body = self._next_body, None
        parsed = early[1] if early is not None and early[0] is m.payload else None
        waiting = self.intake.members.get(m.sender)
        if waiting and len(self.intake.members) == 1:
            n = waiting[0]
            if n.kind == "req" and not n.oversize and len(n.payload) <= self.settings.body_limit_bytes:
                try:
                    nb = parse_body(n.payload)   # pure; refused again, with its reason, when handled
                except ProtocolError:
                    return parsed
                self._next_body = (n.payload, nb)
                self.node.prepare_next(nb.events)
        return parsed

    def _answer_owed(self, force: bool = False) -> None:
        """Answer the bodies taken whose senders asked for a signed acknowledgement, one record per
        sender and MAX_ACK_ANSWERS bodies (`SignedAnswers.answer`), then ack them to the broker."""
        self.acks.answer(self.link, self.sync, force)

    def _on_answer(self, m: Inbound) -> None:
        """An answer: acked to the broker, then what it proves is the exchange's to decide
        (`Exchange.answer`); here only the store moves (the cursor, the body's records, the
        durable record of the body) and the window is offered again."""
        self.link.ack(m)
        corr = m.correlation
        p, earlier = self.ex.lookup(corr)
        if p is None and corr:
            # the durable record of the bodies sent (sync_state.sent_bodies): an earlier wake's body
            p, earlier = self.ex.lookup(corr, self.sync.recall(corr))
        rejected = None
        if p is not None and P_REJECTED_AT in m.props:
            rejected = decode_indices(m.props[P_REJECTED_AT], p.total)
        d = self.ex.answer(corr, m.sender, p, earlier, status=m.props.get(P_STATUS), reason=m.props.get(P_REASON),
                           processed_text=m.props.get(P_PROCESSED), rejected=rejected,
                           proof=lambda body: self._proof(body, m.payload), now=self.clock.mono(),
                           link_max=self.link.max_payload())
        if d.forget:
            self.sync.forget(corr)
        if not d.advances:
            return
        p = d.body
        # through the body's token: live range and backfill rows commit together, and an answer to a
        # body selected before the peer asked for its history again moves nothing (SyncDriver.confirm)
        self.sync.advance(p.peer, p.start, p.seqs, p.end, d.processed, token=p.token, rejected=d.rejected)
        self.sync.note_answer(p.peer, m.payload, p.token)  # the body's records are delivered now
        if d.then == "offer":
            self.offer(p.peer, KIND_BATCH)

    def _proof(self, p: InFlight, payload: bytes):
        """The peer's signed acknowledgement of body `p` in an answer (`binding.answer_proof`)."""
        keyring = self.node.keyring
        return answer_proof(p, payload, self.node.mesh_id, self.node.site_id, keyring.get, self.stats)

    def _on_presence(self, m: Inbound, site: bytes | None = None) -> None:
        """A retained presence reaches every node at every start, and a pull's answer carries the
        answerer's: a payload its boundary refuses is surfaced (once per site and payload in this
        process) and the site counts as absent. The link acknowledged it on arrival (presence is
        never redelivered by a nack)."""
        site = m.site if site is None else site
        e = self.ex.presence.received(site, m.payload, self.node.keyring.__contains__)
        if e is not None:
            self.surfacing.refusal("presence", e.reason, e.detail, site)

    # -------------------------------------------------------------- sending
    # Quiet links (docs/mqtt.md "Quiet links"). A body sent to a peer stays in
    # flight (it waits in the peer's broker session, or at the peer) until the peer answers it or
    # there is evidence that it never will: the peer was reachable after the body was sent (its
    # presence is live, or a message from it arrived) and `answer_timeout_s` passed without the
    # answer (doubling with each such give-up, up to 64 times, until an answer comes), or, on a
    # `sync --once` wake, a message from the peer was among what waited for this node while the
    # answer was not. Only then is the range offered again. A peer that is away is sent one window
    # and nothing more however many cadences or wakes pass, so what waits for it in the broker is
    # at most one window of distinct bodies. Which bodies are in flight is durable (sent_bodies and
    # peer_links.gave_up_id), so the next wake or a restart does not send the window again.
    GIVE_UP_DOUBLINGS = GIVE_UP_DOUBLINGS

    def _load_in_flight(self) -> None:
        """Bodies an earlier process sent and nobody answered yet: in flight for this process too."""
        self.rows.load_in_flight(self.ex, self.node.keyring, self.sync.cursor, self.settings.session_expiry_s)

    def _give_up(self, peer: bytes) -> None:
        """The bodies in flight to `peer` will not be answered: offer their ranges again (the next
        cycle), and count none of them as in flight any more (durably)."""
        self.ex.give_up(peer)
        self._gave_up(peer)

    def _gave_up(self, peer: bytes, upto_id: int | None = None) -> None:
        self.rows.gave_up(peer, upto_id)

    def _expire(self, now: float) -> None:
        for peer in self.ex.expire(now, self.link.max_payload()):
            self._gave_up(peer)

    def _note_link(self, m: Inbound) -> None:
        """What a message tells the send schedule (before it is handled): `Exchange.note_message`."""
        who = m.site if m.kind == "presence" else m.sender
        member = who is not None and who in self.node.keyring and who != self.node.site_id
        self.ex.note_message(m.kind, who, self.clock.mono(), member=member, empty=not m.payload, dup=m.dup,
                             advertised=parse_body_limit(m.props.get(P_BODY_LIMIT)) if member else None,
                             told_too_large=m.props.get(P_REASON) == "too_large" and P_BODY_LIMIT in m.props)
        if member and m.kind != "presence":
            self.ex.note_conn(who, m.props.get(P_CONN), m.seq)

    def _note_answered(self, m: Inbound) -> None:
        """After an answer to a body in flight was handled (`Exchange.answered`); when it shows the
        bodies an earlier process sent lost, they are given up on durably and the window goes again."""
        peer, corr = m.sender, m.correlation
        if peer is None or corr is None:
            return
        still = corr in self.ex.earlier.get(peer, ()) and self.sync.recall(corr) is not None
        upto = self.ex.answered(peer, corr, still_recorded=still, refused=self._refused(m))
        if upto is not None:
            self._gave_up(peer, upto)
            self.offer(peer, KIND_BATCH)

    @staticmethod
    def _refused(m: Inbound) -> bool:
        return m.props.get(P_STATUS) not in (None, "ok")

    # The peer's body limit (docs/mqtt.md "Size limits"): `exchange.BodyLimits` decides; the store
    # keeps what it learned (peer_links), so restarts and sleepers' next wakes start from it.
    def _load_limits(self) -> None:
        self.rows.load_limits(self.ex.limits, self.node.keyring)

    def _save_links(self) -> None:
        """At most once a minute (a flood of forged advertisements must not cost a transaction
        each), and when the runner closes."""
        self._next_links_save = self.clock.mono() + 60.0
        self.rows.save_limits(self.ex.limits)

    def offer(self, peer: bytes, kind: str = KIND_BATCH, bodies: int | None = None, force: bool = False) -> int:
        """Send up to `bodies` bodies to `peer` from where the in-flight window ends (or the
        durable cursor), as the sync layer selects them. Returns events sent. A range with
        nothing for the peer goes out as an empty body: the cursor moves only on an answer.
        `force` sends one body even when nothing is new (the fixed-cadence flush)."""
        plan = self.ex.plan_offer(peer, kind, self.sync.cursor(peer), self._limit(peer), bodies, force,
                                  lambda: self.sync.records_pending(peer))
        sent = 0
        for _ in range(plan.bodies):
            bf = self.ex.may_carry_backfill(peer, kind)
            off = self.sync.select(peer, plan.start, self.max_events, backfill=bf, record_budget=plan.record_budget)
            if not plan.worth_sending(off.end, off.backfill):
                break
            if off.events:
                # The records this body carries and the watermarks; the meta rides along (`body_fit`).
                n = body_fit(off.events, plan.start, off.seqs, off.n_backfill, off.gaps,
                             len(self.sync.body((), peer, off.token)), plan.limit, self.max_events)
                if n is not None:  # the first part that fits; the rest goes in the next body
                    off = self.sync.select(peer, plan.start, n, backfill=bf, record_budget=plan.record_budget)
            self._send(peer, kind, off)
            sent += len(off.events)
            plan.sent(off.end)
        if self._unsaved:
            # Durable (one transaction for the window): an answer that arrives after this process
            # has gone still moves the cursor on the next wake. A crash before this commit loses
            # only that: the range is re-offered.
            self.sync.remember(self._unsaved)
            self._unsaved = []
        return sent

    def _send(self, peer: bytes, kind: str, off: Offer) -> None:
        body = self.sync.body(off.events, peer, off.token)
        user = request_properties(kind, off.start, off.end, off.seqs, off.gaps, off.n_backfill, len(off.events),
                                  self.cfg.secure)
        off.body_hash = body_hash(body)
        corr = self.link.push(peer, body, user)
        off.token = self.sync.keyed(off.token, corr)  # its answer confirms it, in this process or a later one
        self.ex.sent(corr, InFlight(peer, kind, off.start, off.end, off.seqs, self.clock.mono(),
                                    off.n_backfill, off.backfill, off.token, len(body), off.body_hash,
                                    heard=self.link.received))
        self.stats["backfill_events_pushed"] += off.n_backfill
        self.stats["bodies_pushed"] += 1
        self.stats["events_pushed"] += len(off.events)
        self.stats[f"pushed_{kind}"] += 1
        self._unsaved.append((corr, peer, kind, off))  # made durable by `offer`, once per window

    def batch_cycle(self) -> int:
        self.stats["batch_cycles"] += 1
        n = 0
        for peer in self.sync.peers():
            room = self.ex.batch_room(peer)  # a full window waits for answers or evidence of a loss
            if room:
                n += self.offer(peer, KIND_BATCH, bodies=room)
        return n

    def _local_max(self) -> int:
        """The seq of the node's newest own write, found without reading the log:
        `max(seq)` is one look-up of the rowid tree, and only rows appended since the last call
        are examined for `origin='local'`. The scan of the whole log this replaced ran 20 times a
        second and made idle CPU grow with the store (bench/bench_idle.py)."""
        top = eventlog.top(self.node.conn)
        if top > self._scanned:
            r = eventlog.newest_local(self.node.conn, self._scanned)
            if r:
                self._local_top = r
            self._scanned = top
        return self._local_top

    def _realtime(self, now: float) -> None:
        """A realtime body (one, to each present realtime peer with room in its window) when the
        schedule says one is due (`Schedule.realtime_due`)."""
        due = self.schedule.realtime_due(now, 0 if self.cfg.flush_cadence_s else self._local_max())
        if due is None:
            return
        for p in self.ex.push_targets(self.node.keyring.__contains__):
            self.offer(p, KIND_REALTIME, bodies=1, force=due == "flush")
            if due == "push":
                self.stats["realtime_pushes"] += 1

    def notify_produced(self) -> None:
        """In-process writers may call this; polling the log finds other processes' writes too."""
        self.schedule.produced(self.clock.mono())

    # -------------------------------------------------------------- one-shot
    def sync_once(self, settle_s: float = 0.5, timeout_s: float = 20.0) -> dict:
        """One full cycle: take in everything waiting for this node, offer every peer what its
        cursor selects (until it is answered, for peers that are present), then return.

        No fixed sleeps: it waits on the events that matter. `start` returned at
        the SUBACK; everything the broker held for us then (the persistent session's queued bodies,
        retained presence) is delivered before our own presence, published right after SUBSCRIBE,
        comes back to us (the broker delivers to one client in order), so that echo ends the
        intake. A broker that never echoes it (an ACL that drops our presence) falls back to
        `settle_s` of quiet. Then the answers of present peers end the offering; what arrives
        after that waits in the broker for the next wake (the session is persistent)."""
        wake = OnceWake(self.clock.mono(), settle_s, timeout_s)   # the order is the core's
        took = 0
        while True:
            now = self.clock.mono()
            step = wake.next(now, echoed=self.link.presence_echo.is_set(), took=took,
                             waiting=bool(self.ex.waiting_on()) or self.ex.pulls_waiting())
            took = 0
            if step == OnceWake.DONE:
                break
            if step == OnceWake.OFFER:
                for peer in self.ex.lost_while_away():  # (quiet links) made durable here
                    self._gave_up(peer)
                self.batch_cycle()
                self.pull_all()
                continue
            took = self.pump(wake.wait)
            if step == OnceWake.AWAIT:
                self._expire(self.clock.mono())
                self._repull()
        return self.summary()

    def summary(self) -> dict[str, Any]:
        """Counters, and per peer: `behind` = events this node holds that the peer's reported
        applied watermarks do not cover (secure binding only, else null); `unanswered` = events
        after the durable cursor on this path (offered or not yet offered, never answered for)."""
        s = self.stats
        peers = {}
        for p in self.sync.peers():
            peers[p.hex()] = {"present": p in self.ex.presence, "cursor": self.sync.cursor(p),
                              "behind": st.peer_lag(self.node.conn, p) if self.cfg.secure else None,
                              "unanswered": self.sync.backlog(p),
                              "realtime": self.ex.presence.realtime(p)}
        return {"pushed": s["events_acknowledged"], "offered": s["events_pushed"], "applied": s["applied"],
                "duplicate": s["duplicate"], "dropped": s["dropped"], "rejected": s["rejected"],
                "bodies_pushed": s["bodies_pushed"], "bodies_received": s["bodies_received"],
                "answers": s["answers"], "unanswered": len(self.ex.pending),
                "refused_bodies": s["rejected_bodies"], "secure_binding": self.cfg.secure,
                "evictions": s["evictions"], "peers": peers,
                "config": {"cadence_s": self.cfg.cadence_s, "max_events": self.max_events,
                           "body_limit_bytes": self.settings.body_limit_bytes,
                           "session_expiry_s": self.settings.session_expiry_s,
                           "eviction_interval_s": self.cfg.eviction_interval_s}}


def _adopt_private_cursors(node) -> None:
    """Homes from before the runner used the sync layer kept their MQTT cursors in `meta`: moved
    into sync_state's per-(peer, path) cursors once (`sync_state.adopt_meta_cursors`)."""
    st.adopt_meta_cursors(node.conn, PATH)
