"""The node-side sync driver: wires sans-I/O sessions (agent/core/session.py) to a Node.

It builds bodies from the durable per-(peer, path) cursor (filtered by policy, self-echo and the
peer's reported watermarks), applies received bodies through the node's one apply path
(`Node.apply_batch`), advances cursors only on the peer's answer, and advances the node's own
applied watermarks only from what a live, authenticated, stream-continuous body demonstrates
(docs/protocol.md says why that is sound).

A transport makes one `SyncDriver` per open Node and one session per link
(`drv.session(path=..., peer=..., secure=...)`), then feeds it: `start(now)`, `receive(bytes,
now)` for every frame, `data_to_send()` to transmit, `handle_timer(now)` when `timer()` passes,
and `local_events(now)` after a local write (a realtime push, coalesced)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from firmware_bridge.fsutil import atomic_write

from . import mailbox, policy, produce, rehydrate
from .clockstate import now_ms
from .core import delivery, reasons as R
from .core.binding import body_fit
from .core.incoming import split_records, sync_body
from .core.messages import SyncBody, Watermark, emit_body, parse_body, parse_body_streamed
from .core.records import RecordError, resolve_chains  # noqa: F401 (resolve_chains: re-exported)
from .core.session import Outgoing, Session, StreamMeta
from .outcomes import counts
from .store import db, eventlog, reports, sequencing as seqstore, sync_state as st

log = logging.getLogger("ssp_agent.sync")

DEFAULT_BATCH_LIMIT = 500
SCAN_FACTOR = 20  # rows examined per body at most: limit * SCAN_FACTOR (a mostly-filtered log cannot stall a cycle)
MAILBOX_PATH = "mailbox"
MAX_RECORDS_PER_BODY = 128  # control records per body at most (and at most a quarter of the body limit)
RECORD_OVERHEAD = 5  # CBOR bstr header, array growth: bytes a record costs in a body beyond its own


@dataclass(frozen=True)
class _BfPart:
    """One backfill job's share of a body: whole rows, in row_key order, after `expect_from`."""
    table: str
    expect_from: bytes | None
    row_keys: tuple[bytes, ...]
    counts: tuple[int, ...]  # events sent for each row (0: nothing left to send for it)
    done: bool  # the walk reached the table's end


@dataclass(frozen=True)
class _Token:
    path: str
    start: int
    seqs: tuple[int, ...]
    end: int
    bf_parts: tuple[_BfPart, ...] = ()
    rehydrate_gen: int | None = None  # a rehydration reset since selection voids the live advance
    records: tuple[bytes, ...] = ()  # hashes of the control records the body carries (delivered on an answer)
    record_raws: tuple[bytes, ...] = ()  # those records, in body order
    sent_key: bytes | None = None  # the body's row in sync_state.sent_bodies (the key its answer names)
    reoffer_seqs: tuple[int, ...] = ()  # re-offered events (after the live ones, before backfill)
    rescans: tuple[tuple[bytes, int], ...] = ()  # rescan markers the re-offers advance (sync_state)


@dataclass
class Offer:
    """A body selected for a peer (`PortAdapter.select`), kept by the runner until answered.
    Here, below agent/runner.py: the runner imports the sync layer, never the other way round."""
    start: int  # the cursor value the selection started from (seq > start)
    end: int  # last seq examined
    seqs: list[int] = field(default_factory=list)
    events: list[bytes] = field(default_factory=list)
    gaps: list[str] = field(default_factory=list)  # tables whose own events policy withheld in (start, end]
    n_backfill: int = 0  # the last n_backfill of `events` are backfill rows' events (not in `seqs`)
    backfill: bool = False  # carries backfill job progress (rows, or the end of a job's walk)
    token: Any = None  # handed back to `advance` with the peer's answer
    body_hash: bytes | None = None  # BLAKE3 of the body as published (set by Runner._send; §5 acknowledgements)


@dataclass
class Backfill:
    events: list[bytes]
    parts: list[_BfPart]


def _hex(b: bytes | None) -> str | None:
    return None if b is None else b.hex()


def _unhex(h: str | None) -> bytes | None:
    return None if h is None else bytes.fromhex(h)


def token_to_json(tok: _Token, **extra: Any) -> str:
    """A confirmation token as kept in `sent_bodies` (the record raws are not: the body is sent)."""
    return json.dumps({"p": tok.path, "s": tok.start, "q": list(tok.seqs), "e": tok.end, "g": tok.rehydrate_gen,
                       "r": [h.hex() for h in tok.records], "k": _hex(tok.sent_key),
                       "b": [[b.table, _hex(b.expect_from), [k.hex() for k in b.row_keys], list(b.counts), b.done]
                             for b in tok.bf_parts], "o": list(tok.reoffer_seqs),
                       "z": [[site.hex(), upto] for site, upto in tok.rescans], **extra}, separators=(",", ":"))


def token_from_json(text: str) -> tuple[_Token, dict]:
    """The token and the extra members stored with it."""
    d = json.loads(text)
    parts = tuple(_BfPart(t, _unhex(x), tuple(bytes.fromhex(k) for k in rks), tuple(cs), bool(done))
                  for t, x, rks, cs, done in d.pop("b"))
    tok = _Token(d.pop("p"), d.pop("s"), tuple(d.pop("q")), d.pop("e"), parts, d.pop("g"),
                 tuple(bytes.fromhex(h) for h in d.pop("r")), (), _unhex(d.pop("k", None)),
                 reoffer_seqs=tuple(d.pop("o", ())), rescans=tuple((bytes.fromhex(x), u) for x, u in d.pop("z", ())))
    return tok, d


class SyncDriver:
    def __init__(self, node, batch_limit: int = DEFAULT_BATCH_LIMIT) -> None:
        self.node = node
        self.conn = node.conn
        self.batch_limit = batch_limit
        st.ensure_schema(self.conn)
        self._denials_surfaced: set[tuple[bytes, str, str]] = set()
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

    def _rows(self, after: int, upto: int | None):
        """Log rows with seq > after (and <= upto), in append order, bounded by the scan budget."""
        budget = self.batch_limit * SCAN_FACTOR
        chunk = max(64, min(self.batch_limit * 2, budget))
        pos = after
        while budget > 0:
            # The payload is not read here: most rows examined are filtered (policy, self-echo,
            # watermarks), and each payload is sealed at rest; `_open_selected` opens the offered ones.
            rows = eventlog.rows_after(self.conn, pos, upto, min(chunk, budget))
            if not rows:
                return
            for seq, s, t, p, l, raw, origin in rows:
                yield delivery.LogRow(seq, bytes(s), t, (p, l), b"", origin)
            pos = rows[-1][0]
            budget -= len(rows)

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
        allowed = self._allowed_fn(peer)
        pwm = st.peer_watermarks(self.conn, peer)
        counts = self.node._counts
        ro, scans = self._due_reoffers(peer, path, allowed, limit, now) if mode != "push" else ([], ())
        sel = delivery.select(self._rows_for(peer, start), start, peer, self.node.site_id, allowed, pwm,
                              limit - len(ro), lambda r: counts((r.hlc[0], r.hlc[1], r.site_id)))
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
              records: tuple[tuple[bytes, ...], tuple[bytes, ...]] = ((), ()), ro=((), ())) -> _Token:
        """What `confirm` needs once the peer answers a body built from this selection.
        `records`: (hashes, raws) from `select_records`, the records the body carries; `ro`: the
        re-offers ((seq, raw), rescans) it carries after the live events."""
        return _Token(path, start, tuple(sel.seqs), sel.end, tuple(bf.parts) if bf else (),
                      st.rehydrate_generation(self.conn, peer), tuple(records[0]), tuple(records[1]),
                      reoffer_seqs=tuple(seq for seq, _raw in ro[0]), rescans=tuple(ro[1]))

    def _rows_for(self, peer: bytes, start: int):
        """Log rows for `peer`; while this node serves a rehydration of `peer`, rows up to the
        reset point lose their delivered-by-peer tag, so what the peer itself once relayed here
        (and may have evicted since) is offered back to it (agent/rehydrate.py)."""
        upto = st.rehydrate_upto(self.conn, peer) if st.has_schema(self.conn) else 0
        if not upto or start >= upto:
            return self._rows(start, None)
        tag = delivery.origin_tag(peer)
        return (delivery.LogRow(r.seq, r.site_id, r.table, r.hlc, r.raw, "") if r.origin == tag and r.seq <= upto else r
                for r in self._rows(start, None))

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
        parts: list[_BfPart] = []
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
            parts.append(_BfPart(q, job["resume_after_row_key"], tuple(rks), tuple(cnts), done))
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
        wms = tuple(Watermark(s, q, h) for (s, q), h in sorted(st.own_watermarks(self.conn).items()))
        # What does not depend on the events selected is read once, not again per re-selection.
        hmax = self.have_max_hlc()
        recs = self.select_records(peer, path, record_budget)
        records = tuple(recs[1]) + tuple(extra_records)
        empty: int | None = None
        while True:
            sel, bf, start0, ro = self.select_for(peer, path, mode, start=start, limit=limit, backfill=backfill,
                                                  now=now)
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
        meta = StreamMeta(start0, sel.end, tuple(sel.seqs), tuple(sorted(sel.gaps)), len(extra))
        tok = self.token(peer, path, sel, bf, start0, recs, ro)
        self.stats["bodies_out"] += 1
        self.stats["pushed_events"] += len(events)
        return Outgoing(raw, meta, tok, len(events), bf is not None)

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

    def confirm(self, peer: bytes, tok: _Token, processed: int, contiguous: bool = False,
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

    # ------------------------------------------------------------------ mailbox
    def export_mailbox(self, peer: bytes, out: Path) -> dict:
        """One sync body for `peer` from the mailbox path's cursor, carrying this node's answer to
        the files it imported from `peer` (agent/mailbox.py). Written whole and durably or not at
        all: OSError, and nothing moved or kept. The cursor does not move here: it moves when
        `peer`'s answer to this file comes back in one of its files (§14.1), so every export
        re-offers what is not yet acknowledged."""
        now = now_ms()
        # This node's answers: to the peer's files first, then to every other node's (files may go
        # round a ring, never straight back: the next node relays them on). Then the answers of
        # other nodes that reached this node, the peer's first.
        ack = self._mailbox_ack(peer, now)
        others = [self._mailbox_ack(s, now) for s in st.mailbox_owed_peers(self.conn)
                  if s != peer and s in self.node.keyring]
        extra = tuple(r for r in [ack, *others] if r is not None) + tuple(st.relayed_mailbox_acks(self.conn, peer))
        o = self.build(peer, MAILBOX_PATH, "batch", extra_records=extra)
        _write_durably(Path(out), o.body)
        h = mailbox.body_hash(o.body)
        with _txn(self.conn):
            st.put_sent_body(self.conn, MAILBOX_PATH, h, peer, "mailbox", token_to_json(replace(o.token, sent_key=h)),
                             now)
        return {"peer": peer.hex(), "events": o.n_events, "bytes": len(o.body), "file": str(out),
                "body_hash": h.hex(), "answers": len(st.owed_mailbox_answers(self.conn, peer)) if ack else 0,
                "cursor": st.cursor(self.conn, peer, MAILBOX_PATH)[0]}

    def _mailbox_ack(self, peer: bytes, now: int) -> bytes | None:
        """The answer record to `peer`'s files imported here (the newest 16), signed through the
        keystore bridge under a fresh identity (persist-before-release, like every record this node
        issues) and stored; the held one is re-used while the answers are unchanged."""
        answers = st.owed_mailbox_answers(self.conn, peer)
        if not answers:
            return None
        raw = st.mailbox_ack_saying(self.conn, peer, answers)
        if raw is not None:
            return raw
        node = self.node
        raw = produce.issue_record(node, mailbox.ack_to_be_signed(node.site_id, node.mesh_id, peer, answers, now), now)
        with _txn(self.conn):
            st.put_mailbox_ack(self.conn, delivery_hash(raw), peer, answers, raw, now)
        return raw

    def _take_mailbox_acks(self, sender: bytes, raws, now: int) -> dict:
        """The answer records in a file from `sender`: each verified on its own (issuer's key in the
        keyring, not retired; signature over mesh_id; exact members), else dropped and surfaced. One
        addressed to this node counts for the files this node wrote for its issuer and has not had
        answered (`sent_bodies`): the cursor then moves as the MQTT answer moves it (`confirm`,
        §14.1). It may come from the issuer or through any node that relays it (the signature is
        the issuer's); one addressed to a third node is kept and relayed to it in this node's files."""
        out = {"bodies": 0, "events": 0, "relayed": 0}
        node = self.node
        for raw in raws:
            try:
                a = mailbox.verify_ack(raw, node.mesh_id, node.keyring.get)
            except RecordError as e:
                with _txn(self.conn):
                    _surface(self.conn, now, "record_dropped", e.reason,
                             {"type": mailbox.ACK_CONTENT_TYPE, "detail": e.detail})
                continue
            issuer, subject = a["issuer"], a["subject"]
            if subject != node.site_id:
                if issuer != node.site_id:
                    with _txn(self.conn):
                        out["relayed"] += st.relay_mailbox_ack(self.conn, subject, issuer, a["issued_at"], a["raw"])
                continue
            for h, k in a["answers"]:
                r = st.sent_body(self.conn, MAILBOX_PATH, h)
                if r is None or r[0] != issuer:
                    continue  # answered already, forgotten, or not a file written for the issuer
                tok, _extra = token_from_json(r[2])
                n = max(0, min(k, len(tok.seqs) + sum(sum(p.counts) for p in tok.bf_parts)))
                self.confirm(issuer, tok, n)
                out["bodies"] += 1
                out["events"] += n
        return out

    def import_mailbox(self, data: bytes, now: int | None = None, body: SyncBody | None = None) -> dict:
        """Parse the whole body strictly first (nothing changes on a malformed one: the streamed
        parse prescans and walks all of it before returning), then records,
        then the answers to this node's files, then events through the one apply path; then owe
        the sender an answer for this file (carried by the next export to it). Mailbox bodies never
        move watermarks. `body`: the parse of `data` already made (agent/mailbox.py parses before
        making a driver)."""
        body = parse_body_streamed(data) if body is None else body
        now = now_ms() if now is None else now
        # The import is several transactions (records, answer records, one per window of events,
        # the answer owed, rehydration counts): a full disk in a later one must not be reported as
        # "nothing was changed", so the steps that committed are tracked.
        done: dict[str, Any] = {"applied": 0, "processed": 0, "step": "records", "committed": False}
        try:
            return self._import_mailbox(data, now, body, done)
        except Exception as e:
            if not done["committed"] or not db.disk_full(e, self.node.home / self.node.STORE_FILE):
                raise       # nothing committed yet: the generic full-disk line is true
            raise db.StoreError(_partial_import_line(self.node.home, len(body.events), done)) from e

    def _import_mailbox(self, data: bytes, now: int, body: SyncBody, done: dict) -> dict:
        sender = body.from_site_id
        acks, others = split_records(body.records, [mailbox.ACK_CONTENT_TYPE])
        recs = self.apply_records(others, now) if others else None
        if others:
            done["step"], done["committed"] = "records_noted", True
            self.note_records_received(sender, MAILBOX_PATH, others)
        done["step"] = "acks"
        acked = self._take_mailbox_acks(sender, acks, now)  # after the records: a vouch admits its issuer
        done["step"], done["committed"] = "events", done["committed"] or bool(acks)
        # The events go through the one apply path a window at a time: a body
        # parsed by `parse_body_streamed` yields them from its bytes, so at most one window of
        # events and of their outcomes is in memory; each window is a batch (one transaction),
        # and only the counts and what did not simply apply are kept.
        tally: dict[str, Any] = {"received": 0, "applied": 0, "below_horizon": 0, "duplicate": 0, "verified": 0}
        result: dict[str, Any] = counts([])
        detail: list[dict] = []
        not_listed = 0
        k = None
        events = body.events
        windows = events.windows(MAILBOX_WINDOW_BYTES) if hasattr(events, "windows") else [events]
        for window in windows:
            outcomes = self.node.apply_batch(window, now, origin="mailbox")
            if k is None:
                i = delivery.first_rejected(outcomes)   # reads `status` only
                k = None if i == len(outcomes) else tally["received"] + i
            for o in outcomes:
                result[o.status] += 1
                tally["verified"] += o.verified
                if o.reason != R.APPLIED:
                    # Detail for what did not simply apply (reasons, event ids), the first
                    # MAILBOX_DETAIL_MAX of them: a file of 50 000 duplicates must not cost 50 000
                    # objects in memory and on stdout; the counts cover every event.
                    if len(detail) < MAILBOX_DETAIL_MAX:
                        detail.append(o.as_json())
                    else:
                        not_listed += 1
                    if o.reason == R.BELOW_HORIZON:
                        tally["below_horizon"] += 1
                    elif o.status == "duplicate":
                        tally["duplicate"] += 1
                elif o.status == "applied":
                    tally["applied"] += 1
            tally["received"] += len(outcomes)
            done["applied"], done["processed"], done["committed"] = tally["applied"], tally["received"], True
            del outcomes
        k = tally["received"] if k is None else k
        if sender != self.node.site_id and sender in self.node.keyring:
            # Owed only to a site this node trusts: a file naming any other sender (a stranger,
            # another mesh) must not make this node sign and carry answers to it in every file.
            done["step"] = "answer"
            with _txn(self.conn):
                st.owe_mailbox_answer(self.conn, sender, mailbox.body_hash(data), k, now)
        done["step"] = "counts"
        rehydrate.note_counts(self.conn, sender, tally["verified"], tally["applied"], tally["below_horizon"],
                              tally["duplicate"], tally["received"] - tally["verified"], sender in self.node.keyring)
        result["from_site_id"] = sender.hex()
        result["events"] = detail
        result["events_not_listed"] = not_listed
        if recs is not None:
            result["records"] = recs
        result["acknowledged"] = acked
        return result


def _partial_import_line(home: Path, total: int, done: dict) -> str:
    """The full-disk line of an import that committed some of its steps: what is kept, what is
    not, and that importing the file again is safe (its applied events are then duplicates, its
    records already held, and the answer is owed once it commits)."""
    free = db.free_bytes(home)
    failed = {
        "records_noted": "the note of its records for their sender was not recorded",
        "acks": "the answers it carries from peers were not taken",
        "events": f"the other {total - done['processed']} event(s) were not processed",
        "answer": "the answer owed to its sender was not recorded (the sender offers the events again until "
                  "it has one)",
        "counts": "the rehydration's progress counts were not recorded (its answer was)",
    }[done["step"]]
    return (f"the filesystem holding {home} is full ({free if free is not None else '?'} bytes free) during the "
            f"import: {done['applied']} of {total} event(s) of the file were applied and are kept "
            f"({done['processed']} processed), but {failed}. Importing the same file again "
            "once there is space is safe (what was applied counts as duplicates) and completes it. Free space "
            "there, or run `ssp-agent evict --auto` (it uses the space the home reserves for it)")


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


# The events a mailbox import applies per batch (one transaction each), by their bytes: bounds the
# import's memory whatever the body holds, and is large enough that the commit
# per window costs little beside the window's verification.
MAILBOX_WINDOW_BYTES = 1 << 20
# `mailbox import` lists at most this many of the events that did not simply apply (the counts
# cover them all; `events_not_listed` says how many more): what it holds and prints stays bounded
MAILBOX_DETAIL_MAX = 1000


class LinkProvider:
    """The Provider a Session talks to: one per link (path + what the binding knows). The session
    decides which range goes (the exchange's window, agent/core/exchange.py); this selects it."""

    def __init__(self, driver: SyncDriver, path: str, secure: bool) -> None:
        self.driver, self.path, self.secure = driver, path, secure

    def hello_info(self) -> tuple[bytes, tuple[int, int]]:
        return self.driver.node.site_id, self.driver.have_max_hlc()

    def cursor(self, peer: bytes) -> int:
        return st.cursor(self.driver.conn, peer, self.path)[0]

    def records_pending(self, peer: bytes) -> bool:
        return self.driver.records_pending(peer, self.path)

    def outgoing(self, peer: bytes, mode: str, now: int, **kw: Any) -> Outgoing:
        return self.driver.build(peer, self.path, mode, now, **kw)

    def incoming(self, peer: bytes, body: SyncBody, meta: StreamMeta, mode: str, now: int) -> tuple[int, list[int]]:
        k, outs = self.driver.receive(peer, body, meta, mode, now, self.path, self.secure)
        return k, rejected_indices(outs)

    def confirm(self, peer: bytes, token: Any, processed: int, rejected: list[int] | None, now: int) -> None:
        if isinstance(token, _Token):
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


def _surface(conn, now: int, kind: str, reason: str, detail: dict) -> None:
    reports.surface(conn, now, kind, reason, json.dumps(detail, sort_keys=True))


def _write_durably(path: Path, data: bytes) -> None:
    """Written whole or not at all, and durable before the mailbox cursor moves."""
    atomic_write(str(path), data, 0o644)


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


class PortAdapter:
    """The driver behind the interface agent/runner.py uses (peers, cursor, select, advance,
    receive, body, answer_body, note_answer, handshake, have_max, backlog), so the MQTT runner gets
    this layer's durable per-path cursors, policy, self-echo and peer-origin filters and control
    records; the runner's default port is `PortAdapter(node, path="mqtt", secure=...)`.

    A binding that does not authenticate the peer (`secure=False`, plain MQTT) gets no watermark
    inference and its reports are ignored. That is fail-closed and costs only re-offers."""

    def __init__(self, node, path: str = "mqtt", secure: bool = False, batch_limit: int = DEFAULT_BATCH_LIMIT,
                 now: Callable[[], int] = now_ms) -> None:
        self.node, self.path, self.secure = node, path, secure
        self.now = now  # wall-clock ms, the runner's clock: what is stored and what the apply path checks
        self.driver = SyncDriver(node, batch_limit)
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

    def cursor(self, peer: bytes) -> int:
        return st.cursor(self.conn, peer, self.path)[0]

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

    def records_pending(self, peer: bytes) -> bool:
        """Whether `peer` has control records not yet delivered to it on this path."""
        return self.driver.records_pending(peer, self.path)

    def backlog(self, peer: bytes) -> int:
        return self.driver.backlog(peer, self.path)

    def advance(self, peer: bytes, start: int, seqs: list[int], end: int, processed: int, token=None,
                rejected: list[int] | None = None) -> bool:
        """The peer answered a body: `processed` events (live first, then backfill) reached a final
        state. The live cursor moves only contiguously; backfill rows commit, whole rows only, with
        the body's `token` (`Offer.token`, see `SyncDriver.confirm`)."""
        if token is None:
            token = _Token(self.path, start, tuple(seqs), end, (), st.rehydrate_generation(self.conn, peer))
        return self.driver.confirm(peer, token, processed, contiguous=True, rejected=rejected)

    @staticmethod
    def keyed(token, corr: bytes):
        """The token of a body published under correlation data `corr` (its `sent_bodies` key)."""
        return replace(token, sent_key=corr) if isinstance(token, _Token) else token

    def remember(self, sent: list[tuple[bytes, bytes, str, Any]]) -> None:
        """Bodies just published, as (correlation data, peer, kind, Offer): kept durably, so an
        answer that waits in the broker while this process is gone (a wake-sync-sleep device, a
        restart) still moves the cursor when a later process takes it (§14.1)."""
        t = self.now()
        with _txn(self.conn):
            for corr, peer, kind, off in sent:
                if isinstance(off.token, _Token):
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
        the next compaction (Node._record_held)."""
        from .core.records import ack_to_be_signed
        node = self.node
        return produce.issue_record(node, ack_to_be_signed(node.site_id, node.mesh_id, subject, list(answers)), self.now())

    def body(self, events=(), peer: bytes | None = None, token=None, extra_records: tuple = ()) -> bytes:
        """A sync body for `peer` carrying `events`, control records and this node's applied
        watermarks. Records: with `token` (`Offer.token`), the ones selected with the offer (they
        count as delivered when the peer answers, `advance`/`note_answer` with that token); without
        one (an answer body), the next ones not yet delivered to the peer, within the budget, not
        tracked (an answer is not answered)."""
        if isinstance(token, _Token):
            raws = token.record_raws
        else:
            raws = self.driver.select_records(peer, self.path)[1] if peer is not None else ()
        return emit_body(SyncBody(self.node.site_id, self.have_max(), tuple(events), tuple(extra_records) + tuple(raws),
                                  tuple(Watermark(s, q, h) for (s, q), h in sorted(st.own_watermarks(self.conn).items()))))

    def note_answer(self, peer: bytes, data: bytes, token=None) -> None:
        """`peer` answered a body: take the answer's records and (secure binding) reports. With the
        body's `token`, the records that body carried count as delivered to the peer (unless it
        asked for its history again since the body was selected)."""
        if isinstance(token, _Token) and token.records:
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
