"""The member's client of the Commit sequencer (SOVM §22.5, §22.7; docs/sequencer.md "Member
side: the Commit queue"): it submits the queue's Commits (commit_queue.py) through an MQTT 5 broker
and records what the answers mean (answers.py). It follows each group's retained head, signed
discontinuities and `lost` record, offers the evidence the sequencer lost, and looks at held and
attributed receipts again when a group's binding records change."""
from __future__ import annotations

import hashlib
import json
import secrets
import threading
import time
from typing import Callable, Optional

from agent import inbox
from agent.sequencer import receipts
from agent.sequencer.answers import (ATTRIBUTED, HELD, BindingState, SignerFor, check_receipt, fixed_signer,
                                     fixed_state, receipt_outcome, submit_outcome)
from agent.sequencer.commit_queue import QUEUED, CommitQueue
from agent.sequencer.core import EPOCH_LIMIT, STALE_EPOCH
from agent.sequencer.framing import MAX_MESSAGE_BYTES
from agent.sequencer.member import UNSIGNED_CLAIM
from agent.sequencer.recovery import MAX_OFFERED

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
