"""A member node's side of the blind Commit sequencer, over the sync plane's `records` (SOVM
§22.5-§22.6; docs/protocol.md §12, docs/sequencer.md "Gossip").

- **Receipt heads** (`gossip`): each receipt a member holds travels to every peer and is relayed
  on, so a member that never talks to the sequencer learns the chain, and one holding a
  contradicting receipt sees it.
- **Discontinuities**: the sequencer's signed statement of a gap (§22.6 step 4), relayed so every
  member sees the same statement and one holding a receipt for that epoch flags it.
- **Bindings** (`bind`): a mesh authority records which sequencer is bound to a group from which
  MLS epoch; every node resolves the same binding chain from the records it holds.
- **Validation** (`chain`, `status`): agent/sequencer/member.py's `ReceiptChain` over the records
  held; equivocation evidence is surfaced (`sequencer_equivocation`) as it appears.

Below the node: it reads the node's state (agent/nodestate.py), signs through
`produce.issue_record` and stores what it issued as it stores what it receives."""
from __future__ import annotations

import json
import logging
import os
from typing import Optional

from .core import seqrecords as sr
from .core.codec import DecodeError, decode_strict
from . import produce
from .core.cose import ALG_ES256, content_type, parse_sign1
from .core.records import RecordError, record_hash
from .records_in import issuer_key, surface
from .sequencer import member as validator
from .sequencer import receipts as rc
from .store import db, sequencing as store
from .store.sync_state import RecordBudget

log = logging.getLogger("ssp_agent.sequencing")
CONTENT_TYPES = (sr.RECEIPT_HEAD, sr.DISCONTINUITY, sr.BINDING)


class SequencingRefused(Exception):
    """A gossip or binding this node will not issue (CLI exit 2)."""


def is_sequencing_record(raw) -> bool:
    return content_type(raw) in CONTENT_TYPES


def _entry_of(node):
    own = bytes(db.get_meta(node.conn, "public_key"))
    return lambda kid: (own, None) if kid == node.site_id else node.keyring.get(kid)


def store_records(node, raws: list, now: int) -> dict:
    """Verify and store receipt heads and bindings, each on its own, inside the caller's
    transaction (after the body's authority records: a vouch in the same body admits a head's
    issuer); surface drops, binding forks and new equivocation evidence."""
    out = {"stored": 0, "known": 0, "dropped": 0, "refused": 0}
    conn = node.conn
    store.ensure_schema(conn)
    budget = RecordBudget(conn, node.site_id)
    entry_of = _entry_of(node)
    touched: set[bytes] = set()
    before: dict[bytes, validator.ReceiptChain] = {}
    for raw in raws:
        if not isinstance(raw, (bytes, bytearray)):
            continue
        raw = bytes(raw)
        if store.has(conn, record_hash(raw)):
            out["known"] += 1
            continue
        try:
            if content_type(raw) == sr.RECEIPT_HEAD:
                rec = sr.verify_receipt_head(raw, node.mesh_id, entry_of)
                try:
                    r = rc.verify_receipt(rec.receipt)     # the sequencer's ES256 signature, strictly
                except rc.ReceiptError as e:
                    raise RecordError("bad_receipt", e.reason) from None
                if r.group_id != rec.group_id:
                    raise RecordError("bad_receipt", "the receipt is for another group")
                kind, gid = "receipt_head", rec.group_id
            elif content_type(raw) == sr.DISCONTINUITY:
                rec = sr.verify_discontinuity(raw, node.mesh_id, entry_of)
                try:
                    st = rc.verify_statement(rec.statement)     # the sequencer's ES256 signature
                except rc.ReceiptError as e:
                    raise RecordError("bad_statement", e.reason) from None
                if st.group_id != rec.group_id:
                    raise RecordError("bad_statement", "the statement is for another group")
                kind, gid = "discontinuity", rec.group_id
            else:
                rec = sr.verify_binding(raw, node.mesh_id, node.authorities,
                                        lambda issuer: issuer_key(conn, node.site_id, issuer))
                kind, gid = "binding", rec.group_id
        except RecordError as e:
            out["dropped"] += 1
            surface(conn, now, "record_dropped", e.reason, {"detail": e.detail, "type": content_type(raw)})
            continue
        if not budget.admit(rec.issuer, rec.raw, kind, rec.record_hash, now):
            out["refused"] += 1
            continue
        if gid not in before:
            before[gid] = chain(node, gid)
        if kind == "receipt_head":
            stored = store.put_head(conn, rec, rc.receipt_hash(rec.receipt))
        elif kind == "discontinuity":
            stored = store.put_discontinuity(conn, rec, rc.receipt_hash(rec.statement))
        else:
            stored = store.put_binding(conn, rec)
        if stored:
            out["stored"] += 1
            touched.add(gid)
    for gid in sorted(touched):
        _surface_news(node, gid, before[gid], chain(node, gid), now)
    return out


def _surface_news(node, gid: bytes, old: validator.ReceiptChain, new: validator.ReceiptChain, now: int) -> None:
    """What the new records revealed, surfaced once (the loudness §22.5 gives equivocation)."""
    seen = {(e.kind, e.epoch, e.receipts) for e in old.evidence}
    for e in new.evidence:
        if (e.kind, e.epoch, e.receipts) in seen:
            continue
        log.warning("sequencer equivocation in group %s at epoch %d: %s", gid.hex(), e.epoch, e.kind)
        surface(node.conn, now, "sequencer_equivocation", e.kind,
                {"group": gid.hex(), "epoch": e.epoch, "receipts": [r.hex() for r in e.receipts], "detail": e.detail})
    old_attr = set(old.attributed)
    for kid, raw in new.attributed:
        if (kid, raw) not in old_attr:
            surface(node.conn, now, "receipt_attributed", "signer_not_bound",
                    {"group": gid.hex(), "signer": kid.hex(), "receipt": raw.hex()})
    for f in new.binding_forks:
        if f not in old.binding_forks:
            surface(node.conn, now, "record_fork", "sequencer_binding_fork",
                    {"group": gid.hex(), "generation": f[0], "keys": [f[1].hex(), f[2].hex()]})


def bindings(node, gid: bytes) -> sr.BindingChain:
    recs = []
    for raw in store.raws(node.conn, gid, "binding"):
        try:
            recs.append(sr.verify_binding(raw, node.mesh_id, node.authorities,
                                          lambda issuer: issuer_key(node.conn, node.site_id, issuer)))
        except RecordError:
            continue        # an authority removed since: its bindings count no more
    return sr.resolve_bindings(recs)


class _View:
    """What `bindings` reads of a node, from a read-only connection to its store."""

    def __init__(self, conn) -> None:
        self.conn = conn
        self.site_id = bytes(db.get_meta(conn, "site_id"))
        self.mesh_id = bytes(db.get_meta(conn, "mesh_id"))
        self.authorities = {bytes.fromhex(a) for a in json.loads(db.get_meta(conn, "authorities", "[]"))}


def bound_signer(path, gid: bytes, epoch: int) -> tuple[bool, Optional[bytes]]:
    """The sequencer bound to ``gid`` at generation ``epoch`` according to the binding records the
    member node whose store is ``path`` holds (§22.6), read beside whatever holds the home (a read-only
    connection for this one look-up: it never blocks the node's writer). Returns (False, None)
    when the node holds no binding record for the group at all (or there is no node), (True,
    key) when one resolves, (True, None) when records exist and none resolves at that generation
    (a fork, a chain whose genesis has not arrived, a binding only from a later generation):
    the caller holds the link."""
    if not path.exists():
        return False, None
    conn = db.connect_readonly(path)
    try:
        if not store.raws(conn, gid, "binding"):
            return False, None
        view = _View(conn)
        b = bindings(view, gid)
        ch = validator.ReceiptChain(gid, bindings=dict(b.bindings), binding_forks=list(b.forks))
        return True, ch.bound_key(epoch)
    finally:
        conn.close()


def binding_state(path, gid: bytes) -> bytes:
    """What decides ``bound_signer(path, gid, E)`` at every generation E, as bytes: the group's
    binding records as resolved (bindings along the chain and forks), b"none" when the node holds
    none for the group (or there is no node). Equal bytes, equal answers: the member's Commit queue
    looks at its held and attributed receipts again only when this changed (client.py recheck,
    §22.6). A read of the group's binding records only, never of the receipts held."""
    if not path.exists():
        return b"none"
    conn = db.connect_readonly(path)
    try:
        if not store.raws(conn, gid, "binding"):
            return b"none"
        b = bindings(_View(conn), gid)
        return json.dumps({"bindings": sorted((g, k.hex()) for g, k in b.bindings.items()),
                           "forks": sorted((g, x.hex(), y.hex()) for g, x, y in b.forks)}).encode()
    finally:
        conn.close()


def held_of(path, gid: bytes) -> list[bytes]:
    """Every receipt and signed gap statement the member node whose store is ``path`` holds for
    ``gid`` (receipt heads and discontinuity records gossiped over the mesh): what `commits run`
    offers the sequencer beside its queue's for the epochs a restored state lost, and what
    `commits evidence` writes (docs/sequencer.md "Taking back receipts"). Read on a read-only
    connection beside the node; the bytes the records carry, not parsed or verified here (the node
    verified each record when it stored it; the caller picks the epochs, the sequencer verifies)."""
    if not path.exists():
        return []
    conn = db.connect_readonly(path)
    try:
        out = []
        for kind, member in (("head", "receipt"), ("discontinuity", "statement")):
            for raw in store.raws(conn, gid, kind):
                try:
                    out.append(bytes(decode_strict(parse_sign1(raw).payload_bytes)[member]))
                except (DecodeError, KeyError, TypeError):
                    continue
        return out
    finally:
        conn.close()


class BindingStates:
    """``binding_state(path, gid)``, remembered while nothing is committed to the node's store:
    what `commits run` asks every 2 s for each group with retained receipts (client.py recheck)
    costs one ``data_version`` question while the store is idle, and a read of the group's binding
    records (their signatures checked) only after a commit (any: a binding, an authority or an
    issuer key may have changed). A store replaced (another inode) or unreadable starts afresh;
    where the question cannot be asked, every call reads the records."""

    def __init__(self, path) -> None:
        self.path = path
        self._conn = None
        self._ident = None
        self._version = None
        self._cache: dict[bytes, bytes] = {}

    def __call__(self, gid: bytes) -> bytes:
        version = self._store_version()
        if version is None or version != self._version:
            self._cache.clear()
            self._version = version
        if version is None:
            return binding_state(self.path, gid)
        if gid not in self._cache:
            self._cache[gid] = binding_state(self.path, gid)
        return self._cache[gid]

    def _store_version(self):
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self.close()
            return ("absent",)
        except OSError:
            self.close()
            return None
        ident = (st.st_dev, st.st_ino)
        try:
            if self._conn is None or self._ident != ident:
                self.close()
                self._conn, self._ident = store.open_watch(self.path), ident
            return (ident, store.data_version(self._conn))
        except Exception:  # noqa: BLE001 - sqlite3 errors: ask again next time, read the records now
            self.close()
            return None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn, self._ident = None, None


def chain(node, gid: bytes) -> validator.ReceiptChain:
    """The member validator over every receipt and binding this node holds for ``gid``: a pure
    function of that set (the validator's verdict does not depend on order; fed in epoch order,
    then bytes, the chain it keeps does not either)."""
    b = bindings(node, gid)
    ch = validator.ReceiptChain(gid, bindings=dict(b.bindings), binding_forks=list(b.forks))
    heads = []
    for raw in store.raws(node.conn, gid, "head"):
        try:
            heads.append(sr.verify_receipt_head(raw, node.mesh_id, _entry_of(node)).receipt)
        except RecordError:
            continue
    stated = []
    for raw in store.raws(node.conn, gid, "discontinuity"):
        try:
            stated.append(sr.verify_discontinuity(raw, node.mesh_id, _entry_of(node)).statement)
        except RecordError:
            continue
    got = []
    for raw in set(heads):
        try:
            got.append((rc.parse_receipt(raw).epoch, 1, raw))
        except rc.ReceiptError:
            continue
    for raw in set(stated):
        try:
            got.append((rc.parse_statement(raw).epoch, 0, raw))
        except rc.ReceiptError:
            continue
    # epoch order, a statement before a receipt at one epoch, then bytes: a pure function of the set
    for _e, is_receipt, raw in sorted(got):
        if is_receipt:
            ch.add(raw)
        else:
            ch.add_statement(raw)
    return ch


def gossip(node, receipt: bytes, now: int) -> dict:
    """Spread one receipt this member holds (from the sequencer, its queue or the broker) as a
    receipt-head record, or one signed discontinuity statement as a discontinuity record (told
    apart by their COSE content type). Not issued again for bytes a record already carries (from
    anyone): the record that carries it is relayed to every peer anyway."""
    if is_statement(bytes(receipt)):
        return _gossip_statement(node, bytes(receipt), now)
    try:
        r = rc.verify_receipt(bytes(receipt))
    except rc.ReceiptError as e:
        raise SequencingRefused(f"not a valid sequencing receipt: {e}") from None
    before = chain(node, r.group_id)
    if store.has_receipt(node.conn, r.receipt_hash):
        verdict = "duplicate" if r.epoch in before.receipts and before.receipts[r.epoch].raw == r.raw else "held"
        return {"group": r.group_id.hex(), "epoch": r.epoch, "gossiped": False, "verdict": verdict}
    raw = produce.issue_record(node, sr.head_to_be_signed(node.site_id, node.mesh_id, r.group_id, r.raw), now)
    res = _store_own(node, raw, now)
    after = chain(node, r.group_id)
    return {"group": r.group_id.hex(), "epoch": r.epoch, "gossiped": True,
            "record_hash": record_hash(raw).hex(), "stored": res.get("sequencing", {}).get("stored", 0),
            "verdict": _verdict(after, r)}


def _store_own(node, raw: bytes, now: int) -> dict:
    """A sequencing record just issued here, stored as any received one is (`store_records` in a
    transaction of its own), in the shape `records_apply.apply_records` answers."""
    with db.transaction(node.conn):
        return {"sequencing": store_records(node, [raw], now)}


def is_statement(raw: bytes) -> bool:
    """A sequencer's discontinuity statement (by its COSE content type), not a receipt."""
    try:
        return parse_sign1(raw, expect_alg=ALG_ES256, kid_len=rc.KID_LEN, sig_len=64).content_type == \
            rc.DISCONTINUITY_CONTENT_TYPE
    except (DecodeError, TypeError, ValueError):
        return False


def _gossip_statement(node, raw: bytes, now: int) -> dict:
    try:
        st = rc.verify_statement(raw)
    except rc.ReceiptError as e:
        raise SequencingRefused(f"not a valid discontinuity statement: {e}") from None
    out = {"group": st.group_id.hex(), "epoch": st.epoch, "discontinuity": True}
    if store.has_receipt(node.conn, rc.receipt_hash(raw), "discontinuity"):
        return dict(out, gossiped=False, verdict=_statement_verdict(chain(node, st.group_id), st))
    rec = produce.issue_record(node, sr.discontinuity_to_be_signed(node.site_id, node.mesh_id, st.group_id, raw), now)
    res = _store_own(node, rec, now)
    return dict(out, gossiped=True, record_hash=record_hash(rec).hex(),
                stored=res.get("sequencing", {}).get("stored", 0),
                verdict=_statement_verdict(chain(node, st.group_id), st))


def _statement_verdict(ch: validator.ReceiptChain, st: rc.Statement) -> str:
    if any(st.raw in e.receipts for e in ch.evidence):
        return validator.EQUIVOCATION
    if any(raw == st.raw for _k, raw in ch.attributed):
        return validator.REJECTED
    if st.raw in ch.held_statements:
        return validator.HELD
    known = ch.statements.get(st.epoch)
    if known is not None and known.raw != st.raw and known.payload_key == st.payload_key:
        return validator.DUPLICATE
    return validator.ACCEPTED if st.epoch in ch.discontinuities else validator.REJECTED


def _verdict(ch: validator.ReceiptChain, r: rc.Receipt) -> str:
    if any(r.raw in e.receipts for e in ch.evidence):
        return validator.EQUIVOCATION
    if any(raw == r.raw for _k, raw in ch.attributed):
        return validator.REJECTED
    if r.raw in ch.held or any(p.raw == r.raw for p in ch.pending):
        return validator.HELD
    return validator.ACCEPTED if r.epoch in ch.receipts else validator.REJECTED


def bind(node, gid: bytes, sequencer_key: bytes, generation: int, now: int, authority=None) -> dict:
    """Issue the binding of ``sequencer_key`` to ``gid`` from MLS epoch ``generation`` (§22.6), as
    this node (a mesh authority) or a standalone authority (agent/authority.py). It extends the
    group's binding chain from the head this node holds; a forked chain is refused (contested
    hand-offs are resolved where hand-offs are recorded, not papered over by a third binding)."""
    issuer = node.site_id if authority is None else authority.site_id
    if issuer not in node.authorities:
        raise SequencingRefused("only a mesh authority may bind a sequencer to a group (the manifest's "
                                "`authorities`, or --authority-key DIR)")
    if len(sequencer_key) != 33 or sequencer_key[0] not in (2, 3):
        raise SequencingRefused("--sequencer-key must be the 33-byte compressed P-256 key (66 hex digits)")
    store.ensure_schema(node.conn)
    b = bindings(node, gid)
    if b.forks:
        raise SequencingRefused(f"the binding record of group {gid.hex()} has forked at generation {b.forks[0][0]}; "
                                "resolve the contested hand-off first")
    prev = None
    if b.bindings:
        top = max(b.bindings)
        if generation <= top:
            raise SequencingRefused(f"group {gid.hex()} is bound from generation {top} already; a new binding takes "
                                    "effect from a later MLS epoch")
        prev = _binding_hash(node, gid, top)
    raw = produce.issue_record(node, sr.binding_to_be_signed(issuer, node.mesh_id, gid, sequencer_key, generation, prev),
                               now, authority=authority)
    res = _store_own(node, raw, now)
    if res.get("sequencing", {}).get("stored") != 1:
        raise SequencingRefused(f"the binding record did not verify here: {res.get('sequencing')}")
    return {"group": gid.hex(), "sequencer_key": sequencer_key.hex(), "generation": generation,
            "record_hash": record_hash(raw).hex(), "previous_record_hash": None if prev is None else prev.hex()}


def _binding_hash(node, gid: bytes, generation: int) -> Optional[bytes]:
    for raw in store.raws(node.conn, gid, "binding"):
        try:
            b = sr.verify_binding(raw, node.mesh_id, node.authorities,
                                  lambda issuer: issuer_key(node.conn, node.site_id, issuer))
        except RecordError:
            continue
        if b.generation == generation:
            return b.record_hash
    return None


def status(node, gid: Optional[bytes] = None) -> dict:
    out = []
    for g in ([gid] if gid is not None else store.groups(node.conn)):
        ch = chain(node, g)
        head = ch.head()
        out.append({
            "group": g.hex(),
            "bindings": {str(k): v.hex() for k, v in sorted(ch.bindings.items())},
            "binding_forks": [{"generation": f[0], "keys": [f[1].hex(), f[2].hex()]} for f in ch.binding_forks],
            "receipts": [{"epoch": e, "receipt_hash": r.receipt_hash.hex(), "commit_hash": r.commit_hash.hex(),
                          "signer": r.kid.hex()} for e, r in sorted(ch.receipts.items())],
            "head": None if head is None else {"epoch": head.epoch, "receipt_hash": head.receipt_hash.hex()},
            "discontinuities": [{"epoch": e, "statement_hash": rc.receipt_hash(st.raw).hex(), "signer": st.kid.hex()}
                                for e, st in sorted(ch.statements.items()) if e in ch.discontinuities],
            "held": len(ch.held) + len(ch.held_statements) + len(ch.pending),
            "attributed": [{"signer": k.hex(), "receipt": raw.hex()} for k, raw in ch.attributed],
            "equivocation": [{"kind": e.kind, "epoch": e.epoch, "receipts": [r.hex() for r in e.receipts]}
                             for e in ch.evidence],
        })
    return {"groups": out}
