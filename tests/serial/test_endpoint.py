"""Two real nodes syncing through SerialEndpoint (the session that ships over the serial link),
over a simulated faulty line in simulated time: they converge at BER up to 1e-3 with dropped,
doubled, reordered and truncated frames and a pulled cable; duplicates are absorbed by the
idempotent apply (at-least-once above the link)."""
from __future__ import annotations

from agent.sync import SyncDriver
from agent.transport.serial import SerialEndpoint, SessionSettings
from agent.transport.serial_link import LinkConfig, SerialLink
from serial_relay import LineFaults

from ..sync.helpers import NOW, T, mesh


class EndpointLine:
    def __init__(self, drivers, faults, baud=115_200, base=NOW, **cfg):
        self.base = base
        self.q = [[], []]
        self.free = [0.0, 0.0]
        self.rate = baud / 10 / 1000
        self.faults = faults
        self.pulled = False
        self.t = 0
        self.eps = [SerialEndpoint(d, SerialLink(LinkConfig(baud=baud, **cfg), 0x51 + 77 * i), self._writer(i),
                                   SessionSettings(secure=True, cycle_ms=5_000, answer_timeout_ms=60_000,
                                                   batch_limit=50))
                    for i, d in enumerate(drivers)]

    def _writer(self, i):
        def write(data):
            if self.pulled:
                return
            out = self.faults[i].apply(data)
            for k in range(0, len(out), 64):
                piece = out[k:k + 64]
                self.free[i] = max(self.t, self.free[i]) + len(piece) / self.rate
                self.q[i].append((self.free[i] + 2, piece))
        return write

    def run(self, until, done):
        while self.t < until:
            t = self.t
            for i in (0, 1):
                due = [x for x in self.q[i] if x[0] <= t]
                self.q[i] = [x for x in self.q[i] if x[0] > t]
                for _, d in due:
                    self.eps[1 - i].receive_bytes(d, t, self.base + t)
            for ep in self.eps:
                ep.handle_timer(t, self.base + t)
            if done():
                return True
            nxt = [int(x[0]) + 1 for q in self.q for x in q] + [x for x in (ep.timer(t, self.base + t) for ep in self.eps) if x is not None]
            self.t = max(t + 1, min(nxt)) if nxt else t + 100
        return False


def write_rows(node, n, dev):
    for i in range(n):
        node.write(T, {"device": dev, "seq": i}, {"temp": float(i), "note": "x" * 40}, now=NOW + i)


def n_events(node):
    return node.conn.execute("SELECT count(*) FROM events").fetchone()[0]


def all_in(nodes, n):
    """Cheap to check at every step; the tables are compared once at the end."""
    return all(n_events(x) == n for x in nodes)


def test_two_nodes_converge_over_a_faulty_serial_line(tmp_path):
    a, b = mesh(tmp_path, 2)
    write_rows(a, 50, "a")
    write_rows(b, 30, "b")
    f = dict(ber=1e-3, drop=0.02, duplicate=0.02, reorder=0.02, truncate=0.02)
    line = EndpointLine([SyncDriver(a, 50), SyncDriver(b, 50)], [LineFaults(seed=3, **f), LineFaults(seed=4, **f)])
    for i, ep in enumerate(line.eps):
        ep.start(0)
    assert line.run(3_000_000, lambda: all_in((a, b), 80))
    assert a.dump() == b.dump() and len(a.dump()[T]) == 80
    assert sum(ep.link.rejected_frames for ep in line.eps) > 0  # corrupted frames were there, and refused
    # No event was accepted that its signer did not sign: every row is one of the written ones.
    assert {(r["key"]["device"], r["values"]["temp"]) for r in a.dump()[T]} == \
        {("a", float(i)) for i in range(50)} | {("b", float(i)) for i in range(30)}


def test_pulled_cable_mid_exchange_then_replugged_converges(tmp_path):
    a, b = mesh(tmp_path, 2)
    write_rows(a, 150, "a")
    line = EndpointLine([SyncDriver(a, 50), SyncDriver(b, 50)], [LineFaults(seed=5), LineFaults(seed=6)],
                        dead_ms=2000, keepalive_ms=500)
    for ep in line.eps:
        ep.start(0)
    assert line.run(600_000, lambda: n_events(b) > 0)  # part of it crossed
    line.pulled = True
    for q in line.q:
        q.clear()
    assert line.run(line.t + 30_000, lambda: all(ep.session is None for ep in line.eps))  # both saw it
    line.pulled = False
    assert line.run(line.t + 600_000, lambda: all_in((a, b), 150))
    assert a.dump() == b.dump()
    assert all(ep.sessions >= 2 for ep in line.eps)
    kinds = [k for k, _ in line.eps[0].events]
    assert "link_down" in kinds and kinds.count("link_up") >= 2


def test_an_evicted_node_rehydrates_from_a_gateway_over_a_faulty_serial_line(tmp_path):
    """tests/lifecycle/test_rehydrate.py's scenario, the gateway and the Pi joined by a cable at
    BER 1e-3: they sync over it, the Pi evicts, asks for its history (a record in a body), the
    gateway re-offers from genesis on the same serial path and the Pi takes it all back."""
    from agent import rehydrate
    from agent.store import sync_state as st
    from tests.lifecycle.test_eviction import DAY, R, T0, TABLES
    from tests.sync.helpers import sync
    gw, pi, other = mesh(tmp_path, 3, TABLES)
    for s in range(40):
        other.write(R, {"device": "o", "seq": s}, {"temp": float(s)}, now=T0 + s)
    dg, dp = SyncDriver(gw), SyncDriver(pi)
    sync(SyncDriver(other), dg, T0 + 100)
    top = gw.conn.execute("SELECT max(seq) FROM events").fetchone()[0]
    f = dict(ber=1e-3, drop=0.02, duplicate=0.02, reorder=0.02, truncate=0.02)
    line = EndpointLine([dg, dp], [LineFaults(seed=8, **f), LineFaults(seed=9, **f)], base=T0 + 2 * DAY)
    for ep in line.eps:
        ep.start(0)
    served = lambda: st.cursor(gw.conn, pi.site_id, "serial")[0] >= top  # noqa: E731
    assert line.run(3_000_000, lambda: n_events(pi) == 40 and served())
    pi.evict_table(R, (T0 + DAY, 0))
    assert n_events(pi) == 0
    line.run(line.t + 20_000, lambda: False)
    assert n_events(pi) == 0  # the serial cursor passed it all: nothing comes by itself
    rehydrate.start(pi, gw.site_id, now=T0 + 2 * DAY + line.t)
    assert line.run(line.t + 3_000_000, lambda: n_events(pi) == 40 and served())
    assert pi.dump() == gw.dump()
    assert rehydrate.status(pi)["rehydrating"]["events_applied"] == 40
    assert rehydrate.status(gw)["serving"][0]["remaining_events_by_path"]["serial"] == 0


def test_a_long_run_keeps_a_bounded_event_list_and_counts_everything(tmp_path):
    """`run` keeps an endpoint for months: one event per exchange, every cadence. Only the latest
    EVENTS_KEPT are kept; the summary's counts cover all of them."""
    from agent.transport.serial import EVENTS_KEPT
    a, b = mesh(tmp_path, 2)
    line = EndpointLine([SyncDriver(a), SyncDriver(b)], [LineFaults(seed=1), LineFaults(seed=2)])
    ep = line.eps[0]
    for i in range(EVENTS_KEPT + 500):
        ep.events.append(("timeout", ""))
        ep.events.append(("link_down", "peer_silent" if i % 2 else "peer_restarted"))
    s = ep.summary()
    assert len(ep.events) == EVENTS_KEPT
    assert s["timeouts"] == EVENTS_KEPT + 500
    assert s["link"]["down_reasons"] == ["peer_restarted", "peer_silent"]
