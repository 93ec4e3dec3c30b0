"""The apply worker pipeline: a batch's events cut into chunks that the worker processes
(agent/applyworker.py) verify and decode a few chunks ahead (agent/core/prepare.py) while the
applying thread applies the chunks before them, and the next batch's first chunks sent ahead
(`prepare_next`). Pure preparation: the apply path (agent/apply.py) still takes each result in
order and re-verifies when the keyring entry changed since (docs/apply.md)."""
from __future__ import annotations

import logging
import os

from .core import events as ev, numbers
from .store import eventlog

log = logging.getLogger("ssp_agent")


class Pipeline:
    """One node's workers and what is in flight to them."""

    _CHUNK = 256
    _CHUNK_BYTES = 256 * 1024
    _AHEAD = 3   # chunks prepared ahead of the one applying
    _FIRST_CHUNK = 32   # a batch's first chunk with a worker (then doubling up to _CHUNK)
    # Batches of 64 or more adding up to this many events start the worker processes (their
    # start-up, ~0.1 s of CPU, is repaid after a few thousand events): at once for a large mailbox
    # body, at the first body of WORKER_RUN_BATCH or more for a long-running `run`, never for a
    # one-shot command that applies one small body. Once started, every batch of 64 or more uses them.
    WORKER_MIN_BATCH = 2048
    # A long-running node (`run`: the Runner sets `long_running`) starts them at its first batch of
    # this many events: it will receive more, and its first bodies of 1 000 otherwise verified on
    # the applying thread alone (bench/bench_syncrate.py, docs/apply.md).
    WORKER_RUN_BATCH = 512
    long_running = False

    def __init__(self) -> None:
        self.pool = None   # the apply workers: None not started yet, False none (agent/applyworker.py)
        self.batched = 0   # events of batches of 64 or more applied while none was started
        # The batch the caller expects to apply next (`prepare_next`), and the first chunks of it
        # sent to the workers during the batch before: (its raws, its chunks, their tickets).
        self.next_raws = None
        self.carried: tuple | None = None

    def close(self) -> None:
        self.drop_carried()
        if self.pool:
            self.pool.close()
        self.pool = None

    def worker(self, n: int):
        """The apply worker processes (agent/applyworker.py), or None: on one core (a second process
        only adds the pipe's cost to the same core), until batches of WORKER_MIN_BATCH events in
        all came (a long-running node: one of WORKER_RUN_BATCH), or after they failed (SSP_AGENT_APPLY_WORKERS=0 turns them off)."""
        if self.pool is not None:
            return self.pool or None
        self.batched += n
        if self.batched < self.WORKER_MIN_BATCH and not (self.long_running and n >= self.WORKER_RUN_BATCH):
            return None
        if os.environ.get("SSP_AGENT_APPLY_WORKERS") == "0" or len(os.sched_getaffinity(0)) < 2:
            self.pool = False
            return None
        from .applyworker import ApplyWorkers, NoneAvailable
        try:
            self.pool = ApplyWorkers(self.worker_count(), limit=self.worker_count())
        except NoneAvailable:
            return None   # other nodes of this process hold them: this batch prepares here
        except OSError as e:
            log.warning("apply worker not started (%s): verifying on this thread", e)
            self.pool = False
        return self.pool or None

    @staticmethod
    def worker_count() -> int:
        """SSP_AGENT_APPLY_WORKERS, else one per core beyond the applying thread's, at most 3."""
        n = numbers.uint(os.environ.get("SSP_AGENT_APPLY_WORKERS", ""), max_value=64)
        if n is not None:
            return max(1, n)
        return max(1, min(3, len(os.sched_getaffinity(0)) - 1))

    def worker_failed(self, e: Exception) -> None:
        log.warning("apply worker failed (%s): verifying on this thread from now on", e)
        try:
            self.pool.close()
        except Exception:  # noqa: BLE001 - it is gone either way
            pass
        self.pool = False

    def prepare_next(self, raws) -> None:
        """Name the batch the caller expects to apply after the next one (a `run` receiving
        bodies: the next body waiting from the same sender). While the next batch applies, its
        last chunks' answers in hand, the workers start preparing this one, so they do not idle
        through that batch's end (its last chunk, row writes, commit, the answer) and the applying
        thread does not wait for this one's first answer (docs/apply.md "A `run` receiving
        bodies"). A hint only: what was prepared is used only if `apply_batch` is then called with
        this very list, and each chunk's duplicate look-up still runs when the chunk applies."""
        self.next_raws = raws if isinstance(raws, (list, tuple)) else None

    def drop_carried(self) -> None:
        """Read and drop the answers to chunks sent ahead for a batch that did not come."""
        carried, self.carried = self.carried, None
        if carried is not None and self.pool:
            try:
                self.pool.drain()
            except Exception as e:  # noqa: BLE001 - any failure of the worker: prepare here
                self.worker_failed(e)

    def chunks(self, raws, worker: bool) -> list[list]:
        """A batch's chunks: at most _CHUNK events and _CHUNK_BYTES bytes, so the prepare-ahead
        window (_AHEAD chunks) is bounded in bytes as well as in events. With a worker
        the first chunks are smaller (_FIRST_CHUNK, doubling up to _CHUNK): this thread waits for
        the first chunk's answer before applying anything, and a run receives a body of 1 000
        events at a time, so that wait came back at every body (measured on the receiving `run` of
        bench/bench_syncrate.py: ~14 % of its wall time blocked on the first answer of each body
        with first chunks of 256). And the last ones smaller too: after the worker's last answer
        this thread applies that chunk alone, the worker idle (the same wait, at the batch's end)."""
        chunks, cur, size = [], [], 0
        limit = min(self._FIRST_CHUNK, self._CHUNK) if worker else self._CHUNK
        for r in raws:
            n = len(r) if isinstance(r, (bytes, bytearray)) else 0
            if cur and (len(cur) == limit or size + n > self._CHUNK_BYTES):
                chunks.append(cur)
                cur, size = [], 0
                limit = min(2 * limit, self._CHUNK)
            cur.append(r)
            size += n
        if cur:
            chunks.append(cur)
        if worker and len(chunks) > 1:
            last = chunks.pop()
            while len(last) > 2 * self._FIRST_CHUNK:
                chunks.append(last[:len(last) // 2])
                last = last[len(last) // 2:]
            chunks.append(last)
        return chunks

    def verified_ahead(self, st, raws):
        """Each event with what the apply path needs to know of it before touching the store:
        its envelope, keyring entry, signature verdict, decoded payload (agent/core/prepare.py),
        computed a few chunks ahead by the worker process while this thread applies the events
        before them (on one core, or without a worker: here, chunk by chunk). Pure: the same
        checks §12.1 runs, done early; `_apply_one` still takes each result in order and
        re-verifies if the keyring entry changed since. Yields (raw, checked or None)."""
        from .core.prepare import checked_from, prepare
        keyring, mesh = dict(st.keyring), st.mesh_id
        worker = self.worker(len(raws))
        nxt, self.next_raws = self.next_raws, None
        carried, self.carried = self.carried, None
        if carried is not None and (worker is None or carried[0] is not raws):
            self.carried = carried
            self.drop_carried()   # sent ahead for a batch that did not come
            carried = None

        def look_up(chunk):
            # Events this node already holds are answered by the apply path's duplicate look-up
            # before any verification (§12.4 early): preparing them would be wasted work.
            # (The log and the held table only grow during a batch, so "known" stays true.)
            ids = [ev.event_id(bytes(r)) if isinstance(r, (bytes, bytearray)) else None for r in chunk]
            known = eventlog.known_among(st.conn, [i for i in ids if i is not None])
            todo = [bytes(r) for r, i in zip(chunk, ids) if i is not None and i not in known]
            return ids, known, todo

        def send(todo):
            if worker is not None and self.pool and not worker.prepares_here():
                try:
                    return worker.submit(keyring, mesh, todo)
                except Exception as e:  # noqa: BLE001 - any failure of the worker: prepare here
                    self.worker_failed(e)
            return None

        def submit(chunk):
            ids, known, todo = look_up(chunk)
            return ids, known, todo, send(todo)

        def submit_unlooked(chunk):
            # A chunk of the next batch, sent before that batch's transaction: its duplicate
            # look-up is only valid inside it, so it runs when the chunk applies (below), and
            # every event is prepared (an event found held then is answered without its result).
            todo = [bytes(r) for r in chunk if isinstance(r, (bytes, bytearray))]
            return None, None, todo, send(todo)

        chunks = carried[1] if carried is not None else self.chunks(raws, worker is not None)
        if worker is not None:
            ahead = list(carried[2]) if carried is not None else []
            ahead += [submit(c) for c in chunks[len(ahead):self._AHEAD]]
        # The next batch (`prepare_next`): its first chunks go to the workers as this batch's
        # last ones leave them, keeping _AHEAD chunks in flight across the two.
        after = self.chunks(nxt, True) if worker is not None and nxt is not None and nxt is not raws \
            and len(nxt) >= 64 else []
        sent_after: list = []
        done = False
        try:
            for i, chunk in enumerate(chunks):
                if worker is not None:
                    ids, known, todo, ticket = ahead[i]
                    ahead[i] = None   # release the chunk's results as we go
                    j = i + self._AHEAD
                    if j < len(chunks):
                        ahead.append(submit(chunks[j]))
                    elif j - len(chunks) < len(after) and self.pool:
                        sent_after.append(submit_unlooked(after[j - len(chunks)]))
                    looked_late = ids is None
                    if looked_late:   # sent during the batch before: looked up now
                        ids, known, _ = look_up(chunk)
                else:
                    (ids, known, todo), ticket, looked_late = look_up(chunk), None, False
                # `full`: the results cover every event of the chunk (sent before its look-up),
                # else only those the look-up found unknown
                full = False
                results = None
                if ticket is not None and self.pool:
                    try:
                        results = worker.result(ticket)
                        full = looked_late
                    except Exception as e:  # noqa: BLE001 - any failure of the worker: prepare here
                        self.worker_failed(e)
                if results is None:
                    if looked_late:
                        todo = [bytes(r) for r, i in zip(chunk, ids) if i is not None and i not in known]
                    results = prepare(todo, keyring, mesh)
                    if worker is not None and self.pool:
                        worker.prepared_here(len(todo))
                it = iter(results)
                for raw, eid in zip(chunk, ids):
                    if eid is None:
                        yield raw, None
                        continue
                    if eid in known:
                        if full:
                            next(it)
                        yield raw, None
                        continue
                    r = next(it)
                    yield raw, (None if r is None else checked_from(r, bytes(raw), eid, st.keyring.get(r[0])))
            done = True
        finally:
            if worker is not None and self.pool:
                if done and sent_after:
                    self.carried = (nxt, after, sent_after)
                else:
                    try:
                        worker.drain()   # a batch that stopped early (a fault): its answers in flight
                    except Exception as e:  # noqa: BLE001
                        self.worker_failed(e)
