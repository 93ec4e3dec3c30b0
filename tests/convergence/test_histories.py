"""One Hypothesis state machine over 3-5 nodes and adversarial histories: writes (some
through the real CLI `write` verb, a new process's worth of state each), partial exchanges over
faulty in-memory links between random pairs (so events relay through third nodes), eviction on
senders (the same horizon everywhere), process restarts (new Node objects on the same home),
restores of a home from an earlier copy, control records (vouches of an outside signer) in the
same stream as events, and wall-clock jumps inside the skew bound.

After quiescence: every pair of nodes (all with equal horizons) agrees on every row whose whole
history lies above the horizon (§13.5: eviction is the one permitted departure), no HLC is issued
twice by any site, and no watermark claims an event its holder lacks (checked at every step)."""
from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
import time
from pathlib import Path

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.soak import sample
from agent import cli
from agent.simpeer import SimPeer  # noqa: I001
from agent.store import sync_state as sst
from agent.sync import SyncDriver, issue_record
from agent.transport.memory import Faults

from agent.simpeer import NOTES_TABLE, readings_table

from ..sync.helpers import MESH, T, mesh, partial_exchange, reopen, sync_until_quiet

TABLES = readings_table("telemetry") + NOTES_TABLE

SKEW_JUMPS = st.sampled_from([-120_000, -5_000, 0, 0, 0, 3_000, 90_000])


class Histories(RuleBasedStateMachine):
    @initialize(n=st.integers(3, 5), limit=st.integers(2, 8))
    def setup(self, n, limit):
        self.dir = Path(tempfile.mkdtemp(prefix="ssp-hist-"))
        self.nodes = mesh(self.dir, n, TABLES, authority=0)
        self.limit = limit
        self.drivers = [SyncDriver(x, batch_limit=limit) for x in self.nodes]
        self.t = int(time.time() * 1000)  # simulated time never behind the real clock (CLI writes read it)
        self.offset = [0] * n  # each node's wall-clock error, inside the skew bound
        self.horizon = None
        self.snapshots: dict[int, tuple[Path, set[str]]] = {}
        self.catalogue: dict[str, tuple[bytes, str, str, tuple[int, int]]] = {}  # event_id -> site, table, row, hlc
        self.outsider = SimPeer(MESH)
        self.vouched = False
        self.retired = False
        self.lost_own: set[int] = set()

    # ------------------------------------------------------------------ helpers
    def _note_log(self, node) -> None:
        for e in node.log_entries():
            self.catalogue.setdefault(e["event_id"], (bytes.fromhex(e["site_id"]), e["table"],
                                                      json.dumps(e["row_key"], sort_keys=True),
                                                      tuple(map(int, e["hlc"].split(".")))))

    def _own_signed(self, i) -> set[str]:
        """Every event node i's site has signed so far (held or since evicted): the catalogue notes
        each local write as it happens."""
        site = self.nodes[i].site_id
        return {eid for eid, (s, _q, _rk, _h) in self.catalogue.items() if s == site}

    def _lost_by_restore(self, i, signed_at_copy: set[str]) -> bool:
        """Whether restoring node i's copy loses an own event that still counts: one signed after
        the copy, unless eviction everywhere has put it below the horizon (its row is then out of the
        comparison, §13.5). Counting the own events held is not enough: eviction since the copy can
        remove as many old ones as were written after it."""
        for eid in self._own_signed(i) - signed_at_copy:
            _s, q, _rk, hlc = self.catalogue[eid]
            if not (self.horizon is not None and q == T and hlc < self.horizon):
                return True
        return False

    def _reopen(self, i) -> None:
        self.nodes[i] = reopen(self.nodes[i])
        self.drivers[i] = SyncDriver(self.nodes[i], batch_limit=self.limit)

    def teardown(self):
        if not hasattr(self, "nodes"):
            return
        try:
            sync_until_quiet(self.drivers, self.t + 1, max_rounds=200)
            for x in self.nodes:
                self._note_log(x)
            self.check_watermarks()
            self.check_no_hlc_reuse()
            views = [(k, self.comparable(x)) for k, x in enumerate(self.nodes) if k not in self.lost_own]
            for k, v in views[1:]:
                assert v == views[0][1], f"node {k} differs from node {views[0][0]} after quiescence"
        finally:
            for x in self.nodes:
                x.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    def comparable(self, node) -> dict:
        """The tables without rows whose history reaches below the horizon (§13.5)."""
        low = set()
        if self.horizon is not None:
            low = {(q, rk) for _s, q, rk, h in self.catalogue.values() if h < self.horizon}
        return {q: sorted((json.dumps(r, sort_keys=True) for r in rows
                           if (q, json.dumps(r["key"], sort_keys=True)) not in low))
                for q, rows in node.dump().items()}

    # ------------------------------------------------------------------ rules
    @rule(i=st.integers(0, 4), dev=st.sampled_from("ab"), seq=st.integers(0, 3),
          v=st.one_of(st.none(), st.floats(allow_nan=False, allow_infinity=False, width=32)),
          delete=st.booleans(), notes=st.booleans())
    def write(self, i, dev, seq, v, delete, notes):
        i %= len(self.nodes)
        node = self.nodes[i]
        self.t += 1
        now = self.t + self.offset[i]
        if notes:
            node.write("app.notes", {"id": f"{dev}{seq}"}, None if delete else {"body": str(v)}, delete=delete, now=now)
        else:
            node.write(T, {"device": dev, "seq": seq}, None if delete else {"temp": v}, delete=delete, now=now)
        self._note_log(node)

    @rule(i=st.integers(0, 4), dev=st.sampled_from("ab"), seq=st.integers(0, 3), v=st.integers(-5, 5))
    def cli_write(self, i, dev, seq, v):
        """The real `ssp-agent write` verb on the closed home (one process's worth of state)."""
        i %= len(self.nodes)
        home = self.nodes[i].home
        self.nodes[i].close()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            rc = cli.main(["--home", str(home), "write", T, "--key", json.dumps({"device": dev, "seq": seq}),
                           "--set", json.dumps({"temp": float(v)})])
        assert rc == 0
        self.nodes[i] = reopen_home(home)
        self.drivers[i] = SyncDriver(self.nodes[i], batch_limit=self.limit)
        self._note_log(self.nodes[i])

    @rule(i=st.integers(0, 4), j=st.integers(0, 4), seed=st.integers(0, 2**16), drop=st.sampled_from([0.0, 0.3]),
          dup=st.sampled_from([0.0, 0.3]), reorder=st.sampled_from([0.0, 0.5]), cut=st.integers(1, 200))
    def exchange(self, i, j, seed, drop, dup, reorder, cut):
        n = len(self.nodes)
        i, j = i % n, j % n
        if i == j:
            return
        self.t = partial_exchange(self.drivers[i], self.drivers[j], self.t, Faults(drop, dup, reorder, (0, 20)),
                                  seed, cut)
        self._note_log(self.nodes[j])

    @rule(i=st.integers(0, 4))
    def restart(self, i):
        self._reopen(i % len(self.nodes))

    @rule(i=st.integers(0, 4), jump=SKEW_JUMPS)
    def clock_jump(self, i, jump):
        self.offset[i % len(self.nodes)] = jump

    @rule(back=st.integers(50, 2_000))
    def evict_everywhere(self, back):
        """Eviction on every node, senders included, at one horizon (equal horizons)."""
        h = (self.t - back, 0)
        if self.horizon is not None and h <= self.horizon:
            return
        self.horizon = h
        for x in self.nodes:
            x.evict_table(T, h, now=self.t)

    @rule(i=st.integers(0, 4))
    def snapshot(self, i):
        i %= len(self.nodes)
        home = self.nodes[i].home
        self.nodes[i].close()
        snap = self.dir / f"snap{i}"
        shutil.rmtree(snap, ignore_errors=True)
        shutil.copytree(home, snap, ignore=shutil.ignore_patterns("*-shm"))  # an index SQLite rebuilds
        self.nodes[i] = reopen_home(home)
        self.drivers[i] = SyncDriver(self.nodes[i], batch_limit=self.limit)
        self.snapshots[i] = (snap, self._own_signed(i))

    @precondition(lambda self: bool(getattr(self, "snapshots", None)))
    @rule(k=st.integers(0, 4))
    def restore(self, k):
        """Restore a home from its earlier copy. It asks its peers for what it lost; but its own
        events signed after the copy can never come back to it (§32.1 drops them unconditionally),
        so such a node is left out of the final agreement (its peers keep those events and must
        still agree among themselves); it must still never issue an HLC twice."""
        i = sorted(self.snapshots)[k % len(self.snapshots)]
        snap, signed = self.snapshots[i]
        if self._lost_by_restore(i, signed):
            self.lost_own.add(i)
        home = self.nodes[i].home
        self.nodes[i].close()
        shutil.rmtree(home)
        shutil.copytree(snap, home, ignore=shutil.ignore_patterns("*-shm"))
        self.nodes[i] = reopen_home(home)
        if self.horizon is not None:
            self.nodes[i].evict_table(T, self.horizon, now=self.t)  # the copy's horizon was older
        self.drivers[i] = SyncDriver(self.nodes[i], batch_limit=self.limit)

    @rule(i=st.integers(0, 4), seq=st.integers(0, 3), v=st.integers(-5, 5))
    def outsider_event(self, i, seq, v):
        """An event of an outside site (vouched by the authority, node 0) reaches one node,
        before or after the vouch does."""
        i %= len(self.nodes)
        self.t += 1
        raw = self.outsider.event(T, {"device": "o", "seq": seq}, {"temp": float(v)}, (self.t, 0))
        self.nodes[i].apply_batch([raw], self.t)
        self._note_log(self.nodes[i])

    @precondition(lambda self: hasattr(self, "vouched") and not self.vouched)
    @rule()
    def vouch_outsider(self):
        issue_record(self.nodes[0], "vouch", self.outsider.site_id, self.outsider.public_key, now=self.t)
        self.vouched = True

    @precondition(lambda self: getattr(self, "vouched", False) and not self.retired)
    @rule(back=st.integers(0, 50))
    def retire_outsider(self, back):
        """The authority retires the outside site with a cutoff in the past: its events above the
        cutoff stop counting everywhere, whenever the retire arrives."""
        issue_record(self.nodes[0], "retire", self.outsider.site_id, ((self.t - back, 0), None), now=self.t)
        self.retired = True

    # ------------------------------------------------------------------ invariants
    @invariant()
    def watermarks_claim_only_what_is_held(self):
        if hasattr(self, "nodes"):
            self.check_watermarks()

    def check_watermarks(self):
        for node in self.nodes:
            h = node.tables[T].horizon
            for (site, table), w in sst.own_watermarks(node.conn).items():
                mine = {bytes(r[0]).hex() for r in node.conn.execute(
                    "SELECT event_id FROM events WHERE site_id=? AND qualified=?", (site, table))}
                for eid, (s, q, _rk, hlc) in self.catalogue.items():
                    if s == site and q == table and hlc <= w and not (h and q == T and hlc < h):
                        assert eid in mine, f"a watermark {w} of {table} claims {eid[:8]} at {hlc}, not held"

    def check_no_hlc_reuse(self):
        seen: dict[tuple[bytes, tuple[int, int]], str] = {}
        for eid, (s, _q, _rk, hlc) in self.catalogue.items():
            other = seen.setdefault((s, hlc), eid)
            assert other == eid, f"site {s.hex()[:6]} issued HLC {hlc} twice"


def reopen_home(home):
    from agent.node import Node
    return Node.open(home)


TestHistories = Histories.TestCase
TestHistories.settings = settings(max_examples=sample(10, 40), stateful_step_count=30, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
