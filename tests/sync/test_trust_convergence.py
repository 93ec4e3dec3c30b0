"""Trust changes converge whatever order they arrive in.

Materialized state is a function of the delivered events *and* control records (vouch, retire,
role): a retire record removes the effects of its subject's events above the cutoff whenever it
arrives (rebuilt from the retained log), an event whose signer's vouch arrives after it comes back
through re-offer (unknown_kid is rejected, not dropped: the sender re-offers it), and a retired
authority's vouch and role records do not count (docs/protocol.md §5 "Trust")."""
from __future__ import annotations

import itertools
import json
import os
import tempfile
from pathlib import Path

import nacl.signing
from hypothesis import HealthCheck, given, settings, strategies as st

from agent.core import records as rec
from agent.node import Node
from agent.outcomes import REJECTED
from agent.simpeer import SimPeer, readings_table
from agent.store import sync_state as sst
from agent.sync import SyncDriver

from .helpers import MESH, NOW, T
from tests.soak import sample

AUTH1, AUTH2 = SimPeer(MESH), SimPeer(MESH)
S1, S2, S3 = SimPeer(MESH), SimPeer(MESH), SimPeer(MESH)  # S1 provisioned; S2, S3 vouched by records
SIGNERS = [S1, S2, S3, AUTH1]  # AUTH1 signs events too (an authority that is also a node)
OTHER_KEY = nacl.signing.SigningKey.generate()


def manifest() -> str:
    return (f'mesh_id = "{MESH.hex()}"\nauthorities = ["{AUTH1.site_id.hex()}", "{AUTH2.site_id.hex()}"]\n'
            + AUTH1.manifest_peer() + AUTH2.manifest_peer() + S1.manifest_peer() + readings_table("telemetry"))


def record(issuer: SimPeer, kind: str, subject: bytes, value, gen: int = 0, prev: bytes | None = None) -> bytes:
    return rec.build_record(kind, issuer.site_id, MESH, subject, value, gen, prev,
                            lambda tbs: issuer.key.sign(tbs).signature)


@st.composite
def record_pool(draw):
    """Any subset of a pool that exercises every trust rule: vouches from both authorities (two
    geneses for S2 are a fork unless AUTH1 is retired), retirements of signers with cutoffs drawn
    inside the events' HLC range, the retirement of an authority (its vouches and roles no longer
    count), a second key for S3 (fail closed: S3 counts no more), and role records."""
    cut = st.tuples(st.integers(NOW - 1, NOW + 3), st.integers(0, 2))
    pool = {
        "vouch_s2_by_auth1": record(AUTH1, "vouch", S2.site_id, S2.public_key),
        "vouch_s2_by_auth2": record(AUTH2, "vouch", S2.site_id, S2.public_key),
        "vouch_s3_by_auth2": record(AUTH2, "vouch", S3.site_id, S3.public_key),
        "retire_s1": record(AUTH2, "retire", S1.site_id, (draw(cut), None)),
        "retire_s2": record(AUTH1, "retire", S2.site_id, (draw(cut), S3.site_id)),
        "retire_auth1": record(AUTH2, "retire", AUTH1.site_id, (draw(cut), None)),
        "role_s1": record(AUTH1, "role", S1.site_id, "field"),
        "role_s3": record(AUTH2, "role", S3.site_id, "gateway"),
        "second_key_s3": record(AUTH1, "vouch", S3.site_id, bytes(OTHER_KEY.verify_key)),
    }
    chosen = [name for name in sorted(pool) if draw(st.booleans())]
    return [pool[n] for n in chosen]


@st.composite
def histories(draw):
    n = draw(st.integers(min_value=1, max_value=16))
    used: set = set()
    out = []
    for _ in range(n):
        i = draw(st.integers(0, len(SIGNERS) - 1))
        p, l = NOW + draw(st.integers(0, 3)), draw(st.integers(0, 2))
        if (i, p, l) in used:
            continue
        used.add((i, p, l))
        key = {"device": "d", "seq": draw(st.integers(0, 1))}
        if draw(st.integers(0, 4)) == 0:
            out.append(SIGNERS[i].event(T, key, None, (p, l), delete=True))
            continue
        values = {c: draw(st.integers(0, 9)) * 1.0 for c in ("temp",) if draw(st.booleans())}
        if draw(st.booleans()):
            values["note"] = draw(st.sampled_from([None, "a", "b"]))
        out.append(SIGNERS[i].event(T, key, values, (p, l)))
    return out


def deliver(node: Node, batches: list[list[tuple[str, bytes]]]) -> None:
    """Each batch is one body: its records first, then its events (agent/sync.py receive). A
    rejected event is re-offered by its sender (§14.1: the cursor stops before it) until it is not
    rejected any more, as the next sync cycles would do."""
    drv = SyncDriver(node)
    pending: dict[bytes, None] = {}
    for batch in batches:
        recs = [raw for kind, raw in batch if kind == "record"]
        evs = [raw for kind, raw in batch if kind == "event"]
        if recs:
            drv.apply_records(recs, NOW + 10)
        for raw, o in zip(evs, node.apply_batch(evs, NOW + 10)):
            if o.status == REJECTED:
                pending[raw] = None
            else:
                pending.pop(raw, None)
    for _round in range(4):  # re-offer until quiet
        if not pending:
            break
        raws = list(pending)
        pending.clear()
        for raw, o in zip(raws, node.apply_batch(raws, NOW + 10)):
            if o.status == REJECTED:
                pending[raw] = None


def state(node: Node) -> dict:
    roles = {s.hex(): (v if isinstance(v, str) else "forked") for s, v in sst.current_roles(node.conn).items()}
    return {"dump": node.dump(), "roles": roles,
            "trusted": sorted(s.hex() for s in node.keyring if s != node.site_id),
            "cutoffs": {s.hex(): e[1] for s, e in sorted(node.keyring.items()) if e[1] is not None}}


def _run(data, horizon=None, replicas=3):
    records = data.draw(record_pool())
    events = data.draw(histories())
    items = [("record", r) for r in records] + [("event", e) for e in events]
    with tempfile.TemporaryDirectory() as d:
        nodes = []
        for i in range(replicas + 1):
            node, _ = Node.init(Path(d) / f"r{i}", manifest())
            if horizon is not None:
                node.raise_horizon(T, horizon)
            nodes.append(node)
        try:
            # the reference: every record first, then every event
            deliver(nodes[0], [[("record", r) for r in records] + [("event", e) for e in events]])
            for node in nodes[1:]:
                order = data.draw(st.permutations(items))
                dups = data.draw(st.lists(st.sampled_from(items), max_size=3)) if items else []
                seq = data.draw(st.permutations(list(order) + dups))
                cuts = sorted(data.draw(st.lists(st.integers(0, len(seq)), max_size=4)))
                batches, last = [], 0
                for c in cuts + [len(seq)]:
                    batches.append(seq[last:c])
                    last = c
                deliver(node, batches)
            states = [state(n) for n in nodes]
            reopened = []
            for n in nodes:  # a restart changes nothing: the trust is rebuilt from the store
                home = n.home
                n.close()
                reopened.append(Node.open(home))
            nodes = reopened
            states_after = [state(n) for n in nodes]
        finally:
            for n in nodes:
                n.close()
    for a, b in itertools.combinations(range(replicas + 1), 2):
        assert states[a] == states[b], (a, b)
    assert states_after == states


@settings(max_examples=sample(25, 60), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_events_and_records_in_any_order_converge(data):
    _run(data)


@settings(max_examples=sample(12, 30), deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.data())
def test_events_and_records_in_any_order_converge_with_equal_horizons(data):
    _run(data, horizon=(NOW + 2, 0))


# ---------------------------------------------------------------- the same rules over real syncs
from agent.sync import issue_record  # noqa: E402

from .helpers import Signer, mesh, sync  # noqa: E402


def _setup(tmp_path, n=3):
    nodes = mesh(tmp_path, n, authority=0)
    return nodes, [SyncDriver(x) for x in nodes]


def st_records_of(node: Node):
    return sst.records_ordered(node.conn)


def _temp(node: Node, device: str, seq: int):
    rows = [r for r in node.dump()[T] if r["key"] == {"device": device, "seq": seq}]
    return rows[0]["values"].get("temp") if rows else "absent"


def test_a_vouch_arriving_late_brings_the_events_back_through_re_offer(tmp_path):
    (a, b, c), (da, dbb, dc) = _setup(tmp_path)
    newbie = Signer()
    c.add_peer(newbie.site_id, newbie.public_key, None)  # c trusts it by provisioning; b does not yet
    evs = [newbie.event(T, {"device": "n", "seq": i}, {"temp": float(i)}, (NOW, i)) for i in range(3)]
    assert all(o.status == "applied" for o in c.apply_batch(evs, NOW))
    t = sync(dc, dbb, NOW + 10)
    assert not any(r["key"]["device"] == "n" for r in b.dump()[T])
    assert any(s["reason"] == "unknown_kid" and s["kind"] == "rejected" for s in b.surfaced())
    # the authority vouches for it; the vouch reaches b from a, not from c
    issue_record(a, "vouch", newbie.site_id, newbie.public_key, now=t + 1)
    t = sync(da, dbb, t + 2)
    assert newbie.site_id in b.keyring
    # c re-offers what b rejected (its cursor moved past it into the re-offer set, due again after
    # its back-off: docs/protocol.md §2)
    sync(dc, dbb, t + 3_000)
    assert [_temp(b, "n", i) for i in range(3)] == [0.0, 1.0, 2.0]
    assert b.dump() == c.dump()


def test_a_retire_arriving_after_the_events_removes_their_effects(tmp_path):
    (a, b, c), (da, dbb, dc) = _setup(tmp_path)
    c.write(T, {"device": "c", "seq": 1}, {"temp": 1.0, "note": "kept"}, now=NOW)
    cutoff = c.clock.current()
    c.write(T, {"device": "c", "seq": 1}, {"temp": 2.0}, now=NOW + 10)  # above the cutoff
    c.write(T, {"device": "c", "seq": 2}, {"temp": 3.0}, now=NOW + 20)  # a row only the late events made
    t = sync(dc, dbb, NOW + 40)
    assert _temp(b, "c", 1) == 2.0 and _temp(b, "c", 2) == 3.0
    issue_record(a, "retire", c.site_id, (cutoff, None), now=t + 1)
    dbb.apply_records([r for _h, r in st_records_of(a)], t + 2)
    # b holds every event, and the row is what the events that still count make of it
    assert len(list(b.log_entries())) == 3
    assert _temp(b, "c", 1) == 1.0 and _temp(b, "c", 2) == "absent"
    assert [r["values"] for r in b.dump()[T]] == [{"temp": 1.0, "note": "kept"}]
    assert any(s["kind"] == "trust_change" for s in b.surfaced())
    # a node that got the retire first agrees, and b no longer offers what does not count
    assert a.dump()[T] == []  # a never held c's events
    sync(dbb, da, t + 1)
    assert a.dump() == b.dump()
    sel, *_ = dbb.select_for(a.site_id, "memory", start=0)
    assert sel.skipped.get("void") == 2


def test_a_retired_authority_issues_nothing_that_counts(tmp_path):
    (a, b, c), (da, dbb, dc) = _setup(tmp_path)
    old_auth, newbie, later = Signer(), Signer(), Signer()
    for nd in (a, b, c):  # a second authority, provisioned everywhere
        nd.add_peer(old_auth.site_id, old_auth.public_key, None)
        nd.conn.execute("UPDATE meta SET value=? WHERE key='authorities'",
                        (json.dumps(sorted([a.site_id.hex(), old_auth.site_id.hex()])),))
        nd.authorities = {a.site_id, old_auth.site_id}

    def rec_by(signer, kind, subject, value):
        return rec.build_record(kind, signer.site_id, MESH, subject, value, 0, None, signer.sign)
    vouch_newbie = rec_by(old_auth, "vouch", newbie.site_id, newbie.public_key)
    vouch_later = rec_by(old_auth, "vouch", later.site_id, later.public_key)
    ev_newbie = newbie.event(T, {"device": "n", "seq": 1}, {"temp": 1.0}, (NOW, 0))
    ev_later = later.event(T, {"device": "l", "seq": 1}, {"temp": 2.0}, (NOW, 0))
    dbb.apply_records([vouch_newbie], NOW)
    assert b.apply_batch([ev_newbie], NOW)[0].status == "applied"
    retire_raw, _ = issue_record(a, "retire", old_auth.site_id, ((0, 0), None), now=NOW + 1)
    dbb.apply_records([retire_raw], NOW + 2)
    # the retirement withdraws what the retired authority vouched for, and its later vouch counts nowhere
    assert newbie.site_id not in b.keyring and _temp(b, "n", 1) == "absent"
    dbb.apply_records([vouch_later], NOW + 3)
    assert later.site_id not in b.keyring
    assert b.apply_batch([ev_later], NOW + 3)[0].reason == "unknown_kid"
    assert any(s["kind"] == "record_refused" and s["reason"] == "issuer_retired" for s in b.surfaced())
    # c receives the same records in the other order and agrees
    dc.apply_records([retire_raw, vouch_later, vouch_newbie], NOW)
    c.apply_batch([ev_later, ev_newbie], NOW)
    assert c.dump() == b.dump() and set(c.keyring) == set(b.keyring)
    # a current authority re-vouches: a new genesis (the retired issuer's records are no link)
    _, info = issue_record(a, "vouch", newbie.site_id, newbie.public_key, now=NOW + 4)
    assert info["generation"] == 0
    sync(da, dbb, NOW + 5)
    assert newbie.site_id in b.keyring


def test_an_issuer_that_is_retired_cannot_issue(tmp_path):
    from agent.node import NodeError
    (a, b, c), _ = _setup(tmp_path)
    other = Signer()
    for nd in (a,):
        nd.add_peer(other.site_id, other.public_key, None)
        nd.conn.execute("UPDATE meta SET value=? WHERE key='authorities'",
                        (json.dumps(sorted([a.site_id.hex(), other.site_id.hex()])),))
        nd.authorities = {a.site_id, other.site_id}
    SyncDriver(a).apply_records([rec.build_record("retire", other.site_id, MESH, a.site_id, ((0, 0), None), 0, None,
                                                  other.sign)], NOW)
    try:
        issue_record(a, "vouch", os.urandom(16), os.urandom(32), now=NOW + 1)
    except NodeError as e:
        assert "retired" in str(e)
    else:
        raise AssertionError("a retired authority issued a vouch")
