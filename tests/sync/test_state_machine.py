"""A Hypothesis state machine over 3-5 nodes: random writes, random partial exchanges between
random pairs over faulty links, node restarts (the database closed and reopened); then faults
stop and every node syncs with every other: all dumps and all event logs identical, and every
watermark only ever claims what its node holds.

`Mesh` runs the shipped session over in-memory links; `MixedMesh` gives every pair of nodes its
own link, drawn per example: the in-memory link, a serial cable (the same session through
SerialEndpoint over the serial link state machine and a lossy byte pipe), or MQTT (the runner
through one real mosquitto for this module), tests/sync/mixed_links.py; one mesh syncs over all
three, each transport with its own durable cursors (paths memory, serial, mqtt). The MQTT steps
run on wall-clock time and the paho thread: a failure found there may not replay exactly while
Hypothesis shrinks it (it then reports it as flaky, still a failure)."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tests.soak import sample
from agent.store import sync_state as sst
from agent.sync import SyncDriver
from agent.transport.memory import Faults

from .helpers import NOW, T, log_set, mesh, partial_exchange, reopen, st_cursors, sync, sync_until_quiet
from .mixed_links import mqtt_exchange, serial_exchange

LINKS = ("memory", "serial", "mqtt")
_BROKER = None


@pytest.fixture(autouse=True, scope="module")
def _one_broker(tmp_path_factory):
    """One mosquitto for the module (MixedMesh's MQTT links)."""
    global _BROKER
    from agent.transport.broker import Broker, find_mosquitto
    if find_mosquitto() is None:
        pytest.fail("mosquitto is not installed (apt-get install mosquitto); the mixed mesh needs a real broker")
    _BROKER = Broker(workdir=tmp_path_factory.mktemp("broker")).start()
    yield
    _BROKER.close()

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
            self.quiesce()
            dumps = [x.dump() for x in self.nodes]
            logs = [log_set(x) for x in self.nodes]
            assert all(d == dumps[0] for d in dumps), "dumps differ after quiescence"
            assert all(lg == logs[0] for lg in logs), "event logs differ after quiescence"
            self.check_watermarks()
        finally:
            for x in self.nodes:
                x.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def quiesce(self):
        # Faults stop; everyone syncs with everyone until nothing moves.
        sync_until_quiet(self.drivers, self.t + 1, max_rounds=200)

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


class MixedMesh(Mesh):
    """The same rules; each pair's exchanges go over the link drawn for that pair."""

    @initialize(n=st.integers(3, 5), limit=st.integers(1, 6),
                links=st.lists(st.sampled_from(LINKS), min_size=10, max_size=10))
    def setup(self, n, limit, links):
        super().setup(n, limit)
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
        self.links = dict(zip(pairs, links))

    def _link(self, i, j) -> str:
        return self.links[(min(i, j), max(i, j))]

    @rule(i=st.integers(0, 4), j=st.integers(0, 4), seed=st.integers(0, 2**16), drop=st.sampled_from([0.0, 0.2, 0.5]),
          dup=st.sampled_from([0.0, 0.3]), reorder=st.sampled_from([0.0, 0.5]), cut=st.integers(1, 200),
          ber=st.sampled_from([0.0, 1e-4, 1e-3]))
    def exchange(self, i, j, seed, drop, dup, reorder, cut, ber):
        n = len(self.nodes)
        i, j = i % n, j % n
        if i == j:
            return
        link = self._link(i, j)
        if link == "memory":
            self.t = partial_exchange(self.drivers[i], self.drivers[j], self.t, Faults(drop, dup, reorder, (0, 20)),
                                      seed, cut)
            return
        if link == "mqtt":
            mqtt_exchange(_BROKER, self.nodes[i], self.nodes[j], self.limit, cut)  # the broker loses nothing: cut only
            return
        # Serial: frame faults per frame (a tenth of the memory link's per-message rates: a body
        # is many frames), bit errors, and a cut after up to 4 s of line time.
        self.t = serial_exchange(self.nodes[i], self.nodes[j], self.t, self.limit, seed, cut * 20, ber=ber,
                                 drop=drop / 10, duplicate=dup / 10, reorder=reorder / 10, truncate=drop / 10)

    def quiesce(self):
        """Faults stop; every pair syncs over its own link, round after round, until no log and
        no cursor moves."""
        t = self.t + 1
        for _ in range(200):
            before = [len(list(x.log_entries())) for x in self.nodes]
            cur = [st_cursors(d) for d in self.drivers]
            for i in range(len(self.nodes)):
                for j in range(len(self.nodes)):
                    if i == j:
                        continue
                    link = self._link(i, j)
                    if link == "serial":
                        t = serial_exchange(self.nodes[i], self.nodes[j], t, self.limit, i * 7 + j, None)
                    elif link == "mqtt":
                        mqtt_exchange(_BROKER, self.nodes[i], self.nodes[j], self.limit, None)
                    else:
                        t = sync(self.drivers[i], self.drivers[j], t + 1)
            if before == [len(list(x.log_entries())) for x in self.nodes] and cur == [st_cursors(d) for d in self.drivers]:
                return
        raise AssertionError("no quiescence")


TestMesh = Mesh.TestCase
TestMesh.settings = settings(max_examples=sample(10, 40), stateful_step_count=30, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

TestMixedMesh = MixedMesh.TestCase
TestMixedMesh.settings = settings(max_examples=sample(4, 15), stateful_step_count=25, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
