"""The provisioning manifest (docs/cli.md "The manifest") and the local table schema, including
the floor of scope excerpt §1.1. Pure: parses text, touches no file."""
from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable

from .codec import INT64_MAX, INT64_MIN
from .events import is_scalar
from .ids import IdFormatError, parse_hlc, parse_mesh_id, parse_public_key, parse_site_id

# §1.1 the floor: fixed categories, identical on every node.
SYNCABLE = "syncable"
NEVER_SYNCABLE = "never_syncable"
NODE_LOCAL_DERIVED = "node_local_derived"
CATEGORIES = (SYNCABLE, NEVER_SYNCABLE, NODE_LOCAL_DERIVED)

COLUMN_TYPES = ("integer", "real", "text", "blob")
_IDENT = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,62}$")

# Columns per table (key and value columns). The store keeps 2 per value column (value, clock)
# plus 4 of its own (agent/store/rows.py), and SQLite refuses a table, a view or a statement of
# over 2000 (SQLITE_MAX_COLUMN): 500 keeps the widest table at 1004, well under it.
MAX_COLUMNS = 500


class ManifestError(ValueError):
    """A manifest or schema change that cannot be accepted; the message says what to fix."""


def value_fits(col_type: str, v: Any) -> bool:
    """docs/protocol.md §0 "Change events", Types: integer<->int, real<->float, text<->tstr,
    blob<->bstr, no coercion."""
    if v is None:
        return True
    if not is_scalar(v):
        return False
    if col_type == "integer":
        return isinstance(v, int)
    if col_type == "real":
        return isinstance(v, float)
    if col_type == "text":
        return isinstance(v, str)
    if col_type == "blob":
        return isinstance(v, bytes)
    return False


_PY_TYPES = {"integer": int, "real": float, "text": str, "blob": bytes}


def _fits(py: type | None, v: Any) -> bool:
    """`value_fits` for a non-null value of a column whose Python type is `py` (exact types)."""
    t = type(v)
    if t is not py:
        return False
    if t is int:
        return INT64_MIN <= v <= INT64_MAX
    return t is not float or math.isfinite(v)


@dataclass(frozen=True)
class TableDef:
    schema: str
    name: str
    category: str
    key: tuple[str, ...]
    columns: dict[str, str] = field(hash=False)  # every column (key and value) -> type
    retention: str | None = None  # eviction class (scope §3): None = never evicted

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"

    @cached_property  # on the apply path for every event
    def value_columns(self) -> tuple[str, ...]:
        return tuple(c for c in sorted(self.columns) if c not in self.key)

    @cached_property  # merge_upsert's membership test, once per table rather than per event
    def value_column_set(self) -> frozenset[str]:
        return frozenset(self.value_columns)

    @cached_property  # merge_upsert's type test: value column -> its values' one Python type
    def value_types(self) -> dict[str, type]:
        """`object` for a type outside the four: no value is exactly of it (only a null fits)."""
        return {c: _PY_TYPES.get(self.columns[c], object) for c in self.value_columns}

    @cached_property
    def key_set(self) -> frozenset[str]:
        return frozenset(self.key)

    @cached_property  # Node.write_many's check of every local write
    def python_types(self) -> dict[str, type]:
        """Column -> the one Python type its values take (docs/protocol.md §0 Types, no coercion)."""
        return {c: _PY_TYPES[t] for c, t in self.columns.items() if t in _PY_TYPES}

    def fits_exactly(self, row_key: dict[str, Any], values: dict[str, Any] | None) -> bool:
        """True when `row_key` gives exactly the key columns and `values` (None: a delete) only
        value columns, every value of its column's type (a null only in a value column): what
        `key_fits` and `value_fits` accept, checked in one pass. False means "look closer" (the
        caller runs those for the reason), never a different answer."""
        if row_key.keys() != self.key_set:
            return False
        types = self.python_types
        for c, v in row_key.items():
            if not _fits(types.get(c), v):
                return False
        if values is not None:
            value_set = self.value_column_set
            for c, v in values.items():
                if c not in value_set or (v is not None and not _fits(types.get(c), v)):
                    return False
        return True

    def key_fits(self, row_key: dict[str, Any]) -> str | None:
        """SSP/1 §2 Addressing: exactly the key columns, each of a fitting non-null type."""
        m = self.key_misfit(row_key)
        return m[0] if m else None

    def key_misfit(self, row_key: dict[str, Any]) -> tuple[str, str, dict] | None:
        """`key_fits`'s reason, a sentence naming the column(s), and the same as a detail."""
        if row_key.keys() == self.key_set:
            # every key value of its column's one type (on every applied event): fits; else the reason below
            types = self.python_types
            for k, v in row_key.items():
                if type(v) is not types.get(k) or not is_scalar(v):
                    break
            else:
                return None
        if row_key.keys() != self.key_set:
            missing = [k for k in self.key if k not in row_key]
            # a peer's names, shortened and at most 8: the detail is stored (`ssp-agent events`)
            extra = sorted(_short(k) for k in row_key if k not in self.key_set)[:8]
            said = "; ".join(x for x in (f"missing {', '.join(missing)}" if missing else "",
                                         f"not key columns: {', '.join(extra)}" if extra else "") if x)
            return "row_key_columns", f"the key columns are {', '.join(self.key)} ({said})", \
                {"missing": missing, "extra": extra}
        for k in self.key:
            v = row_key[k]
            if v is None:
                return "row_key_type", f"key column {k} ({self.columns[k]}) cannot be null", {"column": k}
            if not value_fits(self.columns[k], v):
                return "row_key_type", f"key column {k} is {self.columns[k]}; {_short(v)} does not fit", {"column": k}
        return None


def check_ident(name: Any, what: str) -> str:
    if not isinstance(name, str) or not _IDENT.match(name) or name.lower().startswith("_ssp"):
        raise ManifestError(f"{what} {_short(name)} must be a letter followed by letters, digits or _ (max 63)")
    return name


def _short(v: Any) -> str:
    """A wrong value as the refusal quotes it: its repr, cut short (it may be a huge table)."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def fold(name: str) -> str:
    """The form SQLite compares identifiers in: ASCII case folded (identifiers are ASCII, _IDENT)."""
    return name.lower()


TABLE_KEYS = frozenset({"schema", "name", "category", "key", "columns", "retention"})


def table_def_from(spec: Any, existing: Iterable["TableDef"] = ()) -> TableDef:
    """A table from a manifest [[tables]] entry (or `table create --spec`), checked against the
    `existing` tables: SQLite folds case, so `APP.readings` is `app.readings` to it."""
    if not isinstance(spec, dict):
        raise ManifestError(f"a table must be a table of schema, name, key, columns..., got {_short(spec)}")
    schema = check_ident(spec.get("schema"), "table schema")
    name = check_ident(spec.get("name"), "table name")
    unknown = sorted(str(k) for k in set(spec) - TABLE_KEYS)
    if unknown:   # a misspelt `retention` would otherwise be silently no retention class
        raise ManifestError(f"table {schema}.{name}: unknown key(s) {_short(', '.join(unknown))}; "
                            f"a table has {', '.join(sorted(TABLE_KEYS))}")
    category = spec.get("category", SYNCABLE)
    if not isinstance(category, str) or category not in CATEGORIES:
        raise ManifestError(f"table {schema}.{name}: category must be one of {', '.join(CATEGORIES)}")
    cols = spec.get("columns")
    if not isinstance(cols, dict) or not cols:
        raise ManifestError(f"table {schema}.{name}: columns must be a non-empty table of name = type")
    if len(cols) > MAX_COLUMNS:
        raise ManifestError(f"table {schema}.{name}: {len(cols)} columns; a table has at most {MAX_COLUMNS}")
    seen: dict[str, str] = {}
    for c, t in cols.items():
        check_ident(c, f"table {schema}.{name}: column")
        if not isinstance(t, str) or t not in COLUMN_TYPES:
            raise ManifestError(f"table {schema}.{name}: column {c} has type {_short(t)}; use one of {', '.join(COLUMN_TYPES)}")
        if fold(c) in seen:
            raise ManifestError(f"table {schema}.{name}: columns {seen[fold(c)]} and {c} differ only in case "
                                "(one column to SQLite)")
        seen[fold(c)] = c
    key = spec.get("key")
    if not isinstance(key, list) or not key or not all(isinstance(k, str) for k in key):
        raise ManifestError(f"table {schema}.{name}: key must be a non-empty list of column names")
    if len(set(key)) != len(key) or any(k not in cols for k in key):
        raise ManifestError(f"table {schema}.{name}: key columns must be distinct columns of the table")
    retention = spec.get("retention")
    if retention is not None:
        check_ident(retention, f"table {schema}.{name}: retention class")
        if category != SYNCABLE:
            raise ManifestError(f"table {schema}.{name}: only syncable tables carry history to evict")
    t = TableDef(schema, name, category, tuple(key), dict(cols), retention)
    _Names(existing).admit(t)
    return t


class _Names:
    """The table and schema names taken, as SQLite compares them (folded), each looked up in a
    dict: a manifest of many tables is checked in linear time."""

    def __init__(self, tables: Iterable["TableDef"] = ()) -> None:
        self.tables: dict[str, str] = {}
        self.schemas: dict[str, str] = {}
        for t in tables:
            self.tables.setdefault(fold(t.qualified), t.qualified)
            self.schemas.setdefault(fold(t.schema), t.schema)

    def admit(self, t: "TableDef", taken: str = "already exists") -> None:
        """Refuse `t` if its name is taken (or differs from a taken one only in case), or if its
        schema is one already spelled otherwise; else take its names."""
        other = self.tables.get(fold(t.qualified))
        if other == t.qualified:
            raise ManifestError(f"table {t.qualified} {taken}")
        if other is not None:
            raise ManifestError(f"table {t.qualified} differs only in case from table {other} (one name to SQLite)")
        spelled = self.schemas.get(fold(t.schema))
        if spelled is not None and spelled != t.schema:
            raise ManifestError(f"schema {t.schema} differs only in case from schema {spelled}; spell it the same")
        self.tables[fold(t.qualified)] = t.qualified
        self.schemas.setdefault(fold(t.schema), t.schema)


@dataclass(frozen=True)
class PeerEntry:
    site_id: bytes
    public_key: bytes
    retired_after: tuple[int, int] | None


@dataclass(frozen=True)
class Manifest:
    mesh_id: bytes
    authorities: tuple[bytes, ...]
    peers: tuple[PeerEntry, ...]
    tables: tuple[TableDef, ...]

    @property
    def evictable(self) -> tuple[str, ...]:
        """Tables the manifest declares evictable (scope §3): those with a retention class."""
        return tuple(t.qualified for t in self.tables if t.retention is not None)


def _list_of(doc: dict, key: str, what: str) -> list:
    """`doc[key]` as a list (absent: empty) of TOML tables, or of strings when what == "str"."""
    v = doc.get(key, [])
    want = str if what == "str" else dict
    if not isinstance(v, list) or not all(isinstance(x, want) for x in v):
        shape = "a list of strings" if what == "str" else f"a list of tables ([[{key}]])"
        raise ManifestError(f"manifest key {key} must be {shape}, got {_short(v)}")
    return v


def parse_manifest(text: str) -> Manifest:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(f"manifest is not valid TOML: {e}") from None
    except RecursionError:   # tomllib parses nested arrays and tables recursively
        raise ManifestError("manifest is not valid TOML: nested too deeply") from None
    known = {"mesh_id", "authorities", "peers", "tables"}
    extra = set(doc) - known
    if extra:
        raise ManifestError(f"unknown manifest keys: {', '.join(sorted(extra))}")
    authority_list = _list_of(doc, "authorities", "str")
    peer_list = _list_of(doc, "peers", "table")
    table_list = _list_of(doc, "tables", "table")
    try:
        mesh_id = parse_mesh_id(doc.get("mesh_id"))
        authorities = tuple(parse_site_id(a, "authority") for a in authority_list)
        peers = []
        for p in peer_list:
            ra = p.get("retired_after")
            peers.append(PeerEntry(parse_site_id(p.get("site_id"), "peer site_id"),
                                   parse_public_key(p.get("public_key")),
                                   parse_hlc(ra) if ra is not None else None))
    except IdFormatError as e:
        raise ManifestError(str(e)) from None
    tables: list[TableDef] = []
    names = _Names()
    for spec in table_list:   # each against those before it (names SQLite folds to one)
        t = table_def_from(spec)
        names.admit(t, "is declared twice")
        tables.append(t)
    return Manifest(mesh_id, authorities, tuple(peers), tuple(tables))
