"""A full disk, on a real small tmpfs, through the real CLI. Extends
tests/lifecycle/test_damage.py (read verbs work, a write fails with one line and
works again once space is freed) with imports, what was acknowledged before, and eviction and WAL
truncation, which must still run on a full disk: they are how a device frees its own space."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

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


def _vouch_for_now(home, peer: SimPeer, tmp_path) -> None:
    """One event of the peer's of now: the evidence of time a horizon needs (docs/apply.md "Eviction")."""
    f = tmp_path / "now.ssp"
    f.write_bytes(_body(peer, [5000], 10_000))
    p = cli(home, "mailbox", "import", str(f))
    assert p.returncode == 0 and json.loads(p.stdout)["applied"] == 1, p.stderr


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
    _vouch_for_now(home, peer, tmp_path)
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
    assert sum(r["key"]["device"] == "peer" for r in rows) == 301

    # space back: writes and imports go on
    filler.unlink()
    assert _write(home, 100).returncode == 0
    p = cli(home, "mailbox", "import", str(fresh))
    assert p.returncode == 0 and json.loads(p.stdout)["applied"] == 20, p.stderr
    rows = json.loads(cli(home, "dump").stdout)[T]
    assert sum(r["key"]["device"] == "peer" for r in rows) == 321


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
        assert import_mailbox_body(node, _body(peer, [5000], 10_000))["applied"] == 1   # the peer's clock now
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


def _peer_events_and_owed(home, peer: SimPeer) -> tuple[int, int]:
    """(the peer's events in the log, answers owed to the peer), read with space back."""
    import sqlite3
    conn = sqlite3.connect(str(home / "store.sqlite"))
    try:
        n = conn.execute("SELECT count(*) FROM events WHERE site_id=?", (peer.site_id,)).fetchone()[0]
        has = conn.execute("SELECT count(*) FROM sqlite_master WHERE name='mailbox_owed'").fetchone()[0]
        owed = conn.execute("SELECT count(*) FROM mailbox_owed WHERE peer=?", (peer.site_id,)).fetchone()[0] if has else 0
        return n, owed
    finally:
        conn.close()


def _import_with_free(fs, home, snapshot, body_file, free: int, capsys) -> tuple[int, str, int, int]:
    """Restore the home from `snapshot`, fill the filesystem but `free` bytes, import `body_file`
    through the CLI (in this process), free the space again: (rc, stderr, peer events, owed)."""
    import shutil
    from agent import cli as agent_cli
    (fs / "filler").unlink(missing_ok=True)
    witness = Path(os.environ["SSP_AGENT_WITNESS_DIR"])   # a copy of both: not a restored home
    for src, dst in ((snapshot / "home", home), (snapshot / "witness", witness)):
        shutil.rmtree(dst)
        shutil.copytree(src, dst)
    filler = fill(fs)
    os.truncate(filler, filler.stat().st_size - free)
    capsys.readouterr()
    rc = agent_cli.main(["--home", str(home), "mailbox", "import", str(body_file)])
    err = capsys.readouterr().err
    filler.unlink()
    return (rc, err, *_peer_events_and_owed(home, _peer()))


def _smallest_free_that_applies(fs, home, snapshot, body_file, capsys, done=lambda res: res[2] > 0):
    """The least free space (in 4 KiB pages) with which the import commits any of the peer's
    events (or what `done` asks): just enough for those commits, so the import's next transaction
    finds the disk full. This separates the import's transactions on a real filesystem without
    any hook (a bisection: what commits with some free space commits with more)."""
    lo, hi = 0, os.statvfs(fs).f_bavail    # lo: nothing applied; hi: assumed enough
    res_hi = _import_with_free(fs, home, snapshot, body_file, hi * 4096, capsys)
    assert done(res_hi), res_hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        res = _import_with_free(fs, home, snapshot, body_file, mid * 4096, capsys)
        if done(res):
            hi, res_hi = mid, res
        else:
            lo = mid
    # Leave the home as that import left it (the last trial may have been one that did not commit).
    again = _import_with_free(fs, home, snapshot, body_file, hi * 4096, capsys)
    assert again[0] == res_hi[0] and again[2:] == res_hi[2:], (res_hi, again)
    return hi * 4096, again


def _partial_import_setup(mid_fs, tmp_path, n_events: int, rehydrating: bool = False):
    import shutil
    peer = _peer()
    home = mid_fs / "h"
    mf = tmp_path / "m.toml"
    mf.write_text(manifest_text(MESH, readings_table(retention="telemetry"), [peer]))
    assert cli(home, "init", "--manifest", str(mf)).returncode == 0
    acked = [_write(home, i).stdout.strip() for i in range(3)]
    if rehydrating:
        assert cli(home, "rehydrate", "--from", peer.site_id.hex()).returncode == 0
    body = tmp_path / "fresh.ssp"
    body.write_bytes(_body(peer, range(n_events), 1000))
    snapshot = tmp_path / "snapshot"
    shutil.copytree(home, snapshot / "home")
    shutil.copytree(os.environ["SSP_AGENT_WITNESS_DIR"], snapshot / "witness")
    return home, body, snapshot, acked


def _line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def test_an_import_whose_answer_hits_the_full_disk_says_what_was_applied(mid_fs, tmp_path, capsys):
    """The events of a file commit, then the answer owed to its sender (a second transaction)
    finds the disk full: the line must not say "nothing was changed" (the events are there), must
    say what failed and that importing the file again is safe; exit 1. With space back, the
    re-import applies nothing twice and records the answer."""
    home, body, snapshot, acked = _partial_import_setup(mid_fs, tmp_path, 5)
    free, (rc, err, applied, owed) = _smallest_free_that_applies(mid_fs, home, snapshot, body, capsys)
    assert (applied, owed) == (5, 0), (free, rc, err)   # the events committed, the answer did not
    line = _line(err)
    assert rc == 1, (rc, line)
    assert "is full" in line and "nothing was changed" not in line, line
    assert "5 of 5" in line and "answer" in line and "again" in line and "safe" in line, line
    # nothing acknowledged is lost, and the re-import is safe: duplicates, the answer now owed
    p = cli(home, "mailbox", "import", str(body))
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["applied"] == 0 and r["duplicate"] == 5, r
    assert _peer_events_and_owed(home, _peer()) == (5, 1)
    log = [json.loads(x) for x in cli(home, "log").stdout.splitlines()]
    assert {e["event_id"] for e in log} >= set(acked)


def test_an_import_stopped_by_the_full_disk_between_windows_says_what_was_applied(mid_fs, tmp_path, capsys,
                                                                                  monkeypatch):
    """A file applied a window at a time (one transaction each) whose second
    window finds the disk full: the first window's events are kept, and the line says so (before:
    "nothing was changed"); importing the file again applies the rest."""
    from agent import mailbox_sync
    monkeypatch.setattr(mailbox_sync, "MAILBOX_WINDOW_BYTES", 1)    # one event per window
    home, body, snapshot, acked = _partial_import_setup(mid_fs, tmp_path, 5)
    free, (rc, err, applied, owed) = _smallest_free_that_applies(mid_fs, home, snapshot, body, capsys)
    assert 0 < applied < 5 and owed == 0, (free, rc, err, applied)
    line = _line(err)
    assert rc == 1, (rc, line)
    assert "is full" in line and "nothing was changed" not in line, line
    assert f"{applied} of 5" in line and "again" in line and "safe" in line, line
    p = cli(home, "mailbox", "import", str(body))
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["applied"] == 5 - applied and r["duplicate"] == applied, r
    assert _peer_events_and_owed(home, _peer()) == (5, 1)


def test_an_import_during_a_rehydration_whose_last_commit_hits_the_full_disk(mid_fs, tmp_path, capsys):
    """During a rehydration from the file's sender, the import's last transaction (the
    rehydration's counts, after the events and the answer) finds the disk full. Before: SQLite had
    rolled the failed COMMIT back itself, the helper's ROLLBACK then failed ("no transaction is
    active") and replaced the full-disk error, so the CLI printed a traceback."""
    home, body, snapshot, acked = _partial_import_setup(mid_fs, tmp_path, 5, rehydrating=True)
    free, (rc, err, applied, owed) = _smallest_free_that_applies(mid_fs, home, snapshot, body, capsys,
                                                                 done=lambda res: res[3] > 0)
    assert (applied, owed) == (5, 1), (free, rc, err)
    line = _line(err)
    assert rc == 1, (rc, line)
    assert "is full" in line and "nothing was changed" not in line and "5 of 5" in line, line
    p = cli(home, "mailbox", "import", str(body))
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["duplicate"] == 5
