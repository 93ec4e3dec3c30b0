"""Sequencing records in the sync plane's `records` (SOVM §22.5-§22.6; formats in docs/protocol.md
§12). Pure: no I/O. They carry the sequencer's control plane between members over the
mesh, so a member that never talks to the sequencer still learns the receipt chain and the binding
in force, and sees a head that contradicts its own.

- `sovm/ssp-receipt-head-v1`: a member's gossip of one receipt it holds; `sovm/ssp-discontinuity-v1`:
  its relay of the sequencer's signed discontinuity statement (§22.6 step 4). Issued by any site
  in the keyring, not chained; the bytes inside are self-verifying (checked by the caller,
  agent/sequencing.py), and the record budget counts each against its issuer.
- `sovm/ssp-sequencer-binding-v1`: a mesh authority binds a sequencer key to a group from an MLS
  epoch (§22.6 singularity). Chained per group as §3 chains every record, its generation the MLS
  epoch (strictly increasing, not contiguous); a fork makes the binding unresolved from the lowest
  generation involved, and receipts there are held, neither applied nor rejected (§22.6).

A node that ignores these types still converges (§5): they carry no authority over data."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional

from .classify import classified
from .codec import encode
from .cose import ALG_EDDSA, protected_header, sig_structure
from .records import STORE_UINT_MAX, RecordError, parse_record, authority_payload, record_hash, verify_signed_by_site

RECEIPT_HEAD = "sovm/ssp-receipt-head-v1"
BINDING = "sovm/ssp-sequencer-binding-v1"
DISCONTINUITY = "sovm/ssp-discontinuity-v1"
HEAD_MEMBERS = frozenset({"group_id", "receipt"})
DISCONTINUITY_MEMBERS = frozenset({"group_id", "statement"})
BINDING_MEMBERS = frozenset({"group_id", "sequencer_key", "generation", "previous_record_hash"})
MAX_RECEIPT_BYTES = 1024          # a receipt is ~200 bytes (group_id up to 255); anything larger is not one


@dataclass(frozen=True)
class ReceiptHead:
    record_hash: bytes
    raw: bytes
    issuer: bytes
    group_id: bytes
    receipt: bytes


@dataclass(frozen=True)
class DiscontinuityRecord:
    record_hash: bytes
    raw: bytes
    issuer: bytes
    group_id: bytes
    statement: bytes


@dataclass(frozen=True)
class Binding:
    record_hash: bytes
    raw: bytes
    issuer: bytes
    group_id: bytes
    sequencer_key: bytes
    generation: int
    previous: Optional[bytes]


def _group_ok(g: Any) -> bool:
    return isinstance(g, bytes) and 1 <= len(g) <= 255


def head_to_be_signed(issuer: bytes, mesh_id: bytes, group_id: bytes, receipt: bytes) -> tuple[bytes, bytes, bytes]:
    protected = protected_header(ALG_EDDSA, RECEIPT_HEAD, issuer)
    payload = encode({"group_id": bytes(group_id), "receipt": bytes(receipt)})
    return protected, payload, sig_structure(protected, mesh_id, payload)


def discontinuity_to_be_signed(issuer: bytes, mesh_id: bytes, group_id: bytes,
                               statement: bytes) -> tuple[bytes, bytes, bytes]:
    protected = protected_header(ALG_EDDSA, DISCONTINUITY, issuer)
    payload = encode({"group_id": bytes(group_id), "statement": bytes(statement)})
    return protected, payload, sig_structure(protected, mesh_id, payload)


def binding_to_be_signed(issuer: bytes, mesh_id: bytes, group_id: bytes, sequencer_key: bytes, generation: int,
                         previous: Optional[bytes]) -> tuple[bytes, bytes, bytes]:
    protected = protected_header(ALG_EDDSA, BINDING, issuer)
    payload = encode({"group_id": bytes(group_id), "sequencer_key": bytes(sequencer_key), "generation": generation,
                      "previous_record_hash": previous})
    return protected, payload, sig_structure(protected, mesh_id, payload)


@classified(RecordError)
def verify_receipt_head(raw: bytes, mesh_id: bytes,
                        entry_of: Callable[[bytes], tuple[bytes, Any] | None]) -> ReceiptHead:
    """The receipt-head boundary: the wrapper signed by a keyring member not retired, exactly the
    two members, a group_id, and receipt bytes of a plausible size. Raises RecordError."""
    raw, s, p = verify_signed_by_site(raw, mesh_id, RECEIPT_HEAD, "receipt_head", HEAD_MEMBERS, entry_of)
    if not _group_ok(p["group_id"]):
        raise RecordError("bad_group_id")
    rc = p["receipt"]
    if not isinstance(rc, bytes) or not 0 < len(rc) <= MAX_RECEIPT_BYTES:
        raise RecordError("bad_receipt")
    return ReceiptHead(record_hash(raw), raw, s.kid, p["group_id"], rc)


@classified(RecordError)
def verify_discontinuity(raw: bytes, mesh_id: bytes,
                         entry_of: Callable[[bytes], tuple[bytes, Any] | None]) -> DiscontinuityRecord:
    """The discontinuity-record boundary, as the receipt head's. Raises RecordError."""
    raw, s, p = verify_signed_by_site(raw, mesh_id, DISCONTINUITY, "discontinuity", DISCONTINUITY_MEMBERS, entry_of)
    if not _group_ok(p["group_id"]):
        raise RecordError("bad_group_id")
    st = p["statement"]
    if not isinstance(st, bytes) or not 0 < len(st) <= MAX_RECEIPT_BYTES:
        raise RecordError("bad_statement")
    return DiscontinuityRecord(record_hash(raw), raw, s.kid, p["group_id"], st)


@classified(RecordError)
def verify_binding(raw: bytes, mesh_id: bytes, authorities: Iterable[bytes],
                   key_of: Callable[[bytes], bytes | None]) -> Binding:
    """The binding boundary: issued by a mesh authority (its provisioned key), exactly the four
    members, a 33-byte compressed key, genesis iff no predecessor. Raises RecordError."""
    raw, s = parse_record(raw)
    if s.content_type != BINDING:
        raise RecordError("not_a_binding_record", s.content_type)
    p = authority_payload(s, mesh_id, authorities, key_of, BINDING_MEMBERS)
    gid, sk, gen, prev = p["group_id"], p["sequencer_key"], p["generation"], p["previous_record_hash"]
    if not _group_ok(gid):
        raise RecordError("bad_group_id")
    if not (isinstance(sk, bytes) and len(sk) == 33 and sk[0] in (2, 3)):
        raise RecordError("bad_sequencer_key", "the 33-byte compressed SEC1 key (§22.5)")
    if not (isinstance(gen, int) and not isinstance(gen, bool) and 0 <= gen <= STORE_UINT_MAX):
        raise RecordError("bad_generation")
    if prev is not None and not (isinstance(prev, bytes) and len(prev) == 32):
        raise RecordError("bad_previous_record_hash")
    return Binding(record_hash(raw), raw, s.kid, gid, sk, gen, prev)


@dataclass
class BindingChain:
    """The binding record of one group as resolved from the records held."""

    bindings: dict[int, bytes]                       # generation -> sequencer key, along the chain
    forks: list[tuple[int, bytes, bytes]]            # (generation from which unresolvable, key, key)
    fork_records: list[bytes]                        # record hashes involved in a fork
    waiting: list[bytes]                             # records whose predecessor is not held (yet)


def resolve_bindings(records: Iterable[Binding]) -> BindingChain:
    """A pure function of the *set* of binding records held for one group (order independent).
    Walk from the genesis; a record with two successors, two geneses, or a successor whose
    generation does not exceed its predecessor's ends the walk: from the lowest generation
    involved nothing resolves (a fork, surfaced). Records off the walked chain wait."""
    by_prev: dict[Optional[bytes], list[Binding]] = {}
    recs = sorted(records, key=lambda r: r.record_hash)
    for r in recs:
        by_prev.setdefault(r.previous, []).append(r)
    out = BindingChain({}, [], [], [])
    on_chain: set[bytes] = set()
    nxt = by_prev.get(None, [])
    last: Optional[Binding] = None
    while nxt:
        bad = len(nxt) > 1 or (last is not None and nxt[0].generation <= last.generation)
        if bad:
            involved = nxt + ([last] if last is not None and len(nxt) == 1 else [])
            gen = min(r.generation for r in nxt)
            keys = sorted({r.sequencer_key for r in involved})
            out.forks.append((gen, keys[0], keys[-1]))
            out.fork_records = sorted(r.record_hash for r in nxt)
            break
        last = nxt[0]
        on_chain.add(last.record_hash)
        out.bindings[last.generation] = last.sequencer_key
        nxt = by_prev.get(last.record_hash, [])
    out.waiting = [r.record_hash for r in recs if r.record_hash not in on_chain and r.record_hash not in out.fork_records]
    return out
