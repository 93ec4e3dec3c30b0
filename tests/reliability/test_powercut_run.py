"""Power cuts while a node syncs under `run` (docs/reliability.md "Power loss"): the workload is
tests/reliability/powercut_run.py, recorded once under the power-cut shim with a real broker and a
real peer, and cut at sync points, at random points and with torn writes
(tests/reliability/powercut.py says what each finding means). After every cut each write `run`
acknowledged and each of the peer's events it answered for is in the store, no HLC is reused, and
the home opens."""
from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.reliability import powercut as pc
from tests.cli_cmd import agent_cmd, agent_env

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="the shim is built with gcc")
WORKLOAD = "tests.reliability.powercut_run"


def _cli(home, *args, env=None):
    p = subprocess.run([*agent_cmd(), "--home", str(home), *map(str, args)], capture_output=True, text=True,
                       env=agent_env(env), timeout=600)
    assert p.returncode == 0, (args, p.stderr)
    return p.stdout


def recorded(tmp_path_factory, drop_sync=None, events=24):
    from agent.simpeer import manifest_text, readings_table
    from agent.transport.broker import Broker
    work = tmp_path_factory.mktemp("run")
    broker = Broker(workdir=work / "broker").start()

    def setup(w, home):
        """B: a second home, each trusting the other (`peer add`), before the trace starts."""
        b, bw = w / "b", w / "b-witness"
        bw.mkdir()
        m = w / "b.toml"
        m.write_text(manifest_text(bytes(range(16)), readings_table(retention="telemetry"), []))
        env = {"SSP_AGENT_WITNESS_DIR": str(bw)}
        _cli(b, "init", "--manifest", m, env=env)
        ids = {h: json.loads((h / "identity.json").read_text()) for h in (home, b)}
        _cli(home, "peer", "add", "--site-id", ids[b]["site_id"], "--public-key", ids[b]["public_key"],
             env={"SSP_AGENT_WITNESS_DIR": str(w / "witness")})
        _cli(b, "peer", "add", "--site-id", ids[home]["site_id"], "--public-key", ids[home]["public_key"], env=env)
        return {"b_home": str(b), "b_witness": str(bw), "broker_url": broker.url}

    try:
        return pc.record(work, events=events, seed=23, shim=pc.build_shim(tmp_path_factory.mktemp("shim")),
                         workload=WORKLOAD, setup=setup, drop_sync=drop_sync)
    finally:
        broker.close()


@pytest.fixture(scope="module")
def recording(tmp_path_factory):
    return recorded(tmp_path_factory)


def test_run_acknowledged_its_writes_and_answered_for_the_peer_s(recording):
    """The trace holds what the cuts need: both kinds of acknowledgement, and `run` fsynced."""
    marks = pc.markers(recording.ops)
    done = [m for _, m in marks if m["k"] == "done"][0]["counts"]
    assert done["acked_a"] == 24 and done["acked_b"] == 24, done
    kinds = {m["how"] for _, m in marks if m["k"] == "ack"}
    assert kinds == {"run", "peer"}, kinds
    assert sum(1 for o in recording.ops if o.op == pc.OP_SYNC) >= 48


def test_a_power_cut_while_run_syncs_loses_nothing_acknowledged(recording):
    cuts = pc.cut_points(recording, sample_syncs=30, random_points=30, torn_points=10, seed=7)
    rep = pc.check(recording, cuts)
    print(rep.summary())
    assert rep.cut_points >= 70 and rep.opened == rep.states_verified
    assert rep.findings == [], rep.summary()


def test_negative_control_an_answer_before_the_commit_is_durable_is_caught(tmp_path_factory):
    """The harness sees a peer's event answered but not durable: the shim skips the store's WAL
    fsyncs (SQLite's commits), so what `run` answered for is lost at some cut."""
    rec = recorded(tmp_path_factory, drop_sync="store.sqlite-wal", events=9)
    rep = pc.check(rec, pc.cut_points(rec, sample_syncs=40, random_points=10, seed=5))
    lost = [f.detail for f in rep.findings if f.kind == "lost_ack"]
    assert any(d.startswith("peer event") for d in lost), rep.summary()
    assert "traceback" not in rep.kinds(), rep.summary()
