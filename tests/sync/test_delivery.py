"""Delivery arithmetic (agent/core/delivery.py): every §13.6 row's watermark behaviour, with
outcomes produced by the node's real apply path; cursor advance; selection filters."""
from __future__ import annotations

import pytest

from agent.core import delivery as dl
from agent.core.codec import encode
from agent.core import cose, events as ev
from agent.node import Node

from .helpers import MESH, NOW, T, Signer, manifest

S = Signer()


@pytest.fixture
def node(tmp_path):
    n, _ = Node.init(tmp_path / "r", manifest())
    n.add_peer(S.site_id, S.public_key, None)
    yield n
    n.close()


def proc(outs):
    return [dl.Processed(o.status, o.reason, o.site_id, o.table, o.hlc, o.verified) for o in outs]


def ok(seq, t=T):
    key = {"device": "d", "seq": seq} if t == T else {"id": str(seq)}
    vals = {"temp": 1.0} if t == T else {"body": "x"}
    return S.event(t, key, vals, (NOW, seq))


def infer(node, raws, current=None, held=None, gapped=frozenset()):
    outs = node.apply_batch(raws, NOW)
    return dl.infer_watermarks(S.site_id, proc(outs), current or {}, held or {}, gapped), outs


def raw_payload(obj, hlc):
    pb = encode(obj)
    prot = cose.protected_header(cose.ALG_EDDSA, ev.EVENT_CONTENT_TYPE, S.site_id)
    return cose.assemble(prot, pb, S.sign(cose.sig_structure(prot, MESH, pb)))


G = (S.site_id, T)


def test_all_final_advances_to_last(node):
    up, _ = infer(node, [ok(1), ok(2), ok(3)])
    assert up == {G: (NOW, 3)}


def test_row_missing_table_holds_and_does_not_advance_past(node):
    up, outs = infer(node, [ok(1), S.event("app.future", {"id": "x"}, {"v": 1}, (NOW, 2)), ok(3)])
    assert outs[1].status == "held"
    assert up == {G: (NOW, 3)}  # another group: the held one is app.future, which gets nothing
    assert (S.site_id, "app.future") not in up
    # the held group stays blocked in later bodies while the event is held
    fut = S.event("app.future", {"id": "y"}, {"v": 1}, (NOW, 9))
    up2 = dl.infer_watermarks(S.site_id, proc(node.apply_batch([fut], NOW)), {}, {(S.site_id, "app.future"): (NOW, 2)}, set())
    assert up2 == {}


def test_row_held_inside_one_group_stops_it(node):
    outs = [dl.Processed("applied", "applied", S.site_id, T, (NOW, 1), True),
            dl.Processed("held", "table_missing", S.site_id, T, (NOW, 2), True),
            dl.Processed("applied", "applied", S.site_id, T, (NOW, 3), True)]
    assert dl.infer_watermarks(S.site_id, outs, {}, {}, set()) == {G: (NOW, 1)}


def test_row_skew_rejected_does_not_advance_past(node):
    far = S.event(T, {"device": "d", "seq": 2}, {"temp": 1.0}, (NOW + 400_000, 0))
    up, outs = infer(node, [ok(1), far, ok(3)])
    assert outs[1].status == "rejected" and outs[1].reason == "clock_skew"
    assert up == {G: (NOW, 1)}
    assert dl.first_rejected(proc(outs)) == 1


def test_row_bad_signature_advances_past_without_setting(node):
    forged = bytearray(ok(2))
    forged[-1] ^= 1
    up, outs = infer(node, [ok(1), bytes(forged), ok(3)])
    assert outs[1].status == "dropped" and outs[1].reason == "bad_signature"
    assert up == {G: (NOW, 3)}
    # a forgery alone sets nothing (its HLC is attacker data)
    up, _ = infer(node, [bytes(forged)])
    assert up == {}


def test_row_forgery_claiming_far_hlc_sets_nothing(node):
    bad = Signer(S.site_id).event(T, {"device": "z", "seq": 1}, {"temp": 0.0}, (NOW + 100, 0))  # wrong key, S's kid
    up, outs = infer(node, [ok(1), bad])
    assert outs[1].reason == "bad_signature" and up == {G: (NOW, 1)}


def test_row_null_or_empty_row_key_advances_past(node):
    base = {"table_schema": "app", "table_name": "readings", "operation": "upsert", "payload": {"temp": 1.0},
            "hlc_physical_ms": NOW, "hlc_logical": 2}
    empty = raw_payload(dict(base, row_key={}), (NOW, 2))
    up, outs = infer(node, [ok(1), empty, ok(3)])
    assert outs[1].status == "dropped" and outs[1].reason == "row_key_empty"
    assert up == {G: (NOW, 3)}


def test_row_unknown_key_column_advances_past(node):
    e = S.event(T, {"device": "d", "nope": 1}, {"temp": 1.0}, (NOW, 2))
    up, outs = infer(node, [ok(1), e])
    assert outs[1].status == "dropped" and outs[1].reason == "row_key_columns"
    assert up == {G: (NOW, 2)}


def test_row_unknown_payload_columns_apply_and_advance(node):
    e = S.event(T, {"device": "d", "seq": 2}, {"temp": 1.0, "unknown": 5}, (NOW, 2))
    up, outs = infer(node, [e])
    assert outs[0].status == "applied"
    assert up == {G: (NOW, 2)}


def test_duplicate_is_final(node):
    node.apply_batch([ok(1)], NOW)
    up, outs = infer(node, [ok(1), ok(2)])
    assert outs[0].status == "duplicate" and up == {G: (NOW, 2)}


def test_foreign_and_unverified_events_never_count():
    other = Signer()
    outs = [dl.Processed("applied", "applied", other.site_id, T, (NOW, 5), True),
            dl.Processed("dropped", "unknown_kid", S.site_id, None, None, False)]
    assert dl.infer_watermarks(S.site_id, outs, {}, {}, set()) == {}


def test_monotonic_and_non_increasing_stream_blocks():
    outs = [dl.Processed("applied", "applied", S.site_id, T, (NOW, 2), True),
            dl.Processed("applied", "applied", S.site_id, T, (NOW, 1), True),
            dl.Processed("applied", "applied", S.site_id, T, (NOW, 3), True)]
    assert dl.infer_watermarks(S.site_id, outs, {}, {}, set()) == {G: (NOW, 2)}
    assert dl.infer_watermarks(S.site_id, outs[:1], {G: (NOW, 7)}, {}, set()) == {}
    assert dl.infer_watermarks(S.site_id, outs[:1], {}, {}, {T}) == {}  # gapped by the sender's policy


def test_cursor_after_and_continuity():
    assert dl.cursor_after(10, [12, 15, 20], 25, 3) == 25
    assert dl.cursor_after(10, [12, 15, 20], 25, 1) == 14  # re-offer from the rejected one
    assert dl.cursor_after(10, [12, 15, 20], 25, 0) == 11
    assert dl.cursor_after(10, [], 25, 0) == 25
    assert dl.continues(0, 0) and dl.continues(5, 9) and not dl.continues(10, 9)


def test_select_filters():
    me, peer, third = b"m" * 16, b"p" * 16, b"t" * 16
    rows = [dl.LogRow(1, peer, T, (1, 0), b"a"), dl.LogRow(2, me, "app.notes", (2, 0), b"b"),
            dl.LogRow(3, third, T, (3, 0), b"c"), dl.LogRow(4, third, T, (9, 0), b"d"),
            dl.LogRow(5, me, T, (10, 0), b"e")]
    sel = dl.select(rows, 0, peer, me, lambda t: t != "app.notes", {(third, T): (3, 0)}, 10)
    assert sel.events == [b"d", b"e"] and sel.seqs == [4, 5] and sel.end == 5
    assert sel.gaps == {"app.notes"} and sel.skipped == {"self_echo": 1, "policy": 1, "watermark": 1}
    sel = dl.select(rows, 2, peer, me, lambda t: True, {}, 1)
    assert sel.events == [b"c"] and sel.end == 3


def test_a_prefix_is_the_selection_with_that_limit():
    """`Selection.prefix(n)` (a body cut to fit its byte limit) is what `select` takes with limit n:
    the same events, end and policy gaps (only those withheld before the cut)."""
    me, peer, third = b"m" * 16, b"p" * 16, b"t" * 16
    rows = [dl.LogRow(1, third, T, (1, 0), b"a"), dl.LogRow(2, third, T, (2, 0), b"b"),
            dl.LogRow(3, me, "app.notes", (3, 0), b"c"), dl.LogRow(4, peer, T, (4, 0), b"d"),
            dl.LogRow(5, third, T, (5, 0), b"e"), dl.LogRow(6, me, "app.x", (6, 0), b"f"),
            dl.LogRow(7, me, T, (7, 0), b"g")]
    allowed = lambda t: t == T  # noqa: E731
    whole = dl.select(rows, 0, peer, me, allowed, {}, 10)
    for n in range(1, len(whole.events)):
        cut, again = whole.prefix(n), dl.select(rows, 0, peer, me, allowed, {}, n)
        assert (cut.events, cut.seqs, cut.end, cut.gaps) == (again.events, again.seqs, again.end, again.gaps)
