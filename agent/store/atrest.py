"""At-rest protection of the retained event log, which holds column values that appear in no local
table (docs/reliability.md "At rest", docs/apply.md "Store format").

Sealed: the signed bytes of every event in `events.raw` and `held.raw`, each a sealing.Sealer blob
under the store's current data key with associated data b"ssp-log\0" | event_id, so a blob copied
into another row does not open. Clear, because queries select on it and it is metadata: seq,
event_id, site_id, HLC, table, row_key, operation, origin, received_ms; and the materialized
tables (the application's data).

Data keys (`atrest_keys`) are sealed by the keystore's seal key; meta `atrest_current` names the
one new values use. A rotation (`rotate`) adds a key and starts the re-seal job (`reseal`), which
rewrites older rows in batches, each one transaction with its cursor, so it resumes where a crash
or a full disk stopped it. Reads select `unseal(event_id, raw)`, an SQL function `install`
registers; the apply path seals before its insert (`LogSeal.seal`)."""
from __future__ import annotations

import json
import sqlite3
import struct

from firmware_bridge.sealing import SEAL_KEY, SealError, Sealer, is_sealed, key_id_of, new_data_key

from . import db

DDL = """CREATE TABLE IF NOT EXISTS atrest_keys (
  key_id INTEGER PRIMARY KEY, wrapped BLOB NOT NULL, seal_key TEXT NOT NULL, created_ms INTEGER NOT NULL)"""

LOG_AD = b"ssp-log\0"
_TABLES = ("events", "held")
RESEAL_BATCH = 500
_COSE_TAG18 = 0xD2   # every COSE_Sign1 this agent stores starts with tag 18


def create_schema(conn: sqlite3.Connection) -> None:
    """Migration v4 (inside its transaction): the key table, and a re-seal job over what the log
    and the held table already hold in clear (run by the next writing open, which has the keystore)."""
    conn.execute(DDL)
    if any(conn.execute(f"SELECT 1 FROM {t} LIMIT 1").fetchone() for t in _TABLES):
        db.set_meta(conn, "atrest_job", json.dumps({t: 0 for t in _TABLES}))
        db.set_meta(conn, "atrest_clear_rows", 1)   # clear rows may exist until the job has passed them
        db.set_meta(conn, "atrest_journal", 1)      # and the signing journal may hold clear outputs


def _wrap_ad(site_id: bytes, key_id: int) -> bytes:
    return b"ssp-atrest-dk-v1\0" + bytes(site_id) + struct.pack(">H", key_id)


class LogSeal:
    """The log's seal and open, bound to event_ids. `clear_ok`: a store whose migration job has
    not yet passed every row may still hold clear values (read as they are)."""

    __slots__ = ("sealer", "clear_ok")

    def __init__(self, sealer: Sealer | None, clear_ok: bool) -> None:
        self.sealer = sealer
        self.clear_ok = clear_ok

    def seal(self, event_id: bytes, raw: bytes) -> bytes:
        return self.sealer.seal(LOG_AD + event_id, raw)

    def open(self, event_id: bytes, blob: bytes) -> bytes:
        if blob[:1] == b"\xd2":
            if self.clear_ok:
                return bytes(blob)
            raise SealError(f"event {bytes(event_id).hex()} is stored in clear in a sealed log (written by "
                            "something other than this agent)")
        if self.sealer is None:
            raise SealError("a sealed value in a store without data keys")
        return self.sealer.open(LOG_AD + event_id, blob)


def install(conn: sqlite3.Connection, log: LogSeal) -> None:
    """Register `unseal(event_id, raw)` on `conn`: what every read of the log's payload selects."""
    def unseal(eid, blob):
        if blob is None:
            return None
        try:
            return log.open(bytes(eid), bytes(blob))
        except SealError as e:
            db.note_unseal_failure(f"the event log cannot be read: {e}. The store does not belong to this keystore, or "
                            "was damaged; keep a copy of the home and see docs/reliability.md \"At rest\"")
            raise
    conn.create_function("unseal", 2, unseal, deterministic=True)


def unavailable(home, conf_kind: str, why: str) -> db.StoreError:
    return db.StoreError(
        f"the event log of {home} is sealed by its {conf_kind} keystore, which {why}: it cannot be opened "
        "without that keystore (by design). Attach or restore the keystore; if it is lost, initialise a new node "
        "and rehydrate it from a peer (docs/reliability.md \"At rest\")")


def open_log(conn: sqlite3.Connection, keystore, site_id: bytes, home, now_ms: int, *, create: bool = True) -> LogSeal:
    """The store's data keys unsealed by `keystore` (a writing open). A store with no data key yet
    (created before this layout, or by `init`) gets one, sealed by the keystore's seal key, which
    is generated inside the keystore when it has none. Raises StoreError (one line) when the
    keystore cannot open them."""
    from firmware_bridge import KeyNotFound, KeystoreError, UnsupportedAlgorithm
    if not create and not conn.execute("SELECT 1 FROM sqlite_master WHERE name='atrest_keys'").fetchone():
        return LogSeal(None, True)   # a read view of a store older than the sealed layout
    rows = conn.execute("SELECT key_id, wrapped, seal_key FROM atrest_keys ORDER BY key_id").fetchall()
    if not create and not rows:
        return LogSeal(None, True)
    kind = getattr(keystore, "kind", "?")
    try:
        if not rows:
            with db.transaction(conn):
                if not conn.execute("SELECT 1 FROM atrest_keys").fetchone():
                    _add_key(conn, keystore, site_id, now_ms)
            rows = conn.execute("SELECT key_id, wrapped, seal_key FROM atrest_keys ORDER BY key_id").fetchall()
        keys = {kid: keystore.unseal(name, bytes(w), _wrap_ad(site_id, kid)) for kid, w, name in rows}
    except KeyNotFound as e:
        raise unavailable(home, kind, f"does not hold the seal key ({e})") from None
    except SealError:
        raise unavailable(home, kind, "is not the one that sealed its data key") from None
    except UnsupportedAlgorithm as e:
        raise db.StoreError(f"the keystore of {home} cannot seal the event log at rest: {e}") from None
    except KeystoreError as e:
        raise unavailable(home, kind, f"is not available ({e})") from None
    current = int(db.get_meta(conn, "atrest_current", rows[-1][0]))
    return LogSeal(Sealer(keys, current), bool(db.get_meta(conn, "atrest_clear_rows", 0)))


def _add_key(conn: sqlite3.Connection, keystore, site_id: bytes, now_ms: int) -> int:
    """A new data key, sealed by the keystore; current from now on (inside the caller's transaction)."""
    if not keystore.has_seal_key(SEAL_KEY):
        keystore.generate_seal_key(SEAL_KEY)
    kid = conn.execute("SELECT coalesce(max(key_id), 0) + 1 FROM atrest_keys").fetchone()[0]
    if kid > 0xFFFF:
        raise db.StoreError("the store has used every data key id (65535 rotations)")
    wrapped = keystore.seal(SEAL_KEY, new_data_key(), _wrap_ad(site_id, kid))
    conn.execute("INSERT INTO atrest_keys VALUES (?, ?, ?, ?)", (kid, wrapped, SEAL_KEY, now_ms))
    db.set_meta(conn, "atrest_current", kid)
    return kid


def rotate(conn: sqlite3.Connection, keystore, site_id: bytes, now_ms: int) -> int:
    """A new data key, and the re-seal job over every row (run it with `reseal`)."""
    with db.transaction(conn):
        kid = _add_key(conn, keystore, site_id, now_ms)
        db.set_meta(conn, "atrest_job", json.dumps({t: 0 for t in _TABLES}))
        db.set_meta(conn, "atrest_journal", 1)
    return kid


# meta: the config of the keystore whose seal key wraps the data keys, when `keystore rewrap` moved
# them away from the home's own keystore (no PIN: a `pin_file` in the home or a `pin_env`); absent,
# the home's keystore seals them.
SEAL_KEYSTORE_META = "atrest_keystore"
# meta: what a committed re-wrap still has to do: destroy the previous keystore's seal key.
REWRAP_META = "atrest_rewrap"
_KEEP = object()


def seal_keystore_conf(conn: sqlite3.Connection) -> dict | None:
    raw = db.get_meta(conn, SEAL_KEYSTORE_META)
    return json.loads(raw) if raw else None


def rewrap(conn: sqlite3.Connection, old_keystore, new_keystore, site_id: bytes, *, new_conf=_KEEP,
           retire: dict | None = None) -> int:
    """Seal every data key again under `new_keystore`'s seal key (a new token or device taking over
    from one still present): no event row is rewritten, key ids and sealed values are unchanged.
    `new_conf`: the seal keystore's config to record with it (None: the home's own keystore);
    `retire`: the previous seal keystore's config, recorded as pending until its seal key is
    destroyed (`rewrap_pending`, `rewrap_done`). One commit: a crash before it leaves the home
    sealed as it was (the new keystore merely holds an unused seal key), after it sealed by the new
    one. secure_delete is on for that commit and the WAL is truncated after it, so the previous
    wrapped values are in no file of the home. Returns the keys re-wrapped."""
    rows = conn.execute("SELECT key_id, wrapped, seal_key FROM atrest_keys").fetchall()
    if not new_keystore.has_seal_key(SEAL_KEY):
        new_keystore.generate_seal_key(SEAL_KEY)
    out = []
    for kid, w, name in rows:
        key = old_keystore.unseal(name, bytes(w), _wrap_ad(site_id, kid))
        wrapped = new_keystore.seal(SEAL_KEY, key, _wrap_ad(site_id, kid))
        if new_keystore.unseal(SEAL_KEY, wrapped, _wrap_ad(site_id, kid)) != key:   # before the old one goes
            raise SealError("the new keystore does not open what it sealed")
        out.append((wrapped, SEAL_KEY, kid))
    _crash_point("rewrap-wrapped")
    prev = conn.execute("PRAGMA secure_delete").fetchone()[0]
    conn.execute("PRAGMA secure_delete=ON")
    try:
        with db.transaction(conn):
            conn.executemany("UPDATE atrest_keys SET wrapped=?, seal_key=? WHERE key_id=?", out)
            if new_conf is None:
                conn.execute("DELETE FROM meta WHERE key=?", (SEAL_KEYSTORE_META,))
            elif new_conf is not _KEEP:
                db.set_meta(conn, SEAL_KEYSTORE_META, json.dumps(new_conf, sort_keys=True))
            if retire is not None:
                db.set_meta(conn, REWRAP_META, json.dumps(retire, sort_keys=True))
    finally:
        conn.execute(f"PRAGMA secure_delete={int(prev)}")
    _crash_point("rewrap-committed")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    return len(out)


def rewrap_pending(conn: sqlite3.Connection) -> dict | None:
    """The previous seal keystore whose seal key a committed re-wrap has not yet destroyed."""
    raw = db.get_meta(conn, REWRAP_META)
    return json.loads(raw) if raw else None


def rewrap_done(conn: sqlite3.Connection) -> None:
    with db.transaction(conn):
        conn.execute("DELETE FROM meta WHERE key=?", (REWRAP_META,))


def _crash_point(name: str) -> None:
    """Tests name a point here to SIGKILL a real process at it (tests/crashpoint.py)."""
    if _CRASH_HOOK is not None:
        _CRASH_HOOK(name)


_CRASH_HOOK = None


def pending(conn: sqlite3.Connection) -> dict | None:
    raw = db.get_meta(conn, "atrest_job")
    return json.loads(raw) if raw else None


def reseal(conn: sqlite3.Connection, log: LogSeal, batch: int = RESEAL_BATCH, max_batches: int | None = None) -> dict:
    """Run the re-seal job: every row of the log and the held table not sealed under the current
    key is rewritten under it, `batch` rows per transaction with the job's cursor, so a crash
    resumes where it stopped. SQLite's secure_delete is on meanwhile, so the old bytes of a
    rewritten value are zeroed in the file rather than left in free space. When every row has
    been passed: the clear-rows flag is cleared, keys no row uses are deleted, and the WAL is
    truncated (it held the pages as they were). Returns counts; `done` is False when stopped by
    `max_batches` (the rest runs on the next call)."""
    job = pending(conn)
    out = {"rewritten": 0, "done": True}
    if job is None:
        return out
    cur = log.sealer.current
    prev = conn.execute("PRAGMA secure_delete").fetchone()[0]
    conn.execute("PRAGMA secure_delete=ON")
    try:
        n_batches = 0
        for t in _TABLES:
            while True:
                if max_batches is not None and n_batches >= max_batches:
                    out["done"] = False
                    return out
                rows = conn.execute(f"SELECT seq, event_id, raw FROM {t} WHERE seq > ? ORDER BY seq LIMIT ?",
                                    (job[t], batch)).fetchall()
                if not rows:
                    break
                upd = []
                for seq, eid, blob in rows:
                    blob = bytes(blob)
                    if is_sealed(blob) and key_id_of(blob) == cur:
                        continue
                    upd.append((log.seal(bytes(eid), log.open(bytes(eid), blob)), seq))
                job[t] = rows[-1][0]
                with db.transaction(conn):
                    conn.executemany(f"UPDATE {t} SET raw=? WHERE seq=?", upd)
                    db.set_meta(conn, "atrest_job", json.dumps(job))
                out["rewritten"] += len(upd)
                n_batches += 1
        with db.transaction(conn):
            conn.execute("DELETE FROM meta WHERE key IN ('atrest_job', 'atrest_clear_rows')")
        log.clear_ok = False
    finally:
        conn.execute(f"PRAGMA secure_delete={int(prev)}")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
    return out


def journal_pending(conn: sqlite3.Connection) -> bool:
    """The signing journal may hold outputs in clear or under an older key (a migrated store, a
    rotation) until a compaction re-seals them (the node compacts it on open then)."""
    return bool(db.get_meta(conn, "atrest_journal", 0))


def journal_resealed(conn: sqlite3.Connection) -> None:
    with db.transaction(conn):
        conn.execute("DELETE FROM meta WHERE key='atrest_journal'")


def drop_retired_keys(conn: sqlite3.Connection, log: LogSeal) -> int:
    """Delete the data keys no stored value uses any more: once no re-seal job is pending and the
    signing journal has been compacted since (compaction re-seals its outputs under the current
    key). Until then an older key stays, so a crash between the two never strands a sealed value."""
    if pending(conn) is not None or journal_pending(conn):
        return 0
    with db.transaction(conn):
        n = conn.execute("DELETE FROM atrest_keys WHERE key_id != ?", (log.sealer.current,)).rowcount
    if n:
        log.sealer = log.sealer.only_current()
    return n


def status(conn: sqlite3.Connection) -> dict:
    """What `keystore show` / `status` report: never a key."""
    keys = conn.execute("SELECT key_id, seal_key, created_ms FROM atrest_keys ORDER BY key_id").fetchall() \
        if conn.execute("SELECT 1 FROM sqlite_master WHERE name='atrest_keys'").fetchone() else []
    conf = seal_keystore_conf(conn)
    return {"sealed": bool(keys), "data_keys": [{"key_id": k, "seal_key": s, "created_ms": c} for k, s, c in keys],
            "current": db.get_meta(conn, "atrest_current"), "job": pending(conn),
            # None: the home's own keystore seals the data keys
            "seal_keystore": None if conf is None else keystore_summary(conf),
            "rewrap": None if rewrap_pending(conn) is None else {"old_seal_key": "not yet destroyed"}}


def keystore_summary(conf: dict) -> dict:
    """What names a keystore, never a PIN."""
    return {k: v for k, v in conf.items() if k in ("kind", "dir", "module", "token_label", "port")}
