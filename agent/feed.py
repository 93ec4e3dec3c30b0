"""The change feed's records (docs/client.md "The change feed"): what an application sees of each
change the apply path made to a row, and of each event the node dropped, rejected or held. Built
here from what `apply.materialize` and `apply.surface` computed, inside the apply transaction, and appended
to the store (agent/store/feed.py) in that transaction: a record exists exactly when its change
committed, in apply order. One record per change: the columns written with their values and
clocks (site, HLC; their values are read from the row with the record), existence before and after, and the spec's application signals inline:
resurrection (§13.2), partial rebuild with its horizon (§13.4), columns ignored as unknown (§13.6)."""
from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from .store import feed as store


def value_json(v: Any) -> Any:
    """A column value in JSON (the CLI's form): bytes as {"$bytes": hex}."""
    return {"$bytes": v.hex()} if isinstance(v, (bytes, bytearray)) else v


def _hlc(s) -> str:
    return f"{s[0]}.{s[1]}"


def note_change(conn, tdef, e, rk: bytes, existed: bool, fx, writes: dict, partial: bool | None, horizon) -> None:
    """One applied event's effect on its row (`writes`: column -> (value, stamp), or None for a
    column a rebuild left without any clock). The columns written and their clocks, not their
    values (read from the row with the record: a superseded value is kept nowhere); a column's clock
    is named only when it is not the event's own (a rebuild's)."""
    own = e.stamp
    cols = []
    for c, w in writes.items():
        if w is None:
            cols.append(_text(c) + ':{"state":"unmaterialized"}')
        elif w[1] == own:
            cols.append(_text(c) + ":{}")
        else:
            cols.append(_text(c) + ':{"site":"' + w[1][2].hex() + '","hlc":"' + _hlc(w[1]) + '"}')
    # The record's text put together from parts (one per applied event): equal to
    # `_dumps(record)` of the same members in this order (tests/core/test_feed_record.py).
    parts = ['{"kind":"change","table":', _text(tdef.qualified), ',"key":', _key_text(rk, e.row_key),
             ',"op":', _text(e.operation), ',"event_id":"', e.event_id.hex(), '","site":"', own[2].hex(),
             '","hlc":"', str(own[0]), ".", str(own[1]), '","existed":', _BOOL[existed], ',"exists":',
             _BOOL[fx.state.exists], ',"columns":{', ",".join(cols), "}"]
    if fx.ignored:
        parts += [',"ignored":', _dumps(sorted(fx.ignored))]   # §13.6 MUST NOT: never presented as a default
    if fx.resurrected:
        parts.append(',"resurrected":true')   # §13.2 SHOULD surface
        if partial:
            # §13.4 MUST: name the row and the horizon that truncated its rebuild
            t = fx.state.tomb_clock
            parts += [',"partial":{"horizon":"', _hlc(horizon), '","tombstone":"', _hlc(t), '"}']
    parts.append("}")
    store.append(conn, tdef.qualified, rk, "".join(parts))


_BOOL = {False: "false", True: "true"}


@lru_cache(maxsize=1024)
def _text(s: str) -> str:
    return _dumps(s)


_KEYS: dict[bytes, str] = {}   # row address -> its key's JSON text (a row key is its address's decode)


def _key_text(rk: bytes, key: dict) -> str:
    text = _KEYS.get(rk)
    if text is None:
        if len(_KEYS) >= 4096:
            _KEYS.clear()
        text = _KEYS[rk] = _dumps({k: value_json(v) for k, v in key.items()})
    return text


_dumps = json.JSONEncoder(separators=(",", ":")).encode


def note_rebuild(conn, tdef, key: dict, rk: bytes, existed: bool, exists: bool, writes: dict, cause: str,
                 partial: Any = None) -> None:
    """A row rebuilt without an event of its own (`cause`: `trust_change`, a signer's writes no
    longer count; `column_added`, §13.6 rebuild from the log): op `rebuild`, each column written
    with the clock it now carries (a rebuild's clocks are no event's)."""
    cols: dict[str, Any] = {c: {"state": "unmaterialized"} if w is None else {"site": w[1][2].hex(), "hlc": _hlc(w[1])}
                            for c, w in writes.items()}
    rec: dict[str, Any] = {"kind": "change", "table": tdef.qualified, "key": {k: value_json(v) for k, v in key.items()},
                           "op": "rebuild", "cause": cause, "event_id": None, "site": None, "hlc": None,
                           "existed": existed, "exists": exists, "columns": cols}
    if partial:
        rec["partial"] = partial   # §13.4 MUST: the clocks the horizon left out
    store.append(conn, tdef.qualified, rk, _dumps(rec))


def note_signal(conn, kind: str, o, detail: dict | None) -> None:
    """An event the node dropped, rejected or held (kind as `ssp-agent events` names it)."""
    rec: dict[str, Any] = {"kind": kind, "table": o.table, "reason": o.reason,
                           "event_id": o.event_id.hex() if o.event_id else None,
                           "site": o.site_id.hex() if o.site_id is not None and o.verified else None}
    if detail:
        rec["detail"] = detail
    store.append(conn, o.table, None, json.dumps(rec, separators=(",", ":"), default=str))
