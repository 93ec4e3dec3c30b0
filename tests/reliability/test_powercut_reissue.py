"""Power loss at every sync point of a re-issue (docs/apply.md "Recovering from a clock that ran
ahead"), with the shim of tests/reliability/powercut.py: the workload (powercut_reissue.py) writes
three events ten years ahead, reopens at the right time (which withdraws and re-issues them) and
writes once more. Each cut's disk (every unsynced write lost, and random prefixes of them) is opened
by the real agent: every acknowledged value is there (or a later write of its row), nothing stays
stamped ahead, and no HLC the run released is reused by another event."""
from __future__ import annotations

import os
import random
import shutil
import time

import pytest

from agent.core import events as ev
from agent.node import Node
from agent.store import eventlog
from tests.reliability import powercut as pc
from tests.reliability.powercut_reissue import LATER, T, WRITES

pytestmark = pytest.mark.skipif(shutil.which("gcc") is None, reason="the shim is built with gcc")
SKEW_MS = 300_000


def _open_and_check(rec, acked: list[dict], released: list) -> list[str]:
    """Open the reconstruction (recovery runs), then the findings."""
    found = []
    old = os.environ.get("SSP_AGENT_WITNESS_DIR")
    os.environ["SSP_AGENT_WITNESS_DIR"] = str(rec.witness)
    try:
        node = Node.open(rec.home)
        try:
            now = int(time.time() * 1000)
            rows = {r["key"]["seq"]: r["values"]["temp"] for r in node.dump()[T]}
            written = [(k["seq"], v["temp"]) for k, v in WRITES + [LATER]]
            for mk in acked:
                seq, value = mk["key"]["seq"], mk["value"]["temp"]
                later = [v for s, v in written[written.index((seq, value)):] if s == seq]
                if rows.get(seq) not in later:
                    found.append(f"lost_ack: row {seq} holds {rows.get(seq)}, acknowledged {value}")
            own = [(bytes(e), (p, l)) for e, s, p, l, *_ in eventlog.entries(node.conn) if bytes(s) == node.site_id]
            if len(own) > len(WRITES) + 1:
                found.append(f"reissued_twice: {len(own)} own events for {len(WRITES) + 1} writes")
            if len({h for _e, h in own}) != len(own):
                found.append(f"hlc_reused: own events share HLCs {own}")
            if any(h[0] > now + SKEW_MS for _e, h in own):
                found.append(f"ahead: own events still stamped ahead {own}")
            by_hlc = {r.hlc: ev.event_id(r.raw) for r in released}
            for eid, h in own:
                if by_hlc.get(h, eid) != eid:
                    found.append(f"hlc_reused: {h} released for another event before the cut")
            eid = node.write(T, {"device": "verify", "seq": 0}, {"temp": 0.5})
            new = [h for e, s, p, l, *_ in eventlog.entries(node.conn) if bytes(e) == eid for h in [(p, l)]]
            if new and new[0] in by_hlc:
                found.append(f"hlc_reused: a new write took {new[0]}, released before the cut")
        finally:
            node.close()
    except Exception as e:  # noqa: BLE001 - any failure to open is a finding
        found.append(f"refused: {e!r}")
    finally:
        if old is None:
            os.environ.pop("SSP_AGENT_WITNESS_DIR", None)
        else:
            os.environ["SSP_AGENT_WITNESS_DIR"] = old
    return found


def test_a_power_cut_at_any_point_of_a_reissue_loses_nothing_and_reuses_no_hlc(tmp_path):
    (tmp_path / "shim").mkdir()
    shim = pc.build_shim(tmp_path / "shim")
    rec = pc.record(tmp_path / "run", events=0, seed=5, shim=shim, workload="tests.reliability.powercut_reissue")
    marks = pc.markers(rec.ops)
    at_reissue = next(i for i, mk in marks if mk["k"] == "reissued")
    syncs = [i + 1 for i, o in enumerate(rec.ops) if o.op == pc.OP_SYNC]
    assert sum(1 for i in syncs if i <= at_reissue) > 20          # the re-issue's own sync points are among them
    rng = random.Random(9)
    m = rec.model()
    done, findings, states = 0, [], set()
    for cut in sorted(set(syncs) | {len(rec.ops)}):
        while done < cut:
            m.step(rec.ops[done])
            done += 1
        acked = [mk for i, mk in marks if i < cut and mk["k"] == "ack"]
        released = list(m.released)
        files, dirs = m.pending_counts()
        choices = [m.reconstruct()]
        if files or dirs:
            choices.append(m.reconstruct({f: rng.randint(0, n) for f, n in files.items()},
                                         {d: rng.randint(0, n) for d, n in dirs.items()}))
        for state in choices:
            h = pc.state_hash(state)
            if h in states:
                continue
            states.add(h)
            pc.write_tree(rec.roots, state)
            findings += [f"cut {cut}: {f}" for f in _open_and_check(rec, acked, released)]
    pc.write_tree(rec.roots, rec._base_state)
    print(f"{len(states)} disk states opened")
    assert len(states) > 20
    assert findings == [], findings[:10]
