"""The node: a thin facade over its state (agent/nodestate.py) and the jobs that work on it, each
a module of functions taking that state and never calling back up here: the home (agent/home.py:
init, open, undo), opening and its repairs (recovery.py), the one apply path and
materialization (apply.py, §12–§13) with its worker pipeline (applypipeline.py), control
records (records_apply.py), trust (trust.py), local writes and schema (writes.py), producing and
the signing journal (produce.py), the clock (nodeclock.py), eviction (eviction.py) and the
operator's views (views.py). Transports, the mailbox and the CLI all call `Node.apply_batch`;
nothing else writes rows."""
from __future__ import annotations

import logging
import sqlite3
from pathlib import Path
from typing import Any, Iterable

from firmware_bridge import SigningBridge

from . import (apply, clockgap, eviction, home as homejob, identity as ident, nodeclock, produce, records_apply, recovery,
               trust, views, writes)
from .clockstate import now_ms
from .errors import NodeError
from .home import home_paths, keep_pin_out_of_store, resolve_pin, seal_keystore
from .nodeclock import ClockUntrusted
from .outcomes import Outcome
from .produce import EVENT_KEY
from .profile import Profile
from .store import atrest, db

# Re-exported: callers read the wall clock as node.now_ms, raise and catch node.NodeError and
# node.ClockUntrusted, and take the keystore helpers and the key name from here.
__all__ = ["Node", "NodeError", "ClockUntrusted", "EVENT_KEY", "now_ms", "home_paths", "keep_pin_out_of_store",
           "resolve_pin", "seal_keystore"]

log = logging.getLogger("ssp_agent")


def _forward(name: str) -> property:
    """A field of the node's state, read and set through the node."""
    return property(lambda self: getattr(self.state, name), lambda self, v: setattr(self.state, name, v),
                    doc=f"the state's `{name}` (agent/nodestate.py)")


class Node:
    STORE_FILE = homejob.STORE_FILE
    IDENTITY_FILE = homejob.IDENTITY_FILE
    INIT_MARKER = homejob.INIT_MARKER

    def __init__(self, home: Path, conn: sqlite3.Connection, bridge: SigningBridge | None, *,
                 read_only: bool = False, log_seal: atrest.LogSeal | None = None) -> None:
        self.state = recovery.start(home, conn, bridge, log_seal, read_only)
        clockgap.recover(self)   # own writes stamped ahead that reached no one: re-issued

    home = _forward("home")
    conn = _forward("conn")
    bridge = _forward("bridge")
    log_seal = _forward("log_seal")
    read_only = _forward("read_only")
    site_id = _forward("site_id")
    mesh_id = _forward("mesh_id")
    authorities = _forward("authorities")
    profile = _forward("profile")
    keyring = _forward("keyring")
    tables = _forward("tables")
    witness = _forward("witness")
    clock = _forward("clock")
    observed = _forward("observed")
    clock_evidence = _forward("clock_evidence")
    evidence_due = _forward("evidence_due")
    applied = _forward("applied")
    logged = _forward("logged")
    journal_base = _forward("journal_base")
    pipeline = _forward("pipeline")

    @property
    def long_running(self) -> bool:
        """Set by a long-running `run`: its first large body starts the apply workers
        (applypipeline.Pipeline.WORKER_RUN_BATCH)."""
        return self.state.pipeline.long_running

    @long_running.setter
    def long_running(self, v: bool) -> None:
        self.state.pipeline.long_running = v

    @property
    def _pool(self):
        """The apply workers (None not started, False none): for tests and benches that count them."""
        return self.state.pipeline.pool

    @_pool.setter
    def _pool(self, v) -> None:
        self.state.pipeline.pool = v

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def init(cls, home: Path, manifest_text: str, keystore: dict | None = None,
             profile: str | Profile | None = None, *, clock_trusted: bool = False,
             wait_clock_s: float = 0) -> tuple["Node", bytes]:
        """Create a node: identity, keystore key, store, manifest tables. Returns (node, public_key).
        The profile (agent/profiles/*.toml) sets horizons, limits and the default keystore
        (agent/home.py makes it; a failure takes back what it made)."""
        home, made, args = homejob.begin_init(home, manifest_text, keystore, profile, clock_trusted, wait_clock_s)
        try:
            public_key = homejob.make_home(home, made, *args)
            return cls.open(home), public_key
        except BaseException:
            made.undo()
            raise

    @classmethod
    def open(cls, home: Path, *, check_machine: bool = True, read_only: bool = False) -> "Node":
        """``read_only``: for the read verbs (status, dump, log, events). Writes nothing (no WAL
        set-up, no recovery, no journal compaction, no keystore), so they work on a full disk and
        beside a running agent; the journal is only inspected, and damage in it still refuses."""
        home = Path(home)
        conn, ks, bridge, log_seal = homejob.open_parts(home, check_machine, read_only)
        try:
            return cls(home, conn, bridge, read_only=read_only, log_seal=log_seal)
        except BaseException:
            # A failed set-up closes what it opened: a leaked bridge keeps the journal's lock, so the
            # next open in this process (a service retrying) was refused as "in use", and leaked fds
            # pile up (found by tests/reliability: thousands of damaged reopens ended in EMFILE).
            if bridge is not None:
                bridge.close()
                ks.close()
            conn.close()
            raise

    @classmethod
    def log_view(cls, home: Path) -> tuple[sqlite3.Connection, atrest.LogSeal]:
        """A read-only connection that can read the sealed log, and its LogSeal (`home.log_view`)."""
        return homejob.log_view(home)

    def rebind_machine(self) -> None:
        with db.transaction(self.conn):
            db.set_meta(self.conn, "machine", ident.machine_fingerprint())

    def __enter__(self) -> "Node":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        st = self.state
        st.pipeline.close()
        nodeclock.lower_ceiling(st)
        if st.bridge is not None:
            st.bridge.close()
            st.bridge = None
        st.witness.close()
        st.conn.close()

    def reload_caches(self) -> None:
        """The keyring, tables and horizons again from the store."""
        self.state.reload_caches()

    # ------------------------------------------------------------------ the apply path (§12)
    def apply_batch(self, raws: Iterable[bytes], now: int | None = None, origin: str = "remote",
                    built: list | None = None, path: str | None = None) -> list[Outcome]:
        return apply.apply_batch(self.state, raws, now, origin, built, path)

    def prepare_next(self, raws) -> None:
        self.state.pipeline.prepare_next(raws)

    def apply_records(self, raws, now: int) -> dict:
        return records_apply.apply_records(self.state, raws, now)

    def retry_held(self, qualified: str, now: int | None = None) -> list[Outcome]:
        return apply.retry_held(self.state, qualified, now)

    def counts(self, stamp: tuple[int, int, bytes]) -> bool:
        return apply.counts(self.state, stamp)

    def surface_clock(self, reason: str, detail: dict) -> None:
        apply.surface_clock(self.state, reason, detail)

    def surface_refused(self, source: str, reason: str, detail: str = "", claimed_sender: bytes | None = None,
                        now: int | None = None, kind: str = "refused") -> None:
        apply.surface_refused(self.state, source, reason, detail, claimed_sender, now, kind)

    def refresh_trust(self, now: int | None = None) -> dict | None:
        return trust.refresh_trust(self.state, now)

    # ------------------------------------------------------------------ local writes and schema
    def write(self, table: str, key: dict[str, Any], values: dict[str, Any] | None, *, delete: bool = False,
              now: int | None = None) -> bytes:
        return writes.write_many(self.state, [(table, key, values, delete)], now=now)[0]

    def write_many(self, changes: list[tuple[str, dict, dict | None, bool]], now: int | None = None) -> list[bytes]:
        return writes.write_many(self.state, changes, now)

    def create_table(self, spec: dict) -> list[Outcome]:
        return writes.create_table(self.state, spec)

    def add_column(self, table: str, column: str, col_type: str) -> int:
        return writes.add_column(self.state, table, column, col_type)

    def release_signed(self, tbs: bytes, assemble, now: int) -> bytes:
        """Sign one control record under a fresh HLC identity (`produce.release_signed`)."""
        return produce.release_signed(self.state, tbs, assemble, now)

    def compact_journal(self) -> dict | None:
        return produce.compact_journal(self.state)

    def compact_journal_if_grown(self) -> None:
        produce.compact_journal_if_grown(self.state)

    # ------------------------------------------------------------------ the clock
    def note_clock(self, now: int | None = None) -> dict:
        a = nodeclock.note_clock(self.state, now)
        if a["trusted"]:
            clockgap.recover(self, now)   # own writes stamped ahead that reached no one: re-issued
        return a

    def mesh_time(self) -> int | None:
        return self.state.mesh_time()

    def record_clock_evidence(self, now: int, force: bool = False, defer: bool = False,
                              assessed: dict | None = None) -> None:
        nodeclock.record_clock_evidence(self.state, now, force, defer, assessed)

    def write_due_meta(self) -> int | None:
        return nodeclock.write_due_meta(self.state)

    def due_meta_committed(self, due: int | None) -> None:
        nodeclock.due_meta_committed(self.state, due)

    def require_trusted_clock(self, what: str, *, override: bool = False, wait_s: float = 0,
                              now: int | None = None, strict: bool = False) -> dict:
        return nodeclock.require_trusted_clock(self.state, what, override=override, wait_s=wait_s, now=now,
                                               strict=strict)

    def own_history_floors(self) -> dict[str, tuple[int, int]]:
        return nodeclock.own_history_floors(self.state)

    # ------------------------------------------------------------------ horizons and eviction
    def raise_horizon(self, table: str, horizon: tuple[int, int], now: int | None = None) -> None:
        eviction.raise_horizon(self.state, table, horizon, now)

    def reset_horizons(self) -> dict[str, str]:
        return eviction.reset_horizons(self.state)

    def reset_horizons_in_txn(self) -> dict[str, str]:
        return eviction.reset_horizons_in_txn(self.state)

    def evict_table(self, table: str, horizon: tuple[int, int], now: int | None = None, *,
                    clock_override: bool = False, wait_clock_s: float = 0) -> int:
        return eviction.evict_table(self.state, table, horizon, now, clock_override=clock_override,
                                    wait_clock_s=wait_clock_s)

    def run_eviction(self, now: int | None = None, *, clock_override: bool = False,
                     wait_clock_s: float = 0) -> dict:
        return eviction.run_eviction(self.state, now, clock_override=clock_override, wait_clock_s=wait_clock_s)

    def store_bytes(self) -> int:
        return eviction.store_bytes(self.state)

    def check_disk_budget(self, now: int | None = None) -> dict:
        return eviction.check_disk_budget(self.state, now)

    # ------------------------------------------------------------------ keyring
    def add_peer(self, site_id: bytes, public_key: bytes, retired_after: tuple[int, int] | None,
                 source: str = "operator", replace: bool = False) -> None:
        trust.add_peer(self.state, site_id, public_key, retired_after, source, replace)

    def remove_peer(self, site_id: bytes) -> None:
        trust.remove_peer(self.state, site_id)

    # ------------------------------------------------------------------ views
    def keyring_entries(self) -> list[dict]:
        return views.keyring_entries(self.state)

    def dump(self) -> dict[str, list]:
        return views.dump(self.state)

    def log_entries(self) -> Iterable[dict]:
        return views.log_entries(self.state)

    def surfaced(self, limit: int = 1000) -> list[dict]:
        return views.surfaced(self.state, limit)

    def ignored_columns(self) -> list[dict]:
        return views.ignored_columns(self.state)

    def status(self) -> dict:
        return views.status(self.state)

    def keystore_card(self) -> dict:
        return views.keystore_card(self.state)
