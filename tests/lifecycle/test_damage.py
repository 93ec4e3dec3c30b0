"""Damage that must not pass silently: a signing journal damaged in its middle,
a full disk and a corrupt store. Driven through the real CLI (`python -m agent.cli`) as a
subprocess: the contract is one line on stderr saying what is wrong and what to do, exit 1 (a
local fault, never exit 2, which means a refused request)."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from agent.node import Node
from agent.simpeer import manifest_text, readings_table
from tests.cli_cmd import agent_cmd, agent_env, installed_python

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")
T = "app.readings"
MANIFEST = manifest_text(MESH, readings_table(retention="telemetry"))
ROOT = Path(__file__).resolve().parents[2]


def cli(home, *args):
    env = agent_env({"PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    return subprocess.run([*agent_cmd(), "--home", str(home), *args],
                          capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=120)


def one_line_fault(p) -> str:
    """Exit 1 (a local fault) with exactly one line on stderr, no traceback."""
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    return lines[0]


def _records(data: bytes) -> list[tuple[int, int]]:
    """(offset, type) of every record of a journal file (docs/keystore.md "Journal format")."""
    pos, out = 8, []
    while pos + 8 <= len(data):
        blen = struct.unpack_from(">I", data, pos)[0]
        out.append((pos, data[pos + 8]))
        pos += 8 + blen
    return out


# ---------------------------------------------------------------- the signing journal
def test_journal_damaged_in_the_middle_is_refused_not_silently_dropped(tmp_path, monkeypatch):
    """Three events signed and released, then a crash before they were applied; then one byte of
    the journal's durable part is damaged before them. Before: the damage was taken for a torn
    tail, the three outputs were truncated away and `status` exited 0. Now every verb refuses
    with one line (exit 1) and the file is untouched; with the byte repaired, the next writing
    open applies all three."""
    home = tmp_path / "a"
    a, _ = Node.init(home, MANIFEST, {"kind": "software"})
    a.write(T, {"device": "d", "seq": 0}, {"temp": 0.0})
    real = a.bridge.release_many

    def release_then_crash(items):
        real(items)
        raise KeyboardInterrupt("crash between release and apply")
    monkeypatch.setattr(a.bridge, "release_many", release_then_crash)
    with pytest.raises(KeyboardInterrupt):
        a.write_many([(T, {"device": "d", "seq": i}, {"temp": float(i)}, False) for i in (1, 2, 3)])
    monkeypatch.undo()
    a.close()
    journal = home / "sign-journal"
    good = journal.read_bytes()
    recs = _records(good)
    intents = [off for off, t in recs if t == 1]
    assert sum(t in (2, 4) for _, t in recs) == 4     # the first write's output, not yet compacted, and three (4: sealed)
    bad = bytearray(good)
    bad[intents[-3] + 12] ^= 0x40          # inside the first of the three intents
    journal.write_bytes(bytes(bad))
    for verb in (["status"], ["dump"], ["write", T, "--key", '{"device":"d","seq":9}', "--set", '{"temp":9.0}']):
        line = one_line_fault(cli(home, *verb))
        assert "damaged at byte" in line and "3 released output(s)" in line and "Nothing was changed" in line
    assert journal.read_bytes() == bytes(bad)
    journal.write_bytes(good)              # restored from a backup
    p = cli(home, "status")                # a read verb: reports, recovers nothing
    assert p.returncode == 0, p.stderr
    st = json.loads(p.stdout)
    assert st["events"] == 1 and st["keystore"]["journal_state"]["released"] == 4
    assert cli(home, "write", T, "--key", '{"device":"d","seq":9}', "--set", '{"temp":9.0}').returncode == 0
    assert json.loads(cli(home, "status").stdout)["events"] == 5      # the three recovered, then the write
    assert [r["key"]["seq"] for r in json.loads(cli(home, "dump").stdout)[T]] == [0, 1, 2, 3, 9]


# ---------------------------------------------------------------- a full disk
@pytest.fixture
def small_fs(tmp_path):
    """A real, small filesystem (tmpfs of 2 MiB) that the test fills up; removed afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({p.stderr.strip()})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def fill(fs: Path) -> Path:
    """Write zeros until the filesystem refuses: a full disk, for real."""
    f = fs / "filler"
    # unbuffered: a buffered file keeps the refused bytes and raises ENOSPC again when it closes
    with open(f, "wb", buffering=0) as out:
        try:
            while True:
                out.write(bytes(65536))
        except OSError as e:
            assert e.errno == 28, e
    assert os.statvfs(fs).f_bavail == 0
    return f


def write(home, seq):
    return cli(home, "write", T, "--key", json.dumps({"device": "d", "seq": seq}), "--set", '{"temp": 1.5}')


def test_full_disk_read_verbs_work_and_writes_fail_with_one_line(small_fs):
    """On a full disk even `status` and `dump` died with a traceback (the
    writable open sets up the WAL index and compacts the journal). Read verbs now open the store
    read-only and write nothing; a write is a local fault: one line, exit 1, nothing changed."""
    home = small_fs / "h"
    mf = small_fs.parent / "m.toml"
    mf.write_text(MANIFEST)
    assert cli(home, "init", "--manifest", str(mf)).returncode == 0
    for i in range(3):
        assert write(home, i).returncode == 0
    # a write that reached the store's WAL but was never checkpointed (the writer died), and no
    # -shm index (it is rebuilt by the next reader; a full disk cannot hold a new one)
    code = ("import os, sys; from pathlib import Path; from agent.node import Node; "
            f"n = Node.open(Path({str(home)!r})); n.write({T!r}, {{'device': 'd', 'seq': 3}}, {{'temp': 3.0}}); "
            "os._exit(0)")
    p = subprocess.run([installed_python() or sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=str(ROOT), env=agent_env({"PYTHONPATH": str(ROOT)}))
    assert p.returncode == 0, p.stderr
    assert (home / "store.sqlite-wal").stat().st_size > 0
    (home / "store.sqlite-shm").unlink()
    filler = fill(small_fs)
    st = cli(home, "status")
    assert st.returncode == 0, st.stderr
    status = json.loads(st.stdout)
    assert status["events"] == 4 and status["keystore"]["journal_state"]["torn_tail_bytes"] == 0
    d = cli(home, "dump")
    assert d.returncode == 0, d.stderr
    assert [r["key"]["seq"] for r in json.loads(d.stdout)[T]] == [0, 1, 2, 3]   # the WAL's row too
    lg = cli(home, "log")
    assert lg.returncode == 0 and len(lg.stdout.splitlines()) == 4, lg.stderr
    assert cli(home, "events").returncode == 0
    # A write may still fit in blocks the home already holds (the dead writer's WAL, checkpointed
    # in place; the WAL index kept in memory, docs/reliability.md "Full disk"); the disk runs out
    # within a few, and that write is one line.
    stored = []
    for seq in range(9, 40):
        p = write(home, seq)
        if p.returncode != 0:
            break
        stored.append(seq)
    line = one_line_fault(p)
    assert "is full" in line and "Free space" in line
    filler.unlink()
    assert write(home, seq).returncode == 0                    # space back: writes go on
    # Whether the refused write got as far as the bridge's release depends on a page of slack in the
    # journal file (the store's layout moves it): a released event the store lacks is applied by the
    # next writing open (persist-before-release, docs/keystore.md), so it may be there twice.
    seqs = [json.loads(x)["row_key"]["seq"] for x in cli(home, "log").stdout.splitlines()]
    assert seqs in ([0, 1, 2, 3, *stored, seq], [0, 1, 2, 3, *stored, seq, seq]), seqs


# ---------------------------------------------------------------- a corrupt store
@pytest.fixture
def node_home(tmp_path):
    home = tmp_path / "h"
    mf = tmp_path / "m.toml"
    mf.write_text(MANIFEST)
    assert cli(home, "init", "--manifest", str(mf)).returncode == 0
    for i in range(20):
        assert write(home, i).returncode == 0
    assert not (home / "store.sqlite-wal").exists()   # checkpointed at close: the file holds it all
    return home


@pytest.mark.parametrize("where", ["header", "pages"])
def test_corrupt_store_is_one_line_with_what_to_do(node_home, where):
    """Overwritten bytes of store.sqlite (its header, or every page after the first) gave raw
    tracebacks for every verb; now one line naming the damage and what to do, exit 1."""
    store = node_home / "store.sqlite"
    data = bytearray(store.read_bytes())
    page = int.from_bytes(data[16:18], "big")
    if where == "header":
        data[0:16] = b"this is no db!!\0"
    else:
        data[page:] = b"\x5a" * (len(data) - page)
    store.write_bytes(bytes(data))
    for verb in (["status"], ["dump"], ["log"], ["events"]):
        line = one_line_fault(cli(node_home, *verb))
        assert "is damaged" in line and "restore store.sqlite from a backup" in line, line
    line = one_line_fault(write(node_home, 99))
    assert "is damaged" in line
    assert store.read_bytes() == bytes(data)    # nothing written over the damage
