"""Power cuts while writers, an importer and eviction run at the same time, each a real CLI
process (`write`, `mailbox import`, `evict --auto`) racing for the home: the workload is
tests/reliability/powercut_mixed.py, recorded once under the power-cut shim and cut at sync points,
at random points and with torn writes (tests/reliability/powercut.py says what each finding means).
After every cut each acknowledged write is in the store or below its table's horizon, no HLC is
reused, the home opens (one line or success); on a sample of cuts `ssp-agent check` finds the
home and its keystore sound and SQLite's integrity check passes."""
from __future__ import annotations

import json
import shutil
import sqlite3

import pytest

from tests.reliability import powercut as pc
from tests.reliability.ext4img import cli

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="the shim is built with gcc")
WORKLOAD = "tests.reliability.powercut_mixed"


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    return pc.build_shim(tmp_path_factory.mktemp("shim"))


@pytest.fixture(scope="module")
def recording(tmp_path_factory, shim):
    return pc.record(tmp_path_factory.mktemp("mixed"), events=48, seed=17, shim=shim, workload=WORKLOAD)


def test_the_commands_raced_and_each_kind_was_acknowledged(recording):
    """The trace holds what the cuts need: acknowledgements of every kind, interleaved (an
    eviction acknowledged between two other acknowledgements), and the processes were many."""
    marks = pc.markers(recording.ops)
    kinds = [m["how"] for _, m in marks if m["k"] in ("ack", "evicted")]
    assert {"cli", "import", "auto"} <= set(kinds), kinds
    first, last = kinds.index("auto"), len(kinds) - 1 - kinds[::-1].index("auto")
    assert first < last and {"cli", "import"} & set(kinds[first:last]), kinds
    done = [m for _, m in marks if m["k"] == "done"][0]["counts"]
    assert done["acked"] == sum(len(m["ids"]) for _, m in marks if m["k"] == "ack") >= 40, done
    assert len({o.pid for o in recording.ops}) >= 20


def test_a_power_cut_while_they_race_loses_nothing_acknowledged(recording):
    cuts = pc.cut_points(recording, sample_syncs=30, random_points=30, torn_points=10, seed=5)
    rep = pc.check(recording, cuts)
    print(rep.summary())
    assert rep.cut_points >= 70 and rep.opened == rep.states_verified
    assert rep.findings == [], rep.summary()


def test_the_cut_homes_pass_check_and_sqlite_integrity(recording, tmp_path):
    """On the raw disk after a cut (before any writing open recovers it): `check` reads it through
    a read view; its home and keystore lines are OK and nothing FAILs (no broker is given, so the
    broker line says it was not probed), and SQLite's own integrity check passes."""
    syncs = sorted({o.i + 1 for o in recording.ops if o.op == pc.OP_SYNC})
    picks = {syncs[len(syncs) * k // 6] for k in range(1, 6)} | {len(recording.ops)}
    m = recording.model()
    done = 0
    try:
        for cut in sorted(picks):
            while done < cut:
                m.step(recording.ops[done])
                done += 1
            pc.write_tree(recording.roots, m.reconstruct())
            p = cli(recording.home, "check", "--json", env={"SSP_AGENT_WITNESS_DIR": str(recording.witness)})
            got = json.loads(p.stdout)
            lines = {c["check"]: c for c in got["checks"]}
            assert lines["home"]["status"] == "OK" and lines["keystore"]["status"] == "OK", (cut, lines)
            assert not [c for c in got["checks"] if c["status"] == "FAIL" and c["check"] != "broker"], (cut, got)
            work = tmp_path / f"copy-{cut}"
            work.mkdir()
            for f in recording.home.glob("store.sqlite*"):
                shutil.copy(f, work / f.name)
            with sqlite3.connect(work / "store.sqlite") as c:
                assert c.execute("PRAGMA integrity_check").fetchone()[0] == "ok", cut
    finally:
        pc.write_tree(recording.roots, recording._base_state)
