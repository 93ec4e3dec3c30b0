"""The explicit state a node's jobs share (agent/home.py, apply.py, applypipeline.py, trust.py,
writes.py, eviction.py, views.py, nodeclock.py, produce.py, recovery.py, records_apply.py): the
store connection, the keystore bridge, the node's ids, the keyring and tables as the store makes
them, and the clock. Each job is a module of functions taking this state; none calls up into
the node (agent/node.py is their facade). The store is the only source of truth: the keyring and
tables are rebuilt from it (`reload_caches`)."""
from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass
from pathlib import Path

from .core.clock import Hlc
from .core.schema import TableDef
from .profile import Profile, load_profile
from .store import atrest, db, rows as rowstore, sync_state


@dataclass
class Table:
    tdef: TableDef
    rows: rowstore.RowStore
    horizon: tuple[int, int] | None


class NodeState:
    """Fields only (and the caches' rebuild); a field a job sets that is not listed here fails."""
    FIELDS = ("home", "conn", "bridge", "log_seal", "read_only", "site_id", "mesh_id", "authorities", "profile",
              "keyring", "tables", "witness", "clock", "observed", "clock_evidence", "evidence_due", "applied",
              "logged", "journal_base", "pipeline")
    __slots__ = FIELDS

    def __init__(self, home: Path, conn: sqlite3.Connection, bridge, log_seal: atrest.LogSeal | None,
                 read_only: bool, pipeline) -> None:
        self.home = home
        self.conn = conn
        self.bridge = bridge
        self.log_seal = log_seal   # None in a read view: it reads no payload (agent/store/atrest.py)
        self.read_only = read_only
        self.pipeline = pipeline   # the apply workers (agent/applypipeline.py)
        self.site_id: bytes = bytes(db.get_meta(conn, "site_id"))
        self.mesh_id: bytes = bytes(db.get_meta(conn, "mesh_id"))
        self.authorities: set[bytes] = {bytes.fromhex(a) for a in json.loads(db.get_meta(conn, "authorities", "[]"))}
        self.profile = Profile.from_dict(json.loads(db.get_meta(conn, "profile", "null") or "null")
                                         or load_profile(None).as_dict())
        self.keyring: dict[bytes, tuple[bytes, tuple[int, int] | None]] = {}
        self.tables: dict[str, Table] = {}
        self.witness = None
        self.clock: Hlc | None = None
        self.observed: tuple[int, int] | None = None   # the clock's mark kept with the last batch (meta clock_observed)
        ev_ms = db.get_meta(conn, "clock_evidence")
        self.clock_evidence: int | None = int(ev_ms) if ev_ms is not None else None
        self.evidence_due: int | None = None   # a deferred evidence reading (nodeclock.write_due_meta)
        self.applied = int(db.get_meta(conn, "applied_count", 0))
        self.logged: set[tuple[int, int]] = set()   # HLCs of own events write_many logged since the last compaction
        self.journal_base = 0   # the signing journal's size after its last compaction

    def reload_caches(self) -> None:
        """The keyring, tables and horizons again from the store: the only source of truth."""
        # The effective keyring: provisioned keys, then what the control records held make of them
        # (vouched keys, cutoffs lowered by retire records: agent/store/sync_state.py trust).
        self.keyring = {}
        sync_state.overlay_keyring(self.conn, self.keyring, self.site_id)
        self.tables = {}
        for q, sch, name, cat, key_json, cols_json, retention, hp, hl in rowstore.table_rows(self.conn):
            t = TableDef(sch, name, cat, tuple(json.loads(key_json)), json.loads(cols_json), retention)
            self.tables[q] = Table(t, rowstore.RowStore(self.conn, t), (hp, hl) if (hp, hl) != (0, 0) else None)

    def mesh_time(self) -> int | None:
        """The newest physical time the peers vouch for (events held from them, their
        acknowledgements of ours): what outweighs evidence taken under a lying clock."""
        return sync_state.peer_time_evidence(self.conn, self.site_id, self.keyring, self.tables)
