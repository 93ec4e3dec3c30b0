"""SigningBridge: the only way to obtain signed bytes (SOVM §22.5 clauses 1-2).

Order inside ``release`` / ``release_many`` (docs/keystore.md "The order of steps"):

  (a) durably record an INTENT for every identity          -- journal fsync #1
  (b) sign (keystore._sign), assemble the COSE_Sign1 bytes  -- caller's ``assemble``
  (c) durably persist the exact assembled bytes             -- journal fsync #2
  (d) return them

(a) before (b): after a crash, any identity that *might* have been signed is known (the device
or token may have produced a signature we never saw), so it is never signed twice (§22.5 cl. 2).
(c) before (d): nothing leaves the bridge that is not durable, so a restart can re-transmit
exactly those bytes instead of re-signing (§22.5 cl. 1).  The caller receives bytes only as the
return value of this class's methods, after (c); there is no public path to a bare signature, so
the unsafe order cannot be written with this API.

An identity with a durable intent and no durable output raises ``OutcomeUnknown`` for ever:
events tick their HLC and sign a new identity (docs/protocol.md §0, "No re-signing"); receipts take the §22.6
"epoch advanced, receipt absent" discontinuity path.
"""
from __future__ import annotations

import enum
import threading
from typing import Callable, Iterator, Optional, Sequence

from .errors import KeystoreError, OutcomeUnknown, UnsupportedAlgorithm
from .identity import DiscontinuityIdentity, EventIdentity, Identity, ReceiptIdentity, decode_identity
from .journal import INTENT, RELEASED, FileOps, Journal
from .keystore import Keystore
from .sealing import Sealer
from .verify import verify_ed25519, verify_p256

Assemble = Callable[[bytes], bytes]
Item = tuple[Identity, str, bytes, Assemble]
Hook = Callable[[str], None]


class Status(enum.Enum):
    ABSENT = "absent"                  # never intended: may be signed
    IN_FLIGHT = "in_flight"            # being signed by another thread of this process
    OUTCOME_UNKNOWN = "outcome_unknown"  # durable intent, no durable output: never sign again
    RELEASED = "released"              # durable output: re-transmit exactly these bytes


def _unknown_message(identity: Identity) -> str:
    if isinstance(identity, ReceiptIdentity):
        return (f"{identity}: a signing intent was recorded but no receipt was persisted (crash or fault "
                "between intent and persist). Under SOVM §22.5 clause 2 this pair counts as already signed and "
                "will never be re-signed: the sequencer must take the §22.6 'epoch advanced, receipt absent' "
                "path (record and surface a receipt-chain discontinuity, chain forward).")
    if isinstance(identity, DiscontinuityIdentity):
        return (f"{identity}: a signing intent was recorded but no statement was persisted; it was never "
                "released and is never signed again: the sequencer signs the same statement under the next attempt.")
    return (f"{identity}: a signing intent was recorded but no event was persisted, or the journal was compacted "
            "past it (then its output, if any, was recorded by the agent). This HLC is spent: tick "
            "the HLC above bridge.max_event_hlc(site_id) and sign a new event (SSP/1 §13.5); "
            "never re-sign this one.")


def _expected_alg(identity: Identity) -> str:
    return "ed25519" if isinstance(identity, EventIdentity) else "p256"


class SigningBridge:
    """Persist-before-release around a Keystore.  Thread-safe; concurrent callers share fsyncs."""

    def __init__(self, keystore: Keystore, journal_path: str, *,
                 fault_hook: Optional[Hook] = None, file_ops: Optional[FileOps] = None,
                 sealer: Optional[Sealer] = None) -> None:
        """``fault_hook`` and ``file_ops`` are test seams (named crash points, lost-fsync shims);
        production passes neither. ``sealer`` (sealing.Sealer): the journal keeps its outputs
        sealed at rest (docs/reliability.md "At rest"); the bytes returned are the clear ones."""
        self._ks = keystore
        self._hook = fault_hook
        self._journal = Journal(journal_path, ops=file_ops, hook=fault_hook, sealer=sealer)
        self._lock = threading.Lock()
        self._inflight: dict[bytes, threading.Event] = {}
        self._pub: dict[str, tuple[str, bytes]] = {}
        self._verify = bool(getattr(keystore, "verify_signatures", True))

    # -- public API ------------------------------------------------------------------------
    def release(self, identity: Identity, key_name: str, tbs: bytes, assemble: Assemble) -> bytes:
        """Sign ``tbs`` (the exact Sig_structure) for ``identity`` and return the persisted
        ``assemble(signature)`` bytes; or the bytes already persisted for ``identity``."""
        return self._release([(identity, key_name, tbs, assemble)])[0]

    def release_many(self, items: Sequence[Item], intended: Optional[Callable[[], None]] = None) -> list[bytes]:
        """Group commit: all intents in one fsync, all signatures, all outputs in one fsync.
        ``intended``: called once the batch's intents are durable, before it is signed (not when
        nothing is signed), so what must follow them (the agent's clock witness) can overlap the
        signing; what it starts is the caller's to finish."""
        return self._release(list(items)) if intended is None else self._release(list(items), intended)

    def released(self, identity: Identity) -> Optional[bytes]:
        """The exact persisted bytes for ``identity`` (for re-transmission), or None."""
        return self._journal.read_released(self._ident(identity))

    def iter_released(self) -> Iterator[tuple[Identity, bytes]]:
        """Every persisted output, in persist order: after a crash between release and apply, the
        agent re-applies the ones its store lacks (docs/keystore.md, local event production)."""
        for ident, _loc in self._journal.released_items():
            out = self._journal.read_released(ident)   # by identity: a compaction may move it
            if out is not None:
                yield decode_identity(ident), out

    def compact_events(self, recorded: Callable[[EventIdentity], bool]) -> dict[str, int]:
        """Compact the journal (docs/keystore.md "Compaction"): drop every released event for which
        ``recorded(identity)`` is true — the caller promises its exact bytes are durable elsewhere
        (the agent: in its event log) — and every event intent without output (spent), leaving one
        FLOOR per site at the highest HLC ever intended. Receipts are kept in full. Afterwards an
        event identity at or below its site's floor that the journal no longer holds is spent:
        ``release`` raises ``OutcomeUnknown`` for it and never signs it. Returns counts."""
        return self._journal.compact_events(recorded, self._busy)

    def compact_receipts(self, recorded_below: Callable[[bytes], Optional[int]]) -> dict[str, int]:
        """Compact the journal's receipts (docs/keystore.md "Compaction"): ``recorded_below(group_id)``
        is the epoch below which the caller holds every receipt of the group durably (or the stated
        gap of an epoch without one), or None. Those receipts are dropped, except the group's last
        released receipt below it (its chain head) and the gap intents after it, leaving one FLOOR
        per group; any identity the journal forgot this way is spent:
        ``status`` says OUTCOME_UNKNOWN and ``release`` never signs it again. Events are kept."""
        return self._journal.compact(None, self._busy, recorded_below)

    def _busy(self) -> set:
        with self._lock:
            return set(self._inflight)

    def journal_stats(self) -> dict[str, int]:
        """{"bytes", "entries", "fsyncs", "compactions"}: when to compact."""
        return self._journal.stats()

    def status(self, identity: Identity) -> Status:
        ident = self._ident(identity)
        with self._lock:
            if ident in self._inflight:
                return Status.IN_FLIGHT
        return {"absent": Status.ABSENT, "intent": Status.OUTCOME_UNKNOWN, "spent": Status.OUTCOME_UNKNOWN,
                "released": Status.RELEASED}[self._journal.state(ident)]

    def public_key(self, key_name: str) -> bytes:
        """The public key this bridge checks ``key_name``'s signatures against (fetched once)."""
        return self._public(key_name)[1]

    def max_event_hlc(self, site_id: bytes) -> Optional[tuple[int, int]]:
        """Highest HLC ever *intended* for ``site_id``: the clock resumes above it (SSP/1 §13.5)."""
        return self._journal.max_event_hlc(site_id)

    def event_gap(self, site_id: bytes) -> Optional[tuple[tuple[int, int], tuple[int, int]]]:
        """(low, top): the site's recorded never-issued range (``open_event_gap``), low raised to the
        highest identity intended inside it since; None without one."""
        return self._journal.event_gap(site_id)

    def open_event_gap(self, site_id: bytes, low: tuple[int, int], top: tuple[int, int]) -> None:
        """Durably record that no event identity of ``site_id`` strictly between ``low`` and ``top``
        was ever intended (the caller's clock knows it: docs/apply.md "Clocks without an RTC"), so
        they may be signed although a compaction's FLOOR lies above them. Refused (KeystoreError)
        by a keystore that only signs identities above the last one it signed (serial firmware)."""
        if self._ks.upward_only:
            raise KeystoreError(f"the {self._ks.kind} keystore signs only identities above the last one it "
                                "signed; it cannot sign in a gap below it")
        self._journal.open_gap(site_id, low, top)

    def receipt_groups(self) -> dict:
        """group_id -> journal.ReceiptGroup (floor, lowest and highest epoch held, statements held):
        what a resume compares a restored state with (§22.6 step 1)."""
        return self._journal.receipt_groups()

    def max_receipt_epoch(self, group_id: bytes) -> Optional[int]:
        """Highest epoch ever intended for ``group_id`` (§22.6 step 1: detect an absent receipt)."""
        return self._journal.max_receipt_epoch(group_id)

    @property
    def keystore(self) -> Keystore:
        return self._ks

    def describe(self) -> dict[str, object]:
        return {"journal": self._journal.path, "keystore": self._ks.describe()}

    def close(self) -> None:
        self._journal.close()

    def __enter__(self) -> "SigningBridge":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the one path every signature takes ----------------------------------------------------
    @staticmethod
    def _ident(identity: Identity) -> bytes:
        if not isinstance(identity, (EventIdentity, ReceiptIdentity, DiscontinuityIdentity)):
            raise TypeError("identity must be an EventIdentity, a ReceiptIdentity or a DiscontinuityIdentity")
        return identity.encode()

    def _public(self, key_name: str) -> tuple[str, bytes]:
        got = self._pub.get(key_name)
        if got is None:
            got = (self._ks.algorithm(key_name), self._ks.public_key(key_name))  # KeyNotFound early
            self._pub[key_name] = got
        return got

    def _release(self, items: list[Item], intended: Optional[Callable[[], None]] = None) -> list[bytes]:
        t = self._claim(items)
        try:
            if t.todo:
                self._sign_and_persist(t.items, t.idents, t.todo, t.results, intended)
            return [t.results[i] for i in t.idents]
        finally:
            self._unclaim(t)

    def release_pipelined(self, finish: Optional["Ticket"], items: Sequence[Item]) -> tuple[Optional[list[bytes]], Optional["Ticket"]]:
        """One step of a pipelined group commit (the sequencer's, docs/sequencer.md "Pipelined
        group commit"): ``finish``'s signatures are awaited and checked, its outputs persisted and
        ``items``' intents made durable in ONE journal commit (one fsync for both), and only then
        is the signing of ``items`` started, in a keystore that may sign in another process
        (Keystore._sign_start). Returns ``finish``'s persisted outputs in its items' order (None
        without ``finish``) and the ticket of ``items`` to pass as ``finish`` to a later step (None
        without items). The order of steps per identity is release_many's: durable intent, sign,
        durable output, return. On any exception both are settled as far as they got — ``finish``'s
        outputs that verified are persisted, ``items`` have no intent unless ``finish`` was clean —
        every claim is dropped, and the caller settles both batches against the journal."""
        t: Optional[Ticket] = None
        try:
            done: list[tuple[bytes, bytes]] = []
            failure: Optional[BaseException] = None
            if finish is not None and finish.todo:
                try:
                    sigs, failure = finish.wait()
                    failure = self._take(finish.items, finish.idents, finish.order, finish.requests, sigs, done) or failure
                except BaseException as exc:
                    failure = exc
                self._fire("before_persist")
            if items:
                try:   # claimed after ``finish`` is in: a refusal here still persists its outputs
                    t = self._claim(list(items))
                except BaseException as exc:
                    failure = failure or exc
            records: list[tuple[int, bytes, bytes | str]] = [(RELEASED, ident, out) for ident, out in done]
            intents = t is not None and bool(t.todo) and failure is None
            if intents:
                assert t is not None  # `intents` says so
                records += [(INTENT, t.idents[k], t.items[k][1]) for k in t.todo]
            if records:
                self._journal.commit(records)
            if done:
                self._fire("after_persist")
            if failure is not None:
                raise failure
            outs = None
            if finish is not None:
                finish.results.update(done)
                outs = [finish.results[i] for i in finish.idents]
            if intents:
                assert t is not None
                self._fire("after_intent")
                # sign in identity order (a serial device refuses identities at/below its last one)
                t.order = sorted(t.todo, key=lambda k: t.idents[k])
                t.requests = [(t.items[k][1], t.items[k][0], bytes(t.items[k][2])) for k in t.order]
                t.wait = self._ks._sign_start(t.requests)
            return outs, t
        except BaseException:
            if t is not None:
                self._unclaim(t)
            raise
        finally:
            if finish is not None:
                self._unclaim(finish)

    def _claim(self, items: list[Item]) -> "Ticket":
        """Check ``items`` and claim their identities (waiting out other threads' in-flight
        signing of the same ones); those the journal already released are read into the ticket's
        results (§22.5 cl. 1: re-transmit exactly the persisted bytes), an intent without output
        raises OutcomeUnknown. The caller ``_unclaim``s the ticket, whatever happens."""
        idents: list[bytes] = []
        fits: set[tuple[str, type]] = set()   # (key name, identity kind) pairs checked in this call
        for identity, key_name, tbs, assemble in items:
            ident = self._ident(identity)
            if not isinstance(tbs, (bytes, bytearray)) or not callable(assemble):
                raise TypeError("tbs must be bytes and assemble a callable(signature) -> bytes")
            if (key_name, type(identity)) not in fits:
                alg, _ = self._public(key_name)  # checked before any intent: nothing is burnt by a typo
                if alg != _expected_alg(identity):
                    raise UnsupportedAlgorithm(f"key {key_name!r} is {alg}; {type(identity).__name__} needs "
                                               f"{_expected_alg(identity)} (events: ed25519, receipts: p256)")
                fits.add((key_name, type(identity)))
            idents.append(ident)
        if len(set(idents)) != len(idents):
            raise ValueError("release_many: the same identity appears twice in one batch")
        t = Ticket(items, idents)
        try:
            while True:
                with self._lock:
                    busy = [self._inflight[i] for i in idents if i in self._inflight]
                    if not busy:
                        for k, state in enumerate(self._journal.states(idents)):
                            if state in ("intent", "spent"):
                                raise OutcomeUnknown(_unknown_message(items[k][0]), items[k][0])
                            if state == "absent":
                                t.todo.append(k)
                        for k in t.todo:
                            self._inflight[idents[k]] = t.done_event
                            t.mine.append(idents[k])
                        break
                for waiting in busy:
                    waiting.wait()
            todo_set = set(t.todo)
            for k, ident in enumerate(idents):
                if k not in todo_set:
                    out = self._journal.read_released(ident)
                    if out is None:   # compacted away since the look-up: spent (the caller holds it)
                        raise OutcomeUnknown(_unknown_message(items[k][0]), items[k][0])
                    t.results[ident] = out
        except BaseException:
            self._unclaim(t)
            raise
        return t

    def _unclaim(self, t: "Ticket") -> None:
        mine, t.mine = t.mine, []
        if mine:
            with self._lock:
                for ident in mine:
                    del self._inflight[ident]
            t.done_event.set()

    def _sign_and_persist(self, items: list[Item], idents: list[bytes], todo: list[int],
                          results: dict[bytes, bytes], intended: Optional[Callable[[], None]] = None) -> None:
        # (a) intents, one durable commit for the whole batch
        self._journal.commit([(INTENT, idents[k], items[k][1]) for k in todo])
        self._fire("after_intent")
        if intended is not None:
            intended()
        # (b) sign in identity order (a serial device refuses identities at/below its last one);
        # the keystore may sign a large batch on several cores, the outputs are the same
        order = sorted(todo, key=lambda k: idents[k])
        requests = [(items[k][1], items[k][0], bytes(items[k][2])) for k in order]
        done: list[tuple[bytes, bytes]] = []
        failure: Optional[BaseException] = None
        # The signatures are checked as they come (a keystore signing in another process makes the
        # next chunk meanwhile, Keystore._sign_chunks); the first failure, the keystore's or a
        # check's, ends the batch: the rest stays OutcomeUnknown.
        chunks = self._ks._sign_chunks(requests)
        try:
            pos = 0
            for sigs in chunks:
                failure = self._take(items, idents, order[pos:pos + len(sigs)], requests[pos:pos + len(sigs)], sigs, done)
                if failure is not None:
                    break
                pos += len(sigs)
        except BaseException as exc:
            failure = exc
        finally:
            chunks.close()
        self._fire("before_persist")
        # (c) persist every output we have, one durable commit; (d) only then return them
        if done:
            self._journal.commit([(RELEASED, ident, out) for ident, out in done])
            self._fire("after_persist")
        if failure is not None:
            raise failure
        results.update(done)

    def _take(self, items: list[Item], idents: list[bytes], order: list[int], requests: list, sigs: list,
              done: list) -> Optional[BaseException]:
        """Check and assemble one chunk of signatures into ``done``; the failure that stopped it."""
        check = self._verify   # else only the signature's form is checked (an in-process keystore)
        hook = self._hook
        for k, (key_name, _identity, tbs), sig in zip(order, requests, sigs):
            assemble = items[k][3]
            try:
                if check or type(sig) is not bytes or len(sig) != 64:
                    self._check_signature(key_name, tbs, sig)
                out = assemble(sig)
                if type(out) is not bytes:
                    if not isinstance(out, bytearray):
                        raise TypeError("assemble(signature) must return the encoded COSE_Sign1 bytes")
                    out = bytes(out)
                if not out:
                    raise TypeError("assemble(signature) must return the encoded COSE_Sign1 bytes")
            except BaseException as exc:  # the rest of the batch stays OutcomeUnknown
                return exc
            done.append((idents[k], out))
            if hook is not None:
                hook("after_sign")
        return None

    def _check_signature(self, key_name: str, tbs: bytes, sig: bytes) -> None:
        if not isinstance(sig, bytes) or len(sig) != 64:
            raise KeystoreError(f"keystore returned a malformed signature for key {key_name!r}")
        if not self._verify:
            return
        alg, pub = self._public(key_name)
        ok = verify_ed25519(pub, tbs, sig) if alg == "ed25519" else verify_p256(pub, tbs, sig)
        if not ok:
            raise KeystoreError(f"keystore returned a signature that does not verify under key {key_name!r}; "
                                "nothing was released. Check the device/token (wrong key, fault or tampering).")

    def _fire(self, point: str) -> None:
        if self._hook is not None:
            self._hook(point)


class Ticket:
    """A batch of ``_claim``ed identities: what ``release_pipelined`` started and finishes later."""
    __slots__ = ("items", "idents", "todo", "mine", "results", "order", "requests", "wait", "done_event")

    def __init__(self, items: list[Item], idents: list[bytes]) -> None:
        self.items = items
        self.idents = idents
        self.todo: list[int] = []
        self.mine: list[bytes] = []
        self.results: dict[bytes, bytes] = {}
        self.order: list[int] = []
        self.requests: list = []
        self.wait: Callable[[], tuple[list[bytes], Optional[BaseException]]] = lambda: ([], None)
        self.done_event = threading.Event()   # shared by its identities' waiters
