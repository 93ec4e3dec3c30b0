"""§12 steps in order and every §13.6 row, each with a hostile input."""
from __future__ import annotations

import os

import cbor2
import pytest

from agent import apply as apply_mod
from agent.applypipeline import Pipeline
from agent.core import events as ev
from agent.core.codec import encode
from agent.node import Node
from agent.store import db
from agent.outcomes import APPLIED, DROPPED, DUPLICATE, HELD, REJECTED
from agent.simpeer import SimPeer

from .helpers import MESH, NOW, T, make_node, peers


@pytest.fixture
def env(tmp_path):
    a, b = peers(2)
    node = make_node(tmp_path / "n", [a, b])
    yield node, a, b
    node.close()


def one(node, raw, now=NOW):
    return node.apply_batch([raw], now)[0]


def payload(**over):
    p = {"table_schema": "app", "table_name": "readings", "row_key": {"device": "d", "seq": 1},
         "operation": "upsert", "payload": {"temp": 1.5}, "hlc_physical_ms": NOW, "hlc_logical": 0}
    p.update(over)
    return p


def test_valid_event_applies_and_duplicate_is_noop(env):
    node, a, _ = env
    raw = a.event(T, {"device": "d", "seq": 1}, {"temp": 1.5}, (NOW, 0))
    assert one(node, raw).status == APPLIED
    o = one(node, raw)
    assert (o.status, o.reason) == (DUPLICATE, "duplicate")
    assert node.dump()[T] == [{"key": {"device": "d", "seq": 1}, "values": {"temp": 1.5}}]
    assert len(list(node.log_entries())) == 1


def test_forged_signature_dropped_surfaced_and_victim_stream_unaffected(env):
    node, a, b = env
    good = a.event(T, {"device": "d", "seq": 1}, {"temp": 1.5}, (NOW, 0))
    # b signs with a's kid: the signature does not verify under a's key.
    forged = b.sign_payload(encode(payload(hlc_physical_ms=NOW + 10)), kid=a.site_id)
    outs = node.apply_batch([forged, good], NOW)
    assert (outs[0].status, outs[0].reason) == (DROPPED, "bad_signature")
    assert not outs[0].verified
    assert outs[1].status == APPLIED
    assert any(s["reason"] == "bad_signature" for s in node.surfaced())


def test_tampered_bytes_fail_signature(env):
    node, a, _ = env
    raw = bytearray(a.event(T, {"device": "d", "seq": 1}, {"temp": 1.5}, (NOW, 0)))
    raw[-1] ^= 1
    assert one(node, bytes(raw)).reason == "bad_signature"


def test_unknown_kid_rejected_and_not_retained(env, tmp_path):
    # Rejected, not dropped: a vouch may still admit the kid, so the sender
    # re-offers it; nothing is retained meanwhile.
    node, _, _ = env
    stranger = SimPeer(MESH)
    o = one(node, stranger.event(T, {"device": "d", "seq": 1}, {"temp": 1.0}, (NOW, 0)))
    assert (o.status, o.reason, o.verified) == (REJECTED, "unknown_kid", False)
    assert node.conn.execute("SELECT count(*) FROM events").fetchone()[0] == 0
    assert node.conn.execute("SELECT count(*) FROM held").fetchone()[0] == 0


def test_wrong_mesh_id_fails_signature(env):
    node, a, _ = env
    other_mesh = SimPeer(bytes(16), site_id=a.site_id, key=a.key)
    o = one(node, other_mesh.event(T, {"device": "d", "seq": 1}, {"temp": 1.0}, (NOW, 0)))
    assert o.reason == "bad_signature"


def test_retired_signer_above_cutoff_dropped_below_applied(env):
    node, a, _ = env
    node.add_peer(a.site_id, a.public_key, (NOW, 5))
    below = one(node, a.event(T, {"device": "d", "seq": 1}, {"temp": 1.0}, (NOW, 5)))
    above = one(node, a.event(T, {"device": "d", "seq": 2}, {"temp": 1.0}, (NOW, 6)))
    assert below.status == APPLIED
    assert (above.status, above.reason) == (DROPPED, "retired_signer")


def test_skew_rejected_not_retained(env):
    node, a, _ = env
    raw = a.event(T, {"device": "d", "seq": 1}, {"temp": 1.0}, (NOW + 300_001, 0))
    o = one(node, raw)
    assert (o.status, o.reason) == (REJECTED, "clock_skew")
    assert list(node.log_entries()) == []
    # At exactly the bound it is accepted; and the rejected one applies once time catches up.
    assert one(node, a.event(T, {"device": "d", "seq": 2}, {"temp": 1.0}, (NOW + 300_000, 0))).status == APPLIED
    assert one(node, raw, now=NOW + 1).status == APPLIED


def test_out_of_floor_dropped_and_logged_not_raised(env):
    node, a, _ = env
    for table in ("sec.keys", "app.index"):
        key = {"id": "x"}
        raw = a.event(table, key, {}, (NOW, 0))
        o = one(node, raw)
        assert (o.status, o.reason) == (DROPPED, "out_of_floor")
    good = a.event(T, {"device": "d", "seq": 1}, {"temp": 1.0}, (NOW, 1))
    assert one(node, good).status == APPLIED
    assert [s for s in node.surfaced() if s["reason"] == "out_of_floor" and s["kind"] == "logged"]


def test_missing_table_held_then_applied_after_creation(env):
    node, a, _ = env
    raw = a.event("app.later", {"id": "r1"}, {"v": 7}, (NOW, 0))
    o = one(node, raw)
    assert (o.status, o.reason) == (HELD, "table_missing")
    again = one(node, raw)
    assert again.status == HELD  # still held, not a duplicate that would pass the watermark
    released = node.create_table({"schema": "app", "name": "later", "key": ["id"],
                                  "columns": {"id": "text", "v": "integer"}})
    assert [x.status for x in released] == [APPLIED]
    assert node.dump()["app.later"] == [{"key": {"id": "r1"}, "values": {"v": 7}}]


@pytest.mark.parametrize("row_key,reason", [
    (None, "row_key_empty"),
    ({}, "row_key_empty"),
    ({"device": "d"}, "row_key_columns"),  # one key column missing
    ({"device": "d", "seq": 1, "extra": 2}, "row_key_columns"),
    ({"device": "d", "nope": 1}, "row_key_columns"),  # composite key with one unknown part
    ({"device": "d", "seq": "1"}, "row_key_type"),
    ({"device": None, "seq": 1}, "bad_row_key_value"),  # null is not a key Scalar
])
def test_row_key_conditions_dropped(env, row_key, reason):
    node, a, _ = env
    raw = a.sign_payload(encode(payload(row_key=row_key)))
    o = one(node, raw)
    assert (o.status, o.reason) == (DROPPED, reason)
    assert node.dump()[T] == []


def test_unknown_and_ill_typed_payload_columns_applied_in_part_and_metered(env):
    node, a, _ = env
    raw = a.event(T, {"device": "d", "seq": 1}, {"temp": 2.5, "future_col": 1, "note": 5, "seq": 9}, (NOW, 0))
    o = one(node, raw)
    assert o.status == APPLIED
    assert node.dump()[T] == [{"key": {"device": "d", "seq": 1}, "values": {"temp": 2.5}}]
    metered = {(m["column"], m["count"]) for m in node.ignored_columns()}
    assert metered == {("future_col", 1), ("note", 1), ("seq", 1)}  # a key column in the payload too
    # The ignored column's clock was untouched: a later lower-HLC write of it still wins.
    assert one(node, a.event(T, {"device": "d", "seq": 1}, {"note": "ok"}, (NOW - 5, 0))).status == APPLIED
    assert node.dump()[T][0]["values"] == {"temp": 2.5, "note": "ok"}


def test_upsert_without_known_columns_asserts_existence(env):
    node, a, _ = env
    one(node, a.event(T, {"device": "d", "seq": 1}, {"unknown": 1}, (NOW, 0)))
    assert node.dump()[T] == [{"key": {"device": "d", "seq": 1}, "values": {}}]


def _resign(a: SimPeer, raw: bytes, mutate) -> bytes:
    """Re-wrap a valid event's parts in another byte form, with a valid signature over them."""
    tag = cbor2.loads(raw)
    protected, _u, pl, sig = tag.value
    return mutate(protected, pl, sig)


def test_untagged_cose_dropped(env):
    node, a, _ = env
    raw = a.event(T, {"device": "d", "seq": 1}, {"temp": 1.0}, (NOW, 0))
    untagged = encode(list(cbor2.loads(raw).value))
    assert (one(node, untagged).status, one(node, untagged).reason) == (DROPPED, "untagged_cose")


def test_non_empty_unprotected_header_dropped(env):
    node, a, _ = env
    raw = a.event(T, {"device": "d", "seq": 1}, {"temp": 1.0}, (NOW, 0))
    p, _u, pl, sig = cbor2.loads(raw).value
    bad = encode(cbor2.CBORTag(18, [p, {4: a.site_id}, pl, sig]))
    o = one(node, bad)
    assert (o.status, o.reason) == (DROPPED, "unprotected_not_empty")


def test_non_deterministic_envelope_with_valid_signature_dropped(env):
    node, a, _ = env
    raw = a.event(T, {"device": "d", "seq": 1}, {"temp": 1.0}, (NOW, 0))
    # Same signed content, array header in a non-shortest form: a second byte form.
    assert raw[1] == 0x84
    bad = raw[:1] + b"\x98\x04" + raw[2:]
    o = one(node, bad)
    assert (o.status, o.reason) == (DROPPED, "non_deterministic")


def test_non_deterministic_payload_with_valid_signature_dropped(env):
    node, a, _ = env
    # A payload map with keys out of canonical order, signed as is.
    p = payload()
    items = sorted(p.items(), key=lambda kv: kv[0], reverse=True)
    body = bytes([0xA0 + len(items)]) + b"".join(cbor2.dumps(k) + cbor2.dumps(v, canonical=True) for k, v in items)
    assert cbor2.loads(body) == p
    o = one(node, a.sign_payload(body))
    assert (o.status, o.reason) == (DROPPED, "non_deterministic")
    # Non-shortest integer inside the payload.
    body2 = encode(payload()).replace(b"\x6bhlc_logical\x00", b"\x6bhlc_logical\x18\x00")
    assert body2 != encode(payload())
    assert one(node, a.sign_payload(body2)).reason == "non_deterministic"


@pytest.mark.parametrize("over,reason", [
    ({"payload": {"temp": True}}, "bad_payload_value"),
    ({"payload": {"temp": float("nan")}}, "bad_payload_value"),  # floats must be finite
    ({"payload": {"temp": float("inf")}}, "bad_payload_value"),
    ({"payload": {"temp": [1]}}, "bad_payload_value"),
    ({"row_key": {"device": "d", "seq": True}}, "bad_row_key_value"),
    ({"operation": "purge"}, "bad_operation"),
    ({"operation": "delete"}, "delete_with_payload"),
    ({"payload": None}, "bad_payload_map"),
    ({"hlc_logical": -1}, "bad_hlc"),
    ({"extra": 1}, "payload_members"),
])
def test_bad_payload_shapes_dropped(env, over, reason):
    node, a, _ = env
    o = one(node, a.sign_payload(encode(payload(**over))))
    assert (o.status, o.reason) == (DROPPED, reason)


def test_self_echo_dropped(env):
    node, a, _ = env
    eid = node.write(T, {"device": "d", "seq": 9}, {"temp": 3.0}, now=NOW)
    raw = [bytes(r[0]) for r in node.conn.execute("SELECT unseal(event_id, raw) FROM events WHERE event_id=?", (eid,))][0]
    o = one(node, raw)
    assert (o.status, o.reason) == (DROPPED, "self_echo")


def test_signature_checked_before_skew_and_scope(env):
    """§12 order: a forged far-future event for a missing table is dropped (signature), not
    rejected (skew) nor held (scope)."""
    node, a, b = env
    forged = b.sign_payload(encode(payload(table_name="nope", hlc_physical_ms=NOW + 10**9)), kid=a.site_id)
    o = one(node, forged)
    assert (o.status, o.reason) == (DROPPED, "bad_signature")
    far = a.sign_payload(encode(payload(table_name="nope", hlc_physical_ms=NOW + 10**9)))
    assert one(node, far).status == REJECTED  # skew before scope


def test_non_bytes_and_garbage_dropped(env):
    node, _, _ = env
    assert one(node, b"\xff\x00garbage").status == DROPPED
    assert one(node, b"").status == DROPPED


def test_surfaced_record_is_bounded_against_a_flood(env):
    """The store keeps the newest `surfaced_limit` rows and counts what it evicts."""
    node, a, _ = env
    with db.transaction(node.conn):
        db.set_meta(node.conn, "surfaced_limit", 50)
    garbage = [b"\xff" + i.to_bytes(4, "big") for i in range(3000)]
    outs = node.apply_batch(garbage, NOW)
    assert all(o.status == DROPPED for o in outs)
    assert node.status()["bounds"]["surfaced"] == {"rows": 50, "limit": 50, "evicted": 2950}
    assert [e["event_id"] for e in node.surfaced(1000)] == [ev.event_id(g).hex() for g in garbage[-50:]]
    # The honest stream behind the flood still applies.
    assert one(node, a.event(T, {"device": "d", "seq": 1}, {"temp": 1.0}, (NOW, 0))).status == APPLIED


def _mixed_events(a, b, n=40, base=0):
    mixed = []
    for i in range(base, base + n):
        good = a.event(T, {"device": "d", "seq": i % 7}, {"temp": float(i)}, (NOW, i))
        mixed += [good, good,  # duplicate inside the batch
                  b.sign_payload(encode(payload(hlc_logical=i)), kid=a.site_id),  # forged
                  b.event("app.later", {"id": str(i)}, {"v": i}, (NOW, i)),  # held
                  b.event(T, {"device": "e", "seq": i}, {"temp": 1.0}, (4_000_000_000_000, i)),  # skew
                  a.sign_payload(encode(payload(row_key={"device": "d"}, hlc_logical=1000 + i))),  # bad key
                  a.sign_payload(encode(payload(operation="merge", hlc_logical=2000 + i))),  # bad shape
                  b"\xd2" + good[1:-1] + bytes([good[-1] ^ 1]),  # damaged signature byte
                  SimPeer(MESH).event(T, {"device": "u", "seq": i}, {"temp": 1.0}, (NOW, i)),  # unknown kid
                  good[:-3]]  # truncated envelope
    return mixed


needs_two_cores = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the apply worker needs 2 cores")


@pytest.mark.parametrize("workers,share", [(0, None), (1, 0.0), (1, 1.0), (1, None), (2, None)])
def test_large_batches_verified_ahead_give_the_same_outcomes(tmp_path, monkeypatch, workers, share):
    """The pipelined path (envelope, signature and payload prepared ahead: on this thread, or in
    worker processes that decode the payloads of no chunk, of every chunk, or of the share that
    balances them with the applying thread) is the same apply path: identical outcomes and state
    to one-by-one application, hostile inputs included."""
    if workers and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("the apply worker needs 2 cores")
    monkeypatch.setattr(Pipeline, "WORKER_MIN_BATCH", 64 if workers else 10**9)
    monkeypatch.setenv("SSP_AGENT_APPLY_WORKERS", str(max(1, workers)))
    if share is not None:
        from agent.applyworker import ApplyWorkers
        monkeypatch.setattr(ApplyWorkers, "FIRST_SHARE", share)
        monkeypatch.setattr(ApplyWorkers, "STEP", 0.0)
    a, b = peers(2)
    mixed = _mixed_events(a, b)
    big = make_node(tmp_path / "big", [a, b])
    small = make_node(tmp_path / "small", [a, b])
    outs_big = big.apply_batch(mixed, NOW)
    if workers:
        assert big._pool and len(big._pool.workers) == workers   # the worker did prepare them
    else:
        assert not big._pool
    outs_small = [small.apply_batch([r], NOW)[0] for r in mixed]
    assert [(o.status, o.reason) for o in outs_big] == [(o.status, o.reason) for o in outs_small]
    assert {o.reason for o in outs_big} >= {"applied", "duplicate", "bad_signature", "table_missing",
                                            "clock_skew", "row_key_columns", "unknown_kid"}
    assert big.dump() == small.dump()
    assert len(outs_big) > 64
    big.close()
    small.close()


@needs_two_cores
def test_chunks_the_applying_thread_prepares_itself_give_the_same_outcomes(tmp_path, monkeypatch):
    """With a share of the chunks prepared on the applying thread (`here`: both cores verify), the
    rest by the worker, the outcomes and state are those of one-by-one application."""
    monkeypatch.setattr(Pipeline, "WORKER_MIN_BATCH", 64)
    monkeypatch.setenv("SSP_AGENT_APPLY_WORKERS", "1")
    from agent.applyworker import ApplyWorkers
    monkeypatch.setattr(ApplyWorkers, "FIRST_SHARE", 1.0)
    monkeypatch.setattr(ApplyWorkers, "FIRST_HERE", 0.5)
    monkeypatch.setattr(ApplyWorkers, "STEP", 0.0)
    a, b = peers(2)
    mixed = _mixed_events(a, b)
    big = make_node(tmp_path / "big", [a, b])
    small = make_node(tmp_path / "small", [a, b])
    outs_big = big.apply_batch(mixed, NOW)
    assert big._pool and big._pool.here == 0.5
    outs_small = [small.apply_batch([r], NOW)[0] for r in mixed]
    assert [(o.status, o.reason) for o in outs_big] == [(o.status, o.reason) for o in outs_small]
    assert big.dump() == small.dump()
    big.close()
    small.close()


@needs_two_cores
def test_a_dead_apply_worker_leaves_the_apply_path_to_this_thread(tmp_path, monkeypatch):
    """A worker process that dies (killed, out of memory) costs speed, never outcomes: the batch
    that finds it gone prepares its events on the applying thread, with the same results."""
    import signal
    monkeypatch.setattr(Pipeline, "WORKER_MIN_BATCH", 64)
    monkeypatch.setenv("SSP_AGENT_APPLY_WORKERS", "1")
    a, b = peers(2)
    big = make_node(tmp_path / "big", [a, b])
    small = make_node(tmp_path / "small", [a, b])
    first, second = _mixed_events(a, b, 20), _mixed_events(a, b, 40, base=100)
    big.apply_batch(first, NOW)
    for r in first:
        small.apply_batch([r], NOW)
    proc = big._pool.workers[0].proc
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    outs_big = big.apply_batch(second, NOW)
    assert big._pool is False   # given up: this thread prepares from now on
    outs_small = [small.apply_batch([r], NOW)[0] for r in second]
    assert [(o.status, o.reason) for o in outs_big] == [(o.status, o.reason) for o in outs_small]
    assert big.dump() == small.dump()
    big.close()
    small.close()


@needs_two_cores
def test_the_apply_worker_starts_once_enough_events_came_in_batches(tmp_path, monkeypatch):
    """Not for a one-shot command applying one small body (its start-up would cost more than it
    saves), but for a long-running one once its bodies add up to WORKER_MIN_BATCH events."""
    monkeypatch.setattr(Pipeline, "WORKER_MIN_BATCH", 250)
    monkeypatch.delenv("SSP_AGENT_APPLY_WORKERS", raising=False)
    a, b = peers(2)
    node = make_node(tmp_path / "n", [a, b])
    node.apply_batch(_mixed_events(a, b, 10), NOW)   # 100 events
    node.apply_batch([a.event(T, {"device": "s", "seq": i}, {"temp": 1.0}, (NOW, i)) for i in range(63)], NOW)
    assert node._pool is None                        # batches under 64 do not count
    node.apply_batch(_mixed_events(a, b, 10, base=50), NOW)
    assert node._pool is None                        # 200
    node.apply_batch(_mixed_events(a, b, 10, base=100), NOW)
    assert node._pool                                # 300: started, and kept
    node.apply_batch(_mixed_events(a, b, 10, base=150), NOW)
    assert node._pool
    node.close()
    assert node._pool is None


@needs_two_cores
def test_a_long_running_node_starts_the_apply_worker_on_its_first_large_batch(tmp_path, monkeypatch):
    """A `run` (Runner marks its node long-running) receives bodies of up to 1 000 events: its
    first body of WORKER_RUN_BATCH events or more starts the worker, without waiting for
    WORKER_MIN_BATCH events in all; a small batch still does not."""
    monkeypatch.delenv("SSP_AGENT_APPLY_WORKERS", raising=False)
    a, b = peers(2)
    node = make_node(tmp_path / "n", [a, b])
    node.long_running = True
    node.apply_batch(_mixed_events(a, b, 10), NOW)   # 100 events
    assert node._pool is None
    node.apply_batch(_mixed_events(a, b, (Pipeline.WORKER_RUN_BATCH + 9) // 10, base=50), NOW)
    assert node._pool
    node.close()
    other = make_node(tmp_path / "o", [a, b])        # not long-running: the same batch waits
    other.apply_batch(_mixed_events(a, b, (Pipeline.WORKER_RUN_BATCH + 9) // 10, base=50), NOW)
    assert other._pool is None
    other.close()


@needs_two_cores
def test_the_apply_worker_prepares_against_the_current_keyring(tmp_path, monkeypatch):
    """The worker holds the keyring it was last sent (it travels only when it changed): a key
    vouched or retired between batches must reach it, else the applying thread finds the entry
    changed and verifies every such event itself (correct, and slow). One-by-one application on
    a node without a worker is the reference."""
    monkeypatch.setattr(Pipeline, "WORKER_MIN_BATCH", 64)
    monkeypatch.setenv("SSP_AGENT_APPLY_WORKERS", "1")
    a, b, c = peers(3)
    big = make_node(tmp_path / "big", [a, b])
    small = make_node(tmp_path / "small", [a, b])

    from agent.core import cose
    real_verify, here = cose.verify_ed25519, []

    def counted(*args):
        here.append(1)
        return real_verify(*args)

    def both(raws):
        monkeypatch.setattr(cose, "verify_ed25519", counted)
        here.clear()
        outs_big = big.apply_batch(raws, NOW)
        monkeypatch.setattr(cose, "verify_ed25519", real_verify)
        assert big._pool
        assert here == []   # every signature was verified by the worker, against the node's entry
        outs_small = [small.apply_batch([r], NOW)[0] for r in raws]
        assert [(o.status, o.reason) for o in outs_big] == [(o.status, o.reason) for o in outs_small]
        return {o.reason for o in outs_big}

    def batch(signer, base, n=80):
        return [signer.event(T, {"device": "k", "seq": i % 9}, {"temp": float(i)}, (NOW, base + i)) for i in range(n)]

    assert both(batch(a, 0) + batch(c, 0)) == {"applied", "unknown_kid"}
    for n in (big, small):
        n.add_peer(c.site_id, c.public_key, None)          # c becomes known
        n.add_peer(a.site_id, a.public_key, (NOW, 150))    # a retired above (NOW, 150)
    assert both(batch(a, 100) + batch(c, 100)) == {"applied", "retired_signer"}
    assert big.dump() == small.dump()
    big.close()
    small.close()


@needs_two_cores
def test_nodes_of_one_process_share_its_worker_allowance(tmp_path, monkeypatch):
    """A process running many nodes (the fleet benchmark runs hundreds) starts at most as many
    workers as one node would: the others prepare on their own thread until workers are free."""
    monkeypatch.setattr(Pipeline, "WORKER_MIN_BATCH", 64)
    monkeypatch.setenv("SSP_AGENT_APPLY_WORKERS", "1")
    a, b = peers(2)
    first, second, ref = (make_node(tmp_path / n, [a, b]) for n in ("first", "second", "ref"))
    raws = _mixed_events(a, b, 10)
    first.apply_batch(raws, NOW)
    outs = second.apply_batch(raws, NOW)
    assert first._pool and second._pool is None        # one worker in the process, the first node's
    assert [(o.status, o.reason) for o in outs] == [(o.status, o.reason) for o in (ref.apply_batch([r], NOW)[0] for r in raws)]
    first.close()
    second.apply_batch(_mixed_events(a, b, 10, base=50), NOW)
    assert second._pool                                  # freed by the first node's close
    second.close()
    ref.close()


def test_the_apply_worker_is_not_started_on_one_core_or_for_small_batches(tmp_path, monkeypatch):
    a, b = peers(2)
    node = make_node(tmp_path / "n", [a, b])
    node.apply_batch(_mixed_events(a, b, 10), NOW)   # 100 events: below WORKER_MIN_BATCH
    assert node._pool is None
    monkeypatch.setattr(Pipeline, "WORKER_MIN_BATCH", 64)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    node.apply_batch(_mixed_events(a, b, 10, base=50), NOW)
    assert node._pool is False
    node.close()


@pytest.mark.parametrize("row_flush", [1, 4096])
def test_rows_held_by_a_batch_give_the_state_one_by_one_application_gives(tmp_path, monkeypatch, row_flush):
    """A batch holds its rows in memory and writes each once (agent/store/rows.py
    `defer`), flushing every ROW_FLUSH rows. Many events per row, deletes, resurrections (whose
    §13.4 rebuild reads the log), column clears and losing writes, in one batch, must leave the
    rows exactly as applying the same events one by one does, whether the batch flushes often or
    once at its end."""
    monkeypatch.setattr(apply_mod, "ROW_FLUSH", row_flush)
    a, b = peers(2)
    raws = []
    for i in range(300):
        s = (a, b)[i % 2]
        key = {"device": "d", "seq": i % 5}
        hlc = (NOW, i if i % 7 else 300 - i)   # some events lose to ones already applied
        if i % 11 == 3:
            raws.append(s.event(T, key, None, hlc, delete=True))
        elif i % 3:
            raws.append(s.event(T, key, {"temp": float(i), "note": None if i % 4 else f"n{i}"}, hlc))
        else:
            raws.append(s.event(T, key, {"note": f"x{i}"}, hlc))
    big = make_node(tmp_path / "big", [a, b])
    small = make_node(tmp_path / "small", [a, b])
    outs_big = big.apply_batch(raws, NOW)
    outs_small = [small.apply_batch([r], NOW)[0] for r in raws]
    assert [(o.status, o.reason) for o in outs_big] == [(o.status, o.reason) for o in outs_small]
    assert big.dump() == small.dump()
    kinds = {r["reason"] for r in big.surfaced(1000)}
    assert "resurrected" in kinds   # the rebuild path ran inside the batch
    cols = "device, seq, temp, note, \"temp$state\", \"note$state\""
    assert (big.conn.execute(f'SELECT {cols} FROM "app.readings" ORDER BY seq').fetchall()
            == small.conn.execute(f'SELECT {cols} FROM "app.readings" ORDER BY seq').fetchall())
    big.close()
    small.close()


def test_duplicate_check_is_the_same_whatever_the_batch_size(tmp_path):
    """The duplicate look-up (§12.4) must not depend on the batch size. Events
    already in the log are duplicates whether they come back alone or in a batch of 64 or more
    (the verify-ahead path), even after the checks behind it would now answer otherwise (a horizon
    raised above them, a signer retired below them)."""
    a, b = peers(2)
    raws = [a.event(T, {"device": "d", "seq": i}, {"temp": float(i)}, (NOW, i)) for i in range(70)]
    nodes = {}
    for name in ("alone", "batch"):
        n = make_node(tmp_path / name, [a, b])
        assert {o.status for o in n.apply_batch(raws, NOW)} == {APPLIED}
        n.raise_horizon(T, (NOW, 35))                                    # half of them below it now
        n.add_peer(a.site_id, a.public_key, (NOW, 50))                   # and the rest above a's cutoff
        nodes[name] = n
    alone = [nodes["alone"].apply_batch([r], NOW)[0] for r in raws]
    batch = nodes["batch"].apply_batch(raws, NOW)
    assert [(o.status, o.reason) for o in alone] == [(DUPLICATE, "duplicate")] * 70
    assert [(o.status, o.reason) for o in batch] == [(o.status, o.reason) for o in alone]
    for n in nodes.values():
        n.close()


@needs_two_cores
@pytest.mark.parametrize("share", [0.0, 1.0])
def test_a_batch_prepared_during_the_one_before_gives_the_same_outcomes(tmp_path, monkeypatch, share):
    """`prepare_next` (a `run` naming the next body waiting): the workers prepare that batch's first
    chunks while this one applies. The same apply path: its duplicate look-up runs inside the
    batch that applies them (bytes the batch before applied are duplicates, not re-applied), a
    key vouched or retired in between is checked against the entry the node holds when the batch
    applies, and a hint for a batch that does not come is dropped. One-by-one application on a
    node without a worker is the reference."""
    monkeypatch.setattr(Pipeline, "WORKER_MIN_BATCH", 64)
    monkeypatch.setenv("SSP_AGENT_APPLY_WORKERS", "1")
    from agent.applyworker import ApplyWorkers
    monkeypatch.setattr(ApplyWorkers, "FIRST_SHARE", share)
    monkeypatch.setattr(ApplyWorkers, "STEP", 0.0)
    a, b, c = peers(3)
    big = make_node(tmp_path / "big", [a, b])
    small = make_node(tmp_path / "small", [a, b])
    first = _mixed_events(a, b, 30)
    # the next one repeats the first's last events (applied by the batch before: duplicates) and
    # carries c's events (c unknown when it is sent ahead, vouched before it applies)
    second = first[-40:] + _mixed_events(a, b, 30, base=100) + \
        [c.event(T, {"device": "c", "seq": i}, {"temp": 1.0}, (NOW, i)) for i in range(70)]
    third = _mixed_events(a, b, 20, base=200)
    never = _mixed_events(a, b, 20, base=300)   # named, never applied
    fourth = _mixed_events(a, b, 20, base=400)
    seen = []

    def step(raws, hint=None):
        if hint is not None:
            big.prepare_next(hint)
        outs_big = big.apply_batch(raws, NOW)
        outs_small = [small.apply_batch([r], NOW)[0] for r in raws]
        assert [(o.status, o.reason) for o in outs_big] == [(o.status, o.reason) for o in outs_small]
        seen.extend(o.reason for o in outs_big)

    step(first, hint=second)
    assert big.pipeline.carried is not None and big.pipeline.carried[0] is second   # its first chunks went ahead
    for n in (big, small):
        n.add_peer(c.site_id, c.public_key, None)           # c vouched between the two batches
        n.add_peer(a.site_id, a.public_key, (NOW, 120))     # a retired above (NOW, 120)
    step(second, hint=never)
    assert big.pipeline.carried is not None and big.pipeline.carried[0] is never
    step(third, hint=fourth)                                 # `never` did not come: dropped
    step(fourth)
    assert big.pipeline.carried is None
    assert {"applied", "duplicate", "retired_signer", "bad_signature", "table_missing"} <= set(seen)
    assert sum(1 for r in seen if r == "applied") > 100
    assert big.dump() == small.dump()
    big.close()
    small.close()


def _row_events(a, b, base, n=70, rows=7):
    """Upserts, deletes and resurrections over a few rows, from two signers."""
    raws = []
    for i in range(base, base + n):
        s = (a, b)[i % 2]
        key = {"device": "d", "seq": i % rows}
        if i % 11 == 3:
            raws.append(s.event(T, key, None, (NOW, i), delete=True))
        else:
            raws.append(s.event(T, key, {"temp": float(i), "note": None if i % 4 else f"n{i}"}, (NOW, i)))
    return raws


def test_rows_kept_between_batches_give_the_state_one_by_one_application_gives(tmp_path):
    """A batch keeps the rows it leaves for the next one (RowStore `defer`/`committed`: a `run`'s
    bodies each re-read the rows the body before wrote). A trust change between two batches
    rebuilds rows outside a batch (here: b retired below most of its events) and a fault rolls a
    batch back: the next batch must read the rows as they are, not as the last batch left them."""
    a, b = peers(2)
    big = make_node(tmp_path / "big", [a, b])
    small = make_node(tmp_path / "small", [a, b])

    def both(raws):
        outs_big = big.apply_batch(raws, NOW)
        outs_small = [small.apply_batch([r], NOW)[0] for r in raws]
        assert [(o.status, o.reason) for o in outs_big] == [(o.status, o.reason) for o in outs_small]
        assert big.dump() == small.dump()

    both(_row_events(a, b, 0))
    both(_row_events(a, b, 100))
    for n in (big, small):
        n.add_peer(b.site_id, b.public_key, (NOW, 120))   # b's events above (NOW, 120) no longer count
    both(_row_events(a, b, 200))
    # a fault half-way through a batch rolls it back; the same events then apply whole
    real, calls = apply_mod.materialize, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 20:
            raise RuntimeError("a local fault")
        return real(*args)

    apply_mod.materialize = failing
    try:
        with pytest.raises(RuntimeError):
            big.apply_batch(_row_events(a, b, 300), NOW)
    finally:
        apply_mod.materialize = real
    both(_row_events(a, b, 300))
    both(_row_events(a, b, 400))
    big.close()
    small.close()


def test_rows_kept_between_batches_are_read_again_after_another_connection_wrote(tmp_path):
    """The rows a batch keeps for the next are used only while no other connection committed in
    between (`PRAGMA data_version`): a row another writer gave a newer column clock keeps it."""
    import sqlite3
    from agent.store.rows import pack_stamp
    a, = peers(1)
    node = make_node(tmp_path / "n", [a])
    node.apply_batch([a.event(T, {"device": "d", "seq": i}, {"temp": float(i)}, (NOW, i)) for i in range(70)], NOW)
    path = node.conn.execute("PRAGMA database_list").fetchone()[2]
    other = sqlite3.connect(path)
    other.execute('UPDATE "_ssp_rows.app.readings" SET temp = 555.0, "_c_temp" = ? WHERE seq = 0',
                  (pack_stamp((NOW, 10_000, a.site_id)),))
    other.commit()
    other.close()
    node.apply_batch([a.event(T, {"device": "d", "seq": i}, {"temp": -1.0}, (NOW, 100 + i)) for i in range(70)], NOW)
    temps = {r["key"]["seq"]: r["values"]["temp"] for r in node.dump()[T]}
    assert temps[0] == 555.0 and temps[1] == -1.0
    node.close()


def test_rows_kept_between_batches_are_read_again_after_a_trust_change(tmp_path):
    """A trust change between two batches rebuilds rows outside a batch: b retired below its
    writes, the rows go back to a's. The next batch must merge against the rebuilt rows (a's
    newer write wins there), not against the rows the batch before left (b's clock)."""
    a, b = peers(2)
    node = make_node(tmp_path / "n", [a, b])
    node.apply_batch([a.event(T, {"device": "d", "seq": i}, {"temp": 1.0}, (NOW, 1000 + i)) for i in range(70)] +
                     [b.event(T, {"device": "d", "seq": i}, {"temp": 2.0}, (NOW, 3000 + i)) for i in range(70)], NOW)
    node.add_peer(b.site_id, b.public_key, (NOW, 1500))    # every write of b's no longer counts
    assert {r["values"]["temp"] for r in node.dump()[T]} == {1.0}
    node.apply_batch([a.event(T, {"device": "d", "seq": i}, {"temp": 3.0}, (NOW, 2000 + i)) for i in range(70)], NOW)
    assert {r["values"]["temp"] for r in node.dump()[T]} == {3.0}
    node.close()


def test_rows_kept_between_batches_are_read_again_after_a_small_batch_wrote(tmp_path):
    """A batch under 64 events writes its rows directly (no batch held in memory): the rows the
    large batch before kept must not answer the next large batch for a row it changed."""
    a, = peers(1)
    node = make_node(tmp_path / "n", [a])
    node.apply_batch([a.event(T, {"device": "d", "seq": i}, {"temp": 1.0}, (NOW, 1000 + i)) for i in range(70)], NOW)
    node.apply_batch([a.event(T, {"device": "d", "seq": 0}, {"temp": 9.0}, (NOW, 5000))], NOW)
    node.apply_batch([a.event(T, {"device": "d", "seq": i}, {"temp": 3.0}, (NOW, 2000 + i)) for i in range(70)], NOW)
    temps = {r["key"]["seq"]: r["values"]["temp"] for r in node.dump()[T]}
    assert temps[0] == 9.0 and temps[1] == 3.0
    node.close()
