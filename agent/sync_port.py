"""The sync layer behind the MQTT runner (agent/runner.py): `PortAdapter` gives the runner this
node's durable per-path cursors, policy, self-echo and peer-origin filters, control records and
the durable record of the bodies it sent (`sync_state.sent_bodies`), through the one sync
driver (agent/sync.py `SyncDriver`) the session links use too. Time is the runner's (`now`)."""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from . import produce
from .clockstate import now_ms
from .core.incoming import sync_body
from .core.messages import SyncBody, Watermark, emit_body, parse_body
from .core.session import StreamMeta
from .store import db, reports, sync_state as st
from .sync import DEFAULT_BATCH_LIMIT, LinkProvider, SyncDriver
from .sync_tokens import Offer, Token, token_from_json, token_to_json

_txn = db.transaction


class PortAdapter(LinkProvider):
    """The link's one provider (`LinkProvider`, what a Session talks to), with what only the MQTT
    runner asks of it (peers, select, advance, receive, body, answer_body, note_answer, handshake,
    have_max, backlog, the durable record of sent bodies), so the runner gets this layer's durable
    per-path cursors, policy, self-echo and peer-origin filters and control records; the runner's
    default port is `PortAdapter(node, path="mqtt", secure=...)`.

    A binding that does not authenticate the peer (`secure=False`, plain MQTT) gets no watermark
    inference and its reports are ignored. That is fail-closed and costs only re-offers."""

    def __init__(self, node, path: str = "mqtt", secure: bool = False, batch_limit: int = DEFAULT_BATCH_LIMIT,
                 now: Callable[[], int] = now_ms) -> None:
        super().__init__(SyncDriver(node, batch_limit), path, secure)
        self.node = node
        self.now = now  # wall-clock ms, the runner's clock: what is stored and what the apply path checks
        self.conn = node.conn

    def peers(self) -> list[bytes]:
        """The sites this node syncs with: its keyring but itself and the authorities' record keys
        (`reports.record_keys`: they sign records and never sync, docs/operations.md §0)."""
        keys = reports.record_keys(self.conn)
        return sorted(s for s in self.node.keyring if s != self.node.site_id and s not in keys)

    def have_max(self) -> tuple[int, int]:
        return self.driver.have_max_hlc()

    def handshake(self, supports_realtime: bool) -> bytes:
        from .core.messages import Handshake, emit_handshake
        return emit_handshake(Handshake(self.node.site_id, self.have_max(), supports_realtime, self.secure, None))

    def select(self, peer: bytes, start: int, limit: int, backfill: bool = False, record_budget: int | None = None):
        """At most `limit` events for `peer` after `start`, through the driver's one selection
        (`SyncDriver.select_for`): the live tail first, then, with `backfill`, whole rows of the
        peer's backfill jobs in what is left (policy re-checked now). The runner asks for backfill
        only when no backfill body is in flight to that peer: the next rows are selected from the
        durable `resume_after_row_key`, which moves only on an answer. The offer's token also
        names the control records the body will carry (`body(events, peer, token)`): those not yet
        delivered to the peer on this path, at most `record_budget` bytes (default a quarter of the
        profile's body limit)."""
        sel, bf, start, ro = self.driver.select_for(peer, self.path, "batch", start=start, limit=limit,
                                                    backfill=backfill)
        extra = [raw for _seq, raw in ro[0]] + (list(bf.events) if bf else [])
        recs = self.driver.select_records(peer, self.path, record_budget)
        return Offer(start, sel.end, list(sel.seqs), list(sel.events) + extra, sorted(sel.gaps),
                     len(extra), bf is not None, self.driver.token(peer, self.path, sel, bf, start, recs, ro))

    def backlog(self, peer: bytes) -> int:
        return self.driver.backlog(peer, self.path)

    def advance(self, peer: bytes, start: int, seqs: list[int], end: int, processed: int, token=None,
                rejected: list[int] | None = None) -> bool:
        """The peer answered a body: `processed` events (live first, then backfill) reached a final
        state. The live cursor moves only contiguously; backfill rows commit, whole rows only, with
        the body's `token` (`Offer.token`, see `SyncDriver.confirm`)."""
        if token is None:
            token = Token(self.path, start, tuple(seqs), end, (), st.rehydrate_generation(self.conn, peer))
        return self.driver.confirm(peer, token, processed, contiguous=True, rejected=rejected)

    @staticmethod
    def keyed(token, corr: bytes):
        """The token of a body published under correlation data `corr` (its `sent_bodies` key)."""
        return replace(token, sent_key=corr) if isinstance(token, Token) else token

    def remember(self, sent: list[tuple[bytes, bytes, str, Any]]) -> None:
        """Bodies just published, as (correlation data, peer, kind, Offer): kept durably, so an
        answer that waits in the broker while this process is gone (a wake-sync-sleep device, a
        restart) still moves the cursor when a later process takes it (§14.1)."""
        t = self.now()
        with _txn(self.conn):
            for corr, peer, kind, off in sent:
                if isinstance(off.token, Token):
                    h = getattr(off, "body_hash", None)  # what a signed acknowledgement names (§5)
                    st.put_sent_body(self.conn, self.path, corr, peer, kind,
                                     token_to_json(off.token, x=off.n_backfill, bf=off.backfill,
                                                   **({"h": h.hex()} if h else {})), t)

    def forget(self, corr: bytes) -> None:
        """A body the peer refused (`ssp-status: rejected`): nothing to confirm later."""
        with _txn(self.conn):
            st.forget_sent_body(self.conn, self.path, corr)

    def recall(self, corr: bytes) -> dict | None:
        """A body an earlier process (or this one) sent under `corr` and nobody answered yet:
        peer, kind, start, end, seqs, n_backfill, backfill, token. None if unknown."""
        r = st.sent_body(self.conn, self.path, corr)
        if r is None:
            return None
        peer, kind, text = r
        tok, extra = token_from_json(text)
        return {"peer": peer, "kind": kind, "start": tok.start, "end": tok.end, "seqs": list(tok.seqs),
                "n_backfill": int(extra.get("x", 0)), "backfill": bool(extra.get("bf", False)), "token": tok,
                "body_hash": bytes.fromhex(extra["h"]) if extra.get("h") else None}

    def receive(self, data: bytes, meta: dict | None = None, sender: bytes | None = None,
                parsed: SyncBody | None = None):
        """`meta`: the frame meta as sent ({s, e, d, g, x}); `sender`: who the binding says sent it
        (a body naming someone else is refused); `parsed`: `parse_body(data)` if the caller has it
        already (the Runner parses the next waiting body early, `Node.prepare_next`). Raises
        ProtocolError: nothing changed."""
        body = sync_body(data, sender, parsed=parsed)
        sm = StreamMeta.from_wire(meta, len(body.events)) if meta is not None else None
        k, outs = self.driver.receive(body.from_site_id, body, sm, "batch", self.now(), self.path, self.secure)
        return body, outs, k

    def answer_body(self, peer: bytes | None = None, extra_records: tuple = ()) -> bytes:
        """An answer's body: this node's watermarks and the next undelivered records for `peer`,
        after `extra_records` (a signed acknowledgement, docs/protocol.md §5)."""
        return self.body((), peer, extra_records=extra_records)

    def sign_ack(self, subject: bytes, answers) -> bytes:
        """This node's acknowledgement of `subject`'s bodies (`core.records.AckAnswer`s), signed with
        its event key through the keystore bridge under a fresh HLC identity (persist-before-release,
        `produce.issue_record`). Not stored: a lost one costs a re-offer, and the journal drops it at
        the next compaction (produce.record_held)."""
        from .core.records import ack_to_be_signed
        node = self.node
        return produce.issue_record(node, ack_to_be_signed(node.site_id, node.mesh_id, subject, list(answers)), self.now())

    def body(self, events=(), peer: bytes | None = None, token=None, extra_records: tuple = ()) -> bytes:
        """A sync body for `peer` carrying `events`, control records and this node's applied
        watermarks. Records: with `token` (`Offer.token`), the ones selected with the offer (they
        count as delivered when the peer answers, `advance`/`note_answer` with that token); without
        one (an answer body), the next ones not yet delivered to the peer, within the budget, not
        tracked (an answer is not answered)."""
        if isinstance(token, Token):
            raws = token.record_raws
        else:
            raws = self.driver.select_records(peer, self.path)[1] if peer is not None else ()
        return emit_body(SyncBody(self.node.site_id, self.have_max(), tuple(events), tuple(extra_records) + tuple(raws),
                                  tuple(Watermark(s, q, h) for (s, q), h in sorted(st.own_watermarks(self.conn).items()))))

    def note_answer(self, peer: bytes, data: bytes, token=None) -> None:
        """`peer` answered a body: take the answer's records and (secure binding) reports. With the
        body's `token`, the records that body carried count as delivered to the peer (unless it
        asked for its history again since the body was selected)."""
        if isinstance(token, Token) and token.records:
            with _txn(self.conn):
                if st.rehydrate_generation(self.conn, peer) == token.rehydrate_gen:
                    st.mark_records_delivered(self.conn, peer, self.path, token.records)
        try:
            b = parse_body(data)
        except Exception:  # noqa: BLE001 - a malformed answer is the runner's to surface
            return
        if b.records:  # records verify on their own (authority signatures): taken from any answer
            self.driver.apply_records(b.records, self.now())
            self.driver.note_records_received(peer, self.path, b.records)
        if not self.secure:
            return
        with _txn(self.conn):
            st.set_peer_watermarks(self.conn, peer, [(w.site_id, w.table, w.hlc) for w in b.applied_watermarks])
