"""A Hypothesis state machine over 3-5 nodes: random writes, random partial exchanges between
random pairs over faulty links, node restarts (the database closed and reopened); then faults
stop and every node syncs with every other: all dumps and all event logs identical, and every
watermark only ever claims what its node holds."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from agent.store import sync_state as sst
from agent.sync import SyncDriver
from agent.transport.memory import Faults

from .helpers import NOW, T, log_set, mesh, partial_exchange, reopen, sync_until_quiet

VALUES = st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False, width=32))


class Mesh(RuleBasedStateMachine):
    @initialize(n=st.integers(3, 5), limit=st.integers(1, 6))
    def setup(self, n, limit):
        self.dir = Path(tempfile.mkdtemp(prefix="ssp-sm-"))
        self.nodes = mesh(self.dir, n)
        self.limit = limit
        self.drivers = [SyncDriver(x, batch_limit=limit) for x in self.nodes]
        self.t = NOW

    def teardown(self):
        if not hasattr(self, "nodes"):
            return
        try:
            # Faults stop; everyone syncs with everyone until nothing moves.
            sync_until_quiet(self.drivers, self.t + 1, max_rounds=200)
            dumps = [x.dump() for x in self.nodes]
            logs = [log_set(x) for x in self.nodes]
            assert all(d == dumps[0] for d in dumps), "dumps differ after quiescence"
            assert all(lg == logs[0] for lg in logs), "event logs differ after quiescence"
            self.check_watermarks()
        finally:
            for x in self.nodes:
                x.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    @rule(i=st.integers(0, 4), dev=st.sampled_from("ab"), seq=st.integers(0, 3), v=VALUES,
          note=st.one_of(st.none(), st.text("xyz", max_size=2)), delete=st.booleans(), table=st.booleans())
    def write(self, i, dev, seq, v, note, delete, table):
        node = self.nodes[i % len(self.nodes)]
        self.t += 1
        if table:
            node.write("app.notes", {"id": f"{dev}{seq}"}, None if delete else {"body": note}, delete=delete, now=self.t)
        else:
            node.write(T, {"device": dev, "seq": seq}, None if delete else {"temp": v, "note": note},
                       delete=delete, now=self.t)

    @rule(i=st.integers(0, 4), j=st.integers(0, 4), seed=st.integers(0, 2**16), drop=st.sampled_from([0.0, 0.2, 0.5]),
          dup=st.sampled_from([0.0, 0.3]), reorder=st.sampled_from([0.0, 0.5]), cut=st.integers(1, 200))
    def exchange(self, i, j, seed, drop, dup, reorder, cut):
        """A partial exchange: the link is faulty and the simulation stops after `cut` ms, in
        whatever state the exchange is (bodies in flight are lost with the session)."""
        n = len(self.nodes)
        i, j = i % n, j % n
        if i == j:
            return
        self.t = partial_exchange(self.drivers[i], self.drivers[j], self.t, Faults(drop, dup, reorder, (0, 20)),
                                  seed, cut)

    @rule(i=st.integers(0, 4))
    def restart(self, i):
        i %= len(self.nodes)
        self.nodes[i] = reopen(self.nodes[i])
        self.drivers[i] = SyncDriver(self.nodes[i], batch_limit=self.limit)

    @invariant()
    def watermarks_claim_only_what_is_held(self):
        if hasattr(self, "nodes"):
            self.check_watermarks()

    def check_watermarks(self):
        for node in self.nodes:
            for (site, table), h in sst.own_watermarks(node.conn).items():
                # every event of that site and table at or below h that anyone holds, this node holds
                mine = {r[0] for r in node.conn.execute(
                    "SELECT event_id FROM events WHERE site_id=? AND qualified=?", (site, table))}
                for other in self.nodes:
                    for eid, p, l in other.conn.execute(
                            "SELECT event_id, hlc_p, hlc_l FROM events WHERE site_id=? AND qualified=?", (site, table)):
                        if (p, l) <= h:
                            assert eid in mine, "a watermark claims an event its node does not hold"


TestMesh = Mesh.TestCase
TestMesh.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
