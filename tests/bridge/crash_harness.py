"""The independent checker and the process driver for the crash tests.

The checker sees only (1) what the producer wrote to its stdout pipe and (2) the journal file,
parsed by bridge_helpers.parse_journal (written from docs/keystore.md, not from the package).
After every restart it asserts:
  - every released output is present durably with identical bytes;
  - no HLC was issued twice;
  - no identity has two different signed outputs (and none was released after being refused);
  - every output verifies, and its payload names the identity it was released under.
"""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import cbor2

from bridge_helpers import cose_parts, parse_journal, sig_structure
from firmware_bridge import verify_ed25519, verify_p256
from firmware_bridge.identity import EventIdentity, decode_identity
from keystores_for_tests import RandomNonceSoftwareKeystore

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
PRODUCER = os.path.join(HERE, "crash_producer.py")


class CheckFailed(AssertionError):
    pass


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise CheckFailed(msg)


@dataclass
class Checker:
    journal: str
    ed_pub: bytes
    p256_pub: bytes
    seen: dict = field(default_factory=dict)       # ident -> bytes ever released
    issued: set = field(default_factory=set)       # HLCs ever issued
    unknown: set = field(default_factory=set)      # idents the bridge refused as OutcomeUnknown
    journal_unknown: set = field(default_factory=set)  # intent without output, read from the journal
    retransmits: int = 0
    recorded_path: str | None = None               # compaction mode: the producer's durable record
    floors: dict = field(default_factory=dict)     # site_id -> highest FLOOR seen in the journal
    compacted: int = 0                             # released outputs found only in the record

    def feed(self, lines: list[str]) -> None:
        for line in lines:
            kind, _, rest = line.partition(" ")
            if kind == "ISSUE":
                hlc = tuple(int(x) for x in rest.split())
                _require(hlc not in self.issued, f"HLC {hlc} issued twice")
                self.issued.add(hlc)
            elif kind == "REL":
                ih, oh = rest.split()
                ident, out = bytes.fromhex(ih), bytes.fromhex(oh)
                _require(ident not in self.unknown, f"{decode_identity(ident)} released after being refused")
                _require(ident not in self.journal_unknown,
                         f"{decode_identity(ident)} signed and released after an unknown-outcome crash")
                if ident not in self.seen and ident[:1] == b"E":
                    idy = decode_identity(ident)
                    fl = self.floors.get(idy.site_id)
                    _require(fl is None or idy.hlc > fl, f"{idy} signed at or below its compaction floor {fl}")
                if ident in self.seen:
                    _require(self.seen[ident] == out, f"{decode_identity(ident)} has two different signed outputs")
                    self.retransmits += 1
                self._check_output(ident, out)
                self.seen[ident] = out
            elif kind == "UNK":
                ident = bytes.fromhex(rest)
                _require(ident not in self.seen, f"{decode_identity(ident)} refused although it was released")
                self.unknown.add(ident)

    def _check_output(self, ident: bytes, out: bytes) -> None:
        identity = decode_identity(ident)
        prot, pay, sig = cose_parts(out)
        payload = cbor2.loads(pay)
        if isinstance(identity, EventIdentity):
            _require(verify_ed25519(self.ed_pub, sig_structure(prot, pay), sig), "bad event signature")
            _require((payload["hlc_physical_ms"], payload["hlc_logical"]) == identity.hlc, "payload HLC != identity")
        else:
            _require(verify_p256(self.p256_pub, sig_structure(prot, pay), sig), "bad receipt signature")
            _require((payload["group_id"], payload["epoch"]) == (identity.group_id, identity.epoch),
                     "payload (group_id, epoch) != identity")

    def check_durable(self, journal_path: str | None = None) -> None:
        recs = parse_journal(journal_path or self.journal)
        intents = {ident for t, ident, _ in recs if t == 1}
        for t, ident, _ in recs:
            if t == 3:
                fl = decode_identity(ident)
                _require(fl.hlc >= self.floors.get(fl.site_id, (0, 0)), "a compaction floor moved down")
                self.floors[fl.site_id] = fl.hlc
        record = read_record(self.recorded_path) if self.recorded_path else {}
        released: dict = {}
        for t, ident, data in recs:
            if t == 2:
                _require(ident not in released, f"{decode_identity(ident)}: two persisted outputs")
                _require(ident in intents, f"{decode_identity(ident)}: persisted without a prior intent")
                released[ident] = data
        for ident, out in self.seen.items():
            if ident not in released and ident in record:
                # compacted away: the producer acknowledged it as recorded; it must be spent
                _require(record[ident] == out, f"{decode_identity(ident)}: recorded bytes differ from released")
                idy = decode_identity(ident)
                _require(idy.hlc <= self.floors.get(idy.site_id, (-1, -1)),
                         f"{idy}: dropped from the journal without a floor covering it")
                self.compacted += 1
                continue
            _require(released.get(ident) == out,
                     f"{decode_identity(ident)}: released output not durable with identical bytes")
        for ident in self.unknown:
            _require(ident not in released, f"{decode_identity(ident)}: refused but persisted")
        self.journal_unknown |= intents - set(released)
        hlcs = [decode_identity(i).hlc for i in released if i[:1] == b"E"]
        _require(len(hlcs) == len(set(hlcs)), "one HLC persisted under two identities")


def read_record(path: str) -> dict:
    """The producer's durable record (compaction mode): lines "<ident hex> <cose hex>", fsynced;
    a torn last line was never acknowledged."""
    out: dict = {}
    if not os.path.exists(path):
        return out
    with open(path) as f:
        for line in f.read().split("\n")[:-1]:
            ih, oh = line.split()
            out[bytes.fromhex(ih)] = bytes.fromhex(oh)
    return out


def new_state(path: str, compact: int = 0) -> Checker:
    ks = RandomNonceSoftwareKeystore(os.path.join(path, "keys"))
    ed = ks.generate_key("site", "ed25519")
    p = ks.generate_key("seq", "p256")
    return Checker(os.path.join(path, "journal"), ed, p,
                   recorded_path=os.path.join(path, "recorded") if compact else None)


@dataclass
class RunResult:
    lines: list
    killed: bool
    done: bool


def run_producer(state: str, *, remaining: int, mode: str = "event", batch: int = 1, crash: str | None = None,
                 kill_after: float | None = None, unsafe: str = "", start_value: int = 0,
                 timeout: float = 60.0, compact: int = 0, keystore: str = "random-nonce") -> RunResult:
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONDONTWRITEBYTECODE="1")
    env.pop("BRIDGE_CRASH", None)
    if crash:
        env["BRIDGE_CRASH"] = crash
    cmd = [sys.executable, PRODUCER, "--state", state, "--mode", mode, "--remaining", str(remaining),
           "--batch", str(batch), "--start-value", str(start_value), "--compact", str(compact)] + \
        (["--unsafe", unsafe] if unsafe else []) + ["--keystore", keystore]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    lines: list = []
    ready = threading.Event()

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line == "READY":
                ready.set()
            else:
                lines.append(line)
        ready.set()

    th = threading.Thread(target=reader, daemon=True)
    th.start()
    if kill_after is not None:
        ready.wait(timeout)
        time.sleep(kill_after)
        try:
            proc.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    th.join(timeout)
    err = proc.stderr.read() if proc.stderr else ""
    killed = proc.returncode == -signal.SIGKILL
    done = bool(lines) and lines[-1] == "DONE"
    if not killed and proc.returncode != 0:
        raise AssertionError(f"producer failed rc={proc.returncode}: {err[-2000:]}")
    return RunResult([l for l in lines if l != "DONE"], killed, done)


def drive_chain(state: str, schedule: list, *, mode: str = "event", batch: int = 1, total: int = 1000,
                unsafe: str = "", compact: int = 0, keystore: str = "random-nonce") -> tuple[Checker, int]:
    """Run the producer through ``schedule`` (each entry "point:hit" or a float delay), checking after
    every restart, then to completion.  Returns (checker, number of SIGKILLs delivered)."""
    checker = new_state(state, compact)
    kills = 0
    for step in schedule + [None]:
        remaining = total - len(checker.seen)
        if remaining <= 0 and step is not None:
            continue
        res = run_producer(state, remaining=max(remaining, 0), mode=mode, batch=batch, unsafe=unsafe,
                           start_value=len(checker.seen) * 7,
                           crash=step if isinstance(step, str) else None, compact=compact,
                           kill_after=step if isinstance(step, float) else None, keystore=keystore)
        kills += res.killed
        if isinstance(step, str):
            _require(res.killed, f"crash point {step} was never reached")
        checker.feed(res.lines)
        checker.check_durable()
        if step is None:
            _require(res.done, "final run did not complete")
    _require(len(checker.seen) >= total, f"only {len(checker.seen)} of {total} outputs released")
    return checker, kills


def random_schedule(seed: int, n: int, max_delay: float) -> list:
    rng = random.Random(seed)
    return [round(rng.uniform(0.0, max_delay), 4) for _ in range(n)]
