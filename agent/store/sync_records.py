"""The local policy store (never replicated), the control records this node holds with their
bound (docs/apply.md "Bounds"), the provisioned keyring and the trust resolved from both, and
the rehydration being served (agent/rehydrate.py)."""
from __future__ import annotations

import json
import sqlite3
from typing import Iterable

from ..core.records import Record, Trust, resolve_trust
from ..core.scope import PolicyRow
from .sync_schema import has_schema


# ---------------------------------------------------------------- policy
def policy_rows(conn: sqlite3.Connection) -> list[PolicyRow]:
    return [PolicyRow(p, s, t, la, e, r) for p, s, t, la, r, e in
            conn.execute("SELECT peer, schema_name, table_name, layer, role, effect FROM policy_rows")]


def put_policy_row(conn: sqlite3.Connection, row: PolicyRow) -> None:
    conn.execute("INSERT OR REPLACE INTO policy_rows VALUES (?,?,?,?,?,?)",
                 (row.peer, row.schema, row.table, row.layer, row.role, row.effect))


def delete_policy_row(conn: sqlite3.Connection, row: PolicyRow) -> int:
    return conn.execute("DELETE FROM policy_rows WHERE peer=? AND schema_name=? AND table_name=? AND layer=? AND role=?",
                        (row.peer, row.schema, row.table, row.layer, row.role)).rowcount


# ---------------------------------------------------------------- control records
def _value_json(r: Record) -> str:
    if r.kind == "role":
        return json.dumps(r.value)
    if r.kind == "vouch":
        return json.dumps(r.value.hex())
    (p, l), succ = r.value
    return json.dumps([[p, l], succ.hex() if succ else None])


def _value_from(kind: str, text: str):
    v = json.loads(text)
    if kind == "role":
        return v
    if kind == "vouch":
        return bytes.fromhex(v)
    return ((v[0][0], v[0][1]), bytes.fromhex(v[1]) if v[1] else None)


# ---------------------------------------------------------------- the bound on stored records
# Control records (vouch, retire, role), rehydrate requests and truncation records are stored
# without expiry, and a chain head in force (the vouch admitting a signer, a retirement, a role)
# must never be evicted, nor the chain below it that peers need to resolve it (records_ordered).
# No eviction rule is safe for all of them, so the bound refuses instead (docs/apply.md "Bounds"):
# once the records held from other issuers reach `records_limit` records or `records_limit_bytes`
# raw bytes (meta; set from the profile at init), a new one from another issuer is not stored,
# the refusal is surfaced (`record_refused`, reason `record_limit`) and counted (meta
# `records_refused`). Records this node issued itself are always stored (their bytes already
# left through the signing journal). A dropped record stores only its surfaced row, which the
# surfaced bound (agent/store/db.py) covers.
RECORDS_LIMIT = 10_000
RECORDS_LIMIT_BYTES = 16 * 2**20
_RECORD_TABLES = (("control_records", "issuer"), ("rehydrate_records", "subject"), ("truncation_records", "issuer"),
                  ("sequencing_records", "issuer"))


def record_usage(conn: sqlite3.Connection, self_site: bytes) -> tuple[int, int]:
    """(records, raw bytes) held from issuers other than this node, over every record table."""
    have = {n for (n,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
    n = size = 0
    for table, issuer in _RECORD_TABLES:
        if table in have:
            c, b = conn.execute(f"SELECT count(*), coalesce(sum(length(raw)), 0) FROM {table} WHERE {issuer} != ?",
                                (self_site,)).fetchone()
            n, size = n + c, size + b
    return n, size


class RecordBudget:
    """Room for records from other issuers, read once from the store per batch of records (the
    caller's transaction) and counted down as it admits them."""

    def __init__(self, conn: sqlite3.Connection, self_site: bytes) -> None:
        self.conn, self.self_site = conn, self_site
        self.count, self.bytes = record_usage(conn, self_site)
        self.limit = int(conn.execute("SELECT coalesce((SELECT value FROM meta WHERE key='records_limit'), ?)",
                                      (RECORDS_LIMIT,)).fetchone()[0])
        self.limit_bytes = int(conn.execute(
            "SELECT coalesce((SELECT value FROM meta WHERE key='records_limit_bytes'), ?)",
            (RECORDS_LIMIT_BYTES,)).fetchone()[0])

    def admit(self, issuer: bytes, raw: bytes, record_type: str, record_hash: bytes, now: int) -> bool:
        """True: store it (and it is counted). False: refused over the bound, surfaced and counted."""
        if issuer == self.self_site:
            return True
        if self.count < self.limit and self.bytes + len(raw) <= self.limit_bytes:
            self.count += 1
            self.bytes += len(raw)
            return True
        self.conn.execute("INSERT INTO meta (key, value) VALUES ('records_refused', 1)"
                          " ON CONFLICT (key) DO UPDATE SET value = value + 1")
        self.conn.execute("INSERT INTO surfaced (at_ms, kind, reason, site_id, detail) VALUES (?,?,?,?,?)",
                          (now, "record_refused", "record_limit", issuer, json.dumps(
                              {"type": record_type, "record_hash": record_hash.hex(), "bytes": len(raw),
                               "held": self.count, "held_bytes": self.bytes, "limit": self.limit,
                               "limit_bytes": self.limit_bytes}, sort_keys=True)))
        return False


def record_bounds(conn: sqlite3.Connection, self_site: bytes) -> dict:
    """What `status` shows of the record bound."""
    n, size = record_usage(conn, self_site)
    meta = dict(conn.execute("SELECT key, value FROM meta WHERE key IN "
                             "('records_limit', 'records_limit_bytes', 'records_refused')").fetchall())
    return {"held": n, "held_bytes": size, "limit": int(meta.get("records_limit", RECORDS_LIMIT)),
            "limit_bytes": int(meta.get("records_limit_bytes", RECORDS_LIMIT_BYTES)),
            "refused": int(meta.get("records_refused", 0))}


def has_record(conn: sqlite3.Connection, h: bytes) -> bool:
    return conn.execute("SELECT 1 FROM control_records WHERE record_hash=?", (h,)).fetchone() is not None


def put_record(conn: sqlite3.Connection, r: Record) -> bool:
    cur = conn.execute("INSERT OR IGNORE INTO control_records VALUES (?,?,?,?,?,?,?,?)",
                       (r.record_hash, r.kind, r.issuer, r.subject, r.generation, r.previous, _value_json(r), r.raw))
    return cur.rowcount == 1


def records(conn: sqlite3.Connection) -> list[Record]:
    if not has_schema(conn):
        return []
    return [Record(bytes(h), bytes(raw), k, bytes(i), bytes(s), g, bytes(p) if p is not None else None, _value_from(k, v))
            for h, k, i, s, g, p, v, raw in conn.execute(
                "SELECT record_hash, kind, issuer, subject, generation, previous, value, raw FROM control_records"
                " ORDER BY record_hash")]


def record_raws(conn: sqlite3.Connection) -> list[bytes]:
    if not has_schema(conn):
        return []
    return [bytes(r[0]) for r in conn.execute("SELECT raw FROM control_records ORDER BY record_hash")]


def records_ordered(conn: sqlite3.Connection) -> list[tuple[bytes, bytes]]:
    """(record_hash, raw) of the authority records in the order bodies carry them: retire, then
    vouch, then role, each chain from its genesis. Retirements first: a retire may void what an
    authority issued, so a receiver that gets it before a successor's re-issued genesis never sees
    the two geneses as a fork (authority records are verified with provisioned keys only, so
    nothing here depends on a vouch)."""
    if not has_schema(conn):
        return []
    return [(bytes(h), bytes(raw)) for h, raw in conn.execute(
        "SELECT record_hash, raw FROM control_records ORDER BY CASE kind WHEN 'retire' THEN 0 WHEN 'vouch' THEN 1 "
        "ELSE 2 END, subject, generation, record_hash")]


def delivered_records(conn: sqlite3.Connection, peer: bytes, path: str) -> set[bytes]:
    """Hashes of the records `peer` is known to hold on `path`."""
    return {bytes(h) for (h,) in conn.execute("SELECT record_hash FROM records_delivered WHERE peer=? AND path=?",
                                               (peer, path))}


def mark_records_delivered(conn: sqlite3.Connection, peer: bytes, path: str, hashes: Iterable[bytes]) -> None:
    conn.executemany("INSERT OR IGNORE INTO records_delivered VALUES (?,?,?)",
                     [(peer, path, bytes(h)) for h in hashes])


def clear_all_records_delivered(conn: sqlite3.Connection) -> None:
    """Every peer, every path: a newly stored record may unlock what a peer dropped."""
    conn.execute("DELETE FROM records_delivered")


def clear_records_delivered(conn: sqlite3.Connection, peer: bytes) -> None:
    """Every path: the peer may have lost what it held (a verified rehydrate request)."""
    conn.execute("DELETE FROM records_delivered WHERE peer=?", (peer,))


def provisioned_keyring(conn: sqlite3.Connection) -> dict:
    """The keyring the node was given (manifest, `peer add`, `authority add`), without records."""
    return {bytes(sid): (bytes(pk), None if rp is None else (rp, rl))
            for sid, pk, rp, rl in conn.execute("SELECT site_id, public_key, retired_p, retired_l FROM keyring")}


def put_keyring(conn: sqlite3.Connection, site: bytes, public_key: bytes, retired_after: tuple[int, int] | None,
                source: str, *, replace: bool = True) -> None:
    """A provisioned keyring entry (`source`: self, manifest, operator, authority...); with
    `replace` False an existing entry for the site is an error (the node's own key at init)."""
    verb = "INSERT OR REPLACE" if replace else "INSERT"
    conn.execute(f"{verb} INTO keyring VALUES (?,?,?,?,?)",
                 (site, public_key, retired_after[0] if retired_after else None,
                  retired_after[1] if retired_after else None, source))


def keyring_source(conn: sqlite3.Connection, site: bytes) -> str | None:
    """Where `site`'s provisioned keyring entry came from, or None (none: vouched by a record, or unknown)."""
    r = conn.execute("SELECT source FROM keyring WHERE site_id=?", (site,)).fetchone()
    return None if r is None else r[0]


def drop_keyring(conn: sqlite3.Connection, site: bytes) -> None:
    conn.execute("DELETE FROM keyring WHERE site_id=?", (site,))


def keyring_sources(conn: sqlite3.Connection) -> dict[bytes, str]:
    return {bytes(s): src for s, src in conn.execute("SELECT site_id, source FROM keyring")}


_SIGNED_RECORD_TABLES = ("control_records", "rehydrate_records", "truncation_records", "mailbox_acks",
                         "sequencing_records")


def holds_signed_record(conn: sqlite3.Connection, h: bytes) -> bool:
    """A control record with this hash is in one of the store's record tables (those that exist)."""
    marks = ",".join("?" for _ in _SIGNED_RECORD_TABLES)
    tables = [t for (t,) in conn.execute(f"SELECT name FROM sqlite_master WHERE name IN ({marks})",
                                         _SIGNED_RECORD_TABLES).fetchall()]
    return any(conn.execute(f"SELECT 1 FROM {t} WHERE record_hash=?", (h,)).fetchone() for t in tables)


def authorities(conn: sqlite3.Connection) -> set[bytes]:
    r = conn.execute("SELECT value FROM meta WHERE key='authorities'").fetchone()
    return {bytes.fromhex(a) for a in json.loads(r[0] if r else "[]")}


def trust(conn: sqlite3.Connection, self_site: bytes | None = None) -> Trust:
    """The effective trust (core/records.resolve_trust) from the provisioned keyring, the
    authority list and every control record held."""
    if self_site is None:
        r = conn.execute("SELECT value FROM meta WHERE key='site_id'").fetchone()
        self_site = bytes(r[0]) if r else b""
    return resolve_trust(records(conn), provisioned_keyring(conn), authorities(conn), self_site)


def overlay_keyring(conn: sqlite3.Connection, keyring: dict, self_site: bytes) -> dict:
    """Replace the in-memory keyring the apply path reads with the effective one: provisioned keys
    and cutoffs, vouched keys, and cutoffs lowered by retire records (resolve_trust). Returns the
    chains, for callers that surface forks."""
    t = trust(conn, self_site)
    keyring.clear()
    keyring.update(t.keyring)
    return t.chains


def current_roles(conn: sqlite3.Connection) -> dict[bytes, object]:
    """subject -> role (str) or scope.FORKED, from the role records that count (a retired
    authority's do not)."""
    from ..core.scope import FORKED
    out: dict[bytes, object] = {}
    if not has_schema(conn) or conn.execute("SELECT 1 FROM control_records WHERE kind='role' LIMIT 1").fetchone() is None:
        return out   # no role record, no role: nothing to resolve (the keyring is every device of a fleet)
    for (kind, subject), ch in trust(conn).chains.items():
        if kind != "role":
            continue
        if ch.forked:
            out[subject] = FORKED
        elif ch.head is not None:
            out[subject] = ch.head.value
    return out


# ---------------------------------------------------------------- rehydration (agent/rehydrate.py)
def rehydrate_upto(conn: sqlite3.Connection, subject: bytes) -> int:
    """While serving a rehydration of `subject`: the last log seq at the reset (0: not serving)."""
    r = conn.execute("SELECT upto_seq FROM rehydrate_served WHERE subject=?", (subject,)).fetchone()
    return 0 if r is None else r[0]


def rehydrate_generation(conn: sqlite3.Connection, subject: bytes) -> int | None:
    if not has_schema(conn):
        return None
    r = conn.execute("SELECT generation FROM rehydrate_served WHERE subject=?", (subject,)).fetchone()
    return None if r is None else r[0]
