"""Agent-level crash test with real processes (item 4 of the remaining work): a producer
subprocess does 1 000 signed writes through Node.write / Node.write_many and is SIGKILLed at
seeded random times (>= 30 kills), restarted each time. The checker here is independent of the
agent: it reads the producer's stdout (lines printed only after a write returned), the store's
event log with sqlite3, and the signing journal with tests/bridge's own parser, and asserts:

  - no HLC was ever issued twice (acknowledged, logged or journalled: one event per HLC);
  - every acknowledged write is in the log with identical bytes, for good;
  - every output the journal held at a crash is in the log, byte for byte, after the next open
    (recovery), and every intent without output stays spent (never in the log);
  - every logged event of ours verifies under the node's key and names the HLC it was logged at.
"""
from __future__ import annotations

import os
import random
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import blake3
import cbor2
import pytest

from bridge_helpers import parse_journal
from firmware_bridge import verify_ed25519
from firmware_bridge.identity import decode_identity

from .test_node_keystores import MANIFEST

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
PRODUCER = os.path.join(HERE, "node_producer.py")
TOTAL = 1000


class Checker:
    def __init__(self, home: str, site_id: bytes, pub: bytes, mesh: bytes) -> None:
        self.home, self.site, self.pub, self.mesh = home, site_id, pub, mesh
        self.acked: dict[bytes, bytes] = {}        # event_id -> bytes acknowledged
        self.by_hlc: dict[tuple, bytes] = {}        # HLC -> the one event_id ever seen under it
        self.owed: dict[bytes, bytes] = {}          # journal outputs the next open must apply
        self.spent: set = set()                     # HLCs of intents without output
        self.recovered = 0                          # journal outputs applied by a later open

    def _hlc_once(self, hlc: tuple, eid: bytes, where: str) -> None:
        prev = self.by_hlc.setdefault(hlc, eid)
        assert prev == eid, f"HLC {hlc} issued twice ({where}): {prev.hex()} and {eid.hex()}"

    def feed(self, lines: list[str]) -> None:
        for line in lines:
            _, eid_h, p, l, raw_h = line.split()
            eid, raw, hlc = bytes.fromhex(eid_h), bytes.fromhex(raw_h), (int(p), int(l))
            assert blake3.blake3(raw).digest() == eid
            assert eid not in self.acked, f"event {eid_h} acknowledged twice"
            assert hlc not in self.spent, f"HLC {hlc} was spent (unknown outcome) and then acknowledged"
            self._hlc_once(hlc, eid, "acknowledged")
            self.acked[eid] = raw

    def _log(self) -> dict[bytes, tuple]:
        from agent.node import Node
        conn, self.seal = Node.log_view(self.home)   # the log is sealed at rest: the keystore opens it
        try:
            rows = conn.execute("SELECT event_id, hlc_p, hlc_l, unseal(event_id, raw), origin FROM events WHERE site_id=?",
                                (self.site,)).fetchall()
        finally:
            conn.close()
        return {bytes(e): ((p, l), bytes(r), o) for e, p, l, r, o in rows}

    def after_crash(self) -> None:
        """The producer is dead: read what it left, before anything reopens the node."""
        log = self._log()
        self._check_log(log)
        recs = parse_journal(os.path.join(self.home, "sign-journal"))
        from firmware_bridge.journal import sealed_ad
        released = {ident: out if t == 2 else self.seal.sealer.open(sealed_ad(ident), out)
                    for t, ident, out in recs if t in (2, 4)}
        assert all(t != 2 for t, _i, _o in recs), "a node journal holds an output in clear"
        for ident, out in released.items():
            eid = blake3.blake3(out).digest()
            self._hlc_once(decode_identity(ident).hlc, eid, "journal")
            if eid not in log:
                self.owed[eid] = out
        for t, ident, _ in recs:
            if t == 1 and ident not in released:
                self.spent.add(decode_identity(ident).hlc)

    def after_open(self) -> None:
        """The next producer run opened the node (recovery ran): owed outputs are in the log."""
        log = self._log()
        for eid, out in self.owed.items():
            assert eid in log and log[eid][1] == out, f"journal output {eid.hex()} not applied on open"
            assert log[eid][2] == "local"
        self.recovered += len(self.owed)
        self.owed.clear()
        self._check_log(log)

    def _check_log(self, log: dict) -> None:
        hlcs = [v[0] for v in log.values()]
        assert len(hlcs) == len(set(hlcs)), "two logged events of ours share an HLC"
        for eid, raw in self.acked.items():
            assert eid in log and log[eid][1] == raw, f"acknowledged write {eid.hex()} missing or changed"
        for eid, (hlc, raw, origin) in log.items():
            assert origin == "local" and hlc not in self.spent, f"{hlc}: spent HLC in the log"
            self._hlc_once(hlc, eid, "log")
            tag = cbor2.loads(raw)
            prot, _, pay, sig = tag.value
            assert verify_ed25519(self.pub, cbor2.dumps(["Signature1", prot, self.mesh, pay]), sig)
            body = cbor2.loads(pay)
            assert (body["hlc_physical_ms"], body["hlc_logical"]) == hlc


def _run(home, start, seed, kill_after, env, extra=()):
    proc = subprocess.Popen([sys.executable, PRODUCER, "--home", home, "--start", str(start), "--total", str(TOTAL),
                             "--seed", str(seed), "--compact-bytes", "60000", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    ready = threading.Event()
    seen_ready = []

    def reader():
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line == "READY":
                seen_ready.append(True)
                ready.set()
            elif line:
                lines.append(line)
        ready.set()
    th = threading.Thread(target=reader, daemon=True)
    th.start()
    if kill_after is not None and kill_after[0] == "startup":
        time.sleep(kill_after[1])     # during start-up: imports, Node.open, recovery, compaction
    elif kill_after is not None:
        assert ready.wait(30), "producer never became ready"
        time.sleep(kill_after[1])
    if kill_after is not None:
        try:
            proc.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(60)
    th.join(10)
    err = proc.stderr.read()
    if proc.returncode not in (0, -signal.SIGKILL):
        raise AssertionError(f"producer failed rc={proc.returncode}: {err[-3000:]}")
    done = bool(lines) and lines[-1] == "DONE"
    return [l for l in lines if l.startswith("ACK")], proc.returncode == -signal.SIGKILL, done, bool(seen_ready)


def _chain(tmp_path, rng, name, kill_budget, extra=()):
    """One home, 1 000 writes, killed until the budget is spent or the writes are done."""
    from agent.node import Node
    node, pub = Node.init(tmp_path / name, MANIFEST, {"kind": "software"})
    site, mesh = node.site_id, node.mesh_id
    node.close()
    home = str(tmp_path / name)
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONDONTWRITEBYTECODE="1")  # same SSP_AGENT_WITNESS_DIR
    checker = Checker(home, site, pub, mesh)
    kills = 0
    while True:
        final = kills >= kill_budget
        when = None if final else ("startup", rng.uniform(0.1, 0.6)) if rng.random() < 0.2 else \
            ("writing", rng.uniform(0.0, 0.03))
        acks, killed, done, opened = _run(home, len(checker.acked), rng.randrange(1 << 30), when, env, extra)
        if opened:
            checker.after_open()     # READY is printed after Node.open: recovery has run
        checker.feed(acks)
        kills += killed
        checker.after_crash()
        if done:
            break
    checker.after_open()
    assert len(checker.acked) == TOTAL, len(checker.acked)
    return kills, len(checker.spent), checker.recovered


@pytest.mark.parametrize("seed", [5150])
def test_sigkill_during_node_writes(tmp_path, seed):
    rng = random.Random(seed)
    t0 = time.monotonic()
    kills = chains = spent = recovered = 0
    while kills < 30:
        k, sp, rec = _chain(tmp_path, rng, f"home{chains}", 30 - kills)
        kills, spent, recovered, chains = kills + k, spent + sp, recovered + rec, chains + 1
    print(f"node crash test: {kills} SIGKILLs over {chains} chain(s) of {TOTAL} writes, {spent} spent HLCs, "
          f"{recovered} released-but-unapplied events applied on open, {time.monotonic() - t0:.1f}s")
    assert kills >= 30, (kills, chains, time.monotonic() - t0)
    assert spent + recovered > 0   # the kills really fell between intent, release and apply


def test_negative_control_no_recovery_is_caught(tmp_path):
    """A node that does not apply released-but-unapplied events on open fails the same checker.
    Each run also dies at its third durable output, before applying it: the window is hit every
    time (left to the random kill times alone, a loaded CI machine once missed it in all 30)."""
    with pytest.raises(AssertionError, match="not applied on open"):
        _chain(tmp_path, random.Random(7), "home", 30, extra=("--no-recovery", "--die-after-persist", "3"))
