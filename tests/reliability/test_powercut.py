"""Power loss at every sync point, the CI sample. The harness is
tests/reliability/powercut.py (model and findings: docs/reliability.md); `tools/powercut.sh` runs
every sync point and thousands of random cut points. Here: the 200-event workload recorded once
under the LD_PRELOAD shim, then 100 sync points (all unsynced writes lost), 100 random cut points
(a random prefix of every file's and directory's unsynced writes kept) and 30 with a torn write,
each reopened by the real agent; and the negative controls, which must be caught."""
from __future__ import annotations

import shutil

import pytest

from tests.reliability import powercut as pc
from tests.soak import sample

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="the shim is built with gcc")


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    return pc.build_shim(tmp_path_factory.mktemp("shim"))


@pytest.fixture(scope="module")
def recording(tmp_path_factory, shim):
    return pc.record(tmp_path_factory.mktemp("powercut"), events=200, seed=7, shim=shim)


def test_the_shim_sees_every_write_of_the_workload(recording):
    """`record` replays the whole trace through the model and compares it with the files the run
    left (it raises on any difference): here, that the trace holds what the harness needs."""
    marks = pc.markers(recording.ops)
    acked = [m for _, m in marks if m["k"] == "ack"]
    assert sum(len(m["ids"]) for m in acked) == 200
    assert {m["how"] for m in acked} == {"cli", "write_many", "import"}
    assert any(m["k"] == "evicted" for _, m in marks)
    assert any(m["k"] == "answered" and m["answers"] for _, m in marks)
    syncs = [o for o in recording.ops if o.op == pc.OP_SYNC]
    assert len(syncs) > 300
    paths = {o.path.rsplit("/", 1)[-1] for o in recording.ops if o.op == pc.OP_OPEN}
    assert {"store.sqlite", "store.sqlite-wal", "sign-journal"} <= paths


def test_a_power_cut_at_any_point_loses_nothing_acknowledged(recording):
    cuts = pc.cut_points(recording, sample_syncs=sample(60, 100), random_points=sample(60, 100),
                          torn_points=sample(20, 30), seed=3)
    rep = pc.check(recording, cuts)
    print(rep.summary())
    assert rep.cut_points >= sample(140, 230) and rep.opened == rep.states_verified
    assert rep.released_outputs > 120
    assert rep.findings == [], rep.summary()


@pytest.mark.parametrize("drop,expect", [("store.sqlite-wal", "lost_ack"),
                                         ("sign-journal", "released_missing")])
def test_negative_control_a_skipped_fsync_is_caught(tmp_path, shim, drop, expect):
    """The harness must see a missing fsync: the shim skips the store's WAL fsyncs (SQLite's
    commits) or the signing journal's (persist-before-release), while logging that the code asked."""
    rec = pc.record(tmp_path, events=60, seed=11, drop_sync=drop, shim=shim)   # one import among them
    rep = pc.check(rec, pc.cut_points(rec, sample_syncs=40, random_points=10, seed=5))
    assert expect in rep.kinds(), rep.summary()
    assert "traceback" not in rep.kinds(), rep.summary()


def test_a_failed_open_releases_the_journal_and_the_store(tmp_path, monkeypatch):
    """Found by the full harness run (tools/powercut.sh): its negative controls reopen thousands of
    damaged reconstructions in one process, and after a few thousand refused opens every open
    failed with a traceback (EMFILE). `Node.open` leaked the signing bridge (the journal's fd and
    its lock) and the store connection when the node's set-up failed after they were opened; the
    next open of that home in the same process (a long-running service retrying) was refused as
    "in use by another process". Now a failed open closes what it opened."""
    import sqlite3

    from agent.node import Node
    from agent.simpeer import manifest_text, readings_table
    monkeypatch.setenv("SSP_AGENT_WITNESS_DIR", str(tmp_path / "w"))
    home = tmp_path / "h"
    node, _ = Node.init(home, manifest_text(bytes(16), readings_table()), {"kind": "software"})
    node.write(pc.T, {"device": "d", "seq": 1}, {"temp": 0.5})
    node.close()
    with sqlite3.connect(home / "store.sqlite") as c:   # damage that only the node's set-up reads
        good = c.execute("SELECT key_json FROM tables").fetchone()[0]
        c.execute("UPDATE tables SET key_json = '{not json'")
    with pytest.raises(ValueError):
        Node.open(home)
    with sqlite3.connect(home / "store.sqlite") as c:
        c.execute("UPDATE tables SET key_json = ?", (good,))
    with Node.open(home) as again:               # before: JournalError, the journal "in use"
        assert again.conn.execute("SELECT count(*) FROM events").fetchone()[0] == 1
