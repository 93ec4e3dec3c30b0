"""Which tables policy lets this node send to a peer (scope §1.2), and the widenings a change
implies (scope §2). Below the node and the sync driver: the driver selects with it, rehydration
names only allowed rows in its truncation records, and records processing (a role record can
widen policy) snapshots it, so none of them reaches up into another for it."""
from __future__ import annotations

import json
import logging

from .clockstate import now_ms
from .core.scope import resolve
from .store import sync_state as st

log = logging.getLogger("ssp_agent.sync")


def allowed_fn(conn, tables: dict, peer: bytes, rows=None, roles=None, surfaced: set | None = None):
    """A function table -> bool: may `peer` receive that table's events now. `tables`: the
    node's tables (their categories); `rows`, `roles`: policy rows and current roles already read
    (one read for many peers); `surfaced`: (peer, table, reason) denials already surfaced by this
    caller (selection runs every cycle; the entry must not flood the record)."""
    rows = st.policy_rows(conn) if rows is None else rows
    roles = st.current_roles(conn) if roles is None else roles
    role = roles.get(peer)
    cats = {q: t.tdef.category for q, t in tables.items()}
    cache: dict[str, bool] = {}
    peer_hex = peer.hex()

    def allowed(q: str) -> bool:
        v = cache.get(q)
        if v is None:
            schema, name = q.split(".", 1)
            d = resolve(rows, peer_hex, schema, name, cats.get(q), role)
            if d.log:
                surface_denial(conn, peer, q, d.reason, surfaced)
            v = cache[q] = d.allow
        return v
    return allowed


def quiet_denials(tables: dict, peer: bytes, rows, roles) -> tuple[str, ...]:
    """The node's tables policy denies `peer` now with no denial to surface (scope §1.2: the floor,
    no matching row, a deny row): a selection may pass over their rows unread. A denial that must
    be logged is left to `allowed_fn`, which surfaces it when a row meets it."""
    role, peer_hex = roles.get(peer), peer.hex()
    out = []
    for q, t in tables.items():
        schema, name = q.split(".", 1)
        d = resolve(rows, peer_hex, schema, name, t.tdef.category, role)
        if not d.allow and not d.log:
            out.append(q)
    return tuple(sorted(out))


def surface_denial(conn, peer: bytes, table: str, reason: str, surfaced: set | None = None) -> None:
    """Scope §1.2 rule 4 (incomparable maximal rows) and a forked role chain: "deny and log".
    Surfaced where `ssp-agent events` lists it, once per (peer, table, reason) while that entry
    is kept."""
    if surfaced is not None:
        if (peer, table, reason) in surfaced:
            return
        surfaced.add((peer, table, reason))
    log.warning("policy: deny for peer %s table %s (%s)", peer.hex(), table, reason)
    from .store import reports
    reports.surface_once(conn, now_ms(), "policy_denied", reason, peer, table,
                         json.dumps({"peer": peer.hex(), "table": table}))


def snapshot(node) -> dict[tuple[bytes, str], bool]:
    """What policy allows now, for every (peer, syncable table) this node could send to."""
    peers = sorted({s for s in node.keyring if s != node.site_id} | set(st.peers_with_cursors(node.conn)))
    tables = sorted(q for q, t in node.tables.items() if t.tdef.category == "syncable")
    snap = {}
    rows, roles = st.policy_rows(node.conn), st.current_roles(node.conn)
    for p in peers:
        allowed = allowed_fn(node.conn, node.tables, p, rows, roles)
        snap.update({(p, q): allowed(q) for q in tables})
    return snap


def enqueue_widenings(node, before: dict, now: int) -> list[tuple[bytes, str]]:
    """Inside the caller's transaction: one durable backfill job per (peer, table) that `before`
    denied and policy allows now (scope §2: widening triggers backfill, whatever widened it)."""
    widened = []
    rows, roles = st.policy_rows(node.conn), st.current_roles(node.conn)
    for p in sorted({p for p, _ in before}):
        allowed = allowed_fn(node.conn, node.tables, p, rows, roles)
        widened += [(p, q) for (pp, q), was in sorted(before.items()) if pp == p and not was and allowed(q)]
    for p, q in widened:
        st.schedule_backfill(node.conn, p.hex(), [q], peers=[p], now_ms=now)
    return widened
