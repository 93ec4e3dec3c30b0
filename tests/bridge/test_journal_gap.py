"""A recorded never-issued range below a site's FLOOR (journal type 5 GAP, docs/keystore.md): its
identities are signable, everything intended inside stays spent across compactions, reopens and a
kill at every step, and the journal refuses a gap that holds an identity it knows."""
import os
import struct

import pytest

from firmware_bridge import EventIdentity, JournalError, KeystoreError, OutcomeUnknown, SigningBridge, Status, \
    open_keystore

from bridge_helpers import assembler, event_payload, event_protected, parse_journal, sig_structure

SITE = bytes.fromhex("00112233445566778899aabbccddeeff")
FUTURE = 2_100_000_000_000      # a first boot far ahead
SANE = 1_800_000_000_000


@pytest.fixture
def env(tmp_path):
    ks = open_keystore({"kind": "software", "dir": str(tmp_path / "keys")})
    ks.generate_key("site", "ed25519")
    path = str(tmp_path / "journal")
    bridge = SigningBridge(ks, path)
    yield ks, bridge, path
    bridge.close()


def ev_item(p, l, v=0):
    prot, pay = event_protected(SITE), event_payload(p, l, v)
    return EventIdentity(SITE, p, l), "site", sig_structure(prot, pay), assembler(prot, pay)


def reopen(ks, bridge, path):
    bridge.close()
    return SigningBridge(ks, path)


def test_a_gap_below_the_floor_is_signable_and_what_it_issued_stays_spent(env):
    ks, bridge, path = env
    bridge.release_many([ev_item(FUTURE, k) for k in range(3)])
    bridge.compact_events(lambda i: True)                       # FLOOR at FUTURE.2
    assert bridge.status(EventIdentity(SITE, SANE, 0)) is Status.OUTCOME_UNKNOWN
    bridge.open_event_gap(SITE, (0, 0), (FUTURE, 0))
    assert bridge.event_gap(SITE) == ((0, 0), (FUTURE, 0))
    assert bridge.status(EventIdentity(SITE, SANE, 0)) is Status.ABSENT
    assert bridge.status(EventIdentity(SITE, FUTURE, 1)) is Status.OUTCOME_UNKNOWN   # above the gap: spent
    first = bridge.release_many([ev_item(SANE, k) for k in range(2)])
    # an intent without output inside the gap (a kill between intent and signature)
    bridge._journal.commit([(1, EventIdentity(SITE, SANE, 2).encode(), "site")])
    assert bridge.event_gap(SITE) == ((SANE, 2), (FUTURE, 0))
    assert bridge.max_event_hlc(SITE) == (FUTURE, 2)          # the clock's high-water mark is unchanged
    for step in range(3):
        if step == 1:
            bridge.compact_events(lambda i: True)               # drops the gap's identities too
            assert any(t == 5 for t, _i, _r in parse_journal(path))
        bridge = reopen(ks, bridge, path)
        assert bridge.event_gap(SITE) == ((SANE, 2), (FUTURE, 0)), step
        for k in range(3):
            assert bridge.status(EventIdentity(SITE, SANE, k)) is not Status.ABSENT, (step, k)
            try:                                                # never signed twice
                assert bridge.release(*ev_item(SANE, k, 9)) == first[k], (step, k)   # the persisted bytes
            except OutcomeUnknown:
                pass
        assert bridge.status(EventIdentity(SITE, SANE, 3)) is Status.ABSENT
        assert bridge.status(EventIdentity(SITE, FUTURE, 0)) is not Status.ABSENT
    bridge.release(*ev_item(SANE, 3))
    assert bridge.event_gap(SITE) == ((SANE, 3), (FUTURE, 0))


def test_the_journal_refuses_a_gap_holding_an_identity_it_knows_or_moving_down(env):
    ks, bridge, path = env
    bridge.release(*ev_item(SANE, 5))
    bridge.release(*ev_item(FUTURE, 0))
    with pytest.raises(JournalError, match="intended inside the gap"):
        bridge.open_event_gap(SITE, (0, 0), (FUTURE, 0))
    bridge.open_event_gap(SITE, (SANE, 5), (FUTURE, 0))
    with pytest.raises(JournalError, match="never moves down"):
        bridge.open_event_gap(SITE, (SANE, 1), (FUTURE, 0))
    with pytest.raises(ValueError):
        bridge.open_event_gap(SITE, (FUTURE, 0), (FUTURE, 0))


def test_a_torn_gap_record_is_no_gap(env):
    """A kill while the GAP record is written (no fsync covered it): the journal opens without it,
    and nothing inside is signable once a FLOOR covers it."""
    ks, bridge, path = env
    bridge.release(*ev_item(FUTURE, 0))
    bridge.compact_events(lambda i: True)
    bridge.open_event_gap(SITE, (0, 0), (FUTURE, 0))
    bridge.close()
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 3)                                    # the GAP record torn
    bridge = SigningBridge(ks, path)
    assert bridge.event_gap(SITE) is None
    assert bridge.status(EventIdentity(SITE, SANE, 0)) is Status.OUTCOME_UNKNOWN
    bridge.close()


def test_a_keystore_that_signs_only_upwards_refuses_a_gap(env):
    ks, bridge, path = env
    bridge.release(*ev_item(FUTURE, 0))
    type(ks).upward_only = True
    try:
        with pytest.raises(KeystoreError, match="above the last one"):
            bridge.open_event_gap(SITE, (0, 0), (FUTURE, 0))
    finally:
        del type(ks).upward_only
    assert bridge.event_gap(SITE) is None
    assert struct.calcsize(">QI") == 12
