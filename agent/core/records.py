"""Control records (the sync body's `records` member; docs/protocol.md §0 "Control records", scope §1.3).

Role assignment, vouch and retire records: tagged COSE_Sign1, alg EdDSA, kid = issuer site_id,
external_aad = mesh_id, deterministic CBOR payload, chained per (kind, subject) by `generation`
and `previous_record_hash` (BLAKE3 of the exact bytes of the superseded record).

Pure: `verify_record` checks one record on its own (independent of events and of other
records); `resolve_chains` turns the set of verified records a node holds into heads and
forks. Because it is a function of the set, the result does not depend on arrival order.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import blake3

from .classify import classified
from .codec import INT64_MAX, DecodeError, decode_strict, encode
from .cose import ALG_EDDSA, Sign1, assemble, content_type, parse_sign1, protected_header, sig_structure, verify_ed25519
from .ids import UINT32_MAX

# Generations, horizons, cutoffs and times reach the store: bounded by what SQLite holds (signed
# 64-bit), not the wire's uint64 (the strict decoder refuses more first).
STORE_UINT_MAX = INT64_MAX

ROLE, VOUCH, RETIRE = "sovm/ssp-role-v1", "sovm/ssp-vouch-v1", "sovm/ssp-retire-v1"
KINDS = {ROLE: "role", VOUCH: "vouch", RETIRE: "retire"}
CONTENT_TYPES = {v: k for k, v in KINDS.items()}
_MEMBERS = {
    ROLE: frozenset({"subject_site_id", "role", "generation", "previous_record_hash"}),
    VOUCH: frozenset({"subject_site_id", "public_key", "generation", "previous_record_hash"}),
    RETIRE: frozenset({"subject_site_id", "retired_after", "successor_site_id", "generation", "previous_record_hash"}),
}


class RecordError(ValueError):
    """A record that is dropped and surfaced; `reason` is a stable code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class Record:
    record_hash: bytes  # BLAKE3 of the exact bytes
    raw: bytes
    kind: str  # role | vouch | retire
    issuer: bytes
    subject: bytes
    generation: int
    previous: bytes | None
    value: Any  # role: str; vouch: public key bytes; retire: ((p, l), successor | None)


def record_hash(raw: bytes) -> bytes:
    return blake3.blake3(raw).digest()


def payload_for(kind: str, subject: bytes, value: Any, generation: int, previous: bytes | None) -> dict:
    p: dict[str, Any] = {"subject_site_id": subject, "generation": generation, "previous_record_hash": previous}
    if kind == "role":
        p["role"] = value
    elif kind == "vouch":
        p["public_key"] = value
    elif kind == "retire":
        (hp, hl), succ = value
        p["retired_after"] = [hp, hl]
        p["successor_site_id"] = succ
    else:
        raise ValueError(f"unknown record kind {kind!r}")
    return p


def to_be_signed(kind: str, issuer: bytes, mesh_id: bytes, subject: bytes, value: Any, generation: int,
                 previous: bytes | None) -> tuple[bytes, bytes, bytes]:
    """(protected, payload, Sig_structure) bytes for a record; sign the last, then `assemble`."""
    protected = protected_header(ALG_EDDSA, CONTENT_TYPES[kind], issuer)
    payload = encode(payload_for(kind, subject, value, generation, previous))
    return protected, payload, sig_structure(protected, mesh_id, payload)


def build_record(kind: str, issuer: bytes, mesh_id: bytes, subject: bytes, value: Any, generation: int,
                 previous: bytes | None, sign: Callable[[bytes], bytes]) -> bytes:
    protected, payload, tbs = to_be_signed(kind, issuer, mesh_id, subject, value, generation, previous)
    return assemble(protected, payload, sign(tbs))


def _bstr(v: Any, n: int) -> bool:
    return isinstance(v, bytes) and len(v) == n


def _uint(v: Any, limit: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= limit


def parse_record(raw: Any) -> tuple[bytes, Any]:
    """The strict COSE_Sign1 parse every record starts with (RecordError on failure)."""
    if not isinstance(raw, (bytes, bytearray)):
        raise RecordError("not_bytes")
    raw = bytes(raw)
    try:
        return raw, parse_sign1(raw)
    except DecodeError as e:
        raise RecordError(e.reason, e.detail) from None


@classified(RecordError)
def authority_payload(s: Sign1, mesh_id: bytes, authorities: Iterable[bytes], key_of: Callable[[bytes], bytes | None],
                      members: frozenset | set) -> dict:
    """The payload map of a parsed record that a mesh authority issued, checked in this order:
    issuer is an authority, its key is known, the signature holds, the payload is strict CBOR
    with exactly `members`. Raises RecordError."""
    if s.kid not in set(authorities):
        raise RecordError("unauthorized_issuer", f"{s.kid.hex()} is not a mesh authority")
    key = key_of(s.kid)
    if key is None:
        raise RecordError("unknown_issuer_key", s.kid.hex())
    if not verify_ed25519(key, s.sig_structure(mesh_id), s.signature):
        raise RecordError("bad_signature")
    try:
        p = decode_strict(s.payload_bytes)
    except DecodeError as e:
        raise RecordError(e.reason, "record payload") from None
    if not isinstance(p, dict) or set(p) != members:
        raise RecordError("bad_record_members")
    return p


def verify_record(raw: bytes, mesh_id: bytes, authorities: Iterable[bytes],
                  key_of: Callable[[bytes], bytes | None]) -> Record:
    """The authority record boundary. Verify one record on its own. Raises RecordError (dropped and surfaced) otherwise.
    `key_of(issuer)` gives the issuer's Ed25519 key from the trusted keyring (or None)."""
    raw, s = parse_record(raw)
    if s.content_type not in _MEMBERS:
        raise RecordError("unknown_record_type", s.content_type)
    p = authority_payload(s, mesh_id, authorities, key_of, _MEMBERS[s.content_type])
    if not _bstr(p["subject_site_id"], 16):
        raise RecordError("bad_subject")
    gen, prev = p["generation"], p["previous_record_hash"]
    if not _uint(gen, STORE_UINT_MAX):
        raise RecordError("bad_generation")
    if prev is not None and not _bstr(prev, 32):
        raise RecordError("bad_previous_record_hash")
    if (gen == 0) != (prev is None):
        raise RecordError("bad_genesis", "generation 0 exactly when previous_record_hash is null")
    kind = KINDS[s.content_type]
    if kind == "role":
        value: Any = p["role"]
        if not isinstance(value, str) or not value:
            raise RecordError("bad_role")
    elif kind == "vouch":
        value = p["public_key"]
        if not _bstr(value, 32):
            raise RecordError("bad_public_key")
    else:
        ra, succ = p["retired_after"], p["successor_site_id"]
        if not isinstance(ra, list) or len(ra) != 2 or not _uint(ra[0], STORE_UINT_MAX) or not _uint(ra[1], UINT32_MAX):
            raise RecordError("bad_retired_after")
        if succ is not None and not _bstr(succ, 16):
            raise RecordError("bad_successor")
        value = ((ra[0], ra[1]), succ)
    return Record(record_hash(raw), raw, kind, s.kid, p["subject_site_id"], gen, prev, value)


@dataclass
class Chain:
    kind: str
    subject: bytes
    head: Record | None = None  # None: absent (no genesis held, or forked)
    forked: bool = False
    fork_records: list[bytes] = field(default_factory=list)  # hashes of the conflicting records
    values: list[Any] = field(default_factory=list)  # values of every held record (fail-closed uses)


def resolve_chains(records: Iterable[Record]) -> dict[tuple[str, bytes], Chain]:
    """Heads per (kind, subject). Two records claiming the same predecessor are a fork: the
    chain is marked forked and its head is absent. A record whose predecessor is not held
    waits (it links when the predecessor arrives: order independence)."""
    groups: dict[tuple[str, bytes], list[Record]] = {}
    for r in records:
        groups.setdefault((r.kind, r.subject), []).append(r)
    out: dict[tuple[str, bytes], Chain] = {}
    for key, recs in groups.items():
        ch = Chain(key[0], key[1], values=[r.value for r in recs])
        by_prev: dict[bytes | None, list[Record]] = {}
        for r in sorted(recs, key=lambda r: r.record_hash):
            by_prev.setdefault(r.previous, []).append(r)
        forks = [rs for rs in by_prev.values() if len(rs) > 1]
        if forks:
            ch.forked = True
            ch.fork_records = sorted(r.record_hash for rs in forks for r in rs)
            out[key] = ch
            continue
        cur = by_prev.get(None, [None])[0]
        while cur is not None:
            ch.head = cur
            nxt = by_prev.get(cur.record_hash, [None])[0]
            if nxt is not None and nxt.generation != cur.generation + 1:
                break  # a successor with a wrong generation does not extend the chain
            cur = nxt
        out[key] = ch
    return out


# ---------------------------------------------------------------- truncation records (docs/protocol.md §8)
# A serving peer's statement to a subject it re-offers history to (rehydration, widening backfill):
# "these rows of this table depend on history I evicted below my horizon; what I send you for them
# is not complete". Issued by the serving node itself (kid = issuer), addressed to one subject.
TRUNCATED = "sovm/ssp-truncated-v1"
TRUNCATED_MEMBERS = frozenset({"subject_site_id", "table_schema", "table_name", "horizon", "row_keys", "issued_at"})
MAX_TRUNCATED_ROWS = 256  # row keys per record; more rows make several records


@dataclass(frozen=True)
class Truncation:
    record_hash: bytes
    raw: bytes
    issuer: bytes
    subject: bytes
    table: str  # schema.name
    horizon: tuple[int, int]
    row_keys: tuple[dict, ...]
    issued_at: int


def truncation_to_be_signed(issuer: bytes, mesh_id: bytes, subject: bytes, schema: str, name: str,
                            horizon: tuple[int, int], row_keys: list[dict], issued_at: int
                            ) -> tuple[bytes, bytes, bytes]:
    protected = protected_header(ALG_EDDSA, TRUNCATED, issuer)
    payload = encode({"subject_site_id": subject, "table_schema": schema, "table_name": name,
                      "horizon": [horizon[0], horizon[1]], "row_keys": list(row_keys), "issued_at": issued_at})
    return protected, payload, sig_structure(protected, mesh_id, payload)


def is_truncation(raw: Any) -> bool:
    return content_type(raw) == TRUNCATED


def _row_key_ok(k: Any) -> bool:
    return (isinstance(k, dict) and bool(k) and all(isinstance(c, str) for c in k)
            and all(isinstance(v, (int, str, bytes, float)) or v is None for v in k.values()))


@classified(RecordError)
def verify_signed_by_site(raw: Any, mesh_id: bytes, ctype: str, label: str, members: frozenset,
                          entry_of: Callable[[bytes], tuple[bytes, Any] | None]) -> tuple[bytes, Any, dict]:
    """The checks a record a site signs about itself starts with (truncation and rehydrate
    records): the content type, the signer's keyring entry (`entry_of(kid)`: public key and
    retirement cutoff or None) known and not retired, the signature, and exactly `members` in the
    payload. Returns (raw, Sign1, payload); raises RecordError."""
    raw, s = parse_record(raw)
    if s.content_type != ctype:
        raise RecordError(f"not_a_{label}_record", s.content_type)
    entry = entry_of(s.kid)
    if entry is None:
        raise RecordError("unknown_kid", s.kid.hex())
    if entry[1] is not None:
        raise RecordError("retired_signer", s.kid.hex())
    if not verify_ed25519(entry[0], s.sig_structure(mesh_id), s.signature):
        raise RecordError("bad_signature")
    try:
        p = decode_strict(s.payload_bytes)
    except DecodeError as e:
        raise RecordError(e.reason, "record payload") from None
    if not isinstance(p, dict) or set(p) != members:
        raise RecordError("bad_record_members")
    return raw, s, p


@classified(RecordError)
def verify_truncation(raw: bytes, mesh_id: bytes,
                      entry_of: Callable[[bytes], tuple[bytes, Any] | None]) -> Truncation:
    """The truncation record boundary. Verify one truncation record on its own. `entry_of(issuer)` gives the issuer's keyring
    entry (public key, retirement cutoff or None). Raises RecordError (dropped and surfaced)."""
    raw, s, p = verify_signed_by_site(raw, mesh_id, TRUNCATED, "truncation", TRUNCATED_MEMBERS, entry_of)
    subj, schema, name, h, rks, at = (p["subject_site_id"], p["table_schema"], p["table_name"], p["horizon"],
                                      p["row_keys"], p["issued_at"])
    if not _bstr(subj, 16):
        raise RecordError("bad_subject")
    if subj == s.kid:
        raise RecordError("self_addressed", "a node does not declare truncation to itself")
    if not (isinstance(schema, str) and schema and isinstance(name, str) and name):
        raise RecordError("bad_table")
    if not isinstance(h, list) or len(h) != 2 or not _uint(h[0], STORE_UINT_MAX) or not _uint(h[1], UINT32_MAX) \
            or (h[0], h[1]) == (0, 0):
        raise RecordError("bad_horizon")
    if not isinstance(rks, list) or not rks or len(rks) > MAX_TRUNCATED_ROWS or not all(map(_row_key_ok, rks)):
        raise RecordError("bad_row_keys")
    if not _uint(at, STORE_UINT_MAX):
        raise RecordError("bad_issued_at")
    return Truncation(record_hash(raw), raw, s.kid, subj, f"{schema}.{name}", (h[0], h[1]), tuple(rks), at)


# ---------------------------------------------------------------- trust (docs/protocol.md §5 "Trust")
@dataclass
class Trust:
    """What the records a node holds (with its provisioned keyring and authority list) make it
    trust. A pure function of the *set* of records, so every node holding the same set trusts the
    same keys with the same cutoffs, whatever order the records arrived in."""
    keyring: dict[bytes, tuple[bytes, tuple[int, int] | None]]  # site -> (public key, cutoff or None)
    retired_authorities: set[bytes]
    chains: dict[tuple[str, bytes], Chain]  # vouch and role chains over the records that count
    void: dict[bytes, str]  # record_hash -> why a held record does not count
    multi_key: set[bytes]  # sites whose vouch records name more than one key (trusted with none)


def resolve_trust(records: Iterable[Record], provisioned: dict[bytes, tuple[bytes, tuple[int, int] | None]],
                  authorities: Iterable[bytes], self_site: bytes) -> Trust:
    """The effective keyring. Every rule only ever moves one way as records are added, which is
    what makes arrival order irrelevant (a drop retains nothing, so nothing a drop decided may
    later be reversed):

    - retire records count from every listed authority, retired or not (a retire only takes trust
      away; counting it whatever its issuer's state keeps cutoffs monotone, never rising);
    - a signer's cutoff is the lowest of its provisioned cutoff and every retire record naming it;
    - an authority is retired when it has a cutoff (provisioned, or any retire record names it);
      a retired authority's vouch and role records do not count at all: records carry no clock,
      so no order every node agrees on places one before or after the retirement;
    - vouch and role chains are resolved over the records that count (a fork is absent);
    - a vouch admits its head's key for a site the provisioned keyring does not hold, unless the
      site's vouch records (any issuer) name more than one key: then none (fail closed, for good);
    - the node's own site is never changed by records."""
    records = list(records)
    auth = set(authorities)
    void: dict[bytes, str] = {}
    counted: list[Record] = []
    for r in records:
        if r.issuer not in auth:
            void[r.record_hash] = "issuer_not_authority"
        else:
            counted.append(r)
    retire = [r for r in counted if r.kind == "retire"]
    cut: dict[bytes, tuple[int, int]] = {}
    for r in retire:
        c = r.value[0]
        cut[r.subject] = c if r.subject not in cut else min(cut[r.subject], c)
    retired = {a for a in auth if (provisioned.get(a) or (None, None))[1] is not None or a in cut}
    rest: list[Record] = []
    for r in counted:
        if r.kind != "retire" and r.issuer in retired:
            void[r.record_hash] = "issuer_retired"
        else:
            rest.append(r)
    chains = resolve_chains(r for r in rest if r.kind != "retire")
    keys: dict[bytes, set[bytes]] = {}
    for r in records:
        if r.kind == "vouch" and r.issuer in auth:
            keys.setdefault(r.subject, set()).add(r.value)
    multi = {s for s, ks in keys.items() if len(ks) > 1}
    keyring = dict(provisioned)
    for (kind, subject), ch in sorted(chains.items()):
        if kind == "vouch" and ch.head is not None and subject not in keyring and subject not in multi \
                and subject != self_site:
            keyring[subject] = (ch.head.value, None)
    for subject, c in cut.items():
        if subject in keyring and subject != self_site:
            pk, old = keyring[subject]
            keyring[subject] = (pk, c if old is None else min(old, c))
    chains.update(resolve_chains(retire))
    return Trust(keyring, retired, chains, void, multi)


# ---------------------------------------------------------------- acknowledgements on MQTT (docs/protocol.md §5)
# An answer to a sync body is not authenticated on a binding without broker ACLs: a reader of the
# inbox topics sees the correlation data and can answer first. So on such a
# binding the answering node signs, about its own processing, which bodies it received (BLAKE3 of
# their exact bytes) and what became of their events; the sender moves its cursor only on that.
# Issued by the answering node (kid = issuer), addressed to the body's author (subject).
ACK = "sovm/ssp-ack-v1"
ACK_MEMBERS = frozenset({"subject_site_id", "answers"})
MAX_ACK_ANSWERS = 16  # bodies one record answers (the answers of one pump, per sender, are grouped)


@dataclass(frozen=True)
class AckAnswer:
    body_hash: bytes  # BLAKE3 of the exact body received
    processed: int  # events that reached a final state before the first rejected one (`ssp-processed`)
    count: int  # events in the body
    rejected: tuple[int, ...]  # indices of the rejected events (`ssp-rejected-at`), ascending


@dataclass(frozen=True)
class Ack:
    issuer: bytes
    subject: bytes
    answers: tuple[AckAnswer, ...]
    raw: bytes

    def answer_for(self, body_hash: bytes) -> AckAnswer | None:
        return next((a for a in self.answers if a.body_hash == body_hash), None)


def is_ack(raw: Any) -> bool:
    return content_type(raw) == ACK


def ack_to_be_signed(issuer: bytes, mesh_id: bytes, subject: bytes, answers: list[AckAnswer]
                     ) -> tuple[bytes, bytes, bytes]:
    """(protected, payload, Sig_structure) of `issuer`'s acknowledgement of `subject`'s bodies."""
    if not 1 <= len(answers) <= MAX_ACK_ANSWERS:
        raise ValueError(f"an acknowledgement answers 1 to {MAX_ACK_ANSWERS} bodies")
    protected = protected_header(ALG_EDDSA, ACK, issuer)
    payload = encode({"subject_site_id": subject,
                      "answers": [[a.body_hash, a.processed, a.count, list(a.rejected)] for a in answers]})
    return protected, payload, sig_structure(protected, mesh_id, payload)


def _ack_answer(a: Any) -> AckAnswer:
    if not (isinstance(a, list) and len(a) == 4 and _bstr(a[0], 32) and _uint(a[2], UINT32_MAX)
            and _uint(a[1], a[2]) and isinstance(a[3], list) and len(a[3]) <= a[2]
            and all(_uint(i, a[2] - 1) for i in a[3]) and list(a[3]) == sorted(set(a[3]))):
        raise RecordError("bad_answers")
    return AckAnswer(a[0], a[1], a[2], tuple(a[3]))


@classified(RecordError)
def verify_ack(raw: Any, mesh_id: bytes, entry_of: Callable[[bytes], tuple[bytes, Any] | None]) -> Ack:
    """The MQTT acknowledgement boundary. Verify one record on its own: content type, the issuer's
    keyring entry (`entry_of(kid)`) known and not retired, the signature over `mesh_id`, the exact
    member set and shapes (processed <= count, rejected indices ascending, below count). Raises
    RecordError. Whether it answers a given body is `Ack.answer_for`."""
    raw, s, p = verify_signed_by_site(raw, mesh_id, ACK, "ack", ACK_MEMBERS, entry_of)
    subj, answers = p["subject_site_id"], p["answers"]
    if not _bstr(subj, 16) or subj == s.kid:
        raise RecordError("bad_subject")
    if not (isinstance(answers, list) and 1 <= len(answers) <= MAX_ACK_ANSWERS):
        raise RecordError("bad_answers")
    return Ack(s.kid, subj, tuple(_ack_answer(a) for a in answers), raw)
