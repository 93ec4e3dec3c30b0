"""What the operator reads of a node: rows, the log, what was surfaced, the keyring, and its
status card (ids, store, keystore, bounds, clock, tables). Reads only. Functions over the
node's state (agent/nodestate.py)."""
from __future__ import annotations

import json
from typing import Iterable

from firmware_bridge.journal import inspect as journal_inspect

from . import clockstate, eviction
from .core.codec import decode_strict
from .store import clockgaps, db, eventlog, migrations, reports, sync_state


def keyring_entries(st) -> list[dict]:
    """The trusted-peer keyring as the node uses it: its own key, manifest and operator entries,
    and keys vouched for by control records (source "record")."""
    sources = sync_state.keyring_sources(st.conn)
    return [{"site_id": s.hex(), "public_key": pk.hex(), "retired_after": f"{ra[0]}.{ra[1]}" if ra else None,
             "source": sources.get(s, "record")} for s, (pk, ra) in sorted(st.keyring.items())]


def dump(st) -> dict[str, list]:
    return {q: t.rows.dump() for q, t in sorted(st.tables.items())}


def log_entries(st) -> Iterable[dict]:
    for eid, sid, p, l, q, rk, op in eventlog.entries(st.conn):
        yield {"event_id": bytes(eid).hex(), "site_id": bytes(sid).hex(), "hlc": f"{p}.{l}", "table": q,
               "operation": op, "row_key": decode_strict(bytes(rk))}


def surfaced(st, limit: int = 1000) -> list[dict]:
    out = []
    for seq, at, kind, reason, eid, sid, q, detail in reports.surfaced_rows(st.conn, limit):
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


def ignored_columns(st) -> list[dict]:
    return [{"site_id": bytes(s).hex(), "table": q, "column": c, "count": n, "first_ms": f, "last_ms": la}
            for s, q, c, n, f, la in reports.ignored_column_rows(st.conn)]


def status(st) -> dict:
    return {"site_id": st.site_id.hex(), "mesh_id": st.mesh_id.hex(), "profile": st.profile.name,
            "store_bytes": eviction.store_bytes(st), "disk_budget_bytes": st.profile.disk_budget_bytes,
            "store_schema": {"version": migrations.store_version(st.conn), "agent": migrations.LATEST},
            "public_key": bytes(db.get_meta(st.conn, "public_key")).hex(),
            "keystore": st.bridge.describe() if st.bridge else keystore_card(st),
            "events": db.log_count(st.conn),     # maintained counts: O(1) however large the log
            "held": db.held_total(st.conn),
            "bounds": bounds(st),
            "clock": clock_status(st),
            "tables": {q: {"category": t.tdef.category, "retention": t.tdef.retention,
                           "horizon": f"{t.horizon[0]}.{t.horizon[1]}" if t.horizon else "0.0"}
                       for q, t in sorted(st.tables.items())}}


def clock_status(st) -> dict:
    """`clockstate.assess`, and the range the clock issues in after a wrong clock (`gap`: low and
    top, and `spent_to`, the highest value the wrong clock issued above it), or None; and how many
    own events wait to be re-issued."""
    out = clockstate.assess(st)
    g = clockgaps.gap(st.conn)
    p = clockgaps.pending(st.conn)
    out["gap"] = None if g is None else {k: f"{h[0]}.{h[1]}" for k, h in zip(("low", "top", "spent_to"), g)}
    out["reissue_pending"] = len(p[0]) if p else 0
    return out


def bounds(st) -> dict:
    """The store-enforced bounds on what peers can make this node keep, and what each evicted
    or refused (docs/apply.md "Bounds"): never silent."""
    return {"surfaced": db.surfaced_bounds(st.conn),
            "records": sync_state.record_bounds(st.conn, st.site_id)}


def keystore_card(st) -> dict:
    """What a read-only status says of the keystore without opening it (no worker, no device):
    its configuration as stored (never a PIN: the store holds none) and the journal as read."""
    conf = json.loads(db.get_meta(st.conn, "keystore", "{}") or "{}")
    path = str(st.home / "sign-journal")
    return {"journal": path, "keystore": conf, "journal_state": journal_inspect(path)}
