"""A sequencer short of disk space refuses to start signing instead of failing in the middle of it.

Before (measured, `sequencer run` with its home on an 8 MiB tmpfs, 600 Commits of 20 KB for new
groups): the disk filled between a batch's signing intents and its receipts' commit; run exited 1
(`the filesystem ... is full`), and the next start stated 35 discontinuities, §22.6 "epoch
advanced, receipt absent", surfaced to every member with the loudness of an equivocation: the
resource-pressure attack §22.5 warns of, open to any client allowed to submit (1 MiB Commits for
new groups fill a disk at ~40 MB/s). Now a Commit is accepted only while the home's filesystem
keeps service.DISK_RESERVE_BYTES free beyond four times the Commits being signed (pending row,
receipts row, WAL, journal); otherwise it is refused `disk_full` before anything is written, and
served again once there is room.
"""
from __future__ import annotations

import collections

from agent.sequencer import core, home as seq_home, service
from agent.sequencer.framing import encode_private_message

G = bytes.fromhex("5e" * 16)
Usage = collections.namedtuple("Usage", "total used free")


def test_commits_are_refused_before_signing_when_the_disk_is_short(tmp_path, monkeypatch):
    home = tmp_path / "seq"
    service.init(home)
    free = {"bytes": 10 << 30}
    monkeypatch.setattr(seq_home.shutil, "disk_usage", lambda p: Usage(1 << 40, 0, free["bytes"]))
    with service.Sequencer(home) as s:
        assert isinstance(s.submit(encode_private_message(G, 0)), service.Accepted)
        commit = encode_private_message(G, 1, ciphertext=b"x" * 100_000)
        free["bytes"] = service.DISK_RESERVE_BYTES + 3 * len(commit)
        ans = s.submit(commit)
        assert isinstance(ans, service.Rejected) and ans.reason == core.DISK_FULL, ans
        assert ans.current_epoch == 1 and ans.head is not None
        assert s.store.group(G).current_epoch == 1 and not s.store.discontinuities()
        # a batch: only what fits is accepted
        many = [encode_private_message(bytes([i]) * 16, 0, ciphertext=b"x" * 100_000) for i in range(1, 7)]
        each = service.DISK_FACTOR * len(many[0]) + service.DISK_PER_COMMIT
        free["bytes"] = service.DISK_RESERVE_BYTES + 3 * each + 1000
        got = s.submit_many(many)
        assert [isinstance(a, service.Accepted) for a in got] == [True] * 3 + [False] * 3, got
        assert {a.reason for a in got[3:]} == {core.DISK_FULL}
        free["bytes"] = 10 << 30          # room again: served as before
        assert isinstance(s.submit(commit), service.Accepted)


def test_a_full_disk_under_a_sequencer_verb_says_what_to_do_for_a_sequencer(tmp_path, monkeypatch, capsys):
    """A full disk under a `sequencer` verb printed the node's advice (`ssp-agent evict --auto`,
    which a sequencer home has nothing for); now: free space, then retry. A node verb keeps it."""
    import errno
    from pathlib import Path

    from agent import cli
    from agent.cli import sequencer as cli_sequencer
    from agent.store.db import storage_fault

    def full(args):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(cli_sequencer, "cmd_status", full)
    assert cli.main(["--home", str(tmp_path / "s"), "sequencer", "status"]) == 1
    err = capsys.readouterr().err
    assert "is full" in err and "evict" not in err, err
    assert "evict --auto" in str(storage_fault(OSError(errno.ENOSPC, "full"), Path(tmp_path) / "store.sqlite"))


def test_a_damaged_sequencer_db_gets_a_sequencer_s_advice(tmp_path):
    """A damaged sequencer.db was told to restore the node's store.sqlite and rehydrate from a peer
    (a node's remedies); a sequencer restores sequencer.db from a copy, which its signing journal
    settles on the next start (never signing an epoch twice), or recovers from members' evidence."""
    import sqlite3
    from pathlib import Path

    from agent.store.db import storage_fault
    e = sqlite3.DatabaseError("database disk image is malformed")
    e.sqlite_errorcode, e.sqlite_errorname = 11, "SQLITE_CORRUPT"
    said = str(storage_fault(e, Path(tmp_path) / "sequencer.db"))
    assert "sequencer.db" in said and "store.sqlite" not in said and "rehydrate" not in said, said
    assert "sequencer recover" in said and "journal" in said, said
    node = str(storage_fault(e, Path(tmp_path) / "store.sqlite"))
    assert "rehydrate" in node and "store.sqlite" in node
