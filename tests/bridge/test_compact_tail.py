"""A receipts-only compaction rewrites what was appended since the last compaction, not every
group's kept entries (docs/keystore.md "Compaction"). Before, each one re-encoded the last receipt
of every group ever signed for (~7.6 µs of CPU a group): a sequencer that had served 20 000 groups
paid ~150 ms a compaction however few of them were active, ~3-5 µs on every Commit of the
benchmark's stream. Now the file the last compaction wrote (the base) is kept byte for byte, and
the base's entries of groups that moved on
stay (released, at or below the new floor) until a full rewrite drops them, once they would be
more than STALE_SHARE of its entries."""
from __future__ import annotations

import os

import pytest

from firmware_bridge import OutcomeUnknown, ReceiptIdentity, SigningBridge, Status, open_keystore
from firmware_bridge import journal as J
from firmware_bridge import journal_compact as JC

from bridge_helpers import assembler, parse_journal, receipt_payload, receipt_protected, sig_structure

IDLE = [b"idle-%05d" % g for g in range(300)]
ACTIVE = [b"busy-%05d" % g for g in range(3)]


@pytest.fixture
def env(tmp_path):
    ks = open_keystore({"kind": "software", "dir": str(tmp_path / "keys")})
    ks.generate_key("seq", "p256")
    path = str(tmp_path / "journal")
    bridge = SigningBridge(ks, path)
    yield ks, bridge, path
    bridge.close()


def item(ks, g: bytes, e: int, tag: bytes = b""):
    prot = receipt_protected(ks.public_key("seq"))
    pay = receipt_payload(g, e, (bytes([e % 256]) + tag).ljust(32, b"\0")[:32], None)
    return ReceiptIdentity(g, e), "seq", sig_structure(prot, pay), assembler(prot, pay)


def advance(ks, bridge, groups, epochs, released: dict) -> None:
    for e in epochs:
        for g, out in zip(groups, bridge.release_many([item(ks, g, e) for g in groups])):
            released[(g, e)] = out


def states(bridge, released: dict, top: dict) -> dict:
    """Every identity's status and bytes, and the one above each group's top (never intended)."""
    out = {}
    for (g, e) in list(released) + [(g, t + 1) for g, t in top.items()]:
        out[(g, e)] = (bridge.status(ReceiptIdentity(g, e)), bridge.released(ReceiptIdentity(g, e)))
    return out


def test_a_compaction_rewrites_what_came_since_the_last_one_not_every_group(env, monkeypatch):
    ks, bridge, path = env
    released: dict = {}
    advance(ks, bridge, IDLE + ACTIVE, range(3), released)
    below = {g: 3 for g in IDLE + ACTIVE}
    first = bridge.compact_receipts(below.get)            # every group: its last receipt, a floor
    assert first["full"] and first["receipts_dropped"] == 2 * len(IDLE + ACTIVE)
    with open(path, "rb") as f:
        base = f.read()
    where = {g: bridge._journal._index[ReceiptIdentity(g, 2).encode()] for g in IDLE}
    advance(ks, bridge, ACTIVE, range(3, 9), released)
    below.update({g: 9 for g in ACTIVE})
    encoded = []
    real = JC.encode_intent
    monkeypatch.setattr(JC, "encode_intent", lambda i, k: encoded.append(i) or real(i, k))
    second = bridge.compact_receipts(below.get)
    # only the active groups' entries since the last compaction: epochs 3-7 dropped, 8 kept (their
    # epoch 2 stays in the base, below the new floor)
    assert not second["full"] and second["receipts_dropped"] == 3 * 5
    assert sorted(encoded) == sorted(ReceiptIdentity(g, 8).encode() for g in ACTIVE)
    with open(path, "rb") as f:
        now = f.read()
    assert now[:len(base)] == base                       # the base, byte for byte
    assert all(bridge._journal._index[ReceiptIdentity(g, 2).encode()] == where[g] for g in IDLE)
    assert second["bytes_after"] < len(base) + 3 * 600


def test_a_tail_compaction_answers_as_a_full_one_and_reopens_to_the_same_answers(env):
    """Every identity: the same status and bytes before and after the compaction, and after
    reopening; an active group's receipts the base still holds (below the new floor) read
    released with their bytes, as they did, where a full rewrite would have dropped them (spent):
    neither is ever signed again. An identity never intended stays absent."""
    ks, bridge, path = env
    released: dict = {}
    advance(ks, bridge, IDLE + ACTIVE, range(2), released)
    below = {g: 2 for g in IDLE + ACTIVE}
    bridge.compact_receipts(below.get)
    advance(ks, bridge, ACTIVE, range(2, 7), released)
    # a gap's intent without output, and a receipt being signed (intent only) at the top
    bridge._journal.commit([(1, ReceiptIdentity(ACTIVE[0], 7).encode(), "seq")])
    top = {g: 1 for g in IDLE} | {g: 6 for g in ACTIVE} | {ACTIVE[0]: 7}
    before = states(bridge, released, top)
    below.update({g: 5 for g in ACTIVE})
    stats = bridge.compact_receipts(below.get)
    assert not stats["full"]
    after = states(bridge, released, top)
    for key, (status, raw) in after.items():
        was_status, was_raw = before[key]
        if key in released:
            # released bytes, or spent (a floor covers it and it left the journal: SQLite holds it)
            assert (status, raw) in ((Status.RELEASED, released[key]), (Status.OUTCOME_UNKNOWN, None)), key
            assert key[1] <= 3 or (status, raw) == (was_status, was_raw), key   # kept: as before
        else:
            assert (status, raw) == (was_status, was_raw), key
    bridge.close()
    reopened = SigningBridge(ks, path)
    try:
        assert states(reopened, released, top) == after
        for (g, e), raw in released.items():       # nothing below the top is signed again
            try:
                again = reopened.release(*item(ks, g, e, b"other commit"))
            except OutcomeUnknown:
                continue
            assert again == raw, (g, e)
    finally:
        reopened.close()


def test_what_the_base_leaves_behind_stays_within_its_share_and_full_rewrites_drop_it(env):
    """Rounds in which a few groups move on: tail compactions, and a full rewrite whenever the
    entries the base would leave behind pass STALE_SHARE of it. Each group's entries that the
    file holds at or below its floor are counted from the file itself: never more than that
    share of the base, so the journal stays within about twice what it keeps plus a round."""
    ks, bridge, path = env
    released: dict = {}
    groups = IDLE[:60] + ACTIVE
    advance(ks, bridge, groups, range(2), released)
    below = {g: 2 for g in groups}
    bridge.compact_receipts(below.get)
    kinds = []
    epoch = {g: 2 for g in groups}
    for r in range(40):
        movers = [groups[(r * 7 + k) % len(groups)] for k in range(4)]
        for g in movers:
            advance(ks, bridge, [g], range(epoch[g], epoch[g] + 3), released)
            epoch[g] += 3
            below[g] = epoch[g]
        stats = bridge.compact_receipts(below.get)
        kinds.append(stats["full"])
        floors, held = {}, []
        for rtype, ident, _data in parse_journal(path):
            if rtype == 3:
                floors[ident[:-8]] = max(floors.get(ident[:-8], b""), ident)
            elif rtype == 1:
                held.append(ident)
        behind = sum(1 for i in held if i <= floors.get(i[:-8], b""))
        assert behind <= J.STALE_SHARE * len(held), (r, behind, len(held))
        assert stats["full"] or behind == bridge._journal._base.stale, (r, behind, bridge._journal._base)
    assert kinds.count(False) >= 20 and kinds.count(True) >= 2, kinds
    assert bridge.journal_stats()["entries"] <= 2 * len(groups) + 4


def test_groups_moving_on_together_are_rewritten_in_full(env):
    """When more than half of the base's entries belong to groups with receipts since, keeping the
    base would leave most of it behind: the whole file is rewritten, as before."""
    ks, bridge, path = env
    released: dict = {}
    groups = IDLE[:20]
    advance(ks, bridge, groups, range(2), released)
    below = {g: 2 for g in groups}
    assert bridge.compact_receipts(below.get)["full"]
    advance(ks, bridge, groups[:11], range(2, 4), released)
    below.update({g: 4 for g in groups[:11]})
    stats = bridge.compact_receipts(below.get)
    assert stats["full"] and stats["entries_kept"] == 20
    assert bridge.journal_stats()["entries"] == 20 and os.path.getsize(path) == stats["bytes_after"]


def test_a_sealed_journal_keeps_its_base_sealed_and_reads_back_after_a_tail_compaction(tmp_path):
    """At rest (docs/reliability.md "At rest"): the base is copied sealed as it is, the outputs kept
    since are copied sealed too, no receipt is ever in the file in clear, and a reopen with the
    data key reads every kept receipt's bytes back."""
    from firmware_bridge.sealing import Sealer, new_data_key
    ks = open_keystore({"kind": "software", "dir": str(tmp_path / "keys")})
    ks.generate_key("seq", "p256")
    path = str(tmp_path / "journal")
    sealer = Sealer({1: new_data_key()}, 1)
    released: dict = {}
    groups = IDLE[:40] + ACTIVE
    with SigningBridge(ks, path, sealer=sealer) as bridge:
        advance(ks, bridge, groups, range(2), released)
        below = {g: 2 for g in groups}
        assert bridge.compact_receipts(below.get)["full"]
        advance(ks, bridge, ACTIVE, range(2, 6), released)
        below.update({g: 6 for g in ACTIVE})
        assert not bridge.compact_receipts(below.get)["full"]
        answers = states(bridge, released, {g: max(e for h, e in released if h == g) for g in groups})
    data = open(path, "rb").read()
    assert not any(raw[-64:] in data for raw in released.values())     # no signature in clear
    with SigningBridge(ks, path, sealer=sealer) as bridge:
        assert states(bridge, released, {g: max(e for h, e in released if h == g) for g in groups}) == answers
        assert all(bridge.released(ReceiptIdentity(g, 5)) == released[(g, 5)] for g in ACTIVE)


@pytest.mark.parametrize("cut", ["since", "base"])
def test_a_journal_cut_short_behind_the_bridge_is_refused_by_a_tail_compaction_too(env, cut):
    """Hostile storage, as in test_bridge_compact.py but where the compaction would keep the base:
    the file loses bytes behind the open bridge, from what came since or into the base itself.
    The compaction cannot map past the file's end and reads short: it refuses (JournalError,
    "short read"), writes no `.compact` file and renames nothing, the file keeps what was left,
    and the bridge still answers from what it holds."""
    from firmware_bridge import JournalError
    ks, bridge, path = env
    released: dict = {}
    advance(ks, bridge, IDLE + ACTIVE, range(2), released)
    below = {g: 2 for g in IDLE + ACTIVE}
    assert bridge.compact_receipts(below.get)["full"]
    base_end = os.path.getsize(path)
    advance(ks, bridge, ACTIVE, range(2, 6), released)
    below.update({g: 6 for g in ACTIVE})
    j = bridge._journal
    # uncut, this compaction would keep the base and rewrite only what came since
    assert j._tail_after(j._base, list(j._index), j._tail, None, below.get, dict(j._receipt_floor)) is not None
    size = os.path.getsize(path)
    left = size - 10 if cut == "since" else base_end - 10
    os.truncate(path, left)
    with pytest.raises(JournalError, match="short read"):
        bridge.compact_receipts(below.get)
    assert not os.path.exists(path + ".compact") and os.path.getsize(path) == left
    assert bridge.status(ReceiptIdentity(ACTIVE[0], 5)) is Status.RELEASED
    assert bridge.released(ReceiptIdentity(IDLE[0], 1)) == released[(IDLE[0], 1)]
