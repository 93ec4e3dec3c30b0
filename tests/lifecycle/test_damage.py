"""Damage that must not pass silently (issue 11 item 6): a signing journal damaged in its middle,
a full disk and a corrupt store. Driven through the real CLI (`python -m agent.cli`) as a
subprocess: the contract is one line on stderr saying what is wrong and what to do, exit 1 (a
local fault, never exit 2, which means a refused request)."""
from __future__ import annotations

import json
import os
import struct
import subprocess
from pathlib import Path

import pytest

from agent.node import Node
from agent.simpeer import manifest_text, readings_table
from tests.cli_cmd import agent_cmd, agent_env

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
    with one line (exit 1) and the file is untouched; with the byte repaired, the next open
    applies all three."""
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
    assert sum(t == 2 for _, t in recs) == 4     # the first write's output, not yet compacted, and three
    bad = bytearray(good)
    bad[intents[-3] + 12] ^= 0x40          # inside the first of the three intents
    journal.write_bytes(bytes(bad))
    for verb in (["status"], ["dump"], ["write", T, "--key", '{"device":"d","seq":9}', "--set", '{"temp":9.0}']):
        line = one_line_fault(cli(home, *verb))
        assert "damaged at byte" in line and "3 released output(s)" in line and "Nothing was changed" in line
    assert journal.read_bytes() == bytes(bad)
    journal.write_bytes(good)              # restored from a backup
    p = cli(home, "status")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["events"] == 4
    assert len(json.loads(cli(home, "dump").stdout)[T]) == 4
