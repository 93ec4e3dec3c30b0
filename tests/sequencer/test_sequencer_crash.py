"""SIGKILL a real sequencer process at every named point of accept → sign → persist → release, and
at seeded random times (SOVM §22.5 cl. 1-3, §22.6).

The checker is independent of the package: it reads the producer's stdout (every byte string the
sequencer let out, printed before anything else saw it), the journal with the parser written
from docs/keystore.md (tests/bridge/bridge_helpers.py) and the state database with sqlite3, and
verifies receipts with cryptography through firmware_bridge.verify_p256. After every kill:
  - never two receipts for one (group_id, epoch) in everything ever released, nor in the journal;
  - every released receipt is in the state database and in the journal with identical bytes;
  - the epoch is never ahead of a durable receipt: every epoch below current_epoch has its
    receipt or a stated discontinuity, and no discontinuity has a receipt;
  - the chain is continuous: each receipt names the hash of the last receipt before it.
At the end every released receipt is re-served byte for byte, and every discontinuity is served
as a stated absence.
"""
from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import blake3
import cbor2

from bridge_helpers import cose_parts, parse_journal
from firmware_bridge import verify_p256
from firmware_bridge.identity import DiscontinuityIdentity, decode_identity

from agent.sequencer import home as seq_home, receipts, service
from tests.soak import sample
from tests.waiting import HANG_S

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
PRODUCER = os.path.join(HERE, "seq_producer.py")
POINTS = ["accepted", "after_intent", "after_sign", "before_persist", "journal_torn_write",
          "journal_before_fsync", "after_persist", "committed", "after_release"]
# the signing journal's compaction (firmware_bridge/journal.py): before and after its rename
COMPACTION_POINTS = ["compact_torn_write", "compact_before_fsync", "compact_before_rename",
                     "compact_after_rename", "compact_after_dirsync"]
HITS = (1, 3, 7, 15)
START = {bytes.fromhex("01" * 16): 0, bytes.fromhex("02" * 16): 100, bytes.fromhex("03" * 16): 7}
# The random kill times of the schedules (0.05-0.9 s from spawn) are for a sequencer that starts
# in about this long; on a slower machine they are stretched by its start-up measured in the same
# test (Pace), so kills land in start-up and in work alike however slow the machine.
REF_READY_S = 0.2


class Pace:
    """The sequencer's start-up on this machine now (spawn to READY), measured on every run."""

    def __init__(self) -> None:
        self.ready: list[float] = []

    def calibrate(self) -> None:
        """One start-up in a scratch home (nothing signed), before any run of the tested home."""
        with tempfile.TemporaryDirectory() as scratch:
            home = os.path.join(scratch, "s")
            service.init(home)
            assert run(home, target=0, pace=self)[2]

    def stretch(self, kill_after: float) -> float:
        recent = self.ready[-9:]
        return kill_after * max(1.0, statistics.median(recent) / REF_READY_S) if recent else kill_after


class Checker:
    def __init__(self, home: str) -> None:
        self.home = home
        self.released: dict = {}           # (group, epoch) -> bytes ever let out
        self.absent: set = set()           # (group, epoch) stated absent as a discontinuity
        conn = sqlite3.connect(os.path.join(home, "sequencer.db"))
        self.key = bytes.fromhex(json.loads(conn.execute(
            "SELECT value FROM meta WHERE key = 'receipt_key'").fetchone()[0])["public_key"])
        conn.close()
        self.discontinuities_seen = 0
        self.journal_seen: dict = {}       # (group, epoch) -> receipt bytes ever found in the journal
        self.forgotten: set = set()        # (group, epoch) a compaction dropped (below its floor, gone)
        self.compacted = 0                 # checks that found a floor (compaction happened)
        self.compactions: list = []        # "full" or "tail", as the producer reported them
        # (group, epoch) -> receipt released before the state was restored from an older copy:
        # the journal's head adopted after a rollback chains to such a receipt, a gap now
        self.before: dict = {}

    def feed(self, lines: list[str]) -> None:
        for line in lines:
            if line.startswith("COMPACTED "):
                self.compactions.append(line.split()[1])
                continue
            kind, g, e, rest = line.split()
            ident = (bytes.fromhex(g), int(e))
            if kind == "ABSENT":
                assert ident not in self.released, f"{ident} released, then stated absent"
                if rest == "1":
                    self.absent.add(ident)
                continue
            raw = bytes.fromhex(rest)
            assert ident not in self.absent, f"{ident} stated absent, then released"
            if ident in self.released:
                assert self.released[ident] == raw, f"two receipts for {ident}"
            self._verify(ident, raw)
            self.released[ident] = raw

    def _verify(self, ident, raw: bytes) -> None:
        prot, pay, sig = cose_parts(raw)
        assert verify_p256(self.key, cbor2.dumps(["Signature1", prot, b"", pay], canonical=True), sig)
        p = cbor2.loads(pay)
        assert (p["group_id"], p["epoch"]) == ident

    def check_durable(self) -> None:
        journal: dict = {}
        path = os.path.join(self.home, "sign-journal")
        # A kill early in the first run can come before the bridge created its journal: then
        # nothing was released (checked below against the released set) and there is nothing to parse.
        records = parse_journal(path) if os.path.exists(path) and os.path.getsize(path) >= 8 else []
        statements: dict = {}
        floors: dict = {}                  # group -> epoch floor of the journal's compaction
        held: set = set()                  # receipt identities the journal holds (intent or output)
        for t, ident, data in records:
            if t == 3:
                idy = decode_identity(ident)
                floors[idy.group_id] = max(idy.epoch, floors.get(idy.group_id, -1))
                continue
            if ident[:1] == b"R":
                idy = decode_identity(ident)
                key = (idy.group_id, idy.epoch)
                # a pair a compaction dropped is spent: never intended or signed again (§22.5 cl. 1-2)
                assert key not in self.forgotten, f"{key} back in the journal after a compaction dropped it"
                held.add(key)
            if t == 2:
                idy = decode_identity(ident)
                key = (idy.group_id, idy.epoch)
                if isinstance(idy, DiscontinuityIdentity):
                    # §22.6 step 4: at most one statement of absence ever persisted per gap
                    assert key not in statements, f"two persisted statements for {key}"
                    statements[key] = data
                    continue
                assert key not in journal, f"two persisted receipts for {key}"
                assert self.journal_seen.get(key, data) == data, f"two persisted receipts for {key}"
                journal[key] = self.journal_seen[key] = data
        conn = sqlite3.connect(os.path.join(self.home, "sequencer.db"))
        try:
            store = {(bytes(g), e): bytes(r) for g, e, r in conn.execute("SELECT group_id, epoch, receipt FROM receipts")}
            gaps = {(bytes(g), e) for g, e in conn.execute("SELECT group_id, epoch FROM discontinuities")}
            groups = {bytes(g): e for g, e in conn.execute("SELECT group_id, current_epoch FROM groups")}
            stated = {(bytes(g), e): bytes(r) for g, e, r in conn.execute("SELECT group_id, epoch, statement FROM statements")}
        finally:
            conn.close()
        def compacted(ident) -> bool:      # dropped by a compaction: at or below its floor, not held
            return ident not in held and ident[1] <= floors.get(ident[0], -1)
        for ident, raw in self.released.items():
            assert store.get(ident) == raw, f"released {ident} not durable in the state with identical bytes"
            assert journal.get(ident) == raw or compacted(ident), f"released {ident} not in the journal with identical bytes"
        for ident, raw in store.items():
            assert journal.get(ident) == raw or compacted(ident), f"state receipt {ident} differs from the journal's"
        for gid, floor in floors.items():
            self.forgotten.update((gid, e) for e in range(START.get(gid, 0), floor + 1) if (gid, e) not in held)
        self.compacted += bool(floors)
        assert not (gaps & set(store)), "an epoch with both a receipt and a discontinuity"
        assert self.absent <= gaps
        assert set(statements) <= gaps, "a statement of absence for an epoch that is no recorded gap"
        for ident, raw in stated.items():
            assert statements.get(ident) == raw, f"stored statement {ident} differs from the journal's"
        for gid, current in groups.items():
            prev = lost = None
            for e in range(START.get(gid, 0), current):   # --idle groups start at 0
                ident = (gid, e)
                # or a receipt released before the state was restored from an older copy, which a
                # compaction then dropped from the journal (restored past the floor: docs/sequencer.md)
                assert ident in store or ident in gaps or (compacted(ident) and ident in self.before), \
                    f"epoch {current} of {gid.hex()} ahead of {e}'s receipt"
                if ident in store:
                    p = cbor2.loads(cose_parts(store[ident])[1])
                    assert p["previous_receipt_hash"] in (prev, lost or prev), f"chain broken at {ident}"
                    prev = lost = blake3.blake3(store[ident]).digest()
                elif ident in self.before:
                    lost = blake3.blake3(self.before[ident]).digest()
            assert not any(g == gid and e >= current for g, e in store), "a receipt above current_epoch"
        self.discontinuities_seen = len(gaps)


def run(home: str, *, crash: str | None = None, kill_after: float | None = None, seed: int = 0,
        target: int = 30, unsafe: str = "", batch: bool = False, chunk: int = 0,
        compact: int = 0, extra: tuple = (), pace: Pace | None = None) -> tuple[list[str], bool, bool]:
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONDONTWRITEBYTECODE="1")
    env.pop("SEQ_CRASH", None)
    if crash:
        env["SEQ_CRASH"] = crash
    proc = subprocess.Popen([sys.executable, PRODUCER, "--home", home, "--seed", str(seed), "--target", str(target)]
                            + (["--unsafe", unsafe] if unsafe else []) + (["--batch"] if batch else []) + (["--chunk", str(chunk)] if chunk else [])
                            + (["--compact-bytes", str(compact)] if compact else []) + list(extra),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    lines: list[str] = []
    t0 = time.monotonic()

    def reader() -> None:
        for line in proc.stdout:
            if line == "READY\n" and pace is not None:
                pace.ready.append(time.monotonic() - t0)
            lines.append(line.rstrip("\n"))
    th = threading.Thread(target=reader, daemon=True)
    th.start()
    if kill_after is not None:
        time.sleep(kill_after)   # from spawn: some kills land in start-up and resume
        try:
            proc.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(HANG_S)
    th.join(HANG_S)
    err = proc.stderr.read()
    killed = proc.returncode == -signal.SIGKILL
    if not killed and proc.returncode != 0:
        raise AssertionError(f"sequencer failed rc={proc.returncode}: {err[-2000:]}")
    done = "DONE" in lines
    return [l for l in lines if l not in ("READY", "DONE")], killed, done


def drive(home: str, schedule: list, *, target: int, seed: int, unsafe: str = "",
          batch: bool = False, chunk: int = 0, compact: int = 0, extra: tuple = (),
          min_released: int = 0) -> tuple[Checker, int]:
    """Run ``schedule`` (crash points, and kill times in seconds from spawn, stretched by Pace),
    then more random kills while fewer than ``min_released`` receipts were let out (a count, not
    what a machine does in a time: at most as many more as the schedule has), then a run to the
    end. Returns the checker and the number of kills (every step is one)."""
    service.init(home)
    checker = Checker(home)
    pace = Pace()
    if any(isinstance(step, float) for step in schedule):
        pace.calibrate()
    more = random.Random(seed)
    kills = n = 0
    while True:
        if n < len(schedule):
            step = schedule[n]
        elif len(checker.released) < min_released and n < 2 * len(schedule):
            step = round(more.uniform(0.05, 0.9), 3)
        else:
            step = None
        if isinstance(step, float):
            step_target = 10**6       # never finishes before its kill
        elif step is None:            # the last run completes: a little past what was reached
            target = max(target, _progress(home) + 5)
            step_target = target
        else:
            step_target = target
        lines, killed, done = run(home, crash=step if isinstance(step, str) else None,
                                  kill_after=pace.stretch(step) if isinstance(step, float) else None, seed=seed + n,
                                  target=step_target, unsafe=unsafe, batch=batch, chunk=chunk, compact=compact,
                                  extra=extra, pace=pace)
        kills += killed
        if isinstance(step, str):
            assert killed, f"crash point {step} was never reached"
        if isinstance(step, float):
            assert killed, f"the run to be killed after {step} s ended by itself"
        checker.feed(lines)
        checker.check_durable()
        n += 1
        if step is None:
            assert done, "the final run did not complete"
            break
    # every released receipt re-served byte for byte; every discontinuity a stated absence
    with service.Sequencer(home) as s:
        for (g, e), raw in checker.released.items():
            assert s.receipt(g, e) == raw
        for g, e in checker.absent:
            assert s.receipt(g, e) == service.Absent(discontinuity=True)
        for g, e, _m in s.store.discontinuities():     # every gap stated, signed by this sequencer
            st = receipts.verify_statement(s.receipt(g, e).statement, s.public_key)
            assert (st.group_id, st.epoch) == (g, e)
        for gid, start in START.items():
            assert s.store.group(gid).current_epoch - start >= target
    return checker, kills


def _progress(home: str) -> int:
    conn = sqlite3.connect(os.path.join(home, "sequencer.db"))
    try:
        rows = conn.execute("SELECT group_id, current_epoch FROM groups").fetchall()
    finally:
        conn.close()
    return max([e - START[bytes(g)] for g, e in rows if bytes(g) in START], default=0)


def test_named_crash_points(tmp_path):
    sched = [f"{p}:{h}" for p in POINTS for h in HITS]
    checker, kills = drive(str(tmp_path / "s"), sched, target=100, seed=1)
    assert kills == len(sched)
    assert checker.discontinuities_seen > 0     # kills between intent and persist took the §22.6 path
    assert len(checker.released) >= 100


def test_random_kills(tmp_path):
    """With the signing journal compacted every ~4 KiB (a dozen receipts): kills land in and
    around compactions too (docs/sequencer.md "Journal compaction")."""
    rng = random.Random(1414)
    sched = [round(rng.uniform(0.05, 0.9), 3) for _ in range(sample(30, 120))]
    want = sample(60, 150)
    checker, kills = drive(str(tmp_path / "s"), sched, target=20, seed=2, compact=4096, min_released=want)
    assert kills >= len(sched)
    assert len(checker.released) >= want
    assert checker.compacted > 0 and checker.forgotten


def test_group_commit_named_crash_points_and_random_kills(tmp_path):
    """submit_many: every group's competing Commits in one call per round, through the pipelined
    group commit with one Commit per step (chunk 1), so the three groups' batches overlap: one
    journal commit holds one batch's receipt and the next one's intent, one SQLite transaction one
    batch's receipt and the next one's pending row. Kills inside a step leave some receipts
    persisted, others intended only; the same checker holds."""
    rng = random.Random(2828)
    sched = [f"{p}:{h}" for p in POINTS for h in (1, 4, 9)] + \
        [f"{p}:{h}" for p in COMPACTION_POINTS for h in (1, 2, 3)] + \
        [round(rng.uniform(0.05, 0.9), 3) for _ in range(sample(15, 117))]
    checker, kills = drive(str(tmp_path / "s"), sched, target=120, seed=4, batch=True, chunk=1, compact=4096,
                           min_released=300)
    assert kills >= len(sched)
    assert checker.discontinuities_seen > 0 and len(checker.released) >= 300
    assert checker.compacted > 0 and checker.forgotten


def test_kills_in_compactions_that_keep_the_base(tmp_path):
    """Twelve more groups taken to epoch 2 and left alone: the journal's compactions keep what the
    last one wrote byte for byte and rewrite only what came since (firmware_bridge/journal.py
    BASE_GROWTH), with a full rewrite now and then. Kills at each step of both kinds, and at
    random times, through the pipelined group commit; the same checker holds."""
    rng = random.Random(4242)
    sched = [f"{p}:{h}" for p in COMPACTION_POINTS for h in (1, 2, 3)] + \
        [round(rng.uniform(0.05, 0.9), 3) for _ in range(sample(12, 30))]
    checker, kills = drive(str(tmp_path / "s"), sched, target=150, seed=7, batch=True, chunk=1, compact=4096,
                           extra=("--idle", "12"), min_released=300)
    assert kills >= len(sched)
    assert checker.compacted > 0 and checker.forgotten
    assert "tail" in checker.compactions and "full" in checker.compactions, checker.compactions
    assert len(checker.released) >= 300


def test_negative_control_epoch_advanced_before_the_receipt_fails_the_checker(tmp_path):
    """A sequencer that moves current_epoch before the receipt is durable (§22.5 cl. 3 violated)
    must fail the same checker after a kill between intent and persist."""
    import pytest
    with pytest.raises(AssertionError, match="ahead of"):
        drive(str(tmp_path / "s"), ["after_intent:3"], target=10, seed=3, unsafe="advance-first")


# Resume after a rollback (§22.6 step 1, step 4; docs/sequencer.md "Resume"): its durable steps,
# after each of which a SIGKILL must leave a state the next resume completes: "settled" (one
# transaction of lost epochs settled against the journal), "stated" (one batch of statements of
# absence stored); the bridge's points (after_intent ... after_persist) fire inside each
# statement batch's release_many.
RESUME_POINTS = ["skipped", "settled", "stated"]
NEVER = 2**40                  # --compact-bytes never reached: the signing journal stays whole
ROLLBACK_GAP_GROUPS = 250      # groups in the copy whose epoch 0 is an unknown outcome


def _settled_so_far(db: str, base: dict) -> int:
    """Epochs settled since the copy came back, all groups together (``base``: each group's epoch
    in the copy)."""
    conn = sqlite3.connect(db)
    try:
        return sum(e - base[bytes(g)] for g, e in conn.execute("SELECT group_id, current_epoch FROM groups"))
    finally:
        conn.close()


def test_rollback_resume_named_crash_points(tmp_path, monkeypatch):
    """The state restored from a copy 52 epochs a group behind its journal, which was never
    compacted (no FLOOR: every receipt released since the copy is adopted byte for byte) and holds
    unknown outcomes — an INTENT without output, appended while no sequencer held the home — at
    each group's epoch after its last receipt and at epoch 0 of 250 more groups in the copy: 253
    gaps (§22.6 "epoch advanced, receipt absent"), each to get one statement of absence. (A state
    restored past a compaction floor takes another path, docs/sequencer.md "Resume": not this
    test's.) The batched resume (16 epochs a transaction, 16 statements a bridge call) SIGKILLed
    after settle transactions, inside statement batches (between intents and outputs, between
    signatures, in a torn journal write, before an fsync, after the outputs persisted) and after
    batches were stored, each point more than once, then completed: after every kill the checker
    above holds (nothing signed twice, a statement at most once a gap, the epoch never ahead of a
    durable receipt or stated gap, the chain continuous)."""
    import shutil
    from firmware_bridge.identity import ReceiptIdentity
    from firmware_bridge.journal import INTENT, Journal
    monkeypatch.setattr(seq_home, "JOURNAL_COMPACT_BYTES", NEVER)      # this process's opens too
    monkeypatch.setattr(seq_home, "JOURNAL_OPEN_COMPACT_BYTES", NEVER)
    main = dict(START)
    home = str(tmp_path / "s")
    service.init(home)
    assert run(home, seed=5, target=8, compact=NEVER)[2]
    gap_groups = [b"\x04" + i.to_bytes(2, "big") + bytes(13) for i in range(ROLLBACK_GAP_GROUPS)]  # sorted last
    with service.Sequencer(home) as s:
        for g in gap_groups:
            s.register(g, 0)
            monkeypatch.setitem(START, g, 0)
    db = os.path.join(home, "sequencer.db")
    shutil.copy(db, str(tmp_path / "backup.db"))
    base = {g: start + 8 for g, start in main.items()} | {g: 0 for g in gap_groups}
    pre = Checker(home)
    lines, _killed, done = run(home, seed=6, target=60, compact=NEVER)
    assert done
    pre.feed(lines)
    pre.check_durable()
    conn = sqlite3.connect(db)
    try:
        top = {bytes(g): e for g, e in conn.execute("SELECT group_id, current_epoch FROM groups") if bytes(g) in main}
    finally:
        conn.close()
    assert top == {g: start + 60 for g, start in main.items()}
    expected = {(g, e) for g, e in top.items()} | {(g, 0) for g in gap_groups}    # the 253 gaps
    j = Journal(os.path.join(home, "sign-journal"))      # no sequencer holds the home
    try:
        j.commit([(INTENT, ReceiptIdentity(g, e).encode(), service.RECEIPT_KEY) for g, e in sorted(expected)])
    finally:
        j.close()
    for suffix in ("-wal", "-shm"):
        if os.path.exists(db + suffix):
            os.unlink(db + suffix)
    shutil.copy(str(tmp_path / "backup.db"), db)
    checker = Checker(home)            # what was released before the copy came back is adopted below
    extra = ("--settle-chunk", "16", "--statement-batch", "16")
    total = sum(e + 1 - base[g] for g, e in top.items()) + len(gap_groups)      # epochs to settle: 409
    settle_kills = ["settled:1", "settled:2", "settled:3", "settled:4"]
    sched = settle_kills + [
        "after_intent:1", "after_intent:2", "after_sign:5", "after_sign:20", "before_persist:1", "before_persist:2",
        "journal_torn_write:1", "journal_torn_write:2", "journal_before_fsync:1", "journal_before_fsync:3",
        "after_persist:1", "after_persist:2", "stated:1", "stated:2", "stated:3", None]
    kills = 0
    for n, step in enumerate(sched):
        lines, killed, done = run(home, crash=step, seed=10 + n, target=70, compact=NEVER, extra=extra)
        assert killed == (step is not None), f"crash point {step} was never reached"
        assert done == (step is None)
        kills += killed
        checker.feed(lines)
        checker.check_durable()
        settled = _settled_so_far(db, base)
        if step in settle_kills:
            # killed after the k-th settle transaction of this resume, each run going on from where
            # the last one stopped: 16 + 32 + 48 + 64 epochs, inside the settlement (409)
            k = int(step.split(":")[1])
            assert settled == 16 * k * (k + 1) // 2 < total, (step, settled)
        elif step is not None:
            # the statement kills: after the settlement, before the last batch of statements
            conn = sqlite3.connect(db)
            try:
                stored = conn.execute("SELECT count(*) FROM statements").fetchone()[0]
            finally:
                conn.close()
            assert settled == total and stored < len(expected), (step, settled, stored)
    assert kills == len(sched) - 1 >= 19
    assert pre.compacted == checker.compacted == 0 and not checker.forgotten     # never a FLOOR
    records = parse_journal(os.path.join(home, "sign-journal"))
    assert not [r for r in records if r[0] == 3]
    stated = [decode_identity(rec[1]) for rec in records if rec[0] == 2 and rec[1][:1] == b"D"]
    assert max(i.attempt for i in stated) >= 2       # kills between a batch's intents and outputs, twice on one batch
    with service.Sequencer(home) as s:
        rollbacks = [e for e in s.store.events() if e["kind"] == "rollback" and bytes.fromhex(e["group"]) in main]
        assert len(rollbacks) >= 4                   # resumed after each kill in the settlement
        gaps = s.store.discontinuities()
        assert {(g, e) for g, e, _m in gaps} == expected      # the unknown outcomes, no other gap
        for g, e, _m in gaps:            # every gap stated once, by this sequencer
            st = receipts.verify_statement(s.receipt(g, e).statement, s.public_key)
            assert (st.group_id, st.epoch) == (g, e)
        assert len(stated) == len({(i.group_id, i.epoch) for i in stated}) == len(gaps)
        for (g, e), raw in pre.released.items():    # adopted byte for byte
            assert s.receipt(g, e) == raw
        for (g, e), raw in checker.released.items():
            assert s.receipt(g, e) == raw
        for gid, start in main.items():
            assert s.store.group(gid).current_epoch - start >= 70
            # the first receipt after the gap chains to the journal's head before it
            nxt = receipts.parse_receipt(s.receipt(gid, top[gid] + 1))
            assert nxt.previous_receipt_hash == receipts.receipt_hash(pre.released[(gid, top[gid] - 1)])


def test_restore_past_compaction_named_crash_points(tmp_path):
    """The state restored from a copy older than the signing journal's compaction floor: each
    group jumps to its floor ("skipped" fires after each group's transaction), then settles from
    the receipt the journal kept (one epoch a transaction here: "settled"), SIGKILLed after each
    group's jump and inside the settlement, then completed. After every kill the
    checker holds; at the end no epoch a member holds a receipt for is stated absent (no
    statement at all: there was no gap), every receipt released before the restore is either
    re-served byte for byte or named lost (`receipts_lost`), never signed again, and the next
    receipt chains to the last one released before the restore (docs/sequencer.md "Resume")."""
    import shutil
    home = str(tmp_path / "s")
    service.init(home)
    assert run(home, seed=5, target=8)[2]
    db = os.path.join(home, "sequencer.db")
    shutil.copy(db, str(tmp_path / "backup.db"))
    pre = Checker(home)
    lines, _killed, done = run(home, seed=6, target=60, compact=4096)
    assert done
    pre.feed(lines)
    pre.check_durable()
    assert pre.compacted
    for suffix in ("-wal", "-shm"):
        if os.path.exists(db + suffix):
            os.unlink(db + suffix)
    shutil.copy(str(tmp_path / "backup.db"), db)
    checker = Checker(home)
    checker.before = pre.released
    # each run counts its own hits: the first jump of each run, then the settlement
    sched = ["skipped:1", "skipped:1", "skipped:1", "settled:1", "settled:2", None]
    for n, step in enumerate(sched):
        lines, killed, done = run(home, crash=step, seed=20 + n, target=70, compact=4096, extra=("--settle-chunk", "1"))
        assert killed == (step is not None), f"crash point {step} was never reached"
        assert done == (step is None)
        checker.feed(lines)
        checker.check_durable()
        conn = sqlite3.connect(db)
        try:
            lost = conn.execute("SELECT count(*) FROM events WHERE kind = 'receipts_lost'").fetchone()[0]
        finally:
            conn.close()
        if step is not None and step.startswith("skipped"):
            assert lost == n + 1, (step, lost)      # one group's jump a run: the kill between two groups
    records = parse_journal(os.path.join(home, "sign-journal"))
    assert not [r for r in records if r[0] == 2 and r[1][:1] == b"D"]      # nothing stated absent
    with service.Sequencer(home) as s:
        assert len([e for e in s.store.events() if e["kind"] == "receipts_lost"]) == len(START)
        assert s.store.discontinuities() == []
        heads = {}
        for (g, e), raw in sorted(pre.released.items()):
            got = s.receipt(g, e)
            assert got == raw or got == service.Absent(discontinuity=False), (g.hex(), e)
            heads[g] = raw
        for g, raw in heads.items():
            top = receipts.parse_receipt(raw).epoch
            assert s.receipt(g, top) == raw                                   # the head: adopted
            nxt = receipts.parse_receipt(s.receipt(g, top + 1))
            assert nxt.previous_receipt_hash == receipts.receipt_hash(raw)
        for (g, e), raw in checker.released.items():
            assert s.receipt(g, e) == raw
