"""A full disk (issue 16 item 2), on a real small tmpfs, through the real CLI. Extends
tests/lifecycle/test_damage.py (issue 11 item 6: read verbs work, a write fails with one line and
works again once space is freed) with imports, what was acknowledged before, and eviction and WAL
truncation, which must still run on a full disk: they are how a device frees its own space."""
from __future__ import annotations

import json
import os
import subprocess
import time

import nacl.signing
import pytest

from agent.simpeer import SimPeer, manifest_text, readings_table
from tests.lifecycle.test_damage import MESH, T, cli, fill, one_line_fault

DAY_MS = 86_400_000


@pytest.fixture
def mid_fs(tmp_path):
    """A real tmpfs of 16 MiB (room for the home's eviction reserve); skipped where mount is refused."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({p.stderr.strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def _peer() -> SimPeer:
    return SimPeer(MESH, bytes(range(16, 32)), nacl.signing.SigningKey(bytes(32)))


def _body(peer: SimPeer, seqs, age_ms: int) -> bytes:
    now = time.time_ns() // 1_000_000
    return peer.body([peer.event(T, {"device": "peer", "seq": s}, {"temp": s + 0.5, "note": "x" * 200},
                                 (now - age_ms + s, 0)) for s in seqs])


def _write(home, seq):
    return cli(home, "write", T, "--key", json.dumps({"device": "d", "seq": seq}), "--set", '{"temp": 1.5}')


def test_full_disk_imports_fail_cleanly_eviction_runs_and_the_node_resumes(mid_fs, tmp_path):
    peer = _peer()
    home = mid_fs / "h"
    mf = tmp_path / "m.toml"
    mf.write_text(manifest_text(MESH, readings_table(retention="telemetry"), [peer]))
    assert cli(home, "init", "--manifest", str(mf)).returncode == 0
    acked = []
    for i in range(5):
        p = _write(home, i)
        assert p.returncode == 0, p.stderr
        acked.append(p.stdout.strip())
    old = tmp_path / "old.ssp"                   # eight days old: the profile's eviction takes them
    old.write_bytes(_body(peer, range(300), 8 * DAY_MS))
    p = cli(home, "mailbox", "import", str(old))
    assert p.returncode == 0 and json.loads(p.stdout)["applied"] == 300, p.stderr
    fresh = tmp_path / "fresh.ssp"
    fresh.write_bytes(_body(peer, range(1000, 1020), 1000))
    filler = fill(mid_fs)

    # writes and imports: one line, exit 1 (a local fault), nothing applied
    assert "is full" in one_line_fault(_write(home, 99))
    line = one_line_fault(cli(home, "mailbox", "import", str(fresh)))
    assert "is full" in line and "Free space" in line, line

    # eviction and WAL truncation run on the full disk, and free space
    free_before = os.statvfs(mid_fs).f_bavail
    p = cli(home, "evict", "--auto")
    assert p.returncode == 0, p.stderr
    report = json.loads(p.stdout)
    assert report["tables"][T]["events_deleted"] == 300, report
    wal = home / "store.sqlite-wal"
    assert not wal.exists() or wal.stat().st_size == 0
    assert os.statvfs(mid_fs).f_bavail > free_before

    # nothing acknowledged is lost: own writes in the log, the peer's rows still materialized
    log = [json.loads(x) for x in cli(home, "log").stdout.splitlines()]
    assert {e["event_id"] for e in log} >= set(acked)
    rows = json.loads(cli(home, "dump").stdout)[T]
    assert sum(r["key"]["device"] == "peer" for r in rows) == 300

    # space back: writes and imports go on
    filler.unlink()
    assert _write(home, 100).returncode == 0
    p = cli(home, "mailbox", "import", str(fresh))
    assert p.returncode == 0 and json.loads(p.stdout)["applied"] == 20, p.stderr
    rows = json.loads(cli(home, "dump").stdout)[T]
    assert sum(r["key"]["device"] == "peer" for r in rows) == 320


def test_the_running_nodes_eviction_job_runs_on_a_full_disk(mid_fs, tmp_path):
    """`run` holds its node open and runs the profile's eviction job periodically: on a full disk
    the job releases the home's reserve, evicts, truncates the WAL and takes the reserve back once
    there is room. Before: it failed like any write (SQLITE_FULL), for as long as the disk stayed full."""
    from agent.mailbox import read_file
    from agent.node import Node
    from agent.store import db
    from agent.sync import import_mailbox_body
    peer = _peer()
    home = mid_fs / "h"
    node, _ = Node.init(home, manifest_text(MESH, readings_table(retention="telemetry"), [peer]), {"kind": "software"})
    try:
        assert (home / db.RESERVE_FILE).stat().st_size == db.RESERVE_BYTES
        ids = node.write_many([(T, {"device": "d", "seq": i}, {"temp": 0.5}, False) for i in range(10)])
        old = tmp_path / "old.ssp"
        old.write_bytes(_body(peer, range(300), 8 * DAY_MS))
        assert import_mailbox_body(node, read_file(old))["applied"] == 300
        filler = fill(mid_fs)
        with pytest.raises(Exception) as e:
            node.write(T, {"device": "d", "seq": 99}, {"temp": 0.5})
        assert db.disk_full(e.value, home / "store.sqlite")
        report = node.run_eviction()
        assert report["tables"][T]["events_deleted"] == 300
        wal = home / "store.sqlite-wal"
        assert not wal.exists() or wal.stat().st_size == 0
        assert {bytes(r[0]) for r in node.conn.execute("SELECT event_id FROM events")} >= set(ids)
        filler.unlink()
        node.write(T, {"device": "d", "seq": 100}, {"temp": 0.5})
        node.run_eviction()
        assert (home / db.RESERVE_FILE).stat().st_size == db.RESERVE_BYTES   # taken back once there is room
    finally:
        node.close()


def test_a_write_signed_but_not_applied_on_a_full_disk_says_so(mid_fs, tmp_path, capsys):
    """A write whose event the bridge released (the journal's last page had room) but whose store
    commit hit the full disk: the next writing open applies it (persist-before-release), so the
    CLI must not say "nothing was changed" (an operator would write it again). Driven through the
    CLI on a node held open, as `run` serves a forwarded `write` (agent/control.py)."""
    from agent import cli as agent_cli
    from agent.node import Node
    home = mid_fs / "h"
    node, _ = Node.init(home, manifest_text(MESH, readings_table(retention="telemetry"), [_peer()]),
                        {"kind": "software"})
    try:
        node.write(T, {"device": "d", "seq": 0}, {"temp": 0.5})
        journal = home / "sign-journal"
        assert 4096 - journal.stat().st_size % 4096 > 1024   # room for one more intent and output
        filler = fill(mid_fs)
        with agent_cli.serving(node):
            rc = agent_cli.main(["--home", str(home), "write", T, "--key", '{"device": "d", "seq": 1}',
                                 "--set", '{"temp": 1.5}'])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 1 and len(err) == 1, err
        released = node.bridge.journal_stats()["entries"]
    finally:
        node.close()
    line = err[0]
    assert "is full" in line and "nothing was changed" not in line, line
    assert "signed" in line and "do not write" in line, line
    filler.unlink()
    with Node.open(home) as again:             # the next writing open applies it, once
        seqs = [e["row_key"]["seq"] for e in again.log_entries()]
    assert seqs == [0, 1], (seqs, released)
