"""Scope above the floor: policy rows and their resolution (scope excerpt §1.1-§1.2).

Pure: rows come in as values, a decision goes out. The store (agent/store/sync_state.py)
keeps the rows; the sender consults `resolve` at selection time (policy never travels).
"""
from __future__ import annotations

from dataclasses import dataclass

from .schema import SYNCABLE, check_ident, ManifestError

LAYERS = ("system", "role", "user")  # ordered: system < role < user
LAYER_RANK = {name: i for i, name in enumerate(LAYERS)}
EFFECTS = ("allow", "deny")
WILDCARD = "*"
FORKED = object()  # a peer whose role chain forked: its role is absent and resolution fails closed
# A role named at local input (policy --role, record issue-role): at most as long as a table or
# column name (core/schema._IDENT), printable. Not their character rule: a role is any tstr
# (scope §1.3) and a record from an authority elsewhere may hold "field-tech"; records from peers
# are not bounded here.
ROLE_MAX = 63


class PolicyError(ValueError):
    """A policy row that cannot be represented (schema wildcard, a table below the floor...)."""


@dataclass(frozen=True)
class PolicyRow:
    peer: str  # 32 lowercase hex, or "*"
    schema: str  # never "*"
    table: str  # a table name, or "*"
    layer: str  # system | role | user
    effect: str  # allow | deny
    role: str = ""  # role layer only: the row applies to peers currently holding this role ("" = any)

    @property
    def specificity(self) -> tuple[bool, bool, bool]:
        return (self.peer != WILDCARD, self.table != WILDCARD, self.role != "")

    def matches(self, peer: str, schema: str, table: str, peer_role: str | None) -> bool:
        if self.schema != schema:
            return False
        if self.peer != WILDCARD and self.peer != peer:
            return False
        if self.table != WILDCARD and self.table != table:
            return False
        if self.role and self.role != peer_role:
            return False
        return True


@dataclass(frozen=True)
class Decision:
    allow: bool
    reason: str  # floor | no_row | incomparable | role_fork | allow | deny
    row: PolicyRow | None = None
    log: bool = False  # the spec asks for this outcome to be logged


def check_role(role: str) -> str:
    """A role name given at local input ("" is none), refused past ROLE_MAX or with a control character."""
    if len(role) > ROLE_MAX or not role.isprintable():
        shown = repr(role) if len(role) <= 60 else repr(role[:57]) + "..."
        raise PolicyError(f"role {shown} must be printable text of at most {ROLE_MAX} characters")
    return role


def check_row(row: PolicyRow, categories: dict[str, str]) -> PolicyRow:
    """Refuse at input what policy must not be able to represent (§1.1, §1.2), and a row naming a
    table (or a schema) the home does not have, which would never match (a typo, not a policy).
    `categories` maps "schema.table" -> floor category for the node's tables."""
    if row.schema == WILDCARD or "*" in row.schema:
        raise PolicyError("a schema wildcard is never valid (scope §1.2: an accidental widening would become "
                          "a total one); name the schema, e.g. app.* or app.readings")
    try:
        check_ident(row.schema, "schema")
        if row.table != WILDCARD:
            check_ident(row.table, "table")
    except ManifestError as e:
        raise PolicyError(str(e)) from None
    if row.peer != WILDCARD and (len(row.peer) != 32 or any(c not in "0123456789abcdef" for c in row.peer)):
        raise PolicyError(f"peer must be a site_id (32 lowercase hex characters) or *, got {row.peer!r}")
    if row.layer not in LAYERS:
        raise PolicyError(f"layer must be one of {', '.join(LAYERS)}, got {row.layer!r}")
    if row.effect not in EFFECTS:
        raise PolicyError(f"effect must be allow or deny, got {row.effect!r}")
    if row.role and row.layer != "role":
        raise PolicyError("only role-layer rows may name a role")
    check_role(row.role)
    if row.table == WILDCARD:
        if not any(q.split(".", 1)[0] == row.schema for q in categories):
            raise PolicyError(f"no table in schema {row.schema} on this node (the manifest's [[tables]], "
                              "or `table create`)")
    else:
        cat = categories.get(f"{row.schema}.{row.table}")
        if cat is None:
            raise PolicyError(f"no table {row.schema}.{row.table} on this node (the manifest's [[tables]], "
                              "or `table create`)")
        if cat != SYNCABLE:
            raise PolicyError(f"{row.schema}.{row.table} is {cat}: it is below the floor and unrepresentable in "
                              "policy (scope §1.1); it never leaves this node whatever policy says")
    return row


def resolve(rows: list[PolicyRow] | tuple[PolicyRow, ...], peer: str, schema: str, table: str,
            category: str | None, peer_role: object = None) -> Decision:
    """§1.2 resolution for (peer, schema, table), in the order the excerpt states.

    `category` is the table's floor category (None: the table is not known here, which is
    outside the floor). `peer_role` is the peer's current role (a str), None when it holds none,
    or FORKED when its role chain forked (surfaced elsewhere; here it fails closed)."""
    # 1. Outside the floor: deny unconditionally.
    if category != SYNCABLE:
        return Decision(False, "floor")
    # A forked role chain: the role layer is absent and resolution fails closed (scope §1.3).
    if peer_role is FORKED:
        return Decision(False, "role_fork", log=True)
    role = peer_role if isinstance(peer_role, str) else None
    matching = [r for r in rows if r.matches(peer, schema, table, role)]
    # 5. No matching row: deny (fail closed).
    if not matching:
        return Decision(False, "no_row")
    # 2. The highest layer containing any matching row wins.
    top = max(LAYER_RANK[r.layer] for r in matching)
    layer_rows = [r for r in matching if LAYER_RANK[r.layer] == top]
    # 3. Within it, the most specific undominated row: exact beats *, componentwise.
    def dominates(a: PolicyRow, b: PolicyRow) -> bool:
        sa, sb = a.specificity, b.specificity
        return sa != sb and all(x >= y for x, y in zip(sa, sb))
    maxima = [r for r in layer_rows if not any(dominates(o, r) for o in layer_rows)]
    if len(maxima) == 1:
        r = maxima[0]
        return Decision(r.effect == "allow", r.effect, r)
    # 4. Incomparable maximal rows: deny and log, never guess open.
    return Decision(False, "incomparable", log=True)
