"""A sequencer's home: its files, the locks that keep it single (§22.6 singularity, locally),
`sequencer init`, and ``Home``, the opened home the group commit works on: state, keystore bridge
and receipt witness, resumed against the signing journal before anything is served (§22.6 step 1,
resume.py), the groups held on members' evidence (§22.5 cl. 2), journal compaction and the disk
reserve (docs/sequencer.md "Journal compaction", "Disk space")."""
from __future__ import annotations

import fcntl
import logging
import os
import shutil
from pathlib import Path
from typing import Callable, Optional, TypeVar

from firmware_bridge import KeystoreUnavailable, SigningBridge, open_keystore, with_pin
from firmware_bridge import keytag
from firmware_bridge.fsutil import fsync_dir
from firmware_bridge.keystore import KeystoreConfigError, check_config

from agent.sequencer import core, receipts
from agent.sequencer.replies import Rejected, SequencerFault, SequencerRefused, SequencerServing
from agent.sequencer.resume import Settler
from agent.sequencer.store import STATE_PAGE_BYTES, STATE_WAL_CHECKPOINT_PAGES, Store
from agent.sequencer.witness import ReceiptWitness

log = logging.getLogger("ssp_agent.sequencer")

RECEIPT_KEY = "receipts"          # the key name of the receipt-signing identity in the keystore
DB_NAME, JOURNAL_NAME, LOCK_NAME, PIN_NAME = "sequencer.db", "sign-journal", "sequencer.lock", "keystore.pin"
INIT_RECORD = "init.incomplete"   # an init in progress, or cut short: the key it generates (_receipt_key)
RUN_LOCK_NAME = "run.lock"        # held exclusively by `sequencer run`, shared by every other verb
# The signing journal is compacted when it grew this much since its last compaction (and on open
# when larger than the second figure): it then holds each group's last receipt and one floor a
# group, not every receipt ever signed (~350 bytes of disk and of memory each: docs/sequencer.md
# "Journal compaction")
JOURNAL_COMPACT_BYTES = 8 * 2**20
# ... or by this many times what the last compaction kept, if more (`Home.maybe_compact`)
JOURNAL_COMPACT_KEPT_RATIO = 1.0
JOURNAL_OPEN_COMPACT_BYTES = 64 * 2**10

# Free space the home's filesystem keeps beyond the Commits being accepted: below it a Commit is
# refused `disk_full` before anything is written, never cut between its signing intent and its
# receipt (a full disk there became a stated discontinuity on the next start, §22.6). Each Commit
# counts DISK_FACTOR times its bytes (pending row, receipts row, their WAL copies) plus
# DISK_PER_COMMIT (receipt, journal entries, index pages).
# It holds room for the state file's WAL to reach its checkpoint size (store.py) besides 4 MiB.
DISK_RESERVE_BYTES = (4 << 20) + STATE_WAL_CHECKPOINT_PAGES * STATE_PAGE_BYTES
DISK_FACTOR = 4
DISK_PER_COMMIT = 4096

Hook = Callable[[str], None]
_H = TypeVar("_H", bound="Home")


def disk_need(message: bytes) -> int:
    """What accepting ``message`` may write before its receipt is committed (the disk reserve)."""
    return DISK_FACTOR * len(message) + DISK_PER_COMMIT



def _with_pin(conf: dict) -> dict:
    try:
        return with_pin(conf)
    except KeystoreUnavailable as e:
        raise SequencerFault(str(e)) from None


def _lock(home: Path, name: str = LOCK_NAME, how: int = fcntl.LOCK_EX) -> int:
    """One sequencer per home (§22.6 singularity, locally): concurrent verbs queue on this lock."""
    fd = os.open(str(home / name), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, how)
    except BlockingIOError:
        os.close(fd)
        raise SequencerServing(f"a `sequencer run` is serving {home}: submit and register through the "
                               "broker (docs/sequencer.md)") from None
    return fd


def serving(home: Path) -> bool:
    """True while a `sequencer run` holds ``home``."""
    try:
        os.close(_lock(Path(home), RUN_LOCK_NAME, fcntl.LOCK_SH | fcntl.LOCK_NB))
    except SequencerServing:
        return True
    except FileNotFoundError:
        return False
    return False


def init(home: Path, keystore: Optional[dict] = None) -> bytes:
    """Create a sequencer home and its receipt key (ES256, generated inside the keystore).
    Returns the 33-byte compressed public key (the registered form, §22.5)."""
    home = Path(home)
    if (home / DB_NAME).exists():
        raise SequencerRefused(f"{home} already holds a sequencer; it is never overwritten")
    try:        # a request that cannot be right is refused before anything is made
        conf = check_config(keystore or {"kind": "software"})
    except KeystoreConfigError as e:
        raise SequencerRefused(str(e)) from None
    home.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = _lock(home)
    try:
        if (home / DB_NAME).exists():
            raise SequencerRefused(f"{home} already holds a sequencer; it is never overwritten")
        if conf.get("kind") == "software":
            conf.setdefault("dir", str(home / "keystore"))
        if "pin" in conf:     # a token PIN goes to a 0600 file, never into the state database
            pfd = os.open(str(home / PIN_NAME), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(pfd, "w") as f:
                f.write(str(conf.pop("pin")))
                f.flush()
                os.fsync(f.fileno())
            conf["pin_file"] = str(home / PIN_NAME)
        try:
            ks = open_keystore(_with_pin(conf))
            try:
                public = _receipt_key(home, ks, conf)
            finally:
                ks.close()
        except BaseException:
            # a failed init leaves no PIN behind (the home is not made: nothing would read it)
            (home / PIN_NAME).unlink(missing_ok=True)
            raise
        store = Store(home / (DB_NAME + ".new"))
        store.set_meta("keystore", conf)
        store.set_meta("receipt_key", {"name": RECEIPT_KEY, "public_key": public.hex()})
        store.close()
        os.replace(home / (DB_NAME + ".new"), home / DB_NAME)   # the home exists only when complete
        fsync_dir(str(home))
        (home / INIT_RECORD).unlink(missing_ok=True)
        fsync_dir(str(home))
        return public
    finally:
        os.close(fd)


def _receipt_key(home: Path, ks, conf: dict) -> bytes:
    """Generate the receipt key, or take up the one an init of this home cut short made (a key
    cannot be taken back off a token or the serial device, and a software key left in the home's
    own keystore was never used: the state that would have used it was never made); any other key
    of that name is still refused (KeyExists). ``INIT_RECORD``: firmware_bridge/keytag.py."""
    kind = conf.get("kind", "")
    public, taken_up = keytag.generate_or_take_up(ks, RECEIPT_KEY, "p256", home / INIT_RECORD, kind,
                                                  keytag.own_directory(conf, home))
    if taken_up:
        log.warning("taking up the receipt key an unfinished init of %s made on the %s keystore", home, kind)
    return public


class Home:
    """An opened sequencer home. What the group commit (pipeline.py) reads of it is public:
    ``store``, ``bridge``, ``witness``, ``signing`` (the receipts' header, once per key),
    ``held``, ``unproven``, ``max_groups``; and it calls ``hold``, ``rejected``, ``settle``,
    ``sign_statements`` (when ``statements_due``), ``disk_room``, ``maybe_compact``, ``fire``."""

    def __init__(self, home: Path, *, fault_hook: Optional[Hook] = None, serve: bool = False) -> None:
        """Open a sequencer home and resume (§22.6 step 1) before anything is served.
        ``serve``: for `sequencer run`, which holds the home for its lifetime (a second one waits,
        a standby); other openers share the run lock and are refused (SequencerServing) while a
        run holds it. ``fault_hook`` is the test seam for named crash points; production passes none."""
        self.home = Path(home)
        if not (self.home / DB_NAME).exists():
            if (self.home / INIT_RECORD).exists():
                raise SequencerRefused(f"{self.home} holds no sequencer: its `sequencer init` was cut short; "
                                       "run the same `sequencer init` again to complete it")
            raise SequencerRefused(f"{self.home} holds no sequencer (run `sequencer init` first)")
        # an init killed after its state was in place left its key record: it must not outlive the
        # init (a state lost later is recovered, §22.6, never initialised again on that key)
        try:
            (self.home / INIT_RECORD).unlink()
        except OSError:
            pass
        self._hook = fault_hook
        # at most this many groups tracked: a new one beyond it (the first Commit of an unknown
        # group_id, §22.6 bootstrap, or a registration) is refused `group_limit`; None: no bound
        self.max_groups: Optional[int] = None
        self._lock_fd = None
        self._run_fd = _lock(self.home, RUN_LOCK_NAME, fcntl.LOCK_EX if serve else fcntl.LOCK_SH | fcntl.LOCK_NB)
        self._lock_fd = _lock(self.home)
        self.bridge: Optional[SigningBridge] = None
        try:
            self.store = Store(self.home / DB_NAME)
            meta = self.store.get_meta("receipt_key")
            self.public_key = bytes.fromhex(meta["public_key"])
            self.signing = receipts.Signing(receipts.protected_header(self.public_key))
            ks = open_keystore(_with_pin(self.store.get_meta("keystore")))
            if ks.public_key(RECEIPT_KEY) != self.public_key:
                ks.close()
                raise SequencerFault("the keystore's receipt key is not the one this sequencer was "
                                     "initialised with: wrong token or device attached")
            self.bridge = SigningBridge(ks, str(self.home / JOURNAL_NAME), fault_hook=fault_hook)
            self._compacted_at = 0          # the journal's size after its last compaction
            self.witness = ReceiptWitness(self.public_key)
            self.settler = Settler(self.store, self.bridge, self.witness, self.public_key, RECEIPT_KEY, self.fire)
            self.settler.resume()
            # groups members' evidence showed behind (§22.5 cl. 2): not served until recovered
            self.held: set[bytes] = set(self.store.held())
            self._unproven_at_resume: Optional[set[bytes]] = None
            if self.bridge.journal_stats()["bytes"] > JOURNAL_OPEN_COMPACT_BYTES:
                self.compact_journal()
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if getattr(self, "witness", None) is not None:
            self.witness.close()
        if self.bridge is not None:
            self.bridge.close()
            self.bridge.keystore.close()
            self.bridge = None
        if getattr(self, "store", None) is not None:
            self.store.close()
            self.store = None  # type: ignore[assignment]
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        if getattr(self, "_run_fd", None) is not None:
            os.close(self._run_fd)
            self._run_fd = None

    def __enter__(self: _H) -> _H:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def group_limit_detail(self) -> str:
        return f"this sequencer tracks at most {self.max_groups} groups (`sequencer run --max-groups`)"

    def disk_room(self) -> int:
        """Bytes the home's filesystem can still give to Commits (its free space less
        DISK_RESERVE_BYTES)."""
        try:
            return shutil.disk_usage(self.home).free - DISK_RESERVE_BYTES
        except OSError:
            return 1 << 62

    def fire(self, point: str) -> None:
        """A named crash point (the test seam ``fault_hook``)."""
        if self._hook is not None:
            self._hook(point)

    def compact_journal(self) -> dict:
        """Drop from the signing journal every receipt the receipts table holds (or whose gap it
        states): below each group's committed epoch (§22.5 cl. 3: the epoch moves only with the
        receipt or the stated gap), except the group's last one; a group frozen on
        equivocation evidence keeps all of its own for the audit. What the journal forgets this
        way stays spent, never signed again (docs/sequencer.md "Journal compaction")."""
        # a gap whose statement is not signed yet keeps its intent (and the receipt before it) in
        # the journal: a state restored past the floor settles it again and states it then
        unstated: dict[bytes, int] = {}
        for gid, epoch, _ch, _prev in self.store.unsigned_gaps():
            unstated.setdefault(gid, epoch)

        def recorded_below(gid: bytes) -> Optional[int]:
            state = self.store.group(gid)
            if state is None or state.failed_closed:
                return None
            return min(state.current_epoch, unstated.get(gid, state.current_epoch))
        stats = self.bridge.compact_receipts(recorded_below)
        self._compacted_at = stats["bytes_after"]
        return stats

    def maybe_compact(self) -> None:
        # a full compaction rewrites every group's kept entries (~7.6 µs a group; most rewrite
        # only what came since, docs/keystore.md "Compaction"): it waits until the journal grew by
        # what it keeps, at least JOURNAL_COMPACT_BYTES, so its cost per Commit stays bounded
        # however many groups, and the journal (with its in-memory index) within twice its
        # compacted size plus that step ("Journal compaction")
        grown = self.bridge.journal_stats()["bytes"] - self._compacted_at
        if grown >= max(JOURNAL_COMPACT_BYTES, JOURNAL_COMPACT_KEPT_RATIO * self._compacted_at):
            self.compact_journal()

    def hold(self, group_id: bytes, evidence: str, detail: dict) -> None:
        """§22.5 cl. 2: members' evidence (``evidence``: core.BROKER_HEAD or core.COMMIT_AHEAD)
        shows this state behind what was released; the group is served nothing that signs until
        `sequencer recover` resumes it from members' receipts (docs/sequencer.md)."""
        if group_id in self.held:
            return
        log.warning("group %s held (%s): this state is behind what was released (a restored machine?); "
                    "run `sequencer recover` with members' evidence", group_id.hex(), evidence)
        self.store.hold(group_id, core.STATE_BEHIND, {"group": group_id.hex(), "evidence": evidence, **detail})
        self.held.add(group_id)

    @property
    def unproven(self) -> set[bytes]:
        """``_unproven`` as it was after this open's resume: read once, when first needed (`run`
        reads it before serving; a one-shot verb only on a Commit framed ahead)."""
        if self._unproven_at_resume is None:
            self._unproven_at_resume = self._unproven()
        return self._unproven_at_resume

    def _unproven(self) -> set[bytes]:
        """The groups whose state the receipt witness does not vouch for after this resume: a
        released receipt (a head) the witness lacks or holds another of, or any group at all when
        the witness holds nothing while this home holds receipts (a witness lost with the old
        machine). The witness proves a home restore only: a whole-machine restore restores it too
        (docs/sequencer.md "Evidence from members on resume")."""
        top = self.witness.top
        out, unreceipted, any_head = set(), set(), False
        for s in self.store.iter_groups():
            if s.failed_closed or s.migrated:
                continue
            if s.head is None:
                unreceipted.add(s.group_id)
                continue
            any_head = True
            w = top.get(s.group_id)
            if w is None or w[0] != s.head.epoch or receipts.receipt_hash(w[1]) != s.head.receipt_hash:
                out.add(s.group_id)
        return out | unreceipted if any_head and not top else out

    def rejected(self, d: core.Decision) -> Rejected:
        assert isinstance(d, core.Reject)
        head = None if d.head is None or d.group_id is None else self.store.receipt(d.group_id, d.head.epoch)
        return Rejected(d.reason, d.group_id, d.current_epoch, head, d.detail)

    def settle(self, gid: bytes, epoch: int, *, cause: str, candidate: Optional[tuple[bytes, bytes]] = None) -> None:
        """Bring (group, epoch) in line with the journal, never signing (``Settler.settle``)."""
        self.settler.settle(gid, epoch, cause=cause, candidate=candidate)

    @property
    def statements_due(self) -> bool:
        """A gap was recorded whose statement of absence is not signed yet (§22.6 step 4)."""
        return self.settler.unsigned

    def sign_statements(self) -> None:
        """Sign the statement of every gap recorded and not stated yet (``Settler.sign_statements``)."""
        self.settler.sign_statements()
