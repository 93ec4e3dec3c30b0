"""The node-side sync driver: wires sans-I/O sessions (agent/core/session.py) to a Node.

It builds bodies from the durable per-(peer, path) cursor (filtered by policy, self-echo and the
peer's reported watermarks), applies received bodies through the node's one apply path
(`Node.apply_batch`), advances cursors only on the peer's answer, and advances the node's own
applied watermarks only from what a live, authenticated, stream-continuous body demonstrates
(docs/protocol.md says why that is sound).

A transport makes one `SyncDriver` per open Node and one session per link
(`drv.session(path=..., peer=..., secure=...)`), then feeds it: `start(now)`, `receive(bytes,
now)` for every frame, `data_to_send()` to transmit, `handle_timer(now)` when `timer()` passes,
and `local_events(now)` after a local write (a realtime push, coalesced). The MQTT runner's port
is agent/sync_port.py, mailbox files agent/mailbox_sync.py, sent-body tokens agent/sync_tokens.py."""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from . import mailbox_sync, policy, produce, rehydrate
from .clockstate import now_ms
from .core import delivery
from .core.binding import body_fit
from .core.messages import SyncBody, Watermark, emit_body, parse_body_streamed
from .core.records import resolve_chains  # noqa: F401 (resolve_chains: re-exported)
from .core.session import Outgoing, Session, StreamMeta
from .mailbox_sync import MAILBOX_DETAIL_MAX, MAILBOX_PATH, MAILBOX_WINDOW_BYTES  # noqa: F401 - re-exported
from .store import db, eventlog, sequencing as seqstore, sync_state as st
from .sync_tokens import Backfill, BfPart, Offer, Token, token_from_json, token_to_json  # noqa: F401 - re-exported

log = logging.getLogger("ssp_agent.sync")

DEFAULT_BATCH_LIMIT = 500
SCAN_FACTOR = 20  # rows examined per body at most: limit * SCAN_FACTOR (a mostly-filtered log cannot stall a cycle)
MAX_RECORDS_PER_BODY = 128  # control records per body at most (and at most a quarter of the body limit)
RECORD_OVERHEAD = 5  # CBOR bstr header, array growth: bytes a record costs in a body beyond its own


class SyncDriver:
    def __init__(self, node, batch_limit: int = DEFAULT_BATCH_LIMIT) -> None:
        self.node = node
        self.conn = node.conn
        self.batch_limit = batch_limit
        st.ensure_schema(self.conn)
        self._denials_surfaced: set[tuple[bytes, str, str]] = set()
        # per (peer, path): the rehydrate generation of the last body built, and where bodies
        # restart after a reset that landed with a window in flight (`_restart`)
        self._redo: dict[tuple[bytes, str], tuple[int | None, int | None]] = {}
        self._fit: dict[tuple[bytes, str], int] = {}  # per (peer, path): events the last bodies fitted (`build`)
        self.stats = {"pushed_events": 0, "received_events": 0, "bodies_out": 0, "bodies_in": 0}

    # ------------------------------------------------------------------ sessions
    def session(self, path: str = "memory", peer: bytes | None = None, *, secure: bool = False,
                binding_unsolicited: bool = False, realtime_capable: bool = False, **kw: Any) -> Session:
        """A session for one link. `secure`: the binding authenticated the peer (e.g. TLS client
        certificates bound to the site_id); only then are its reports and stream trusted for
        watermarks. `path` names the transport path (one cursor per peer per path)."""
        kw.setdefault("body_limit", int(getattr(self.node.profile, "body_limit_bytes", 256 * 1024)))
        return Session(LinkProvider(self, path, secure), peer=peer, secure=secure,
                       binding_unsolicited=binding_unsolicited, realtime_capable=realtime_capable, **kw)

    # ------------------------------------------------------------------ selection
    def have_max_hlc(self) -> tuple[int, int]:
        return self.node.clock.current()  # an upper bound of every HLC held; advisory only (§31)

    def _allowed_fn(self, peer: bytes, rows=None, roles=None):
        """`rows`, `roles`: policy rows and current roles already read (one read for many peers).
        Each denial that must be logged is surfaced once per driver (agent/policy.py)."""
        return policy.allowed_fn(self.conn, self.node.tables, peer, rows, roles, self._denials_surfaced)

    def _rows(self, after: int, skip_tables: tuple[str, ...] = ()) -> "LogScan":
        """Log rows with seq > after, in append order, bounded by the scan budget; the rows of
        `skip_tables` (quiet policy denials) this node did not sign are passed over in SQL."""
        budget = self.batch_limit * SCAN_FACTOR
        return LogScan(self.conn, after, budget, max(64, min(self.batch_limit * 2, budget)), self.node.site_id,
                       skip_tables)

    def _open_selected(self, seqs: list[int]) -> list[bytes]:
        """The signed bytes of the selected log rows, in `seqs` order: only what is offered is
        read and unsealed (a gateway's policy may filter nearly everything it examines)."""
        raws = eventlog.open_seqs(self.conn, seqs)
        return [raws[seq] for seq in seqs]

    def select_for(self, peer: bytes, path: str, mode: str = "batch", *, start: int | None = None,
                   limit: int | None = None, backfill: bool = True, now: int | None = None
                   ) -> tuple[delivery.Selection, Backfill | None, int, tuple[list, tuple]]:
        """The one selection both callers use (sessions/mailbox through `build`, the MQTT runner
        through `PortAdapter.select`): the live tail from `start` (default: the durable cursor, or
        the push position), at most `limit` events (default: the batch limit), then, if `backfill`
        and there is room, the next rows of the peer's backfill jobs (never in a push)."""
        if start is None:
            start = st.cursor(self.conn, peer, path)[0]
        limit = self.batch_limit if limit is None else limit
        if limit <= 0:  # an answer while the window is full: watermarks and records only
            return delivery.Selection(end=start), None, start, ([], ())
        prows, roles = st.policy_rows(self.conn), st.current_roles(self.conn)
        allowed = self._allowed_fn(peer, prows, roles)
        pwm = st.peer_watermarks(self.conn, peer)
        counts = self.node.counts
        ro, scans = self._due_reoffers(peer, path, allowed, limit, now) if mode != "push" else ([], ())
        scan = self._rows(start, policy.quiet_denials(self.node.tables, peer, prows, roles))
        sel = delivery.select(self._rows_for(peer, start, scan), start, peer, self.node.site_id, allowed, pwm,
                              limit - len(ro), lambda r: counts((r.hlc[0], r.hlc[1], r.site_id)))
        if scan.done:  # every row up to the scan's end was examined, those passed over in SQL too
            sel.end = max(sel.end, scan.end)
        sel.events = self._open_selected(sel.seqs)
        # Our own history we no longer hold (evicted, lost to a restore) travels with the stream as
        # floors, so no receiver infers a watermark across it (§14.2; docs/protocol.md §4).
        sel.gaps |= {delivery.floor_entry(q, h) for q, h in self.node.own_history_floors().items()}
        bf = None
        room = limit - len(sel.events) - len(ro)
        if backfill and mode != "push" and room > 0:
            # Widening backfill (scope §2): live tail first, then the jobs' rows, policy re-checked now.
            bf = self.select_backfill(peer, allowed, pwm, room)
        return sel, bf, start, (ro, scans)

    def _due_reoffers(self, peer: bytes, path: str, allowed, limit: int, now: int | None
                      ) -> tuple[list[tuple[int, bytes]], tuple[tuple[bytes, int], ...]]:
        """(seq, raw) of events `peer` rejected on `path` that are due again, at most a quarter of
        the body: they never crowd out the live tail, and the live tail never
        starves them; and the rescans they include (`st.reoffer_due`). Policy and self-echo are
        re-checked now, like any selection."""
        if not st.has_schema(self.conn) or not st.reoffer_count(self.conn, peer, path):
            return [], ()
        with _txn(self.conn):
            due, scans = st.reoffer_due(self.conn, peer, path, now_ms() if now is None else now,
                                        max(1, limit // 4), st.cursor(self.conn, peer, path)[0])
            stale = {seq for seq, site, q, _raw in due if site == peer or not allowed(q)}
            if stale:
                st.reoffer_done(self.conn, peer, path, stale)
        return [(seq, raw) for seq, site, q, raw in due if seq not in stale], tuple(scans)

    def token(self, peer: bytes, path: str, sel: delivery.Selection, bf: Backfill | None, start: int,
              records: tuple[tuple[bytes, ...], tuple[bytes, ...]] = ((), ()), ro=((), ())) -> Token:
        """What `confirm` needs once the peer answers a body built from this selection.
        `records`: (hashes, raws) from `select_records`, the records the body carries; `ro`: the
        re-offers ((seq, raw), rescans) it carries after the live events."""
        return Token(path, start, tuple(sel.seqs), sel.end, tuple(bf.parts) if bf else (),
                      st.rehydrate_generation(self.conn, peer), tuple(records[0]), tuple(records[1]),
                      reoffer_seqs=tuple(seq for seq, _raw in ro[0]), rescans=tuple(ro[1]))

    def _rows_for(self, peer: bytes, start: int, scan: "LogScan"):
        """Log rows for `peer` (`scan`); while this node serves a rehydration of `peer`, rows up to
        the reset point lose their delivered-by-peer tag, so what the peer itself once relayed here
        (and may have evicted since) is offered back to it (agent/rehydrate.py)."""
        upto = st.rehydrate_upto(self.conn, peer) if st.has_schema(self.conn) else 0
        if not upto or start >= upto:
            return scan
        tag = delivery.origin_tag(peer)
        return (delivery.LogRow(r.seq, r.site_id, r.table, r.hlc, r.raw, "") if r.origin == tag and r.seq <= upto else r
                for r in scan)

    # ------------------------------------------------------------------ widening backfill (scope §2)
    def covering_rows(self, table: str, after: bytes | None, limit: int) -> list[tuple[bytes, list]]:
        """Up to `limit` rows of `table` with row_key > `after`, in row_key order, each with its
        covering set: the retained events that own the row's column clocks, existence clock and
        tombstone clock (§13.1: selected on the clock, not the value), as log rows in HLC order.
        A clock whose event was evicted (below this node's horizon) has nothing to send."""
        from .store import rows as rowstore
        out = []
        for r in rowstore.clocks_after(self.conn, self.node.tables[table].tdef, after, limit):
            stamps = {rowstore.unpack_stamp(b) for b in r[1:] if b is not None}
            evs = []
            for p, l, sid in sorted(stamps):
                e = eventlog.event_at(self.conn, sid, table, p, l)
                if e is not None:
                    evs.append(delivery.LogRow(e[0], bytes(e[1]), e[2], (e[3], e[4]), bytes(e[5]), e[6]))
            out.append((bytes(r[0]), evs))
        return out

    def select_backfill(self, peer: bytes, allowed, pwm: dict, room: int) -> Backfill | None:
        """The next rows of this peer's backfill jobs, at most the profile's rows per cycle and
        `room` events. Policy is re-checked here, at emit time: a job whose table a standing
        narrow now denies is stopped (a later widening enqueues it again)."""
        jobs = st.backfill_jobs(self.conn, peer) if st.has_schema(self.conn) else []
        if not jobs:
            return None
        rows_left = max(1, int(getattr(self.node.profile, "backfill_rows_per_cycle", 1000)))
        events: list[bytes] = []
        parts: list[BfPart] = []
        for job in jobs:
            q = job["table"]
            if rows_left <= 0 or room - len(events) <= 0:
                break
            if q not in self.node.tables or not allowed(q):
                with _txn(self.conn):
                    st.drop_backfill(self.conn, peer, q)
                log.info("backfill for %s on %s stopped: policy denies it now", peer.hex(), q)
                continue
            rows = self.covering_rows(q, job["resume_after_row_key"], rows_left)
            rks, cnts = [], []
            full = True
            for rk, evs in rows:
                chosen = [e.raw for e in evs
                          if e.site_id != peer and not ((w := pwm.get((e.site_id, q))) is not None and e.hlc <= w)]
                if rks and len(events) + len(chosen) > room:
                    full = False  # whole rows only: the rest waits for the next cycle
                    break
                events.extend(chosen)
                rks.append(rk)
                cnts.append(len(chosen))
            rows_left -= len(rks)
            done = full and len(rows) < rows_left + len(rks)
            parts.append(BfPart(q, job["resume_after_row_key"], tuple(rks), tuple(cnts), done))
            if not full:
                break
        return Backfill(events, parts) if parts else None

    def build(self, peer: bytes, path: str, mode: str, now: int | None = None,
              extra_records: tuple[bytes, ...] = (), *, start: int | None = None, max_events: int | None = None,
              max_bytes: int | None = None, record_budget: int | None = None, backfill: bool = True) -> Outgoing:
        """One body for `peer` on `path` from `start` (default: the durable cursor): at most
        `max_events` events (default: the batch limit) and, when given, `max_bytes` bytes (the
        peer's body limit now, `core.exchange.BodyLimits`): a selection that does not fit is
        selected again with fewer events (one event too large for any body still goes alone).
        `extra_records`: records the body carries beyond the held ones (the mailbox path's answer
        record, agent/mailbox.py); never tracked as delivered."""
        limit = self.batch_limit if max_events is None else max_events
        asked = start
        if start is not None and limit > 0:
            start = self._restart(peer, path, start)
        wms = tuple(Watermark(s, q, h) for (s, q), h in sorted(st.own_watermarks(self.conn).items()))
        # What does not depend on the events selected is read once, not again per re-selection.
        hmax = self.have_max_hlc()
        recs = self.select_records(peer, path, record_budget)
        records = tuple(recs[1]) + tuple(extra_records)
        empty: int | None = None
        # Under a byte limit, at first about what fitted last time (a quarter more, growing while
        # the bodies fill it): the rows read and unsealed are the body's, not the batch limit's.
        full = limit
        if max_bytes is not None and limit > 0 and (peer, path) in self._fit:
            limit = min(limit, self._fit[(peer, path)])
        sel = None
        while True:
            if sel is None:
                sel, bf, start0, ro = self.select_for(peer, path, mode, start=start, limit=limit,
                                                      backfill=backfill, now=now)
            extra = [raw for _seq, raw in ro[0]] + (list(bf.events) if bf else [])
            events = list(sel.events) + extra
            raw = emit_body(SyncBody(self.node.site_id, hmax, tuple(events), records, wms))
            if max_bytes is None or len(raw) <= max_bytes or len(events) <= 1:
                break
            # How many fit: the estimate the MQTT runner cuts its bodies by (`binding.body_fit`,
            # the body without events, then each event and its meta), selected again with that.
            if empty is None:
                empty = len(emit_body(SyncBody(self.node.site_id, hmax, (), records, wms)))
            n = body_fit(events, start0, sel.seqs, len(extra), sel.gaps, empty, max_bytes, limit)
            limit = max(1, min(len(events) - 1, n if n is not None else len(events) - 1))
            # Live events alone: the first `limit` of them are what a selection with that limit
            # takes (each body's rows are read and unsealed once, not once per try).
            sel = sel.prefix(limit) if not extra and not ro[1] and bf is None and limit < len(sel.seqs) else None
        meta = StreamMeta(start0, sel.end, tuple(sel.seqs), tuple(sorted(sel.gaps)), len(extra))
        if max_bytes is not None and full > 0 and len(events) >= limit:
            grown = len(events) + len(events) // 4 + 1
            if grown < full:
                self._fit[(peer, path)] = grown
            else:
                self._fit.pop((peer, path), None)
        if asked is not None and start != asked:
            gen, _ = self._redo[(peer, path)]
            self._redo[(peer, path)] = (gen, sel.end if sel.end < asked else None)
        tok = self.token(peer, path, sel, bf, start0, recs, ro)
        self.stats["bodies_out"] += 1
        self.stats["pushed_events"] += len(events)
        return Outgoing(raw, meta, tok, len(events), bf is not None)

    def _restart(self, peer: bytes, path: str, start: int) -> int:
        """Where a body asked to start at `start` starts. A rehydrate request that landed while a
        window was in flight resets the cursor, and answers to that window never move it
        (`confirm`): the bodies after it restart from the reset cursor, each from where the last
        one ended, until they reach `start`, rather than the whole history going again once the
        window drains."""
        gen = st.rehydrate_generation(self.conn, peer)
        last, redo = self._redo.get((peer, path), (gen, None))
        if last != gen:
            redo = st.cursor(self.conn, peer, path)[0]
        self._redo[(peer, path)] = (gen, redo)
        return start if redo is None or redo >= start else redo

    def _held_records(self, peer: bytes | None = None) -> list[tuple[bytes, bytes]]:
        """(record_hash, raw) of every record a body to `peer` could carry, in body order, hashes
        as stored: authority records (vouch, retire, role: a vouch admits the signer of what
        follows), rehydrate requests, then truncation records (up to 256 row keys each), which go
        only to their subject, the one node that acts on them, then sequencing records (bindings
        before receipt heads; agent/sequencing.py), to every peer."""
        return (st.records_ordered(self.conn) + rehydrate.latest_requests(self.conn)
                + rehydrate.truncations_for(self.conn, peer) + seqstore.records_ordered(self.conn))

    def _record_raws(self, peer: bytes | None = None) -> list[bytes]:
        return [raw for _h, raw in self._held_records(peer)]

    def record_budget(self) -> int:
        """Bytes of records a body may carry: a quarter of the profile's body limit."""
        return max(256, int(getattr(self.node.profile, "body_limit_bytes", 256 * 1024)) // 4)

    def select_records(self, peer: bytes | None, path: str, budget: int | None = None
                       ) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """(hashes, raws) of the records for one body to `peer` on `path`: those not yet delivered
        to it there (`records_delivered`), in body order, a prefix of at most `budget` bytes
        (default `record_budget()`) and MAX_RECORDS_PER_BODY records, so records never make a body
        exceed the limit; the rest follow in later bodies. A single record larger than the budget
        goes alone (otherwise it could never be sent)."""
        budget = self.record_budget() if budget is None else budget
        done = st.delivered_records(self.conn, peer, path) if peer is not None else set()
        hashes: list[bytes] = []
        raws: list[bytes] = []
        used = 0
        for h, raw in self._held_records(peer):
            if h in done:
                continue
            cost = len(raw) + RECORD_OVERHEAD
            if raws and (used + cost > budget or len(raws) >= MAX_RECORDS_PER_BODY):
                break  # a prefix: what follows never overtakes what it depends on
            hashes.append(h)
            raws.append(raw)
            used += cost
        return tuple(hashes), tuple(raws)

    def backlog(self, peer: bytes, path: str) -> int:
        """Events after the durable cursor on `path` for `peer` (offered or not, never answered for)."""
        return eventlog.count_after(self.conn, st.cursor(self.conn, peer, path)[0], peer)

    def records_pending(self, peer: bytes, path: str) -> bool:
        """Whether `peer` has records to receive on `path` (not yet delivered there)."""
        done = st.delivered_records(self.conn, peer, path)
        return any(h not in done for h, _raw in self._held_records(peer))

    def note_records_received(self, peer: bytes, path: str, raws) -> None:
        """Records that came from `peer` (a body or an answer): it holds them, never send them back."""
        hs = [delivery_hash(r) for r in raws if isinstance(r, (bytes, bytearray))]
        if hs:
            with _txn(self.conn):
                st.mark_records_delivered(self.conn, peer, path, hs)

    def confirm(self, peer: bytes, tok: Token, processed: int, contiguous: bool = False,
                rejected: list[int] | None = None, now: int | None = None) -> bool:
        """The peer answered a body: advance (§14.1). `processed`: events it processed to a final
        state before the first rejected one. `rejected` (peers that report it): the indices of
        every event it rejected; then everything else counts as processed, the live cursor moves
        past the rejected events and they join the re-offer set (one rejected
        event cannot pin the stream behind it, and it is still re-offered, §13.6), unless that
        set is full, where the cursor stops at the first one that does not fit, as before.
        Backfill progress commits here too, whole rows only, after the live events and re-offers.
        `contiguous` (several bodies in flight, the MQTT runner): the live cursor moves only if
        the body started at or before it (an earlier unanswered range is re-offered). Backfill
        rows are committed on their own (`advance_backfill` only moves from the row the body was
        selected from). Returns whether the live cursor moved."""
        now = now_ms() if now is None else now
        # What the answer proves is pure (core.delivery.answer_moves); here the store follows it.
        mv = delivery.answer_moves(tok.start, tok.seqs, tok.end, tok.reoffer_seqs,
                                   [(p.counts[:len(p.row_keys)], p.done) for p in tok.bf_parts], processed, rejected)
        moved = False
        with _txn(self.conn):
            if tok.sent_key is not None:
                st.forget_sent_body(self.conn, tok.path, tok.sent_key)
            if st.rehydrate_generation(self.conn, peer) != tok.rehydrate_gen:
                return False  # the peer asked for its history again meanwhile: its cursors restart at genesis
            if tok.records:  # it answered (or the file is written): it holds the body's records
                st.mark_records_delivered(self.conn, peer, tok.path, tok.records)
            cur = st.cursor(self.conn, peer, tok.path)[0]
            if mv.live > cur and not (contiguous and tok.start > cur):
                st.advance_cursor(self.conn, peer, tok.path, mv.live)
                moved = True
                st.reoffer_put(self.conn, peer, tok.path, list(mv.new_reoffers), now)
            st.reoffer_done(self.conn, peer, tok.path, list(mv.reoffers_done))
            if mv.rescans_done:
                for site, upto in tok.rescans:  # the walk moves on; its rejections go back below
                    st.rescan_done(self.conn, peer, tok.path, site, upto, now)
            if mv.reoffers_again:
                st.reoffer_put(self.conn, peer, tok.path, list(mv.reoffers_again), now)  # later, less often
            for part, (nrows, nev, last, done) in zip(tok.bf_parts, mv.backfill):
                st.advance_backfill(self.conn, peer, part.table, part.expect_from,
                                    part.row_keys[last] if last >= 0 else None, nrows, nev, done)
        return moved

    # ------------------------------------------------------------------ receiving
    def apply_records(self, raws, now: int) -> dict:
        """Verify and store control records and act on what they change (`Node.apply_records`:
        the processing returns effects, the node acts on them)."""
        return self.node.apply_records(raws, now)

    def receive(self, peer: bytes, body: SyncBody, meta: StreamMeta | None, mode: str, now: int,
                path: str, secure: bool) -> tuple[int, list]:
        """Apply one parsed body from `peer`. Returns (processed before first rejected, outcomes)."""
        if body.records:
            self.apply_records(body.records, now)
            self.note_records_received(peer, path, body.records)
        # An authenticated peer's deliveries are tagged, so they are never offered back to it.
        origin = delivery.origin_tag(peer) if secure else "remote"
        outcomes = self.node.apply_batch(body.events, now, origin=origin, path=path)
        k = delivery.first_rejected([_proc(o) for o in outcomes])
        rehydrate.note_body(self.conn, peer, outcomes, peer in self.node.keyring)
        self.stats["bodies_in"] += 1
        self.stats["received_events"] += len(outcomes)
        self._note_rejections(outcomes)
        if secure and mode != MAILBOX_PATH:
            with _txn(self.conn):
                if mode == "batch" and meta is not None:
                    self._advance_stream(peer, path, meta, outcomes, k)
                # Reports are hints for selection only; taken from authenticated peers only.
                st.set_peer_watermarks(self.conn, peer, [(w.site_id, w.table, w.hlc) for w in body.applied_watermarks])
        return k, outcomes

    def _note_rejections(self, outcomes: list) -> None:
        """Rejected events are not retained (§13.6), but the sender moves past them now and re-offers them
        later: remember each (bounded per signer) so no watermark is
        inferred across it, and forget it once it reaches a final state here, on any path."""
        pins = [(o.site_id, o.table, o.hlc, o.event_id) for o in outcomes
                if o.status == delivery.REJECTED and o.verified and o.table is not None and o.hlc is not None]
        final = [(o.site_id, o.event_id) for o in outcomes
                 if o.status != delivery.REJECTED and o.event_id is not None and o.site_id is not None]
        if final and not st.any_pins(self.conn):
            final = []
        if pins or final:
            with _txn(self.conn):
                if final:
                    st.unpin(self.conn, final)
                if pins:
                    st.pin_rejected(self.conn, pins)

    def _advance_stream(self, peer: bytes, path: str, meta: StreamMeta, outcomes: list, k: int) -> None:
        n_live = len(meta.seqs)
        policy_gaps, floors = delivery.split_gaps(meta.gaps)
        if policy_gaps:
            st.add_stream_gaps(self.conn, peer, policy_gaps)
        completed = st.stream_completed(self.conn, peer, path)
        if not delivery.continues(meta.start, completed):
            return  # not demonstrably contiguous with what we hold from this sender: infer nothing
        live = [self._proc_full(o) for o in outcomes[:n_live]]
        current = st.own_watermarks(self.conn)
        gapped = st.stream_gaps(self.conn, peer) | delivery.unmet_floors(
            peer, floors, current, {o.table for o in live if o.table is not None})
        up = delivery.infer_watermarks(peer, live, current, st.held_min(self.conn, peer), gapped)
        st.raise_watermarks(self.conn, up)
        # Rejected events are pinned (`_note_rejections`), so the stream is complete past them: the
        # sender's cursor moves past them too and re-offers them.
        new = delivery.completed_after(meta.start, meta.end, list(meta.seqs), n_live)
        if new > completed:
            st.set_stream_completed(self.conn, peer, path, new)

    def _proc_full(self, o) -> delivery.Processed:
        """A known event's duplicate outcome carries no table/HLC: read them from the log."""
        if o.verified and (o.table is None or o.hlc is None) and o.event_id is not None:
            r = eventlog.place_of(self.conn, o.event_id)
            if r is not None:
                return delivery.Processed(o.status, o.reason, o.site_id, r[0], (r[1], r[2]), o.verified)
        return _proc(o)

    def surface_protocol_error(self, peer: bytes | None, reason: str, detail: str, now: int,
                               path: str = "memory") -> None:
        """A session refused a peer's frame: surfaced as every transport surfaces a refusal (kind
        `refused`, its code from agent/core/reasons.py, the source `session:<path>`), so
        `ssp-agent events` shows one name per violation whatever the link."""
        log.warning("protocol error from %s on %s: %s %s", peer.hex() if peer else "?", path, reason, detail)
        self.node.surface_refused(f"session:{path}", reason, detail, peer, now)

    # ------------------------------------------------------------------ mailbox (agent/mailbox_sync.py)
    def export_mailbox(self, peer: bytes, out: Path) -> dict:
        return mailbox_sync.export(self, peer, out)

    def import_mailbox(self, data: bytes, now: int | None = None, body: SyncBody | None = None) -> dict:
        return mailbox_sync.import_body(self, data, now, body)

# The mailbox verbs (agent/mailbox.py holds the file and answer-record pieces below this layer).
def import_mailbox_body(node, data: bytes, now: int | None = None) -> dict:
    """Raises ProtocolError before anything is written (docs/cli.md "Exit status": a refused body changes
    nothing): the strict parse runs before the driver is made, because making it creates the
    sync tables and the default policy rows of a home that has none yet. The events are read from
    `data` as they apply (`parse_body_streamed`)."""
    body = parse_body_streamed(data)
    return SyncDriver(node).import_mailbox(data, now, body=body)


def export_mailbox_body(node, peer: bytes, out: Path) -> dict:
    """Raises OSError (a full or failing medium) having moved nothing."""
    return SyncDriver(node).export_mailbox(peer, Path(out))


def change_policy(node, change, now: int | None = None) -> list[tuple[str, str]]:
    """Run `change(conn)` (policy rows in, out) in one transaction with the backfill it implies:
    for every (peer, table) that policy denied before and allows after (a widening, scope §2), one
    durable backfill job. Peers: every site this node trusts or holds a cursor for. Returns the
    widened (peer hex, table) pairs."""
    now = now_ms() if now is None else now
    st.ensure_schema(node.conn)
    snap = policy.snapshot(node)
    with _txn(node.conn):
        change(node.conn)
        widened = policy.enqueue_widenings(node, snap, now)
    rehydrate.announce_truncations(node, widened, now)
    return [(p.hex(), q) for p, q in widened]


class LogScan:
    """The log rows one selection examines: seq > `after`, in append order, at most `budget` seqs
    of the log (a mostly-filtered log cannot stall a cycle). Rows of `skip_tables` this node did
    not sign (quiet policy denials) are passed over in SQL, unread: a gateway's log is mostly
    telemetry no device is sent. Iterated to its end (`done`), every row up to `end` was examined."""

    def __init__(self, conn, after: int, budget: int, chunk: int, own: bytes, skip_tables: tuple[str, ...]) -> None:
        self.conn, self.after, self.budget, self.chunk = conn, after, budget, chunk
        self.own, self.skip_tables = own, skip_tables
        self.end, self.done = after, False

    def __iter__(self):
        top = min(eventlog.top(self.conn), self.after + self.budget)
        pos = self.after
        while pos < top:
            rows = eventlog.rows_after(self.conn, pos, top, self.chunk, skip_tables=self.skip_tables, own=self.own)
            # The payload is not read here: each is sealed at rest; `_open_selected` opens the offered ones.
            for seq, s, t, p, l, _raw, origin in rows:
                yield delivery.LogRow(seq, bytes(s), t, (p, l), b"", origin)
            if len(rows) < self.chunk:
                break
            pos = rows[-1][0]
        self.end, self.done = top, True


class LinkProvider:
    """The one provider of a link (its path and what the binding knows of the peer): a Session
    talks to it (`core.session.Provider`), the MQTT runner to its extension `PortAdapter`
    (agent/sync_port.py). The exchange decides which range goes (agent/core/exchange.py); this
    selects it, applies what arrives and moves the cursor on answers."""

    def __init__(self, driver: SyncDriver, path: str, secure: bool) -> None:
        self.driver, self.path, self.secure = driver, path, secure

    def hello_info(self) -> tuple[bytes, tuple[int, int]]:
        return self.driver.node.site_id, self.driver.have_max_hlc()

    def cursor(self, peer: bytes) -> int:
        """The durable cursor on this link's path."""
        return st.cursor(self.driver.conn, peer, self.path)[0]

    def records_pending(self, peer: bytes) -> bool:
        """Whether `peer` has control records not yet delivered to it on this path."""
        return self.driver.records_pending(peer, self.path)

    def outgoing(self, peer: bytes, mode: str, now: int, **kw: Any) -> Outgoing:
        return self.driver.build(peer, self.path, mode, now, **kw)

    def incoming(self, peer: bytes, body: SyncBody, meta: StreamMeta, mode: str, now: int) -> tuple[int, list[int]]:
        k, outs = self.driver.receive(peer, body, meta, mode, now, self.path, self.secure)
        return k, rejected_indices(outs)

    def confirm(self, peer: bytes, token: Any, processed: int, rejected: list[int] | None, now: int) -> None:
        if isinstance(token, Token):
            # contiguous: with a window in flight, an answer moves the live cursor only when its
            # body started at or before it (the rule the MQTT answers follow, `PortAdapter.advance`)
            self.driver.confirm(peer, token, processed, contiguous=True, rejected=rejected, now=now)

    def protocol_error(self, peer: bytes | None, reason: str, detail: str, now: int) -> None:
        self.driver.surface_protocol_error(peer, reason, detail, now, self.path)


# ---------------------------------------------------------------------- helpers
def rejected_indices(outcomes: list) -> list[int]:
    """The body indices of the events rejected here (the answer reports them)."""
    return [i for i, o in enumerate(outcomes) if o.status == delivery.REJECTED]


def delivery_hash(raw: bytes) -> bytes:
    from .core.records import record_hash
    return record_hash(bytes(raw))


def _proc(o) -> delivery.Processed:
    return delivery.Processed(o.status, o.reason, o.site_id, o.table, o.hlc, o.verified)


_txn = db.transaction  # one transaction helper for every writer (agent/store/db.py)


def issue_record(node, kind: str, subject: bytes, value: Any, now: int | None = None,
                 authority=None, store=None) -> tuple[bytes, dict]:
    """Issue a control record, signed through a keystore bridge under a fresh identity
    (persist-before-release: a crash never makes an issuer sign two different records it could
    both have released). The issuer is this node (it must be a mesh authority; signed with its
    event key) or, with `authority` (agent/authority.py, `authority create`), a standalone
    authority this node lists, signed through the bridge of its directory; records that authority
    released and this node does not hold (a crash after release, or issued through another node)
    are stored first, so the chain continues from them instead of forking. The record extends the
    subject's chain from the head this node holds, is stored, and goes to every peer (in the next
    bodies to it, until it answers one: docs/protocol.md §5). `store(raws)`: how records are
    verified and stored (default: here; a node read beside its running service hands them to it)."""
    from .core import records as rec
    from .node import NodeError
    issuer = node.site_id if authority is None else authority.site_id
    if issuer not in node.authorities:
        if authority is not None:
            raise NodeError(f"authority {issuer.hex()} is not a mesh authority on this node; add it with "
                            f"`ssp-agent authority add --site-id {issuer.hex()} --public-key "
                            f"{authority.public_key.hex()}`")
        raise NodeError("this node is not a mesh authority (the manifest's `authorities`); only an authority "
                        "may issue vouch, retire and role records (or pass --authority-key DIR made by "
                        "`ssp-agent authority create`)")
    if authority is None and subject == node.site_id and kind != "role":
        raise NodeError("a node does not vouch for or retire itself")
    st.ensure_schema(node.conn)
    if kind != "retire" and issuer in st.trust(node.conn, node.site_id).retired_authorities:
        raise NodeError(f"authority {issuer.hex()} is retired: its vouch and role records count nowhere "
                        "(docs/protocol.md §5 Trust); issue from a current authority")
    now = now_ms() if now is None else now
    if store is None:
        drv = SyncDriver(node)
        store = lambda raws: drv.apply_records(raws, now)   # noqa: E731
    if authority is not None:
        earlier = [raw for raw in authority.released() if not st.has_record(node.conn, delivery_hash(raw))]
        if earlier:
            log.warning("storing %d record(s) the authority released before but this node does not hold", len(earlier))
            store(earlier)
    gen, prev = _chain_position(node, kind, subject)
    raw = produce.issue_record(node, rec.to_be_signed(kind, issuer, node.mesh_id, subject, value, gen, prev), now,
                               authority=authority)
    res = store([raw])
    if res["stored"] != 1 and res["known"] != 1:
        hint = " (is the authority's public key in this node's keyring?)" if authority is not None else ""
        raise NodeError(f"the issued record did not verify here{hint}: {res}")
    info = {"kind": kind, "subject": subject.hex(), "generation": gen,
            "record_hash": rec.record_hash(raw).hex(), "previous_record_hash": prev.hex() if prev else None}
    return raw, info if authority is None else {**info, "issuer": issuer.hex()}


def _chain_position(node, kind: str, subject: bytes):
    from .node import NodeError
    # Over the records that count: a retired authority's records are no link (a successor issues
    # a new genesis), docs/protocol.md §5 Trust.
    ch = st.trust(node.conn, node.site_id).chains.get((kind, subject))
    if ch is not None and ch.forked:
        raise NodeError(f"the {kind} chain of {subject.hex()} has forked; it is treated as absent until an "
                        "operator resolves it")
    if ch is not None and ch.head is None and ch.values:
        raise NodeError(f"this node holds {kind} records of {subject.hex()} without their genesis; sync first")
    return (0, None) if ch is None or ch.head is None else (ch.head.generation + 1, ch.head.record_hash)

