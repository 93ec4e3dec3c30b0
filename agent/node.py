"""The node runtime: the one apply path (§12), local writes through the keystore bridge,
materialization (§13) and the operator's views. Transports, the mailbox and the CLI all
call `Node.apply_batch`; nothing else writes rows."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sqlite3
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from firmware_bridge import (EventIdentity, KeyExists, KeystoreError, KeystoreUnavailable, SigningBridge,
                             open_keystore, with_pin)
from firmware_bridge import keytag
from firmware_bridge.errors import DeviceTimeout
from firmware_bridge.fsutil import atomic_write, fsync_dir
from firmware_bridge.journal import inspect as journal_inspect

from . import clockgap, identity as ident, produce
from .clockstate import now_ms  # re-exported: callers read the wall clock as node.now_ms
from .core import cose, events as ev, numbers, reasons as R
from .core.clock import Hlc, beyond_skew
from .core.codec import DecodeError, decode_strict
from .core.merge import Effects, RowState, below, merge_delete, merge_upsert, rebuild_columns, rebuild_without
from .core.schema import SYNCABLE, ManifestError, TableDef, fold, parse_manifest, table_def_from
from .profile import Profile, ProfileError, load_profile
from .outcomes import to_json
from .outcomes import APPLIED, DROPPED, DUPLICATE, HELD, REJECTED, Outcome
from .errors import NodeError  # re-exported: raised and caught as node.NodeError
from .produce import EVENT_KEY  # re-exported
from .store import atrest, counters, db, eventlog, migrations, reports, rows as rowstore, sync_state

log = logging.getLogger("ssp_agent")

# Held events (§13.6 row 1) are bounded per signer and in total, so neither fictional tables nor
# one signer can fill the disk or crowd out another signer's holds. What does
# not fit is rejected (surfaced; the sender re-offers it later), never dropped.
HELD_LIMIT_PER_SIGNER = 10_000
HELD_LIMIT_TOTAL = 100_000
# Events one eviction transaction deletes: its WAL (about a page per event it touches) must fit in
# the space the home reserves (db.RESERVE_BYTES) whatever the store's size.
EVICT_BATCH = 1000
JOURNAL_COMPACT_BYTES = 4 * 2**20  # compact the signing journal when it grew this much since the last time
JOURNAL_OPEN_COMPACT_BYTES = 64 * 2**10  # on open, compact only a journal larger than this (or after a recovery)


class ClockUntrusted(NodeError):
    """Reason code `clock_untrusted`: an operation that needs a trustworthy wall clock (eviction,
    a horizon change, `init`) found none and had no override (docs/apply.md "Clocks without an RTC")."""


@dataclass
class _Table:
    tdef: TableDef
    rows: rowstore.RowStore
    horizon: tuple[int, int] | None


class Node:
    STORE_FILE = "store.sqlite"
    IDENTITY_FILE = "identity.json"
    # Present while `init` runs (what the home held before it, for undoing): an init cut short by
    # a kill or a power cut is completed by the next one, which first removes what that one made
    INIT_MARKER = "init.incomplete"

    def __init__(self, home: Path, conn: sqlite3.Connection, bridge: SigningBridge | None, *,
                 read_only: bool = False, log_seal: atrest.LogSeal | None = None) -> None:
        self.home = home
        self.conn = conn
        self.bridge = bridge
        self.log_seal = log_seal   # None in a read view: it reads no payload (agent/store/atrest.py)
        if log_seal is not None:
            atrest.install(conn, log_seal)
        self.read_only = read_only
        self._pool = None   # the apply workers: None not started yet, False none (agent/applyworker.py)
        self._batched = 0   # events of batches of 64 or more applied while none was started
        # The batch the caller expects to apply next (`prepare_next`), and the first chunks of it
        # sent to the workers during the batch before: (its raws, its chunks, their tickets).
        self._next_raws = None
        self._carried: tuple | None = None
        self.site_id: bytes = bytes(db.get_meta(conn, "site_id"))
        self.mesh_id: bytes = bytes(db.get_meta(conn, "mesh_id"))
        self.authorities: set[bytes] = {bytes.fromhex(a) for a in json.loads(db.get_meta(conn, "authorities", "[]"))}
        self.profile = Profile.from_dict(json.loads(db.get_meta(conn, "profile", "null") or "null")
                                         or load_profile(None).as_dict())
        if not read_only:   # a read view writes nothing (an older layout is read as it is)
            db.scrub_superseded(conn, self.profile.secure_delete)
            db.ensure_held_counts(conn)
        self._load_caches()
        self.witness = ident.ClockWitness(self.site_id)
        self.clock = self._resume_clock()
        clockgap.resume(self)   # inside the gap a wrong clock left, if it issues there
        ev_ms = db.get_meta(conn, "clock_evidence")
        self.clock_evidence: int | None = int(ev_ms) if ev_ms is not None else None
        self._applied = int(db.get_meta(conn, "applied_count", 0))
        self._logged: set[tuple[int, int]] = set()   # HLCs of own events write_many logged since the last compaction
        if read_only:
            return   # a read view: the repairs below write, and are left to the next writing open
        if log_seal is not None and atrest.pending(conn) is not None:
            # A store written before the log was sealed, or a data-key rotation: (re)seal every
            # row in batches, each committed with its cursor (a crash resumes here).
            done = atrest.reseal(conn, log_seal)
            log.warning("event log sealed at rest under data key %d (%d rows rewritten)",
                        log_seal.sealer.current, done["rewritten"])
        stale = rowstore.stale_views(conn, [t.tdef for t in self.tables.values()])
        if stale:  # views made before they carried "C$state" (docs/apply.md)
            with _txn(conn):
                for tdef in stale:
                    rowstore.create_view(conn, tdef)
        if self._trust_changed():  # e.g. a home written before trust changes were rebuilt
            with _txn(self.conn):
                self._reconcile_trust(now_ms())
        # A crash between creating a table and releasing its held events: finish it now.
        for q in eventlog.held_tables(conn):
            if q in self.tables:
                self.retry_held(q)
        if bridge is not None:
            self._recover_released()
            if log_seal is not None:
                if atrest.journal_pending(conn):
                    # a migrated store or a rotation: compaction re-seals the journal's outputs
                    # under the current key, after which the older keys can go
                    self.compact_journal()
                    atrest.journal_resealed(conn)
                atrest.drop_retired_keys(conn, log_seal)
            self._redeliver_if_restored()
            clockgap.recover(self)   # own writes stamped ahead that reached no one: re-issued

    def _redeliver_if_restored(self) -> None:
        """A home restored from an older copy lost events it had applied, and its peers' cursors
        are past them: ask every peer to offer its history again (a rehydrate request that keeps
        the horizons, agent/rehydrate.py). Detected by the applied count kept beside the witness,
        outside the home. The node's own events signed after the copy cannot come back to it
        (§32.1 drops them unconditionally); peers keep them, and the lost-history floor keeps
        receivers from counting them as held here (docs/protocol.md §3)."""
        mirrored = self.witness.read_applied()
        if mirrored is None or mirrored <= self._applied:
            return
        from . import rehydrate
        log.warning("this home applied %d events before and holds %d now (restored from an older copy?): "
                    "asking peers to offer their history again", mirrored, self._applied)
        rehydrate.start(self, None, reset=False, cause="restored_home")
        with _txn(self.conn):
            self._applied = mirrored
            db.set_meta(self.conn, "applied_count", mirrored)
            reports.surface(self.conn, now_ms(), "restored_home", "applied_count_behind_witness",
                            json.dumps({"applied_before": mirrored}))

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def init(cls, home: Path, manifest_text: str, keystore: dict | None = None,
             profile: str | Profile | None = None, *, clock_trusted: bool = False,
             wait_clock_s: float = 0) -> tuple["Node", bytes]:
        """Create a node: identity, keystore key, store, manifest tables. Returns (node, public_key).
        The profile (agent/profiles/*.toml) sets horizons, limits and the default keystore."""
        # Absolute: what the store records (keystore dir, PIN file) must not depend on the directory
        # `init` ran in; a systemd unit or cron starts the node from elsewhere.
        home = Path(home).absolute()
        interrupted = _Made.interrupted(home)
        if interrupted is not None:
            log.warning("an earlier init of %s was cut short: removing what it made", home)
            interrupted.undo(keep_device_key=False)
        if (home / cls.STORE_FILE).exists() or (home / cls.IDENTITY_FILE).exists():
            raise NodeError(f"{home} already holds a node; choose an empty directory (a node is never re-initialised in place)")
        manifest = parse_manifest(manifest_text)
        try:
            prof = profile if isinstance(profile, Profile) else load_profile(profile)
        except ProfileError as e:
            raise NodeError(str(e)) from None
        _check_retention(prof, manifest.tables)
        ks_conf = _check_keystore_conf(dict(keystore or prof.keystore))
        # A node's first evidence of real time is the reading taken here: a wrong one would let
        # its first writes be stamped anywhere, so `init` waits for a trustworthy clock in strict
        # mode (first-boot enrolment, --wait-clock); elsewhere an unverifiable clock is accepted
        # with a warning and recorded as no evidence (`_require_trusted_clock`).
        clock = _require_trusted_clock(None, "init", clock_trusted, wait_clock_s)
        # A failed init takes back everything it made (probe r01: a store and a keystore left by a
        # failure made the home refuse `init` and crash `status`): what the home and an outside
        # software keystore directory held before is noted, and anything new removed on failure.
        made = _Made.noting(home, ks_conf)
        if interrupted is not None:
            made.device_key = interrupted.device_key
        try:
            return cls._init_in(home, manifest, prof, ks_conf, clock, made)
        except BaseException:
            made.undo()
            raise

    @classmethod
    def _init_in(cls, home: Path, manifest, prof: Profile, ks_conf: dict, clock: dict,
                 made: "_Made") -> tuple["Node", bytes]:
        home.mkdir(parents=True, exist_ok=True)
        os.chmod(home, 0o700)
        made.record()   # durable before anything else is made here
        site_id = os.urandom(16)
        if ks_conf.get("kind") == "software":
            ks_conf["dir"] = str(Path(ks_conf.get("dir") or home / "keystore").absolute())
        wrote_pin = "pin" in ks_conf
        ks_conf = keep_pin_out_of_store(home, ks_conf)
        try:
            ks = open_keystore(resolve_pin(ks_conf))
            kind = ks_conf.get("kind", "")
            try:
                public_key = ks.generate_key(EVENT_KEY, "ed25519", tag=made.generating(kind))
            except KeyExists:
                existing = ks.public_key(EVENT_KEY)
                if not made.reusable(kind, existing, ks.key_tag(EVENT_KEY)):
                    made.nothing_generated()   # another's key: none of this init's is on the device
                    raise
                log.warning("taking up the event key an unfinished init of %s made on the %s keystore",
                            home, ks_conf.get("kind"))
                public_key = existing
            except (DeviceTimeout, KeystoreUnavailable):
                raise      # the device may have made it: its record stays for the next init
            except KeystoreError:
                made.nothing_generated()   # refused by the device: nothing of this init is on it
                raise
            made.generated(ks_conf.get("kind", ""), public_key)
        except BaseException:
            if wrote_pin:  # a failed init leaves no PIN behind (it would outlive the attempt)
                Path(ks_conf["pin_file"]).unlink(missing_ok=True)
            raise
        # Paths inside the home are stored relative to it, so the home can move (docs/operations.md).
        for k in ("dir", "pin_file"):
            if k in ks_conf and Path(ks_conf[k]).parent == home:
                ks_conf[k] = Path(ks_conf[k]).name
        conn = db.connect(home / cls.STORE_FILE)
        try:
            cls._make_store(conn, home, site_id, public_key, manifest, prof, ks_conf, clock)
        finally:
            # Closed here, not left to the garbage collector: an open connection keeps the WAL (and every
            # page version in it) on the card after the node's own close.
            conn.close()
            ks.close() if hasattr(ks, "close") else None
        return cls.open(home), public_key

    @classmethod
    def _make_store(cls, conn: sqlite3.Connection, home: Path, site_id: bytes, public_key: bytes, manifest,
                    prof: Profile, ks_conf: dict, clock: dict) -> None:
        migrations.create(conn)
        with _txn(conn):
            db.set_meta(conn, "site_id", site_id)
            db.set_meta(conn, "mesh_id", manifest.mesh_id)
            db.set_meta(conn, "public_key", public_key)
            db.set_meta(conn, "authorities", json.dumps([a.hex() for a in manifest.authorities]))
            db.set_meta(conn, "profile", json.dumps(prof.as_dict()))
            db.set_meta(conn, "keystore", json.dumps(ks_conf))
            db.set_meta(conn, "machine", ident.machine_fingerprint())
            db.set_meta(conn, "clock_ceiling", 0)
            if clock["trusted"]:  # an unverified reading is no evidence (docs/apply.md)
                db.set_meta(conn, "clock_evidence", clock["now_ms"])
            db.set_meta(conn, "surfaced_limit", prof.surfaced_limit)
            db.set_meta(conn, "records_limit", prof.records_limit)
            db.set_meta(conn, "records_limit_bytes", prof.records_limit_bytes)
            sync_state.put_keyring(conn, site_id, public_key, None, "self", replace=False)
            for p in manifest.peers:
                if p.site_id == site_id:
                    continue
                sync_state.put_keyring(conn, p.site_id, p.public_key, p.retired_after, "manifest")
            for t in manifest.tables:
                _create_table_rows(conn, t)
        _write_identity_file(home, site_id, public_key, manifest.mesh_id, ks_conf)
        db.ensure_reserve(home)   # the space eviction may use on a full disk (agent/store/db.py)
        ident.claim_home(site_id, home)
        _Made.done(home)

    @classmethod
    def open(cls, home: Path, *, check_machine: bool = True, read_only: bool = False) -> "Node":
        """``read_only``: for the read verbs (status, dump, log, events). Writes nothing (no WAL
        set-up, no recovery, no journal compaction, no keystore), so they work on a full disk and
        beside a running agent; the journal is only inspected, and damage in it still refuses."""
        home = Path(home)
        path = home / cls.STORE_FILE
        if (home / cls.INIT_MARKER).exists():
            raise NodeError(f"the init of {home} was cut short (killed, or the power went); run the same `init` again: "
                            "it removes what the first one made and completes")
        if not path.exists():
            raise NodeError(f"{home} holds no node; create one with `ssp-agent --home {home} init --manifest FILE`")
        conn = db.connect_readonly(path) if read_only else db.connect(path)
        try:
            # The layout version: a newer store is refused by both kinds of open;
            # a writing open migrates an older one forward (below, once the identity checks pass,
            # so a refused open changes nothing), a read view reads it as it is.
            migrations.refuse_newer(conn, path)
        except BaseException:
            conn.close()
            raise
        if check_machine:
            bound = db.get_meta(conn, "machine")
            here = ident.machine_fingerprint()
            if bound is not None and bound != here:
                site = bytes(db.get_meta(conn, "site_id")).hex()
                conn.close()
                raise NodeError(
                    f"this home belongs to site {site}, created on another machine ({bound}, this is {here}). "
                    "Running it here would make two devices sign as one site_id. Initialise a new node on this "
                    "device, or, only if the original device is destroyed, run "
                    f"`ssp-agent --home {home} identity rebind --confirm-original-destroyed`.")
        if read_only:
            try:
                journal_inspect(str(home / "sign-journal"))   # JournalCorrupt: refuse, as a writing open does
            except BaseException:
                conn.close()
                raise
            try:
                return cls(home, conn, None, read_only=True)
            except BaseException:
                conn.close()
                raise
        if check_machine:
            site = bytes(db.get_meta(conn, "site_id"))
            other = ident.claim_home(site, home)
            if other is not None:
                conn.close()
                raise NodeError(
                    f"this home is a copy of {other}, which holds the same node (site {site.hex()}): two homes "
                    "signing as one site_id would reuse HLCs (§13.5). Initialise a new node here; or, if this copy "
                    f"is to replace the original, remove {other} first (a home that moves is followed).")
        try:
            migrations.migrate(conn, path)
            db.ensure_bounds(conn)
        except BaseException:
            conn.close()
            raise
        db.ensure_reserve(home)   # a home made before it, or one whose reserve an eviction used
        ks_conf = home_paths(home, json.loads(db.get_meta(conn, "keystore")))
        ks = open_keystore(resolve_pin(ks_conf))
        try:
            # The event log, the held table and the journal's outputs are sealed at rest under the
            # store's data key, which only this keystore (or the one `keystore rewrap` moved the
            # data key to) unseals (docs/reliability.md "At rest").
            with seal_keystore(home, conn, ks) as sks:
                log_seal = atrest.open_log(conn, sks, bytes(db.get_meta(conn, "site_id")), home, now_ms())
            bridge = SigningBridge(ks, str(home / "sign-journal"), sealer=log_seal.sealer)
        except BaseException:
            ks.close()
            conn.close()
            raise
        try:
            return cls(home, conn, bridge, log_seal=log_seal)
        except BaseException:
            # A failed set-up closes what it opened: a leaked bridge keeps the journal's lock, so the
            # next open in this process (a service retrying) was refused as "in use", and leaked fds
            # pile up (found by tests/reliability: thousands of damaged reopens ended in EMFILE).
            bridge.close()
            ks.close()
            conn.close()
            raise

    @classmethod
    def log_view(cls, home: Path) -> tuple[sqlite3.Connection, atrest.LogSeal]:
        """A read-only connection to a home's store that can read the sealed log (`unseal` is
        installed; the keystore unseals the data keys and is closed again), and the LogSeal, whose
        sealer also opens the journal's sealed outputs. Writes nothing: for tools and tests that
        inspect a stopped node's files."""
        home = Path(home)
        conn = db.connect_readonly(home / cls.STORE_FILE)
        try:
            conf = atrest.seal_keystore_conf(conn) or json.loads(db.get_meta(conn, "keystore"))
            ks = open_keystore(resolve_pin(home_paths(home, conf)))
            try:
                seal = atrest.open_log(conn, ks, bytes(db.get_meta(conn, "site_id")), home, 0, create=False)
            finally:
                ks.close()
            atrest.install(conn, seal)
        except BaseException:
            conn.close()
            raise
        return conn, seal

    def rebind_machine(self) -> None:
        with _txn(self.conn):
            db.set_meta(self.conn, "machine", ident.machine_fingerprint())

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._drop_carried()
        if self._pool:
            self._pool.close()
        self._pool = None
        self._lower_ceiling()
        if self.bridge is not None:
            self.bridge.close()
            self.bridge = None
        self.witness.close()
        self.conn.close()

    def _load_caches(self) -> None:
        """Rebuilt from the database on every open: it is the only source of truth."""
        # The effective keyring: provisioned keys, then what the control records held make of them
        # (vouched keys, cutoffs lowered by retire records: agent/store/sync_state.py trust).
        self.keyring: dict[bytes, tuple[bytes, tuple[int, int] | None]] = {}
        sync_state.overlay_keyring(self.conn, self.keyring, self.site_id)
        self.tables: dict[str, _Table] = {}
        for q, sch, name, cat, key_json, cols_json, retention, hp, hl in rowstore.table_rows(self.conn):
            t = TableDef(sch, name, cat, tuple(json.loads(key_json)), json.loads(cols_json), retention)
            self.tables[q] = _Table(t, rowstore.RowStore(self.conn, t), (hp, hl) if (hp, hl) != (0, 0) else None)

    def _lower_ceiling(self) -> None:
        """On a clean close, bring the durable ceiling down to the clock and keep the clock's exact
        value beside it (`clock_closed`): this run issued nothing above it, so the next open can
        resume exactly there instead of above a window left standing (§13.5; docs/apply.md).
        Only the writer (it holds the journal's lock) does it; a crash leaves the window."""
        if self.read_only or self.bridge is None:
            return
        p, l = self.clock.current()
        try:
            ceiling = int(db.get_meta(self.conn, "clock_ceiling", 0))
            if ceiling > p or (ceiling == p and _hlc_meta(db.get_meta(self.conn, "clock_closed")) != (p, l)):
                with _txn(self.conn):
                    db.set_meta(self.conn, "clock_ceiling", p)
                    db.set_meta(self.conn, "clock_closed", f"{p}.{l}")
        except sqlite3.Error as e:   # a full disk: the window stays, which is safe
            log.warning("clock: the ceiling could not be lowered on close (%s)", e)

    def _resume_clock(self) -> Hlc:
        """§13.5 clock durability and §12 step 5 across processes. The clock resumes above
        everything this site may have released (its log, the signing journal's intents, and the
        witness outside the home, made durable before every release) and everything it has
        observed (the mark kept with each applied batch), so neither a restart, a crash nor a
        restored older home re-issues an HLC or undercuts an observed one (docs/apply.md).
        It also resumes above the in-home ceiling, whichever is higher: a home restored together
        with its witness (a machine snapshot taken while the node ran) lost what it issued after
        the snapshot, possibly above the wall clock after observing a peer, and only the ceiling
        bounds that. After a clean close the ceiling is the clock itself (`_lower_ceiling`)."""
        store_ceiling = int(db.get_meta(self.conn, "clock_ceiling", 0))
        closed = _hlc_meta(db.get_meta(self.conn, "clock_closed"))
        witness = self.witness.read()
        self._observed = _hlc_meta(db.get_meta(self.conn, "clock_observed"))
        seen = [self._max_own_hlc(), self._observed, witness]
        if self.bridge is not None:
            seen.append(self.bridge.max_event_hlc(self.site_id))
        highest = max((s for s in seen if s is not None), default=None)
        if not self.read_only:   # it records what it finds (a write), and needs the journal's intents
            self._detect_lost_history(witness)
        if witness is None and store_ceiling > 0:
            log.warning("clock: no witness at %s (lost, or a restored home?); resuming above the ceiling %d",
                        self.witness.path, store_ceiling)
        if closed is not None and closed[0] == store_ceiling:
            # The last writer closed cleanly at `closed` and no run issued past it since (the
            # first tick of any run persists a new ceiling first: `ceiling_ms` 0 makes it due).
            return Hlc.resume(0, closed if highest is None else max(closed, highest))
        return Hlc.resume(store_ceiling, highest)

    def own_history_floors(self) -> dict[str, tuple[int, int]]:
        """Per table ("*": every table), the highest own HLC this node may have released and no
        longer holds (evicted, or lost to a restored home). A receiver infers no watermark for
        this node's stream across it unless it already holds everything up to it (§14.2;
        docs/protocol.md "3. Applied watermarks (§14.2, §34)")."""
        raw = db.get_meta(self.conn, "own_history_floors")
        return {q: (v[0], v[1]) for q, v in json.loads(raw).items()} if raw else {}

    def _raise_own_floor(self, table: str, hlc: tuple[int, int]) -> None:
        """Inside the caller's transaction (with the deletion or the detection that causes it)."""
        floors = self.own_history_floors()
        if table not in floors or hlc > floors[table]:
            floors[table] = hlc
            db.set_meta(self.conn, "own_history_floors", json.dumps({q: list(v) for q, v in sorted(floors.items())}))

    def _detect_lost_history(self, witness: tuple[int, int] | None) -> None:
        """The witness records every HLC released before it could leave the node; if it is above
        everything the home knows of its own history, the home lost some (a restore): record it."""
        if witness is None or self.witness.legacy:
            return
        known = [self._max_own_hlc(), *self.own_history_floors().values()]
        if self.bridge is not None:
            known.append(self.bridge.max_event_hlc(self.site_id))
        highest = max((k for k in known if k is not None), default=None)
        if highest is None or witness > highest:
            log.warning("clock: this home lacks own events released up to %d.%d (restored from an older copy?); "
                        "peers will take them from others", witness[0], witness[1])
            with _txn(self.conn):
                self._raise_own_floor("*", witness)

    def _recover_released(self) -> None:
        """A crash between the bridge's release and the apply left signed, persisted local events
        the log lacks: apply them through the one apply path (docs/keystore.md), then compact the
        journal for everything the log now holds."""
        events: list[bytes] = []
        records: list[bytes] = []   # control records this node signed (authority, rehydrate, truncation)
        for identity, raw in self.bridge.iter_released():   # one read of the journal
            if isinstance(identity, EventIdentity) and identity.site_id == self.site_id:
                (events if _is_event(raw) else records).append(raw)
        missing = [raw for raw in events if self._known(ev.event_id(raw)) is None]
        if missing:
            log.warning("applying %d local event(s) released before a crash but never applied", len(missing))
            self.apply_batch(missing, origin="local")
        # Control records the store lacks: store them, so a re-issue extends their chain.
        records = [raw for raw in records if not self._record_held(raw)]
        if records:
            sync_state.ensure_schema(self.conn)
            log.warning("storing %d control record(s) released before a crash but never stored", len(records))
            self.apply_records(records, now_ms())
        from . import rehydrate
        rehydrate.abandon_unreleased(self)   # a rehydration start killed before its release
        # Compaction rewrites the journal (two fsyncs: the new file, its directory). On open only
        # after a recovery or once the journal outgrew JOURNAL_OPEN_COMPACT_BYTES: a `write` per
        # process would otherwise pay both for the one entry the previous one left. The entries that wait are
        # read by every open (above), which the bound keeps cheap.
        if missing or records or self.bridge.journal_stats()["bytes"] > JOURNAL_OPEN_COMPACT_BYTES:
            self.compact_journal()

    def apply_records(self, raws, now: int) -> dict:
        """Verify and store control records, each on its own (a bad one is dropped and surfaced
        without affecting the rest), and act on what they change. Runs before a body's events so
        a vouch travelling with its subject's events admits them. The processing lives below the
        node (agent/records_in.py, agent/rehydrate.py) and returns effects; the node acts on them
        here: keyring and trust rebuilt in the records' own transaction, then rehydrate requests
        (verified under the new keyring), then the truncation records a widening or a served
        rehydration calls for (signed through the bridge, outside any transaction)."""
        from . import rehydrate, records_in, sequencing
        from .core.cose import content_type
        from .core.records import TRUNCATED
        from .core.records import ACK as MQTT_ACK
        from .mailbox import ACK_CONTENT_TYPE
        kinds = [content_type(r) for r in raws]
        # MQTT acknowledgements speak to one node about one body: the runner takes them from the
        # answer (Runner._proof); anywhere else (recovery from the journal included) they are inert.
        raws = [r for r, k in zip(raws, kinds) if k != MQTT_ACK]
        kinds = [k for k in kinds if k != MQTT_ACK]
        rh = [r for r, k in zip(raws, kinds) if k == rehydrate.CONTENT_TYPE]
        tr = [r for r, k in zip(raws, kinds) if k == TRUNCATED]
        acks = [r for r, k in zip(raws, kinds) if k == ACK_CONTENT_TYPE]
        sq = [r for r, k in zip(raws, kinds) if k in sequencing.CONTENT_TYPES]
        raws = [r for r, k in zip(raws, kinds)
                if k not in (rehydrate.CONTENT_TYPE, TRUNCATED, ACK_CONTENT_TYPE, *sequencing.CONTENT_TYPES)]
        if acks:
            # Mailbox answers are taken by the mailbox import only (they speak to one node about its
            # files). Here: this node's own, released before a crash and not stored (recovery).
            records_in.keep_own_acks(self, acks, now)
        fx = records_in.RecordEffects()
        try:
            with _txn(self.conn):
                out, fx = records_in.store_authority_records(self, raws, now)
                if fx.trust_changed:
                    # Trust changed: rows become the merge of the retained events that still count
                    # (a retire removes its subject's events above the cutoff, whenever it arrives).
                    self._load_caches()
                    trust = self._reconcile_trust(now)
                    if trust:
                        out["trust"] = trust
        finally:
            if fx.trust_changed:
                self._load_caches()  # keyring rebuilt from the store, records overlaid
        if rh:
            # After the vouches: a request travelling with the vouch for its subject is verified.
            with _txn(self.conn):
                out["rehydrate"] = rehydrate.handle_records(self, rh, now)
            fx.subjects_reset = [bytes.fromhex(s) for s in out["rehydrate"].get("subjects_reset", [])]
        if sq:
            # Receipt heads and sequencer bindings (agent/sequencing.py), after the authority
            # records: a vouch in the same body admits a head's issuer.
            with _txn(self.conn):
                out["sequencing"] = sequencing.store_records(self, sq, now)
        if fx.widened:
            rehydrate.announce_truncations(self, fx.widened, now)
        if tr:
            # After the authority records: a vouch in the same body admits the truncation's issuer.
            with _txn(self.conn):
                out["truncation"] = rehydrate.handle_truncations(self, tr, now)
        for subj in fx.subjects_reset:
            # Serving a rehydration from a log evicted below a horizon: say which rows are incomplete.
            n = len(rehydrate.issue_truncations(self, subj, now=now, cause="rehydration"))
            if n:
                out["truncation_issued"] = out.get("truncation_issued", 0) + n
        return out

    def reload_caches(self) -> None:
        """The keyring, tables and horizons again from the store (after a rolled-back change that
        lowered them in memory: agent/rehydrate.py `start`)."""
        self._load_caches()

    def compact_journal(self) -> dict | None:
        """Drop from the signing journal our released events whose exact bytes the log holds (its
        commits are durable: synchronous=FULL) or that count as applied below their table's
        horizon; the bridge keeps a per-site floor so none of them is ever signed again. The
        events `write_many` applied since the last compaction are known to be in the log without
        reading them back (`_logged`); any other entry is read from the journal and looked up."""
        if self.bridge is None:
            return None
        logged = set(self._logged)
        site = self.site_id

        def recorded(identity) -> bool:
            if not isinstance(identity, EventIdentity) or identity.site_id != site:
                return False
            if identity.hlc in logged:
                return True
            raw = self.bridge.released(identity)
            return raw is not None and (
                self._record_held(raw) if not _is_event(raw) else
                self._known(ev.event_id(raw)) == "log" or self._below_own_horizon(raw))
        stats = self.bridge.compact_events(recorded)
        self._logged.difference_update(logged)
        self._journal_base = stats["bytes_after"]
        return stats

    def _record_held(self, raw: bytes) -> bool:
        """A control record this node signed through the bridge (rehydrate, truncation, mailbox answer, authority
        records) that its store holds: done, like an event in the log."""
        from .core.records import is_ack, record_hash
        if is_ack(raw):
            return True  # an MQTT acknowledgement is done once released: a lost one costs a re-offer
        return sync_state.holds_signed_record(self.conn, record_hash(bytes(raw)))

    def _below_own_horizon(self, raw: bytes) -> bool:
        try:
            e = ev.event_from_verified(raw, cose.parse_sign1(raw))
        except DecodeError:
            return False
        tbl = self.tables.get(e.table)
        return tbl is not None and below(e.hlc, tbl.horizon)

    def _max_own_hlc(self) -> tuple[int, int] | None:
        return eventlog.newest_of(self.conn, self.site_id)

    # ------------------------------------------------------------------ the apply path (§12)
    def apply_batch(self, raws: Iterable[bytes], now: int | None = None, origin: str = "remote",
                    built: list | None = None, path: str | None = None) -> list[Outcome]:
        """Apply events in one transaction; each event is atomic on its own (a savepoint:
        log insert, clocks, row and metering commit together or not at all). `built`: for
        local events only (`write_many`), each event's `checked` as `_local_checked` made it.
        `path`: the transport the events came by, the metrics' origin label (`origin` is the
        log's tag, `peer:<site_id>` under the secure binding: never a label value)."""
        now = now_ms() if now is None else now
        try:
            with _txn(self.conn):
                out = self._apply_in_txn(raws, now, origin) if built is None else \
                    self._apply_built(raws, built, now, origin)
                self._persist_observed()
                new = sum(1 for o in out if o.reason == R.APPLIED)
                if new:
                    self._applied += new
                    db.set_meta(self.conn, "applied_count", self._applied)
                counters.bump_outcomes(self.conn, path or origin, (o.status for o in out))   # the metrics
                due = self.write_due_meta()
        finally:
            self._next_raws = None   # a hint for the batch after this one only (`prepare_next`)
        for t in self.tables.values():
            t.rows.committed()   # the rows this batch left are the store's (RowStore `defer`)
        self.due_meta_committed(due)
        if new:
            self.witness.note_applied(self._applied)
        return out

    def _persist_observed(self) -> None:
        """§12 step 5 across processes: the clock's high-water mark is kept with the batch that
        raised it, so the next process resumes above every HLC this node has applied."""
        cur = self.clock.current()
        if self._observed is None or cur > self._observed:
            db.set_meta(self.conn, "clock_observed", f"{cur[0]}.{cur[1]}")
            self._observed = cur

    def _apply_built(self, raws: list[bytes], built: list, now: int, origin: str) -> list[Outcome]:
        """`_apply_in_txn` for local events this node just built and released (`_local_checked`):
        fresh identities the bridge held no bytes for, so nothing knows them yet (the log's
        INSERT OR IGNORE still answers a duplicate); parsed, verified and decoded by construction."""
        since: dict[bytes, str] = {}
        out = []
        # As `_apply_in_txn`: the batch's rows held in memory and written once each; their
        # current state read up front in one query (the batch names its rows before applying).
        touched = {}
        for checked in built:
            if checked is not None:
                e = checked[3]
                touched.setdefault(e.table, []).append(rowstore.row_key_bytes(e.row_key))
        stores = [t.rows for t in self.tables.values()]
        for rs in stores:
            rs.defer()
        try:
            for table, rks in touched.items():
                tbl = self.tables.get(table)
                if tbl is not None:
                    tbl.rows.prefetch(rks)
            for raw, checked in zip(raws, built):
                o = self._apply_one(raw, now, origin, checked, since if checked is not None else None)
                if o.status == APPLIED and o.reason == R.APPLIED:
                    since[o.event_id] = "log"
                out.append(o)
            for rs in stores:
                rs.flush(keep=False)
        finally:
            for rs in stores:
                rs.discard()   # after a fault the transaction rolls back: nothing held survives it
        return out

    def _apply_in_txn(self, raws: Iterable[bytes], now: int, origin: str) -> list[Outcome]:
        """Every event's effects (log insert, clocks, row, metering) are written inside the
        caller's transaction; a local fault rolls the whole batch back, never half an event."""
        raws = raws if isinstance(raws, (list, tuple)) else list(raws)
        if len(raws) < 64:
            return [self._apply_one(raw, now, origin) for raw in raws]
        out: list[Outcome] = []
        # Events this batch put into the log or the held table since their chunk's look-up (the
        # only way one found unknown there becomes known): the duplicate check answers from it
        # exactly as `_known` would, without a query per event.
        since: dict[bytes, str] = {}
        # The batch's rows are held in memory and written once each (agent/store/rows.py
        # `defer`), at most ROW_FLUSH of them at a time so a batch over many rows stays bounded;
        # the rows the last committed batch left are read from memory while no other connection
        # has committed since (`PRAGMA data_version`, read under this transaction's write lock).
        stores = [t.rows for t in self.tables.values()]
        version = db.data_version(self.conn)
        for rs in stores:
            rs.defer(version)
        try:
            for raw, checked in self._verified_ahead(raws):
                o = self._apply_one(raw, now, origin, checked, since if checked is not None else None)
                if o.event_id is not None:
                    if o.status == HELD:
                        since.setdefault(o.event_id, "held")
                    elif o.status == DUPLICATE or (o.status == APPLIED and o.reason == R.APPLIED):
                        since[o.event_id] = "log"
                out.append(o)
                if len(out) % 256 == 0 and sum(rs.pending() for rs in stores) > self.ROW_FLUSH:
                    for rs in stores:
                        rs.flush()
            for rs in stores:
                rs.flush(keep=False)
        finally:
            for rs in stores:
                rs.discard()   # after a fault the transaction rolls back: nothing held survives it
        return out

    ROW_FLUSH = 4096  # rows held in memory by one batch before they are written (bounds its memory)

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

    def _worker(self, n: int):
        """The apply worker processes (agent/applyworker.py), or None: on one core (a second process
        only adds the pipe's cost to the same core), until batches of WORKER_MIN_BATCH events in
        all came (a long-running node: one of WORKER_RUN_BATCH), or after they failed (SSP_AGENT_APPLY_WORKERS=0 turns them off)."""
        if self._pool is not None:
            return self._pool or None
        self._batched += n
        if self._batched < self.WORKER_MIN_BATCH and not (self.long_running and n >= self.WORKER_RUN_BATCH):
            return None
        if os.environ.get("SSP_AGENT_APPLY_WORKERS") == "0" or len(os.sched_getaffinity(0)) < 2:
            self._pool = False
            return None
        from .applyworker import ApplyWorkers, NoneAvailable
        try:
            self._pool = ApplyWorkers(self._worker_count(), limit=self._worker_count())
        except NoneAvailable:
            return None   # other nodes of this process hold them: this batch prepares here
        except OSError as e:
            log.warning("apply worker not started (%s): verifying on this thread", e)
            self._pool = False
        return self._pool or None

    @staticmethod
    def _worker_count() -> int:
        """SSP_AGENT_APPLY_WORKERS, else one per core beyond the applying thread's, at most 3."""
        n = numbers.uint(os.environ.get("SSP_AGENT_APPLY_WORKERS", ""), max_value=64)
        if n is not None:
            return max(1, n)
        return max(1, min(3, len(os.sched_getaffinity(0)) - 1))

    def _worker_failed(self, e: Exception) -> None:
        log.warning("apply worker failed (%s): verifying on this thread from now on", e)
        try:
            self._pool.close()
        except Exception:  # noqa: BLE001 - it is gone either way
            pass
        self._pool = False

    def prepare_next(self, raws) -> None:
        """Name the batch the caller expects to apply after the next one (a `run` receiving
        bodies: the next body waiting from the same sender). While the next batch applies, its
        last chunks' answers in hand, the workers start preparing this one, so they do not idle
        through that batch's end (its last chunk, row writes, commit, the answer) and the applying
        thread does not wait for this one's first answer (docs/apply.md "A `run` receiving
        bodies"). A hint only: what was prepared is used only if `apply_batch` is then called with
        this very list, and each chunk's duplicate look-up still runs when the chunk applies."""
        self._next_raws = raws if isinstance(raws, (list, tuple)) else None

    def _drop_carried(self) -> None:
        """Read and drop the answers to chunks sent ahead for a batch that did not come."""
        carried, self._carried = self._carried, None
        if carried is not None and self._pool:
            try:
                self._pool.drain()
            except Exception as e:  # noqa: BLE001 - any failure of the worker: prepare here
                self._worker_failed(e)

    def _chunks(self, raws, worker: bool) -> list[list]:
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

    def _verified_ahead(self, raws):
        """Each event with what the apply path needs to know of it before touching the store:
        its envelope, keyring entry, signature verdict, decoded payload (agent/core/prepare.py),
        computed a few chunks ahead by the worker process while this thread applies the events
        before them (on one core, or without a worker: here, chunk by chunk). Pure: the same
        checks §12.1 runs, done early; `_apply_one` still takes each result in order and
        re-verifies if the keyring entry changed since. Yields (raw, checked or None)."""
        from .core.prepare import checked_from, prepare
        keyring, mesh = dict(self.keyring), self.mesh_id
        worker = self._worker(len(raws))
        nxt, self._next_raws = self._next_raws, None
        carried, self._carried = self._carried, None
        if carried is not None and (worker is None or carried[0] is not raws):
            self._carried = carried
            self._drop_carried()   # sent ahead for a batch that did not come
            carried = None

        def look_up(chunk):
            # Events this node already holds are answered by the apply path's duplicate look-up
            # before any verification (§12.4 early): preparing them would be wasted work.
            # (The log and the held table only grow during a batch, so "known" stays true.)
            ids = [ev.event_id(bytes(r)) if isinstance(r, (bytes, bytearray)) else None for r in chunk]
            known = self._known_among([i for i in ids if i is not None])
            todo = [bytes(r) for r, i in zip(chunk, ids) if i is not None and i not in known]
            return ids, known, todo

        def send(todo):
            if worker is not None and self._pool:
                try:
                    return worker.submit(keyring, mesh, todo)
                except Exception as e:  # noqa: BLE001 - any failure of the worker: prepare here
                    self._worker_failed(e)
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

        chunks = carried[1] if carried is not None else self._chunks(raws, worker is not None)
        if worker is not None:
            ahead = list(carried[2]) if carried is not None else []
            ahead += [submit(c) for c in chunks[len(ahead):self._AHEAD]]
        # The next batch (`prepare_next`): its first chunks go to the workers as this batch's
        # last ones leave them, keeping _AHEAD chunks in flight across the two.
        after = self._chunks(nxt, True) if worker is not None and nxt is not None and nxt is not raws \
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
                    elif j - len(chunks) < len(after) and self._pool:
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
                if ticket is not None and self._pool:
                    try:
                        results = worker.result(ticket)
                        full = looked_late
                    except Exception as e:  # noqa: BLE001 - any failure of the worker: prepare here
                        self._worker_failed(e)
                if results is None:
                    if looked_late:
                        todo = [bytes(r) for r, i in zip(chunk, ids) if i is not None and i not in known]
                    results = prepare(todo, keyring, mesh)
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
                    yield raw, (None if r is None else checked_from(r, bytes(raw), eid, self.keyring.get(r[0])))
            done = True
        finally:
            if worker is not None and self._pool:
                if done and sent_after:
                    self._carried = (nxt, after, sent_after)
                else:
                    try:
                        worker.drain()   # a batch that stopped early (a fault): its answers in flight
                    except Exception as e:  # noqa: BLE001
                        self._worker_failed(e)

    def _apply_one(self, raw: bytes, now: int, origin: str, checked=None, since: dict | None = None) -> Outcome:
        """The one apply path: §12 steps in the spec's order, then §13 materialization.
        `checked` is this event's (parsed envelope, keyring entry, signature ok, decoded event
        or its shape error, event_id) when `_verified_ahead` computed them already; `since` then
        holds what the batch made known after the chunk's one duplicate look-up found this event
        unknown."""
        if not isinstance(raw, (bytes, bytearray)):
            return self._surface(Outcome(DROPPED, R.NOT_BYTES), now)
        raw = bytes(raw)
        eid = checked[4] if checked is not None else ev.event_id(raw)
        # Envelope: tag 18, empty unprotected map, deterministic bytes (docs/protocol.md §0 "Change events"): else dropped.
        if checked is not None:
            sign1 = checked[0]
        else:
            try:
                sign1 = cose.parse_sign1(raw)
            except DecodeError as e:
                return self._surface(Outcome(DROPPED, e.reason, eid), now)
        if sign1.content_type != ev.EVENT_CONTENT_TYPE:
            return self._surface(Outcome(DROPPED, R.NOT_AN_EVENT, eid), now)
        kid = sign1.kid
        # §32.1 self-echo suppression, on every path (local writes are ours by construction).
        if origin != "local" and kid == self.site_id:
            return Outcome(DROPPED, R.SELF_ECHO, eid, kid)
        # Identical bytes were verified when first applied: a known event_id is a no-op (§12.4).
        # Whatever the batch size: the same bytes get the same outcome.
        known = since.get(eid) if since is not None else self._known(eid)
        if known == "log":
            return Outcome(DUPLICATE, R.DUPLICATE, eid, kid, verified=True)
        if known == "held":
            return Outcome(HELD, R.ALREADY_HELD, eid, kid, verified=True)
        # §12.1 signature verification: kid in the keyring, valid signature, retirement cutoff.
        entry = self.keyring.get(kid)
        if entry is None:
            # Rejected, not dropped (docs/protocol.md §5 Trust): the one
            # verification failure that may resolve (a vouch or `peer add` may still come), so the
            # sender re-offers it. Nothing is retained and no watermark is blocked (the event is
            # attributable to no group here); only the delivering link's cursor waits, which costs
            # whoever delivered it, and an honest sender holds it only if it trusts the kid.
            return self._surface(Outcome(REJECTED, R.UNKNOWN_KID, eid, kid), now)
        if checked is not None and checked[1] == entry:
            sig_ok = checked[2]
        else:
            if checked is not None:   # prepared against another keyring entry: start over from the bytes
                sign1, checked = cose.parse_sign1(raw), None
            sig_ok = cose.verify_ed25519(entry[0], sign1.sig_structure(self.mesh_id), sign1.signature)
        if not sig_ok:
            return self._surface(Outcome(DROPPED, R.BAD_SIGNATURE, eid, kid), now)
        decoded = checked[3] if checked is not None and checked[1] == entry else None
        if decoded is None:
            try:
                decoded = ev.event_from_verified(raw, sign1, eid)
            except DecodeError as err:
                decoded = err
        if isinstance(decoded, DecodeError):
            return self._surface(Outcome(DROPPED, decoded.reason, eid, kid, verified=True), now)
        e = decoded
        table = e.table
        base = dict(event_id=eid, site_id=kid, table=table, hlc=e.hlc, verified=True)
        if entry[1] is not None and e.hlc > entry[1]:
            return self._surface(Outcome(DROPPED, R.RETIRED_SIGNER, **base), now)
        # §12.2 skew bound: rejected and not retained; the sender re-offers it. A local event
        # carries our own clock, which may run ahead of a wall clock that jumped back.
        if origin != "local" and beyond_skew(e.hlc[0], now):
            return self._surface(Outcome(REJECTED, R.CLOCK_SKEW, **base), now)
        # §12.3 scope: a missing table is held (§13.6 row 1); outside the floor is dropped and logged.
        tbl = self.tables.get(table)
        if tbl is None:
            return self._hold(e, now, base)
        if tbl.tdef.category != SYNCABLE:
            log.info("dropped %s: table %s is %s (outside the floor)", eid.hex(), table, tbl.tdef.category)
            return self._surface(Outcome(DROPPED, R.OUT_OF_FLOOR, **base), now, kind="logged")
        bad_key = tbl.tdef.key_misfit(e.row_key)
        if bad_key:
            return self._surface(Outcome(DROPPED, bad_key[0], **base), now, detail=bad_key[2])
        # §3: below the table's eviction horizon counts as applied and writes nothing.
        if below(e.hlc, tbl.horizon):
            return Outcome(APPLIED, R.BELOW_HORIZON, **base)
        # §12.4 idempotent insert keyed on event_id.
        rk = checked[5] if checked is not None and len(checked) > 5 and checked[5] is not None else \
            rowstore.row_key_bytes(e.row_key)
        cur = self.conn.execute(
            eventlog.INSERT_EVENT, (eid, kid, e.hlc[0], e.hlc[1], table, rk, e.operation,
                                            self.log_seal.seal(eid, raw), origin))
        if cur.rowcount == 0:
            return Outcome(DUPLICATE, R.DUPLICATE, **base)
        # §12.5 HLC observe.
        self.clock.observe(e.hlc, now)
        self._materialize(tbl, e, rk, now)
        return Outcome(APPLIED, R.APPLIED, eid, kid, table, e.hlc, True)

    def _known_among(self, eids: list[bytes]) -> set[bytes]:
        """The event_ids among `eids` that the log or the held table holds (one query)."""
        return eventlog.known_among(self.conn, eids)

    def _known(self, eid: bytes) -> str | None:
        in_log, in_held = self.conn.execute(eventlog.KNOWN_EVENT, (eid,)).fetchone()
        return "log" if in_log else "held" if in_held else None

    def _materialize(self, tbl: _Table, e: ev.Event, rk: bytes, now: int) -> None:
        """§13: compute the effects from the row's clocks, then write them."""
        state = tbl.rows.load(rk) or RowState()
        fx: Effects
        if e.operation == "delete":
            fx = merge_delete(tbl.tdef, state, e.stamp)
        else:
            fx = merge_upsert(tbl.tdef, state, e.stamp, e.payload or {})
        writes: dict[str, Any] = dict(fx.writes)
        if fx.resurrected:
            rb = rebuild_columns(tbl.tdef, tbl.tdef.value_columns, fx.state.tomb_clock,
                                 self._candidates(tbl.tdef, rk), tbl.horizon)
            writes = rb.writes
            row_txt = json.dumps(to_json(e.row_key), sort_keys=True)
            if rb.partial:
                # §13.4 MUST: never present a partial rebuild as complete; name row and horizon.
                h = tbl.horizon
                self._record("partial_rebuild", "tombstone_below_horizon", e, now,
                             {"row_key": to_json(e.row_key), "horizon": f"{h[0]}.{h[1]}",
                              "tombstone": f"{fx.state.tomb_clock[0]}.{fx.state.tomb_clock[1]}"})
                log.warning("partial resurrection rebuild of %s %s: history below horizon %s.%s is evicted",
                            e.table, row_txt, h[0], h[1])
            else:
                self._record("resurrection", "resurrected", e, now, {"row_key": to_json(e.row_key)})
        tbl.rows.save(rk, e.row_key, fx.state, writes)
        if fx.ignored:
            # §13.6: meter ignored columns per (site, table, column).
            self.conn.executemany(
                reports.COUNT_IGNORED_COLUMN,
                [(e.site_id, e.table, c, now, now) for c in fx.ignored])

    def _candidates(self, t: TableDef, rk: bytes) -> Iterable[tuple[tuple[int, int, bytes], dict]]:
        """Retained upserts of one row that count under the current trust (the rebuild filters
        by tombstone clock and horizon)."""
        for stamp, op, payload in self._row_events(t, rk):
            if op == "upsert" and self._counts(stamp):
                yield stamp, payload

    def _row_events(self, t: TableDef, rk: bytes) -> Iterable[tuple[tuple[int, int, bytes], str, dict | None]]:
        """Every retained event of one row: (stamp, operation, payload)."""
        for sid, p, l, op, raw in self.conn.execute(eventlog.ROW_EVENTS, (t.qualified, rk)).fetchall():
            payload = decode_strict(cose.parse_sign1(bytes(raw)).payload_bytes)["payload"]
            yield (p, l, bytes(sid)), op, (dict(payload) if payload is not None else None)

    def _counts(self, stamp: tuple[int, int, bytes]) -> bool:
        """Whether a retained event with this stamp still passes §12.1 under the current trust:
        its signer is trusted and its HLC is not above the signer's cutoff. The log keeps the
        events that do not; they no longer count."""
        entry = self.keyring.get(stamp[2])
        return entry is not None and (entry[1] is None or stamp[:2] <= entry[1])

    # ------------------------------------------------------------------ trust changes (item 5)
    def _trust_snapshot(self) -> dict:
        return {s.hex(): [pk.hex(), None if c is None else list(c)] for s, (pk, c) in sorted(self.keyring.items())}

    def _trust_changed(self) -> bool:
        raw = db.get_meta(self.conn, "materialized_trust")
        return raw is None or json.loads(raw) != self._trust_snapshot()

    def refresh_trust(self, now: int | None = None) -> dict | None:
        """Re-read the keyring and control records and bring the rows in line (one transaction)."""
        now = now_ms() if now is None else now
        try:
            with _txn(self.conn):
                self._load_caches()
                return self._reconcile_trust(now)
        finally:
            self._load_caches()

    def _reconcile_trust(self, now: int) -> dict | None:
        """Inside the caller's transaction, after `_load_caches`: make the rows the merge of the
        retained events that count under the current trust (materialized state is a function of
        the delivered events and records). `meta.materialized_trust` records the
        keyring the rows reflect. Against it: for a signer trusted less now (cutoff lowered, key no
        longer trusted) every row with a clock owned by one of its events that no longer counts is
        rebuilt without them (`merge.rebuild_without`); for a signer trusted more now (a vouch
        whose fork resolved, an operator raising a cutoff) its retained events that count again
        are merged back (merging is idempotent and order-free). Returns a summary, or None."""
        cur = self._trust_snapshot()
        raw = db.get_meta(self.conn, "materialized_trust")
        if raw is not None and json.loads(raw) == cur:
            return None
        if raw is None:
            # Rows made before this record existed may hold effects of any retained event.
            old = {s.hex(): "unknown" for s in eventlog.signers(self.conn)}
        else:
            old = json.loads(raw)
        inf = (float("inf"), 0)

        def cut(e):
            return inf if e[1] is None else tuple(e[1])
        shrunk, grown = [], []
        for h in sorted(set(old) | set(cur)):
            o, n = old.get(h), cur.get(h)
            if o == "unknown":
                if n is None or n[1] is not None:
                    shrunk.append(bytes.fromhex(h))
                continue
            if o is not None and (n is None or cut(n) < cut(o) or n[0] != o[0]):
                shrunk.append(bytes.fromhex(h))
            if n is not None and (o is None or cut(n) > cut(o) or n[0] != o[0]):
                grown.append(bytes.fromhex(h))
        summary = {"rows_rebuilt": 0, "events_merged": 0, "partial": 0}
        void = lambda s: not self._counts(s)  # noqa: E731
        for q, tbl in sorted(self.tables.items()):
            for rk, key in tbl.rows.rows_with_clock_of(shrunk):
                state = tbl.rows.load(rk)
                if state is None or not any(void(c) for c in [state.exist_clock, state.tomb_clock,
                                                               *state.cells.values()] if c is not None):
                    continue
                rb = rebuild_without(tbl.tdef, state, void, self._row_events(tbl.tdef, rk), tbl.horizon)
                st = rb.state
                if st.exist_clock is None and st.tomb_clock is None and not st.cells:
                    tbl.rows.delete(rk)  # nothing that counts ever touched it
                else:
                    tbl.rows.save(rk, key, st, rb.writes)
                summary["rows_rebuilt"] += 1
                if rb.partial:
                    summary["partial"] += 1
                    h = tbl.horizon
                    reports.surface_table(
                        self.conn, now, "partial_rebuild", "trust_change_below_horizon", q,
                        json.dumps({"row_key": to_json(key), "horizon": f"{h[0]}.{h[1]}", "clocks": rb.partial},
                                   sort_keys=True))
        for site in grown:
            for p, l, q, raw in eventlog.events_of(self.conn, site):
                tbl = self.tables.get(q)
                if tbl is None or not self._counts((p, l, site)) or below((p, l), tbl.horizon):
                    continue
                e = ev.event_from_verified(bytes(raw), cose.parse_sign1(bytes(raw)))
                self._materialize(tbl, e, rowstore.row_key_bytes(e.row_key), now)
                summary["events_merged"] += 1
        db.set_meta(self.conn, "materialized_trust", json.dumps(cur, sort_keys=True))
        if summary["rows_rebuilt"] or summary["events_merged"]:
            log.warning("trust changed: %s", summary)
            reports.surface(self.conn, now, "trust_change", "rows_rebuilt",
                            json.dumps({**summary, "less_trusted": [s.hex() for s in shrunk],
                                        "more_trusted": [s.hex() for s in grown]}, sort_keys=True))
        return summary

    def _hold(self, e: ev.Event, now: int, base: dict) -> Outcome:
        n_signer, n_total = db.held_count(self.conn, e.site_id)
        if n_signer >= HELD_LIMIT_PER_SIGNER or n_total >= HELD_LIMIT_TOTAL:
            # Retain nothing more; the sender moves past it and re-offers it later (agent/sync.py).
            return self._surface(Outcome(REJECTED, R.HELD_LIMIT, **base), now)
        cur = self.conn.execute(eventlog.HOLD_EVENT, (e.event_id, e.site_id, e.table, e.hlc[0], e.hlc[1],
                                                             self.log_seal.seal(e.event_id, e.raw), now))
        if cur.rowcount == 0:
            return Outcome(HELD, R.ALREADY_HELD, **base)
        return self._surface(Outcome(HELD, R.TABLE_MISSING, **base), now, kind="held")

    def _surface(self, o: Outcome, now: int, kind: str | None = None, detail: dict | None = None) -> Outcome:
        """Record what the spec says to surface (or log) where `ssp-agent events` lists it.
        The store bounds the record (the newest `surfaced_limit` rows are kept, evictions counted:
        agent/store/db.py), in every process: a hostile peer cannot fill the disk."""
        kind = kind or o.status
        self.conn.execute(reports.SURFACE_EVENT,
                          (now, kind, o.reason, o.event_id, o.site_id if o.verified else None, o.table,
                           json.dumps({"status": o.status, "claimed_kid": None if o.verified or o.site_id is None
                                       else o.site_id.hex(), **(detail or {})})))
        if kind != "logged":
            log.warning("%s %s: %s", o.status, o.event_id.hex() if o.event_id else "-", o.reason)
        return o

    def _record(self, kind: str, reason: str, e: ev.Event, now: int, detail: dict) -> None:
        self.conn.execute(reports.SURFACE_EVENT,
                          (now, kind, reason, e.event_id, e.site_id, e.table, json.dumps(detail, sort_keys=True)))

    # ------------------------------------------------------------------ refused messages
    def surface_clock(self, reason: str, detail: dict) -> None:
        """Surface a clock condition (kind `clock`), e.g. eviction deferred for an untrusted clock."""
        with _txn(self.conn):
            reports.surface(self.conn, now_ms(), "clock", reason, json.dumps(detail, sort_keys=True))

    def surface_refused(self, source: str, reason: str, detail: str = "", claimed_sender: bytes | None = None,
                        now: int | None = None, kind: str = "refused") -> None:
        """Surface a message from outside that its boundary parser refused (an MQTT body, a
        presence payload, a frame meta, a mailbox file: `source`) where `ssp-agent events` lists it
        (kind `refused`, its reason code), in a transaction of its own. `claimed_sender` is who the
        transport says sent it (a topic segment: not authenticated, so kept in the detail). A serial
        link incarnation that ended comes the same way with kind `link_lost` (docs/serial.md)."""
        now = now_ms() if now is None else now
        with _txn(self.conn):
            reports.surface(self.conn, now, kind, reason, json.dumps(
                {"source": source, "detail": detail[:200],
                 "claimed_sender": claimed_sender.hex() if claimed_sender else None},
                sort_keys=True))

    # ------------------------------------------------------------------ local writes
    def write(self, table: str, key: dict[str, Any], values: dict[str, Any] | None, *, delete: bool = False,
              now: int | None = None) -> bytes:
        return self.write_many([(table, key, values, delete)], now=now)[0]

    def write_many(self, writes: list[tuple[str, dict, dict | None, bool]], now: int | None = None) -> list[bytes]:
        """Produce signed local events: tick the HLC (durable ceiling first), sign and persist
        through the bridge (one group commit), then apply through the one apply path."""
        now = now_ms() if now is None else now
        payloads = []
        tables = self.tables
        for table, key, values, delete in writes:
            tbl = tables.get(table)
            if tbl is not None and tbl.tdef.category == SYNCABLE and isinstance(key, dict) and \
                    (delete or type(values) is dict) and tbl.tdef.fits_exactly(key, None if delete else values):
                # the common case, checked in one pass; anything else is looked at closely below
                payloads.append((tbl.tdef, key, None if delete else values, "delete" if delete else "upsert"))
                continue
            if tbl is None:
                raise NodeError(f"no table {table!r} on this node (known: {', '.join(sorted(self.tables)) or 'none'})")
            if tbl.tdef.category != SYNCABLE:
                # §1.1: a producer emitting out-of-floor data has a bug that silence would hide.
                raise NodeError(f"{table} is {tbl.tdef.category}: it never leaves this node and takes no events")
            if not isinstance(key, dict):
                raise NodeError(f"--key must be a JSON object of the key columns {list(tbl.tdef.key)} (row_key_columns)")
            bad = tbl.tdef.key_misfit(key)
            if bad:
                raise NodeError(f"--key: {bad[1]} ({bad[0]})")
            if not delete:
                if not isinstance(values, dict):
                    raise NodeError("--set must be a JSON object of column values")
                from .core.schema import value_fits
                for c, v in values.items():
                    if c not in tbl.tdef.value_columns:
                        raise NodeError(f"{table} has no value column {c!r} (value columns: {', '.join(tbl.tdef.value_columns)})")
                    if not value_fits(tbl.tdef.columns[c], v):
                        hint = ""
                        if tbl.tdef.columns[c] == "real" and type(v) is int:
                            # no coercion (docs/protocol.md §0); say how to write it rather than convert silently
                            hint = f" (an integer is not a real; write {float(v)!r})"
                        raise NodeError(f"column {c} is {tbl.tdef.columns[c]}; {v!r} does not fit{hint}")
            payloads.append((tbl.tdef, key, None if delete else values, "delete" if delete else "upsert"))
        built: list = []
        raws = produce.issue_events(self, payloads, produce.signing_now(self, now, defer=True), built)
        try:
            outs = self.apply_batch(raws, now, origin="local", built=self._local_checked(raws, built))
        except Exception as e:
            # Signed and released, so durable in the signing journal: the next writing open applies
            # them (persist-before-release, _recover_released). On a full disk the CLI's usual
            # "nothing was changed" would be false, and an operator would write them again.
            if not db.disk_full(e, self.home / self.STORE_FILE):
                raise
            free = db.free_bytes(self.home)
            raise db.StoreError(
                f"the filesystem holding {self.home} is full ({free if free is not None else '?'} bytes free): "
                f"{len(raws)} event(s) were signed and kept in the signing journal but not applied; the next "
                "writing command applies them once there is space, so do not write them again. Free space there, "
                "or run `ssp-agent evict --auto` (it uses the space the home reserves for it)") from e
        for o in outs:
            if o.status != APPLIED or o.reason != R.APPLIED:
                # A local write either lands in the log or fails: never an id
                # for an event stored and sent nowhere (e.g. below an eviction horizon).
                raise NodeError(f"local event was not stored: {o.status} ({o.reason})")
        self._logged.update(b[6] for b in built)
        self.compact_journal_if_grown()
        return [o.event_id for o in outs]

    def release_signed(self, tbs: bytes, assemble, now: int) -> bytes:
        """Sign one control record under a fresh HLC identity (`produce.release_signed`)."""
        return produce.release_signed(self, tbs, assemble, now)

    def compact_journal_if_grown(self) -> None:
        """Compact the signing journal once it grew JOURNAL_COMPACT_BYTES since the last time."""
        if self.bridge.journal_stats()["bytes"] > getattr(self, "_journal_base", 0) + JOURNAL_COMPACT_BYTES:
            self.compact_journal()

    def note_clock(self, now: int | None = None) -> dict:
        """Assess the clock and, when it is trustworthy, keep the reading as evidence (throttled):
        `run` calls it every minute, so a node that only receives still has fresh evidence."""
        from . import clockstate
        now = now_ms() if now is None else now
        st = clockstate.assess(self, now)
        if st["trusted"]:
            self.record_clock_evidence(now, assessed=st)
            clockgap.recover(self, now)   # own writes stamped ahead that reached no one: re-issued
        return st

    def mesh_time(self) -> int | None:
        """The newest physical time the peers vouch for (events held from them, their
        acknowledgements of ours): what outweighs evidence taken under a lying clock."""
        return sync_state.peer_time_evidence(self.conn, self.site_id, self.keyring, self.tables)

    def record_clock_evidence(self, now: int, force: bool = False, defer: bool = False,
                              assessed: dict | None = None) -> None:
        """Keep the highest wall-clock reading taken while the clock was trustworthy (meta
        clock_evidence; only rises). Throttled to one store write a minute unless forced.
        `defer`: written by the next transaction that commits anyway (`write_due_meta`).
        `assessed` (clockstate.assess) saying the evidence is contradicted by a synchronised
        reading the peers agree with: the evidence is lowered to the reading, and surfaced."""
        from .clockstate import EVIDENCE_EVERY_MS
        cur = self.clock_evidence
        if assessed is not None and assessed.get("evidence_contradicted") and not self.read_only \
                and cur is not None and now < cur:
            with _txn(self.conn):
                db.set_meta(self.conn, "clock_evidence", now)
                reports.surface(self.conn, now, "clock", R.CLOCK_EVIDENCE_RESET, json.dumps(
                    {"evidence_ms": cur, "now_ms": now, "mesh_ms": self.mesh_time()}, sort_keys=True))
            log.warning("clock: the evidence %d was taken under a wrong clock (a synchronised reading and "
                        "the peers' time say %d); lowered to it", cur, now)
            self.clock_evidence = now
            self._evidence_due = None
            return
        if self.read_only or (cur is not None and (now <= cur or (not force and now < cur + EVIDENCE_EVERY_MS))):
            return
        if defer:
            self._evidence_due = max(now, self._evidence_due or 0)
            return
        with _txn(self.conn):
            db.set_meta(self.conn, "clock_evidence", now)
        self.clock_evidence = now

    _evidence_due: int | None = None

    def write_due_meta(self) -> int | None:
        """Inside the caller's transaction: the deferred evidence reading, if any. Returns it, for
        `due_meta_committed` once the transaction committed."""
        due = self._evidence_due
        if due is not None and (self.clock_evidence is None or due > self.clock_evidence):
            db.set_meta(self.conn, "clock_evidence", due)
            return due
        return None

    def due_meta_committed(self, due: int | None) -> None:
        if due is not None:
            self.clock_evidence = max(due, self.clock_evidence or 0)
            if self._evidence_due is not None and self._evidence_due <= due:
                self._evidence_due = None

    def require_trusted_clock(self, what: str, *, override: bool = False, wait_s: float = 0,
                              now: int | None = None, strict: bool = False) -> dict:
        """Eviction and horizon changes need a trustworthy wall clock: wait up
        to `wait_s` for one, else refuse (ClockUntrusted). Returns the clock's assessment; a
        trusted reading is recorded as evidence."""
        st = _require_trusted_clock(self, what, override, wait_s, now, strict)
        if st["trusted"]:
            self.record_clock_evidence(st["now_ms"], force=True, assessed=st)
        return st

    def _local_checked(self, raws: list[bytes], built: list) -> list:
        """What the apply path would compute for each freshly released local event (the
        `checked` of `_apply_one`: envelope, keyring entry, signature valid, decoded event, event_id),
        taken from what we built it from instead of parsing, verifying and decoding it again
        (a local write is not verified twice). It holds because the bytes are
        exactly `assemble(protected, payload, signature)` of our own encoding (its prefix compared here;
        otherwise None: the full path), and the signature is valid under our keyring key: the
        bridge releases only signatures that verify under the keystore's public key (it checks
        those of keystores outside the process), and that key is compared with ours once."""
        entry = self.keyring.get(self.site_id)
        if entry is None or len(raws) != len(built) or not self._own_key_matches(entry[0]):
            return [None] * len(raws)
        site = self.site_id
        out = []
        Sign1, Event, event_id, alg, ctype = cose.Sign1, ev.Event, ev.event_id, cose.ALG_EDDSA, ev.EVENT_CONTENT_TYPE
        for raw, (protected, pb, t, key, values, op, hlc, prefix) in zip(raws, built):
            if len(raw) != len(prefix) + 64 or not raw.startswith(prefix):   # not exactly prefix + signature
                out.append(None)
                continue
            sign1 = Sign1(protected, alg, ctype, site, pb, raw[-64:])
            e = Event(event_id(raw), raw, site, t.schema, t.name, dict(key), op,
                      None if values is None else dict(values), hlc)
            out.append((sign1, entry, True, e, e.event_id))   # the `checked` tuple of `_apply_one`
        return out

    def _own_key_matches(self, public_key: bytes) -> bool:
        return self.bridge.public_key(EVENT_KEY) == public_key

    # ------------------------------------------------------------------ schema and horizons
    def create_table(self, spec: dict) -> list[Outcome]:
        """Create a table, then apply the events held for it (§13.6 row 1)."""
        # checked against the tables here: SQLite takes `APP.readings` for `app.readings`
        t = table_def_from(spec, [x.tdef for x in self.tables.values()])
        _check_retention(self.profile, [t])
        with _txn(self.conn):
            _create_table_rows(self.conn, t)
        self._load_caches()
        return self.retry_held(t.qualified)

    def retry_held(self, qualified: str, now: int | None = None) -> list[Outcome]:
        now = now_ms() if now is None else now
        if qualified not in self.tables:
            return []
        with _txn(self.conn):  # release and re-apply in one transaction: nothing is lost between
            out = self._apply_in_txn(eventlog.take_held(self.conn, qualified), now, "remote")
            counters.bump_outcomes(self.conn, "released", (o.status for o in out))   # held, now applied
            return out

    def add_column(self, table: str, column: str, col_type: str) -> int:
        """Schema evolution: add a value column and rebuild it from the retained log by the
        resurrection-rebuild rule (§13.6 last paragraphs), in one transaction. Returns rows rebuilt."""
        tbl = self.tables.get(table)
        if tbl is None:
            raise NodeError(f"no table {table!r}")
        same = [c for c in tbl.tdef.columns if fold(c) == fold(column)] if isinstance(column, str) else []
        if same:   # SQLite folds case: `TEMP` is the column `temp`
            raise NodeError(f"{table} already has a column {same[0]!r}")
        cols = dict(tbl.tdef.columns)
        cols[column] = col_type
        try:
            newdef = table_def_from({"schema": tbl.tdef.schema, "name": tbl.tdef.name, "category": tbl.tdef.category,
                                     "key": list(tbl.tdef.key), "columns": cols, "retention": tbl.tdef.retention})
        except ManifestError as e:
            raise NodeError(str(e)) from None
        n = 0
        with _txn(self.conn):
            rowstore.add_column(self.conn, newdef, column)
            rowstore.set_columns(self.conn, table, json.dumps(cols, sort_keys=True))
            rs = rowstore.RowStore(self.conn, newdef)
            for rk, key in list(rs.all_row_keys()):
                state = rs.load(rk)
                rb = rebuild_columns(newdef, [column], state.tomb_clock, self._candidates(newdef, rk), tbl.horizon)
                if rb.writes[column] is not None:
                    rs.save(rk, key, state, {column: rb.writes[column]})
                    n += 1
        self._load_caches()
        return n

    def raise_horizon(self, table: str, horizon: tuple[int, int], now: int | None = None) -> None:
        """§3: horizons are monotonic; only rehydration lowers one (to zero). A horizon above
        both the wall clock and the HLC is refused: every later local write would fall below it
        and vanish. An accepted one is observed by the clock (and kept with it), so every later
        local HLC is above it whatever the wall clock does."""
        now = now_ms() if now is None else now
        tbl = self.tables.get(table)
        if tbl is None:
            raise NodeError(f"no table {table!r}")
        if tbl.tdef.retention is None:
            raise NodeError(f"{table} is not declared evictable: give it a retention class in the manifest "
                            "(scope §3: only declared categories may be evicted)")
        cur = tbl.horizon or (0, 0)
        if horizon < cur:
            raise NodeError(f"{table}: horizon {horizon[0]}.{horizon[1]} is below the current {cur[0]}.{cur[1]}; "
                            "horizons never move back (only rehydration resets them)")
        if horizon > (now, 0) and horizon > self.clock.current():
            raise NodeError(f"{table}: horizon {horizon[0]}.{horizon[1]} is above this node's clock "
                            f"({max((now, 0), self.clock.current())[0]}); every later local write would fall "
                            "below it. Check the clock, and give a horizon in the past")
        with _txn(self.conn):
            rowstore.set_horizon(self.conn, table, horizon)
            self.clock.observe(horizon, now)
            self._persist_observed()
        tbl.horizon = horizon if horizon != (0, 0) else None

    def reset_horizons(self) -> dict[str, str]:
        """Rehydration (scope §3, agent/rehydrate.py): every horizon back to zero, the only way a
        horizon ever moves down. Returns the horizons it replaced. Nothing else changes: rows
        and the retained log stay; history comes back from peers by re-delivery."""
        with _txn(self.conn):
            return self.reset_horizons_in_txn()

    def reset_horizons_in_txn(self) -> dict[str, str]:
        """`reset_horizons` inside the caller's transaction (rehydration resets the horizons and
        the watermarks that described them as one commitment). The in-memory
        horizons follow once the caller committed (`_load_caches` on failure is not needed:
        they are only lowered, and a rolled-back lowering is re-read on the next open)."""
        old = {q: f"{t.horizon[0]}.{t.horizon[1]}" for q, t in self.tables.items() if t.horizon}
        rowstore.zero_horizons(self.conn)
        reports.surface(self.conn, now_ms(), "horizons_reset", "rehydration", json.dumps({"previous": old}))
        for t in self.tables.values():
            t.horizon = None
        return old

    def evict_table(self, table: str, horizon: tuple[int, int], now: int | None = None, *,
                    clock_override: bool = False, wait_clock_s: float = 0) -> int:
        """Raise one table's horizon and delete the retained events below it. Returns events deleted.
        Needs a trustworthy clock: a horizon is judged against it (raise_horizon)."""
        def work() -> int:   # all of it writes (the clock evidence too): all of it may need the reserve
            st = self.require_trusted_clock(f"evict {table}", override=clock_override, wait_s=wait_clock_s, now=now)
            at = st["now_ms"] if now is None else now
            self.raise_horizon(table, horizon, at)
            n = self._delete_below_horizon(table)
            self._reclaim()
            return n
        return self._with_reserve(work)

    def _with_reserve(self, work):
        """Run an eviction; on a full disk, release the space the home reserves for it and run it
        once more (it is idempotent: horizons only rise, deletions below them repeat as no-ops).
        Afterwards take the reserve back if there is room (agent/store/db.py)."""
        try:
            out = work()
        except Exception as e:
            if not db.disk_full(e, self.home / self.STORE_FILE):
                raise
            freed = db.release_reserve(self.home)
            if not freed:
                raise
            log.warning("the disk is full: eviction uses the %d bytes the home reserves for it", freed)
            out = work()
        db.ensure_reserve(self.home)
        return out

    def run_eviction(self, now: int | None = None, *, clock_override: bool = False,
                     wait_clock_s: float = 0) -> dict:
        """The eviction job (scope §3): advance each evictable table's horizon to now minus the
        profile's duration for its retention class, delete the retained events below it and
        reclaim the space. It never emits an event and never removes a materialized row (an
        ambiguous marker fails open: rows stay). Horizons only move up. Its horizons are "now
        minus a duration": a clock a year ahead would evict a year of history and set horizons
        no write can get above, so it refuses without a trustworthy clock (ClockUntrusted)."""
        # The automatic job is strict: it runs unattended, and what it deletes does not come back.
        def work() -> dict:   # all of it writes (the clock evidence too): all of it may need the reserve
            st = self.require_trusted_clock("eviction", override=clock_override, wait_s=wait_clock_s, now=now,
                                            strict=True)
            return self._run_eviction(st["now_ms"] if now is None else now)
        return self._with_reserve(work)

    def _run_eviction(self, now: int) -> dict:
        before = self.store_bytes()
        tables = {}
        # A clock that says it is synchronised may still lie: no horizon passes the newest time the
        # mesh vouches for, so a peer's later writes (its HLC only rises) stay above it, and with
        # no such evidence no horizon moves (docs/apply.md "What eviction never does").
        vouched = sync_state.peer_time_evidence(self.conn, self.site_id, self.keyring, self.tables)
        for q, t in sorted(self.tables.items()):
            keep_ms = self.profile.horizons_ms.get(t.tdef.retention) if t.tdef.retention else None
            if keep_ms is None:
                continue  # not declared evictable, or this profile keeps that class in full
            target = (max(0, min(now - keep_ms, vouched)), 0) if vouched is not None else (0, 0)
            if target > (t.horizon or (0, 0)):
                self.raise_horizon(q, target, now)
            h = t.horizon or (0, 0)
            tables[q] = {"horizon": f"{h[0]}.{h[1]}", "events_deleted": self._delete_below_horizon(q)}
        self._reclaim()
        report = {"tables": tables, "bytes_before": before, "bytes_after": self.store_bytes()}
        report["budget"] = self.check_disk_budget(now)
        report["journal"] = self.compact_journal()
        return report

    def _delete_below_horizon(self, table: str) -> int:
        """Delete the retained events below the table's horizon, a batch per transaction with
        the WAL truncated between them, so the space it needs is one batch's (docs/reliability.md
        "Full disk"). This node's own events that no peer acknowledged stay (their watermarks say
        which, §14.2): they may be all there is of them (docs/apply.md "What eviction never does")."""
        h = self.tables[table].horizon
        if h is None:
            return 0
        keep = (self.site_id, sync_state.acked_by_any(self.conn, self.site_id, table))
        with _txn(self.conn):
            own = eventlog.newest_evictable_own(self.conn, self.site_id, table, h, keep[1])
            if own is not None:  # our own history below it is gone from here: say so to receivers (§14.2)
                self._raise_own_floor(table, own)
        total = 0
        while True:
            with _txn(self.conn):
                n = eventlog.delete_below(self.conn, table, h, EVICT_BATCH, keep)
            total += n
            if n < EVICT_BATCH:
                return total
            db.checkpoint(self.conn)

    def _reclaim(self) -> None:
        # auto_vacuum=INCREMENTAL returns freed pages to the filesystem (an older store is converted once).
        if db.reclaim_free_pages(self.conn):
            log.info("the store was converted to return freed pages to the filesystem (one VACUUM)")

    def store_bytes(self) -> int:
        wal = self.home / (self.STORE_FILE + "-wal")
        return db.store_pages_bytes(self.conn) + (wal.stat().st_size if wal.exists() else 0)

    def check_disk_budget(self, now: int | None = None) -> dict:
        """Say so loudly when the store nears its budget; writes keep working (never a silent failure)."""
        used, budget = self.store_bytes(), self.profile.disk_budget_bytes
        frac = used / budget
        state = "ok" if frac < self.profile.warn_fraction else "near" if frac < 1 else "over"
        if state != "ok":
            msg = (f"store uses {used / 2**20:.1f} MiB of its {budget / 2**20:.0f} MiB budget ({frac:.0%}); "
                   "shorten the profile's horizons, run eviction, or move to a larger profile")
            log.warning("DISK BUDGET %s: %s", state.upper(), msg)
            with _txn(self.conn):
                reports.surface(self.conn, now_ms() if now is None else now, "disk_budget", state,
                                json.dumps({"used_bytes": used, "budget_bytes": budget, "message": msg}))
        return {"state": state, "used_bytes": used, "budget_bytes": budget}

    # ------------------------------------------------------------------ keyring
    def add_peer(self, site_id: bytes, public_key: bytes, retired_after: tuple[int, int] | None,
                 source: str = "operator", replace: bool = False) -> None:
        if site_id == self.site_id:
            raise NodeError("that is this node's own site_id; a node does not add itself as a peer")
        if len(public_key) != 32:
            raise NodeError("public key must be 32 bytes (Ed25519)")
        known = self.keyring.get(site_id)
        if known is not None and known[0] != public_key and not replace:
            # A different key for a known site_id is either a mistake or a re-keyed device; never silent.
            raise NodeError(f"site {site_id.hex()} is already trusted with another key ({known[0].hex()}); "
                            "pass --replace to replace it (events it signed with the old key stay valid)")
        try:
            with _txn(self.conn):
                sync_state.put_keyring(self.conn, site_id, public_key, retired_after, source)
                self._load_caches()
                self._reconcile_trust(now_ms())  # a lowered cutoff removes what no longer counts
        finally:
            self._load_caches()

    def remove_peer(self, site_id: bytes) -> None:
        """Drop a peer the operator or the manifest put in the keyring. One trusted through a vouch
        record is in-band state: retire it through the mesh authority instead."""
        if site_id == self.site_id:
            raise NodeError("that is this node's own site_id; its key cannot be removed from its keyring")
        if sync_state.keyring_source(self.conn, site_id) is None:
            if site_id in self.keyring:
                raise NodeError(f"site {site_id.hex()} is trusted through a vouch record; retire it with the "
                                "mesh authority (`record issue-retire`)")
            raise NodeError(f"site {site_id.hex()} is not in the keyring (`peer list` shows it)")
        try:
            with _txn(self.conn):
                sync_state.drop_keyring(self.conn, site_id)
                self._load_caches()
                self._reconcile_trust(now_ms())  # its events no longer count: rows rebuilt without them
        finally:
            self._load_caches()

    def keyring_entries(self) -> list[dict]:
        """The trusted-peer keyring as the node uses it: its own key, manifest and operator entries,
        and keys vouched for by control records (source "record")."""
        sources = sync_state.keyring_sources(self.conn)
        return [{"site_id": s.hex(), "public_key": pk.hex(), "retired_after": f"{ra[0]}.{ra[1]}" if ra else None,
                 "source": sources.get(s, "record")} for s, (pk, ra) in sorted(self.keyring.items())]

    # ------------------------------------------------------------------ views
    def dump(self) -> dict[str, list]:
        return {q: t.rows.dump() for q, t in sorted(self.tables.items())}

    def log_entries(self) -> Iterable[dict]:
        for eid, sid, p, l, q, rk, op in eventlog.entries(self.conn):
            yield {"event_id": bytes(eid).hex(), "site_id": bytes(sid).hex(), "hlc": f"{p}.{l}", "table": q,
                   "operation": op, "row_key": decode_strict(bytes(rk))}

    def surfaced(self, limit: int = 1000) -> list[dict]:
        out = []
        for seq, at, kind, reason, eid, sid, q, detail in reports.surfaced_rows(self.conn, limit):
            d = {"seq": seq, "at_ms": at, "kind": kind, "reason": reason}
            if eid is not None:
                d["event_id"] = bytes(eid).hex()
            if sid is not None:
                d["site_id"] = bytes(sid).hex()
            if q is not None:
                d["table"] = q
            if detail:
                d["detail"] = json.loads(detail)
            out.append(d)
        return out[::-1]

    def ignored_columns(self) -> list[dict]:
        return [{"site_id": bytes(s).hex(), "table": q, "column": c, "count": n, "first_ms": f, "last_ms": la}
                for s, q, c, n, f, la in reports.ignored_column_rows(self.conn)]

    def status(self) -> dict:
        return {"site_id": self.site_id.hex(), "mesh_id": self.mesh_id.hex(), "profile": self.profile.name,
                "store_bytes": self.store_bytes(), "disk_budget_bytes": self.profile.disk_budget_bytes,
                "store_schema": {"version": migrations.store_version(self.conn), "agent": migrations.LATEST},
                "public_key": bytes(db.get_meta(self.conn, "public_key")).hex(),
                "keystore": self.bridge.describe() if self.bridge else self._keystore_card(),
                "events": db.log_count(self.conn),     # maintained counts: O(1) however large the log
                "held": db.held_total(self.conn),
                "bounds": self._bounds(),
                "clock": self._clock_status(),
                "tables": {q: {"category": t.tdef.category, "retention": t.tdef.retention,
                               "horizon": f"{t.horizon[0]}.{t.horizon[1]}" if t.horizon else "0.0"}
                           for q, t in sorted(self.tables.items())}}

    def _clock_status(self) -> dict:
        from . import clockstate
        return clockstate.assess(self)

    def _bounds(self) -> dict:
        """The store-enforced bounds on what peers can make this node keep, and what each evicted
        or refused (docs/apply.md "Bounds"): never silent."""
        return {"surfaced": db.surfaced_bounds(self.conn),
                "records": sync_state.record_bounds(self.conn, self.site_id)}

    def _keystore_card(self) -> dict:
        """What a read-only status says of the keystore without opening it (no worker, no device):
        its configuration as stored (never a PIN: the store holds none) and the journal as read."""
        conf = json.loads(db.get_meta(self.conn, "keystore", "{}") or "{}")
        path = str(self.home / "sign-journal")
        return {"journal": path, "keystore": conf, "journal_state": journal_inspect(path)}


CLOCK_WAIT_SAY_S = 5.0   # how often a wait for a synchronised clock says so


def _require_trusted_clock(node, what: str, override: bool, wait_s: float, now: int | None = None,
                           strict: bool = False) -> dict:
    """Wait up to `wait_s` for a trustworthy clock. A clock the node has evidence against (behind
    or far ahead of what it read while trusted) is always refused. A clock that is merely not
    known to be synchronised (no sync source, no contrary evidence: containers, devices without a
    time service) is refused only in strict mode — `strict`, a `--wait-clock`, or
    SSP_AGENT_CLOCK_STRICT=1, which first-boot enrolment and the automatic eviction job use — and
    otherwise accepted with a warning, so the command-line contract (docs/cli.md "The manifest": `init`,
    `evict --horizon`) holds on machines that cannot say."""
    from . import clockstate
    strict = strict or wait_s > 0 or os.environ.get("SSP_AGENT_CLOCK_STRICT", "").strip().lower() in ("1", "true", "yes")
    deadline = time.monotonic() + max(0.0, wait_s)
    say_at = time.monotonic()
    while True:
        st = clockstate.assess(node, now, trusted_override=override)
        if st["trusted"] or time.monotonic() >= deadline:
            break
        if time.monotonic() >= say_at:
            # A wait of up to `wait_s` (enrolment: 600 s) is never silent: the console and the
            # journal say what it waits for.
            say_at += CLOCK_WAIT_SAY_S
            print(f"ssp-agent: {what} waits for a synchronised wall clock ({st['state']}: "
                  f"{st['hint'].split(';')[0]}); {max(0.0, deadline - time.monotonic()):.0f} s left",
                  file=sys.stderr, flush=True)
        time.sleep(1.0)
    if not st["trusted"] and not strict and st["state"] == "unsynced":
        log.warning("%s: the wall clock is not known to be synchronised (%s); proceeding", what, st["hint"])
        st = dict(st, unverified=True)
        return st
    if not st["trusted"]:
        raise ClockUntrusted(f"clock_untrusted: {what} needs a trustworthy wall clock ({st['state']}: {st['hint']}); "
                             "wait for time sync (--wait-clock SECONDS), or pass --clock-trusted if the clock is right")
    return st


def _hlc_meta(v) -> tuple[int, int] | None:
    if not v:
        return None
    p, l = str(v).split(".")
    return int(p), int(l)


def _is_event(raw: bytes) -> bool:
    """The bridge journal also holds control records this node signed: those are not events."""
    return cose.content_type(raw) == ev.EVENT_CONTENT_TYPE


def _create_table_rows(conn: sqlite3.Connection, t: TableDef) -> None:
    rowstore.insert_table_row(conn, t)
    rowstore.create_table(conn, t)


def _check_retention(prof: Profile, tables) -> None:
    """A retention class the profile does not name is refused: a typo would silently keep that
    table's history forever (README "Device profiles")."""
    for t in tables:
        if t.retention is not None and prof.unknown_classes([t.retention]):
            known = sorted([*prof.horizons_ms, *prof.keep_full])
            raise NodeError(f"table {t.qualified}: retention class {t.retention!r} is not one profile {prof.name} "
                            f"names ({', '.join(known)}); fix the manifest, or add it to the profile's [horizons] "
                            f"(\"forever\" keeps it in full)")


def _entries(d: Path | None) -> set[str] | None:
    """The names in directory ``d``; None when there is no such directory."""
    return set(os.listdir(d)) if d is not None and d.is_dir() else None


@dataclass
class _Made:
    """What `init` may make, noted before it starts: the home (or its entries) and, for a software
    keystore, its directory (or its files). `undo` removes what was not there before."""

    home: Path
    home_before: set[str] | None          # None: the home was not there
    ks_dir: Path | None = None            # a software keystore's directory
    ks_before: set[str] | None = None
    # A key this init (or an unfinished one before it) generated on a token or the serial device,
    # {"kind", "public_key"}: a key cannot be taken back off a device, so the next init of this
    # home takes it up again instead of failing on KeyExists for ever
    device_key: dict | None = None

    @classmethod
    def noting(cls, home: Path, ks_conf: dict) -> "_Made":
        ks_dir = None
        if ks_conf.get("kind") == "software":
            ks_dir = Path(ks_conf.get("dir") or home / "keystore").absolute()
        return cls(home, _entries(home), ks_dir, _entries(ks_dir))

    def record(self) -> None:
        """The marker (Node.INIT_MARKER): this, durable, so a killed init can be undone later."""
        data = {"home_before": None if self.home_before is None else sorted(self.home_before),
                "ks_dir": None if self.ks_dir is None else str(self.ks_dir),
                "ks_before": None if self.ks_before is None else sorted(self.ks_before),
                "device_key": self.device_key}
        atomic_write(str(self.home / Node.INIT_MARKER), json.dumps(data).encode(), 0o600)

    def generating(self, kind: str) -> bytes | None:
        """The event key is about to be asked of a device: the tag it will carry (where the device
        keeps one, ``Keystore.key_tag``) is recorded first, so a kill before the public key is
        recorded still leaves this init's key recognisable (firmware_bridge/keytag.py). A software
        key is a file ``undo`` removes: None."""
        if kind == "software":
            return None
        old = self.device_key
        if not keytag.valid(old) or old["kind"] != kind:
            record = keytag.new_record(kind, existed_before=False)
            # a record from before tags ({"kind", "public_key"}) keeps telling its key by that
            legacy = old.get("public_key") if isinstance(old, dict) and old.get("kind") == kind else None
            if legacy is not None and keytag.valid({**record, "public_key": legacy}):
                record["public_key"] = legacy
            self.device_key = record
            self.record()
        return keytag.tag_of(self.device_key)

    def nothing_generated(self) -> None:
        """The device refused to generate the key, or holds another's of that name: a record of
        this init's tag alone is dropped (``undo`` then removes the home as for any failure
        before a key was made)."""
        if self.device_key is not None and not self.device_key.get("public_key"):
            self.device_key = None

    def generated(self, kind: str, public_key: bytes) -> None:
        """The event key was just generated: a device's is recorded before anything else is made."""
        if kind != "software":     # a software key is a file `undo` removes
            self.device_key = {**(self.device_key or {}), "kind": kind, "public_key": public_key.hex()}
            self.record()

    def reusable(self, kind: str, public_key: bytes, tag: bytes | None = None) -> bool:
        """Whether the device's existing event key is the one an unfinished init of this home made:
        the public key it recorded, or the tag it recorded before asking for the key."""
        return keytag.is_ours(self.device_key, kind, public_key, tag)

    @staticmethod
    def done(home: Path) -> None:
        (home / Node.INIT_MARKER).unlink()
        fsync_dir(str(home))

    @classmethod
    def interrupted(cls, home: Path) -> "_Made | None":
        """The record of an init of ``home`` that never finished, or None."""
        try:
            data = json.loads((home / Node.INIT_MARKER).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise NodeError(f"{home / Node.INIT_MARKER} (left by an init cut short) cannot be read: {e}; "
                            "remove the home and run init again") from None
        hb, kd, kb, dk = (data.get(k) for k in ("home_before", "ks_dir", "ks_before", "device_key"))
        return cls(home, None if hb is None else set(hb), None if kd is None else Path(kd),
                   None if kb is None else set(kb), dk if isinstance(dk, dict) else None)

    def undo(self, keep_device_key: bool = True) -> None:
        """Remove what this init made; a key it made on a device stays there, and so does the
        record of it (the home then holds only the marker) for the next init to take it up."""
        try:
            if self.ks_dir is not None and self.ks_dir.parent != self.home:
                _remove_new(self.ks_dir, self.ks_before)
            _remove_new(self.home, self.home_before)
            if keep_device_key and self.device_key is not None:
                self.home.mkdir(parents=True, exist_ok=True)
                self.record()
        except OSError as e:   # the failure itself is what the operator must see
            log.warning("a failed init could not remove what it made in %s: %s", self.home, e)


def _remove_new(path: Path, before: set[str] | None) -> None:
    """Remove the entries of `path` not in `before`; `path` itself if it was not there (None)."""
    if not path.exists():
        return
    if before is None:
        shutil.rmtree(path)
        return
    for name in set(os.listdir(path)) - before:
        p = path / name
        shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def _check_keystore_conf(conf: dict) -> dict:
    """A keystore request that cannot be right is refused before anything is made (exit 2); a
    keystore that is right but unavailable is a fault the keystore reports (exit 1)."""
    from firmware_bridge.keystore import KeystoreConfigError, check_config
    try:
        conf = check_config(conf)
    except KeystoreConfigError as e:
        raise NodeError(str(e)) from None
    if conf.get("pin_file"):
        conf["pin_file"] = str(Path(conf["pin_file"]).absolute())
    return conf


def home_paths(home: Path, conf: dict) -> dict:
    """The keystore config with paths stored relative to the home resolved against it. (A home made
    before paths were stored this way by an `init` with a relative --home holds paths relative to
    the directory init ran in: those still resolve from there.)"""
    conf = dict(conf)
    for k in ("dir", "pin_file"):
        v = conf.get(k)
        if v and not os.path.isabs(v):
            in_home = home / v
            conf[k] = str(in_home if in_home.exists() or not os.path.exists(v) else Path(v).absolute())
    return conf


def keep_pin_out_of_store(home: Path, conf: dict) -> dict:
    """A token PIN given at init goes to HOME/keystore.pin (0600), never into the store, which
    gets copied and backed up; the store keeps only where to find it (`pin_file`), or the name
    of an environment variable (`pin_env`) when the operator gave one."""
    conf = dict(conf)
    if "pin" in conf:
        pin_path = home / "keystore.pin"
        fd = os.open(str(pin_path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(str(conf.pop("pin")))
            f.flush()
            os.fsync(f.fileno())
        conf["pin_file"] = str(pin_path)
    return conf


@contextlib.contextmanager
def seal_keystore(home: Path, conn: sqlite3.Connection, ks):
    """The keystore whose seal key wraps the log's data keys: `ks` (the home's own), or the one
    `keystore rewrap` moved them to (meta atrest_keystore), opened for the duration and closed.
    One that cannot be opened is the at-rest fault: one line, what to do."""
    conf = atrest.seal_keystore_conf(conn)
    if conf is None:
        yield ks
        return
    try:
        other = open_keystore(resolve_pin(home_paths(home, conf)))
    except (KeystoreError, NodeError) as e:
        raise atrest.unavailable(home, conf.get("kind", "?"), f"is not available ({e})") from None
    try:
        yield other
    finally:
        other.close()


def resolve_pin(conf: dict) -> dict:
    """The keystore config with its PIN resolved (firmware_bridge.with_pin). A PIN that is not
    there is a keystore fault (exit 1, as a token that is not there): the environment or the file
    may be back on the next try, and the unit restarts on 1, never on a refusal's 2."""
    try:
        return with_pin(conf)
    except KeystoreUnavailable as e:
        todo = "set it in the environment of the command or the service (`systemctl edit ssp-agent`)" \
            if "pin_env" in conf and "pin_file" not in conf else "restore it or re-provision"
        raise KeystoreUnavailable(f"{e}; {todo}") from None


def _write_identity_file(home: Path, site_id: bytes, public_key: bytes, mesh_id: bytes, ks: dict) -> None:
    """A human-readable card of who this node is (never secrets)."""
    data = {"site_id": site_id.hex(), "public_key": public_key.hex(), "mesh_id": mesh_id.hex(),
            "keystore": ks.get("kind")}
    (home / Node.IDENTITY_FILE).write_text(json.dumps(data, indent=2) + "\n")


_txn = db.transaction  # kept as a short local name
