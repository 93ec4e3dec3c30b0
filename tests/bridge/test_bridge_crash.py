"""Crash tests with real processes: SIGKILL at named points and at seeded random times.

Producer: crash_producer.py (a subprocess).  Independent checker: crash_harness.Checker, which
reads only the producer's stdout pipe and the journal file.  SOVM §22.5 clauses 1-2,
SSP/1 §13.5 (HLC never reused).
"""
from concurrent.futures import ThreadPoolExecutor

import pytest

from crash_harness import CheckFailed, drive_chain, random_schedule
from tests.soak import sample

EVENT_POINTS = ["after_pending", "after_intent", "after_sign", "before_persist", "journal_torn_write",
                "journal_before_fsync", "after_persist", "after_print"]
RECEIPT_POINTS = [p for p in EVENT_POINTS if p != "after_pending"]
HITS = (1, 3, 8)
# in a group of 32, hit 20 of after_sign is in the middle of a group commit
GROUP_HITS = {"after_sign": (5, 20, 70), "after_print": (10, 40, 70)}


def _parallel(jobs):
    with ThreadPoolExecutor(max_workers=2) as pool:
        return [f.result() for f in [pool.submit(*j) for j in jobs]]


def _named(points, hits_for):
    return [f"{p}:{h}" for p in points for h in hits_for(p)]


def test_event_named_crash_points(tmp_path):
    single = _named(EVENT_POINTS, lambda p: HITS)
    group = _named(EVENT_POINTS, lambda p: GROUP_HITS.get(p, HITS))
    (c1, k1), (c2, k2) = _parallel([(drive_chain, str(tmp_path / "single"), single),
                                    (lambda: drive_chain(str(tmp_path / "group"), group, batch=32, total=4000),)])
    assert k1 == len(single) and k2 == len(group)  # every point reached and killed, several hits each
    assert c1.unknown and c2.unknown        # unknown outcomes happened and were refused
    assert c1.retransmits and c2.retransmits  # persisted bytes were re-sent exactly


def test_event_named_crash_points_parallel_signing(tmp_path):
    """Groups of 128: the software keystore signs them on worker threads (firmware_bridge/software.py);
    a kill before, during and after that batch signing, in the middle of its outputs, loses nothing."""
    sched = _named(["after_intent", "after_sign", "before_persist", "journal_torn_write", "journal_before_fsync",
                    "after_persist", "after_print"],
                   lambda p: {"after_sign": (3, 100, 250), "after_print": (60, 200)}.get(p, (1, 3)))
    c, k = drive_chain(str(tmp_path / "g128"), sched, batch=128, total=3000, keystore="plain")
    assert k == len(sched)
    assert c.unknown and c.retransmits


def test_receipt_named_crash_points(tmp_path):
    sched = _named(RECEIPT_POINTS, lambda p: HITS)
    (c1, k1), (c2, k2) = _parallel([
        (lambda: drive_chain(str(tmp_path / "single"), sched, mode="receipt"),),
        (lambda: drive_chain(str(tmp_path / "group"), _named(RECEIPT_POINTS, lambda p: GROUP_HITS.get(p, HITS)),
                             mode="receipt", batch=32, total=4000),)])
    assert k1 == len(sched) and k2 == len(sched)
    assert c1.unknown and c1.retransmits and c2.unknown


def _random_kills(tmp_path, seed, target, mode, batch, max_delay):
    kills, chain = 0, 0
    while kills < target:
        sched = random_schedule(seed * 1000 + chain, 40, max_delay)
        _, k = drive_chain(str(tmp_path / f"{mode}-{batch}-{chain}"), sched, mode=mode, batch=batch)
        kills += k
        chain += 1
    return kills


@pytest.mark.parametrize("seed", [20261202])
def test_random_kills_events(tmp_path, seed):
    n = sample(30, 70)
    k = _parallel([(_random_kills, tmp_path, seed, n, "event", 1, 0.02),
                   (_random_kills, tmp_path, seed + 1, n, "event", 16, 0.02)])
    assert sum(k) >= 2 * n, k


@pytest.mark.parametrize("seed", [77])
def test_random_kills_receipts(tmp_path, seed):
    k = _parallel([(_random_kills, tmp_path, seed, 30, "receipt", 1, 0.02),
                   (_random_kills, tmp_path, seed + 1, 30, "receipt", 8, 0.02)])
    assert sum(k) >= 60, k


# -- negative controls: the same checker must catch the unsafe orders ---------------------------

@pytest.mark.parametrize("mode", ["event", "receipt"])
def test_negative_control_release_before_persist_is_caught(tmp_path, mode):
    with pytest.raises(CheckFailed, match="not durable"):
        drive_chain(str(tmp_path / "s"), ["after_print:5"], mode=mode, unsafe="UnsafeBridge")


def test_negative_control_caught_under_random_kills(tmp_path):
    with pytest.raises(CheckFailed, match="not durable|two different"):
        drive_chain(str(tmp_path / "s"), random_schedule(5, 30, 0.02), unsafe="UnsafeBridge")


@pytest.mark.parametrize("mode", ["event", "receipt"])
def test_negative_control_resign_after_unknown_outcome_is_caught(tmp_path, mode):
    with pytest.raises(CheckFailed, match="after an unknown-outcome crash"):
        drive_chain(str(tmp_path / "s"), ["after_sign:2"], mode=mode, unsafe="ResigningBridge")


# -- compaction (docs/keystore.md "Compaction"): the same checker, plus the producer's record -----

COMPACT_POINTS = ["compact_torn_write", "compact_before_fsync", "compact_before_rename", "compact_after_rename",
                  "compact_after_dirsync", "after_record", "after_print", "after_intent", "after_persist"]


def test_event_crash_points_during_compaction(tmp_path):
    """A crash at every step of a compaction (several hits each) loses no released output that was
    not yet recorded, and no identity is ever signed twice or below its floor."""
    sched = _named(COMPACT_POINTS, lambda p: (1, 4, 9))
    (c1, k1), (c2, k2) = _parallel([
        (lambda: drive_chain(str(tmp_path / "b1"), sched[: len(sched) // 2] * 1, batch=1, compact=5),),
        (lambda: drive_chain(str(tmp_path / "b8"), sched, batch=8, compact=3, total=4000),)])
    assert k1 == len(sched) // 2 and k2 == len(sched)
    assert c1.compacted and c2.compacted      # outputs really left the journal for the record
    assert c2.floors and c2.unknown            # floors written; spent identities refused after restarts


@pytest.mark.parametrize("seed", [4242])
def test_random_kills_with_compaction(tmp_path, seed):
    k = _parallel([(lambda: _random_kills_c(tmp_path, seed, 30, 1, 4),),
                   (lambda: _random_kills_c(tmp_path, seed + 1, 30, 8, 2),)])
    assert sum(k) >= 60, k


def _random_kills_c(tmp_path, seed, target, batch, compact):
    kills, chain = 0, 0
    while kills < target:
        sched = random_schedule(seed * 1000 + chain, 30, 0.03)
        _, k = drive_chain(str(tmp_path / f"c-{batch}-{chain}"), sched, batch=batch, compact=compact)
        kills += k
        chain += 1
    return kills


def test_negative_control_compaction_ignoring_the_record_is_caught(tmp_path):
    with pytest.raises(CheckFailed, match="not durable"):
        drive_chain(str(tmp_path / "s"), ["compact_after_dirsync:3"], batch=4, compact=2, unsafe="CompactAllBridge")
