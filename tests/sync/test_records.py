"""Control records (docs/protocol.md §0 "Control records", scope §1.3): verified alone, chained per subject, forks
surfaced and treated as absent, authorities only, vouch and retire changing the keyring."""
from __future__ import annotations

import os

from hypothesis import given, settings, strategies as st_

from agent.core import records as rec
from agent.core.scope import FORKED
from agent.store import sync_state as st
from agent.sync import SyncDriver, issue_record

from .helpers import MESH, NOW, T, Signer, log_set, mesh, reopen, sync

AUTH = Signer()
SUBJ = os.urandom(16)


def mk(kind, value, gen, prev, signer=AUTH, subject=SUBJ):
    return rec.build_record(kind, signer.site_id, MESH, subject, value, gen, prev, signer.sign)


def verify(raw, authorities=(AUTH.site_id,)):
    keys = {AUTH.site_id: AUTH.public_key}
    return rec.verify_record(raw, MESH, authorities, keys.get)


def chain(n, kind="role"):
    out, prev = [], None
    for g in range(n):
        raw = mk(kind, f"r{g}", g, prev)
        out.append(raw)
        prev = rec.record_hash(raw)
    return out


@settings(max_examples=30, deadline=None)
@given(st_.permutations(list(range(5))))
def test_chain_head_is_order_independent(order):
    raws = chain(5)
    held = []
    heads = []
    for i in order:
        held.append(verify(raws[i]))
        heads.append(rec.resolve_chains(held)[("role", SUBJ)].head)
    final = rec.resolve_chains(held)[("role", SUBJ)]
    assert not final.forked and final.head.generation == 4 and final.head.value == "r4"


def test_prefix_waits_for_its_predecessor():
    raws = chain(3)
    ch = rec.resolve_chains([verify(raws[2]), verify(raws[1])])[("role", SUBJ)]
    assert ch.head is None and not ch.forked  # no genesis held yet: absent
    ch = rec.resolve_chains([verify(r) for r in raws[:2]])[("role", SUBJ)]
    assert ch.head.value == "r1"


def test_fork_is_detected_and_absent():
    raws = chain(2)
    rival = mk("role", "other", 1, rec.record_hash(raws[0]))
    ch = rec.resolve_chains([verify(r) for r in raws + [rival]])[("role", SUBJ)]
    assert ch.forked and ch.head is None and len(ch.fork_records) == 2
    # two geneses are a fork too
    ch = rec.resolve_chains([verify(mk("role", "a", 0, None)), verify(mk("role", "b", 0, None))])[("role", SUBJ)]
    assert ch.forked


def test_unauthorized_issuer_and_malformed_records_dropped():
    mallory = Signer()
    raw = mk("vouch", os.urandom(32), 0, None, signer=mallory)
    for bad, reason in [
        (raw, "unauthorized_issuer"),
        (mk("role", "x", 0, b"\x00" * 32), "bad_genesis"),
        (mk("role", "x", 1, None), "bad_genesis"),
        (mk("role", "", 0, None), "bad_role"),
        (b"\xa0", "untagged_cose"),
    ]:
        try:
            verify(bad)
        except rec.RecordError as e:
            assert e.reason == reason, (e.reason, reason)
        else:
            raise AssertionError(reason)
    forged = bytearray(mk("role", "x", 0, None))
    forged[-1] ^= 1
    try:
        verify(bytes(forged))
    except rec.RecordError as e:
        assert e.reason == "bad_signature"


def setup_mesh(tmp_path, n=3):
    nodes = mesh(tmp_path, n, authority=0)
    return nodes, [SyncDriver(x) for x in nodes]


def test_vouch_travels_and_admits_a_new_key_even_via_a_relay(tmp_path):
    (a, b, c), (da, dbb, dc) = setup_mesh(tmp_path)
    newbie = Signer()
    raw, info = issue_record(a, "vouch", newbie.site_id, newbie.public_key, now=NOW)
    assert info["generation"] == 0
    ev1 = newbie.event(T, {"device": "new", "seq": 1}, {"temp": 3.0}, (NOW, 1))
    # b gets the vouch from a; c never talks to a, only to b (records are forwarded)
    t = sync(da, dbb, NOW)
    assert newbie.site_id in b.keyring
    assert b.apply_batch([ev1], NOW)[0].status == "applied"
    sync(dbb, dc, t + 1)
    assert newbie.site_id in c.keyring and log_set(c) == log_set(b)
    # and it survives a restart (the keyring overlay is rebuilt from the store)
    c = reopen(c)
    assert newbie.site_id in c.keyring


def test_retire_record_cuts_a_signer_off(tmp_path):
    (a, b, c), (da, dbb, dc) = setup_mesh(tmp_path)
    c.write(T, {"device": "c", "seq": 1}, {"temp": 1.0}, now=NOW)
    cutoff = c.clock.current()
    late = c.write(T, {"device": "c", "seq": 2}, {"temp": 2.0}, now=NOW + 10)
    issue_record(a, "retire", c.site_id, (cutoff, None), now=NOW + 20)
    # the record reaches b; c's later event is dropped there, the earlier applied
    t = sync(da, dbb, NOW + 30)
    assert b.keyring[c.site_id][1] == cutoff
    t = sync(dc, dbb, t + 1)
    got = {e["row_key"]["seq"] for e in b.log_entries()}
    assert got == {1}
    assert any(s["reason"] == "retired_signer" and s.get("event_id") == late.hex() for s in b.surfaced())


def test_fork_from_two_authority_records_is_surfaced_and_fails_closed(tmp_path):
    (a, b, c), (da, dbb, dc) = setup_mesh(tmp_path)
    issue_record(a, "role", c.site_id, "field", now=NOW)
    g0 = st.records(a.conn)[0]
    sk = a.bridge.keystore
    # a second record claiming the same predecessor, signed by the same authority key
    def sign(tbs):
        return sk._sign("events", None, tbs)
    rival = rec.build_record("role", a.site_id, a.mesh_id, c.site_id, "quarantine", 1, g0.record_hash, sign)
    first = rec.build_record("role", a.site_id, a.mesh_id, c.site_id, "field2", 1, g0.record_hash, sign)
    dbb.apply_records([g0.raw, first], NOW)
    assert st.current_roles(b.conn)[c.site_id] == "field2"
    res = dbb.apply_records([rival], NOW)
    assert res["forks"] == 1
    assert st.current_roles(b.conn)[c.site_id] is FORKED
    assert any(s["kind"] == "record_fork" for s in b.surfaced())
    # the role layer is absent, so resolution fails closed for c
    b.write(T, {"device": "b", "seq": 1}, {"temp": 1.0}, now=NOW)
    sel, *_ = dbb.select_for(c.site_id, "memory")
    assert sel.events == [] and sel.skipped.get("policy", 0) >= 1


def test_record_from_non_authority_is_dropped_and_surfaced(tmp_path):
    (a, b, c), (da, dbb, dc) = setup_mesh(tmp_path)
    mallory_rec = rec.build_record("vouch", c.site_id, c.mesh_id, os.urandom(16), os.urandom(32), 0, None,
                                   lambda tbs: c.bridge.keystore._sign("events", None, tbs))
    res = dbb.apply_records([mallory_rec], NOW)
    assert res["dropped"] == 1 and st.records(b.conn) == []
    assert any(s["kind"] == "record_dropped" and s["reason"] == "unauthorized_issuer" for s in b.surfaced())


def test_issue_refused_for_non_authority(tmp_path):
    (a, b, c), _ = setup_mesh(tmp_path)
    from agent.node import NodeError
    try:
        issue_record(b, "role", c.site_id, "x", now=NOW)
    except NodeError as e:
        assert "authority" in str(e)
    else:
        raise AssertionError("a non-authority issued a record")
    # a chain extends from the head: generation 1 links to generation 0
    issue_record(a, "role", c.site_id, "x", now=NOW)
    _, info = issue_record(a, "role", c.site_id, "y", now=NOW + 1)
    assert info["generation"] == 1
    assert st.current_roles(a.conn)[c.site_id] == "y"
