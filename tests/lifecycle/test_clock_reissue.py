"""Re-issuing own writes a clock ten years ahead stamped (docs/apply.md "Recovering from a clock that
ran ahead"): a SIGKILL at every step of the withdrawal and re-issue loses nothing, re-issues
nothing twice and reuses no HLC; an event a peer acknowledged is never withdrawn."""
from __future__ import annotations

import os
import sqlite3
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import pytest

from agent.node import Node
from agent.simpeer import readings_table
from agent.store import eventlog, sync_state

MESH = "00112233445566778899aabbccddeeff"
T = "app.readings"
TEN_YEARS_MS = 3650 * 86_400_000
SKEW_MS = 300_000
PEER = bytes.fromhex("aa" * 16)
PEER_KEY = "11" * 32

# Each kill point: SIGKILL the process that opens the node (and so recovers) when it reaches it.
KILL = r"""
import os, signal, sys
from pathlib import Path
home, point = Path(sys.argv[1]), sys.argv[2]
from agent import clockgap, node as nodemod, produce
from agent.store import clockgaps
from firmware_bridge import SigningBridge
from firmware_bridge.journal import Journal, INTENT
def die():
    os.kill(os.getpid(), signal.SIGKILL)
def after(obj, name):
    orig = getattr(obj, name)
    def f(*a, **k):
        r = orig(*a, **k)
        die()
        return r
    setattr(obj, name, f)
def before(obj, name, when=lambda *a: True):
    orig = getattr(obj, name)
    def f(*a, **k):
        if when(*a):
            die()
        return orig(*a, **k)
    setattr(obj, name, f)
if point == "gap_recorded":          # the journal's GAP durable, the store's gap not yet
    after(SigningBridge, "open_event_gap")
elif point == "before_sign":         # the withdrawal recorded, nothing re-issued yet
    before(produce, "issue_events")
elif point == "after_intent":        # the re-issues' intents durable, not signed
    orig = Journal.commit
    def commit(self, records):
        records = list(records)
        orig(self, records)
        if any(r[0] == INTENT for r in records):
            die()
    Journal.commit = commit
elif point == "released":            # signed and persisted, not applied
    after(produce, "issue_events")
elif point == "applied":             # applied beside the originals, the journal not compacted
    before(nodemod.Node, "compact_journal", lambda n: clockgaps.pending(n.conn) is not None)
elif point == "compacted":           # the journal forgot the originals, the log still holds them
    before(clockgaps, "withdraw")
nodemod.Node.open(home).close()
sys.exit(3)                          # the point was never reached
"""
POINTS = ["gap_recorded", "before_sign", "after_intent", "released", "applied", "compacted"]


def _manifest(peers: bool) -> str:
    text = f'mesh_id = "{MESH}"\n'
    if peers:
        text += f'[[peers]]\nsite_id = "{PEER.hex()}"\npublic_key = "{PEER_KEY}"\n'
    return text + readings_table("telemetry")


def _ahead(home: Path, peers: bool = False) -> tuple[bytes, list[tuple[dict, dict]]]:
    """A node whose writes were stamped ten years ahead (the override trusts any clock: the
    node believed it), closed. Returns its site and the writes in order."""
    node, _ = Node.init(home, _manifest(peers))
    fut = int(time.time() * 1000) + TEN_YEARS_MS
    writes = [({"device": "a", "seq": 0}, {"temp": 2.5}), ({"device": "a", "seq": 1}, {"temp": 3.5}),
              ({"device": "a", "seq": 0}, {"temp": 7.5})]
    try:
        for i, (k, v) in enumerate(writes):
            node.write(T, k, v, now=fut + i)
        return node.site_id, writes
    finally:
        node.close()


def _own(home: Path, site: bytes) -> dict[tuple[int, int], bytes]:
    """HLC -> event_id of the node's own events in its log (read view: no recovery runs)."""
    node = Node.open(home, read_only=True)
    try:
        return {(p, l): bytes(e) for e, s, p, l, *_ in eventlog.entries(node.conn) if bytes(s) == site}
    finally:
        node.close()


def _journal(home: Path, site: bytes) -> tuple[set, set]:
    """(HLCs intended, HLCs released) of the site's events in the signing journal, read by hand."""
    data = (home / "sign-journal").read_bytes()
    pos, intended, released = 8, set(), set()
    while pos + 8 <= len(data):
        blen, crc = struct.unpack_from(">II", data, pos)
        body = data[pos + 8:pos + 8 + blen]
        if len(body) != blen or zlib.crc32(body) != crc or not blen:
            break
        ilen = struct.unpack_from(">H", body, 1)[0]
        ident = body[3:3 + ilen]
        if ident[:1] == b"E" and ident[1:17] == site and body[0] in (1, 2, 4):
            hlc = struct.unpack(">QI", ident[17:29])
            (intended if body[0] == 1 else released).add(hlc)
        pos += 8 + blen
    return intended, released


def _rows(node: Node) -> dict:
    return {r["key"]["seq"]: r["values"]["temp"] for r in node.dump()[T]}


def _check(home: Path, site: bytes, writes, seen: dict[tuple[int, int], bytes], spent: set) -> None:
    node = Node.open(home)
    try:
        now = int(time.time() * 1000)
        own = {(p, l): bytes(e) for e, s, p, l, *_ in eventlog.entries(node.conn) if bytes(s) == site}
        assert len(own) == len(writes) and all(p <= now + SKEW_MS for p, _ in own), own   # nothing ahead, none twice
        for hlc, eid in own.items():
            assert seen.get(hlc, eid) == eid, hlc     # no HLC of an earlier event reused
            assert hlc not in spent, hlc              # nor one whose signing outcome was unknown
        assert _rows(node) == {0: 7.5, 1: 3.5}
        done = [e for e in node.surfaced(100) if e["kind"] == "clock" and e["reason"] == "clock_reissued"]
        assert len(done) == 1 and done[0]["detail"]["withdrawn"] == len(writes), done
        # Later writes land in the gap too, and win as they would at any peer.
        node.write(T, {"device": "a", "seq": 1}, {"temp": 9.5})
        assert _rows(node) == {0: 7.5, 1: 9.5}
        assert node.clock.current()[0] <= int(time.time() * 1000) + SKEW_MS
    finally:
        node.close()


@pytest.mark.parametrize("point", POINTS)
def test_a_kill_at_any_step_of_the_reissue_loses_nothing_and_reuses_no_hlc(tmp_path, point):
    home = tmp_path / "a"
    site, writes = _ahead(home)
    seen = dict(_own(home, site))                       # the originals: their HLCs stay theirs
    p = subprocess.run([sys.executable, "-c", KILL, str(home), point], capture_output=True, text=True,
                       env=os.environ.copy(), timeout=120)
    assert p.returncode == -9, (p.returncode, p.stderr)   # killed at the point
    after = _own(home, site)
    for hlc, eid in after.items():
        assert seen.setdefault(hlc, eid) == eid, hlc
    intended, released = _journal(home, site)
    _check(home, site, writes, seen, intended - released - set(after))


def test_a_kill_twice_then_a_clean_open(tmp_path):
    """Two kills in a row at different steps (each reopen resumes the one before), then a clean one."""
    home = tmp_path / "a"
    site, writes = _ahead(home)
    seen = dict(_own(home, site))
    spent: set = set()
    for point in ("after_intent", "applied"):
        p = subprocess.run([sys.executable, "-c", KILL, str(home), point], capture_output=True, text=True,
                           env=os.environ.copy(), timeout=120)
        assert p.returncode == -9, (point, p.returncode, p.stderr)
        after = _own(home, site)
        for hlc, eid in after.items():
            assert seen.setdefault(hlc, eid) == eid, hlc
        intended, released = _journal(home, site)
        spent |= intended - released - set(after)
    _check(home, site, writes, seen, spent)


def test_an_event_a_peer_acknowledged_is_not_withdrawn(tmp_path):
    """A peer reported a watermark at or above the writes stamped ahead (it holds them: its clock
    was ahead too): withdrawing would diverge from it, and its watermark covers the gap, so nothing
    is withdrawn or re-issued; the events stay deliverable and the cause is surfaced."""
    home = tmp_path / "a"
    site, writes = _ahead(home, peers=True)
    before = _own(home, site)
    conn = sqlite3.connect(home / "store.sqlite")
    try:
        with conn:
            sync_state.ensure_schema(conn)
            sync_state.set_peer_watermarks(conn, PEER, [(site, T, max(before))])
    finally:
        conn.close()
    node = Node.open(home)
    try:
        assert _own(home, site) == before                  # every event kept as it was
        assert _rows(node) == {0: 7.5, 1: 3.5}
        stranded = [e for e in node.surfaced(100) if e["kind"] == "clock"]
        assert [e["reason"] for e in stranded] == ["clock_stranded"], stranded
        assert stranded[0]["detail"]["cause"] == "acknowledged"
        assert node.clock.current() >= max(before)        # still above them: never reissued
    finally:
        node.close()


def test_a_running_node_recovers_once_its_clock_is_synchronised(tmp_path, monkeypatch):
    """`run` checks the clock every minute (Node.note_clock): a node whose clock ran ahead while
    no source said it was synchronised re-issues its writes there once one does, without a restart."""
    flag = tmp_path / "synchronized"
    monkeypatch.delenv("SSP_AGENT_CLOCK_TRUSTED", raising=False)
    monkeypatch.setenv("SSP_AGENT_CLOCK_SYNC", f"timesyncd:{flag}")
    node, _ = Node.init(tmp_path / "a", _manifest(False))
    try:
        fut = int(time.time() * 1000) + TEN_YEARS_MS
        node.write(T, {"device": "a", "seq": 0}, {"temp": 2.5}, now=fut)     # never synchronised: not capped
        node.write(T, {"device": "a", "seq": 0}, {"temp": 7.5}, now=fut + 1)
        assert not node.note_clock()["trusted"] and node.clock.current()[0] >= fut   # nothing done yet
        flag.write_text("")
        assert node.note_clock()["trusted"]
        now = int(time.time() * 1000)
        own = {(p, l) for e, s, p, l, *_ in eventlog.entries(node.conn) if bytes(s) == node.site_id}
        assert len(own) == 2 and max(own)[0] <= now + SKEW_MS, own
        assert _rows(node) == {0: 7.5}
        node.write(T, {"device": "a", "seq": 1}, {"temp": 1.5})
        assert node.clock.current()[0] <= int(time.time() * 1000) + SKEW_MS
    finally:
        node.close()


def test_a_home_restored_from_before_the_reissue_reuses_no_hlc_of_the_run_it_lost(tmp_path):
    """The clock witness outside the home holds the highest HLC ever released, which lies above
    the gap; the gap's own witness (agent/gapwitness.py) holds what the gap issued, so a home
    restored from a copy taken before the re-issue starts its own re-issue above what the lost run
    issued, even at the same wall-clock time."""
    import shutil
    home, copy = tmp_path / "a", tmp_path / "copy"
    site, writes = _ahead(home)
    shutil.copytree(home, copy)
    t = int(time.time() * 1000) + 100_000                   # within the skew bound, ahead of the reopen
    node = Node.open(home)                                  # re-issues, then two writes at t
    try:
        node.write(T, {"device": "a", "seq": 5}, {"temp": 5.5}, now=t)
        node.write(T, {"device": "a", "seq": 6}, {"temp": 6.5}, now=t)
    finally:
        node.close()
    lost = _own(home, site)
    assert {(t, 0), (t, 1)} <= set(lost)
    shutil.rmtree(home)
    shutil.copytree(copy, home)                             # the restore: the lost run is gone
    node = Node.open(home)
    try:
        node.write(T, {"device": "a", "seq": 7}, {"temp": 7.5}, now=t)
        assert _rows(node) == {0: 7.5, 1: 3.5, 7: 7.5}
    finally:
        node.close()
    for hlc, eid in _own(home, site).items():
        assert lost.get(hlc, eid) == eid, hlc                 # no HLC of the lost run reused


def test_a_reissue_cut_short_and_finished_under_a_wrong_clock_again_stays_in_the_gap(tmp_path, monkeypatch):
    """Killed after the withdrawal was recorded; the next open has the clock ten years ahead again
    (a bad boot, no sync): the re-issue is finished with its ticks capped by the evidence the
    trustworthy reading left, so nothing lands ahead."""
    home = tmp_path / "a"
    site, writes = _ahead(home)
    p = subprocess.run([sys.executable, "-c", KILL, str(home), "before_sign"], capture_output=True, text=True,
                       env=os.environ.copy(), timeout=120)
    assert p.returncode == -9, p.stderr
    flag = tmp_path / "synchronized"                       # absent: not synchronised
    monkeypatch.delenv("SSP_AGENT_CLOCK_TRUSTED", raising=False)
    monkeypatch.setenv("SSP_AGENT_CLOCK_SYNC", f"timesyncd:{flag}")
    import agent.clockstate as cs
    real = cs.now_ms
    monkeypatch.setattr("agent.clockgap.now_ms", lambda: real() + TEN_YEARS_MS)
    node = Node.open(home)
    try:
        own = _own(home, site)
        assert len(own) == len(writes) and max(own)[0] <= real() + 2 * SKEW_MS, own
        assert _rows(node) == {0: 7.5, 1: 3.5}
    finally:
        node.close()


def test_status_shows_the_gap_the_clock_issues_in(tmp_path):
    """`status` says where the clock issues after a recovery (the gap: low, top, and the highest
    value the wrong clock spent above it) and how many own events wait to be re-issued; a home
    that never ran ahead shows none."""
    home = tmp_path / "a"
    site, writes = _ahead(home)
    with Node.open(home, read_only=True) as n:
        before = n.status()["clock"]
    assert before["gap"] is None and before["reissue_pending"] == 0, before
    with Node.open(home) as n:          # the writing open recovers
        clock = n.status()["clock"]
    low, top, spent = (tuple(map(int, clock["gap"][k].split("."))) for k in ("low", "top", "spent_to"))
    assert low < top <= spent and clock["reissue_pending"] == 0, clock
    own = _own(home, site)
    assert all(low < h < top for h in own), (clock, own)    # every re-issue inside the gap
    fresh = tmp_path / "b"
    Node.init(fresh, _manifest(False))[0].close()
    with Node.open(fresh, read_only=True) as n:
        assert n.status()["clock"]["gap"] is None
