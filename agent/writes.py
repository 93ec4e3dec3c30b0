"""Local changes: writes checked against their table, issued through producing (agent/produce.py:
tick, sign, persist before release) and applied through the one apply path (agent/apply.py),
and the schema the operator changes (a table created, a column added and rebuilt from the
retained log, §13.6). Functions over the node's state (agent/nodestate.py)."""
from __future__ import annotations

import json

from . import apply, feed, home as homejob, produce
from .clockstate import now_ms
from .core import cose, events as ev, reasons as R
from .core.merge import rebuild_columns
from .core.schema import SYNCABLE, ManifestError, fold, table_def_from
from .errors import NodeError
from .home import STORE_FILE
from .outcomes import APPLIED, Outcome
from .produce import EVENT_KEY
from .store import db, rows as rowstore


def write_many(st, writes: list[tuple[str, dict, dict | None, bool]], now: int | None = None) -> list[bytes]:
    """Produce signed local events: tick the HLC (durable ceiling first), sign and persist
    through the bridge (one group commit), then apply through the one apply path."""
    now = now_ms() if now is None else now
    payloads = []
    tables = st.tables
    for table, key, values, delete in writes:
        tbl = tables.get(table)
        if tbl is not None and tbl.tdef.category == SYNCABLE and isinstance(key, dict) and \
                (delete or type(values) is dict) and tbl.tdef.fits_exactly(key, None if delete else values):
            # the common case, checked in one pass; anything else is looked at closely below
            payloads.append((tbl.tdef, key, None if delete else values, "delete" if delete else "upsert"))
            continue
        if tbl is None:
            raise NodeError(f"no table {table!r} on this node (known: {', '.join(sorted(st.tables)) or 'none'})")
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
    raws = produce.issue_events(st, payloads, produce.signing_now(st, now, defer=True), built)
    try:
        outs = apply.apply_batch(st, raws, now, origin="local", built=local_checked(st, raws, built))
    except Exception as e:
        # Signed and released, so durable in the signing journal: the next writing open applies
        # them (persist-before-release, recovery.recover_released). On a full disk the CLI's usual
        # "nothing was changed" would be false, and an operator would write them again.
        if not db.disk_full(e, st.home / STORE_FILE):
            raise
        free = db.free_bytes(st.home)
        raise db.StoreError(
            f"the filesystem holding {st.home} is full ({free if free is not None else '?'} bytes free): "
            f"{len(raws)} event(s) were signed and kept in the signing journal but not applied; the next "
            "writing command applies them once there is space, so do not write them again. Free space there, "
            "or run `ssp-agent evict --auto` (it uses the space the home reserves for it)") from e
    for o in outs:
        if o.status != APPLIED or o.reason != R.APPLIED:
            # A local write either lands in the log or fails: never an id
            # for an event stored and sent nowhere (e.g. below an eviction horizon).
            raise NodeError(f"local event was not stored: {o.status} ({o.reason})")
    st.logged.update(b[6] for b in built)
    produce.compact_journal_if_grown(st)
    return [o.event_id for o in outs]


def local_checked(st, raws: list[bytes], built: list) -> list:
    """What the apply path would compute for each freshly released local event (the
    `checked` of `apply_one`: envelope, keyring entry, signature valid, decoded event, event_id),
    taken from what we built it from instead of parsing, verifying and decoding it again
    (a local write is not verified twice). It holds because the bytes are
    exactly `assemble(protected, payload, signature)` of our own encoding (its prefix compared here;
    otherwise None: the full path), and the signature is valid under our keyring key: the
    bridge releases only signatures that verify under the keystore's public key (it checks
    those of keystores outside the process), and that key is compared with ours once."""
    entry = st.keyring.get(st.site_id)
    if entry is None or len(raws) != len(built) or not own_key_matches(st, entry[0]):
        return [None] * len(raws)
    site = st.site_id
    out = []
    Sign1, Event, event_id, alg, ctype = cose.Sign1, ev.Event, ev.event_id, cose.ALG_EDDSA, ev.EVENT_CONTENT_TYPE
    for raw, (protected, pb, t, key, values, op, hlc, prefix, rk) in zip(raws, built):
        if len(raw) != len(prefix) + 64 or not raw.startswith(prefix):   # not exactly prefix + signature
            out.append(None)
            continue
        sign1 = Sign1(protected, alg, ctype, site, pb, raw[-64:])
        e = Event(event_id(raw), raw, site, t.schema, t.name, dict(key), op,
                  None if values is None else dict(values), hlc)
        out.append((sign1, entry, True, e, e.event_id, rk))   # the `checked` tuple of `apply_one`, with the row key
    return out


def own_key_matches(st, public_key: bytes) -> bool:
    return st.bridge.public_key(EVENT_KEY) == public_key


def create_table(st, spec: dict) -> list[Outcome]:
    """Create a table, then apply the events held for it (§13.6 row 1)."""
    # checked against the tables here: SQLite takes `APP.readings` for `app.readings`
    t = table_def_from(spec, [x.tdef for x in st.tables.values()])
    homejob.check_retention(st.profile, [t])
    with db.transaction(st.conn):
        homejob.create_table_rows(st.conn, t)
    st.reload_caches()
    return apply.retry_held(st, t.qualified)


def add_column(st, table: str, column: str, col_type: str) -> int:
    """Schema evolution: add a value column and rebuild it from the retained log by the
    resurrection-rebuild rule (§13.6 last paragraphs), in one transaction. Returns rows rebuilt."""
    tbl = st.tables.get(table)
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
    with db.transaction(st.conn):
        rowstore.add_column(st.conn, newdef, column)
        rowstore.set_columns(st.conn, table, json.dumps(cols, sort_keys=True))
        rs = rowstore.RowStore(st.conn, newdef)
        for rk, key in list(rs.all_row_keys()):
            state = rs.load(rk)
            rb = rebuild_columns(newdef, [column], state.tomb_clock, apply.candidates(st, newdef, rk), tbl.horizon)
            if rb.writes[column] is not None:
                rs.save(rk, key, state, {column: rb.writes[column]})
                feed.note_rebuild(st.conn, newdef, key, rk, state.exists, state.exists, {column: rb.writes[column]},
                                  "column_added")   # the application's change feed, same transaction
                n += 1
    st.reload_caches()
    return n
