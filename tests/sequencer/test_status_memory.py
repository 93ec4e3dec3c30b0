"""`sequencer status` of many groups prints them one at a time (docs/sequencer.md "CLI").

Before: opening the home read and cached every group's state (the resume looked at each, even
with nothing in the journal ahead of it), and status built every group's entry as one list, then
the whole JSON text: 100 000 groups (run's default --max-groups) took the installed command to
233 MB resident, beside a `sequencer run` on a 512 MB device. Now the resume reads only the groups
the journal is ahead of, the groups are read in one pass and written as they are read (67 MB),
and the text printed is the same, byte for byte.
"""
from __future__ import annotations

import io
import json
import subprocess
import sys
from contextlib import redirect_stdout

from agent.cli import sequencer as cli_sequencer
from agent.sequencer import receipts, service
from agent.sequencer.framing import encode_private_message
from tests.cli_cmd import agent_cmd, agent_env

GROUPS = 100_000
# the interpreter and the CLI's imports take ~38 MB; measured 67 MB, before: 233 MB
PEAK_KIB = 80 << 10


def _peak_kib_of(cmd: list[str], env: dict) -> tuple[int, int]:
    """The command's peak resident set (KiB, its own: the wrapper's only child) and the bytes it
    printed, run from a fresh wrapper process."""
    wrapper = ("import resource, subprocess, sys\n"
               "p = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE)\n"
               "assert p.returncode == 0, p.returncode\n"
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, len(p.stdout))\n")
    out = subprocess.run([sys.executable, "-c", wrapper, *cmd], capture_output=True, text=True, env=env, check=True)
    peak, size = out.stdout.split()
    return int(peak), int(size)


def test_status_of_100_000_groups_holds_one_at_a_time(tmp_path):
    home = tmp_path / "seq"
    service.init(home)
    with service.Sequencer(home) as s, s.store._tx():
        s.store.conn.executemany(
            "INSERT INTO groups (group_id, current_epoch, head_epoch, head_hash, origin) VALUES (?, 5, 4, ?, 'registered')",
            [(i.to_bytes(16, "big"), bytes(32)) for i in range(GROUPS)])
    peak, size = _peak_kib_of([*agent_cmd(), "--home", str(home), "sequencer", "status"], agent_env())
    assert size > GROUPS * 200                     # every group printed (~280 bytes each)
    assert peak < PEAK_KIB, f"sequencer status of {GROUPS} groups peaked at {peak >> 10} MiB"


def test_the_streamed_status_is_the_status_byte_for_byte(tmp_path):
    """Groups with gaps, signed statements and none, in group_id order, with the events."""
    home = tmp_path / "seq"
    service.init(home)
    groups = [bytes([b]) * 16 for b in (0x30, 0x10, 0x20)]
    with service.Sequencer(home) as s:
        for g in groups:
            s.register(g, 0)
            assert isinstance(s.submit(encode_private_message(g, 0)), service.Accepted)
        # gaps for two groups, one signed (the resume path states them; written here directly)
        s.store.commit_discontinuity(s.store.group(groups[1]).__class__(groups[1], 2), 1, None, None, "signing_failed")
        s.store.commit_discontinuity(s.store.group(groups[2]).__class__(groups[2], 3), 2, None, None, "signing_failed")
        s.sign_statements()
        whole = json.dumps(s.status()) + "\n"
        buf = io.StringIO()
        with redirect_stdout(buf):
            cli_sequencer._print_streamed(s.status(stream=True))
    assert buf.getvalue() == whole
    doc = json.loads(whole)
    assert [g["group"] for g in doc["groups"]] == sorted(g.hex() for g in groups)
    assert [g["discontinuities"] for g in doc["groups"]] == [[1], [2], []]     # 10.., 20.., 30..
    assert all(g["statements"] for g in doc["groups"][:2])
    assert receipts.verify_statement(bytes.fromhex(doc["groups"][0]["statements"]["1"]), s.public_key)
