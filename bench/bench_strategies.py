"""Hostile-peer strategies, measured (issue 16 item 3). Beyond the poison inputs of issue 11
(tests/mqtt/test_rogue.py, bench/bench_flood.py): peers that are mesh members (their key is in the
keyring, they publish only as themselves, as the broker ACLs of docs/mqtt.md enforce) and misbehave
on purpose. Each strategy runs twice on a fresh private mosquitto: with the attacker, and with the
same node behaving honestly (same topology, same workload), and reports the honest figures against
each other.

    python bench/bench_strategies.py [--events 200] [--attack-s 6] [strategy ...]

Strategies (`STRATEGIES`):

- never_answers     M takes every body (acks it to the broker) and never answers; advertises realtime.
- lying_watermarks  M reports applied watermarks at HLC 2^62 for every (site, table) and have_max_hlc 2^62.
- slow_trickle      M answers every body just before the sender gives up on it (holding its window),
                    and sends a body of one new event every 0.2 s.
- withhold_replay   M never offers its own events and re-sends old bodies of A's events (from itself) in a loop,
                    at most 8 unanswered (about what an honest window allows).
- replay_flood      the same with up to 200 unanswered: a member flooding bodies, ignoring any window.
- dropping_relay    A and B never meet; M and C relay. M drops every event of A (answers as if applied).
- signer_flood      M, a trusted signer, writes `--flood` valid events as fast as it can while A writes.

Every node's loop runs in its own thread (the harness touches a node only under its lock), so one
node's fsyncs do not stall another's loop; they still share the GIL and the machine's cores.
Honest workload: A writes `--events` events (20 per 0.1 s). Figures for B (the honest receiver):
convergence = time from A's first write until B holds all of A's events and B's applied watermark
for A's stream covers A's newest HLC (the binding is run secure: anonymous broker, but every node
publishes only under its own name, as the ACLs would make it); B's CPU (thread time of B's steps),
B's home growth on disk, and the bytes the attacker published (its messages' payloads). The
runs share one process: RSS is the whole process's peak growth (all nodes), stated as such."""
from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("SSP_AGENT_WITNESS_DIR", tempfile.mkdtemp(prefix="ssp-bench-witness-"))
os.environ.setdefault("SSP_AGENT_CLOCK_TRUSTED", "1")

from agent.core.cose import parse_sign1  # noqa: E402
from agent.core.messages import SyncBody, Watermark, emit_body, parse_body  # noqa: E402
from agent.node import Node  # noqa: E402
from agent.outcomes import Outcome  # noqa: E402
from agent.runner import KIND_BATCH, RunConfig, Runner  # noqa: E402
from agent.simpeer import manifest_text, readings_table  # noqa: E402
from agent.store import sync_state as st  # noqa: E402
from agent.sync import PortAdapter  # noqa: E402
from agent.transport.broker import Broker  # noqa: E402
from agent.transport.mqtt import P_COUNT, P_END, P_KIND, P_META, P_PART, P_START, MqttSettings  # noqa: E402

MESH = bytes.fromhex("57a70000000000000000000000000042")
MANIFEST = manifest_text(MESH, readings_table())
T = "app.readings"
STRATEGIES = ("never_answers", "lying_watermarks", "slow_trickle", "withhold_replay", "replay_flood",
              "dropping_relay", "signer_flood")
REPLAY_IN_FLIGHT = {"withhold_replay": 8, "replay_flood": 200}  # replayed bodies M keeps unanswered
LIE = (2 ** 62, 0)


def home_bytes(p: Path) -> int:
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def rss_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


# ------------------------------------------------------------------ ports and runners of the attacker
class Topology(PortAdapter):
    """Only these peers are offered to (who talks to whom: A and B never meet in dropping_relay)."""

    def __init__(self, node, allowed: set[bytes] | None, **kw) -> None:
        super().__init__(node, **kw)
        self.allowed = allowed

    def peers(self) -> list[bytes]:
        return [p for p in super().peers() if self.allowed is None or p in self.allowed]


class LyingPort(Topology):
    """Watermark reports and have_max_hlc far above anything held."""

    def have_max(self):
        return LIE

    def body(self, events=(), peer=None, token=None, extra_records=()):
        b = parse_body(super().body(events, peer, token, extra_records))
        sites = [s for s in self.node.keyring] + [self.node.site_id]
        wms = tuple(Watermark(s, T, LIE) for s in sorted(set(sites)))
        return emit_body(replace(b, have_max_hlc=LIE, applied_watermarks=wms))


class DroppingPort(Topology):
    """A relay that drops every event of `victim` it receives, and answers as if it applied them."""

    def __init__(self, node, allowed, victim: bytes, **kw) -> None:
        super().__init__(node, allowed, **kw)
        self.victim = victim
        self.dropped = 0

    def receive(self, data, meta=None, sender=None):
        b = parse_body(data)
        keep = tuple(e for e in b.events if parse_sign1(e).kid != self.victim)
        body, outs, _k = super().receive(emit_body(replace(b, events=keep)), None, sender)
        pad = len(b.events) - len(keep)
        self.dropped += pad
        return b, list(outs) + [Outcome("applied", "applied")] * pad, len(b.events)


class AttackerRunner(Runner):
    """The attacker node's loop: an honest Runner except where a strategy says otherwise; counts
    the bytes it publishes (payloads) in `sent_bytes`."""
    strategy = "honest"

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.old_bodies: list = []  # withhold_replay: bodies of old events it re-sends
        self.sent_bytes = 0
        self._delayed: list = []
        self._next_trickle = 0.0
        self._i = 0
        push, answer = self.link.push, self.link.answer

        def counted_push(peer, body, user, correlation=None):
            self.sent_bytes += len(body)
            return push(peer, body, user, correlation)

        def counted_answer(m, body, user):
            self.sent_bytes += len(body)
            return answer(m, body, user)
        self.link.push, self.link.answer = counted_push, counted_answer

    def _on_request(self, m) -> None:
        if self.strategy == "never_answers":
            self.stats["withheld_answers"] += 1
            self.link.ack(m)  # taken from the broker, never answered
            return
        if self.strategy == "slow_trickle":
            self._delayed.append((time.monotonic() + self.hold_s, m))
            return
        super()._on_request(m)

    def offer(self, peer, kind=KIND_BATCH, bodies=None, force=False) -> int:
        if self.strategy in REPLAY_IN_FLIGHT:
            return 0  # its own events are withheld; it only replays (step)
        return super().offer(peer, kind, bodies, force)

    def step(self, timeout: float = 0.05) -> None:
        super().step(timeout)
        now = time.monotonic()
        if self.strategy == "slow_trickle":
            due = [x for x in self._delayed if x[0] <= now]
            self._delayed = [x for x in self._delayed if x[0] > now]
            for _t, m in due:
                super()._on_request(m)
            if now >= self._next_trickle:
                self._next_trickle = now + 0.2
                self._i += 1
                self.node.write(T, {"device": "trickle", "seq": self._i}, {"temp": 1.0, "note": "t"})
        elif self.strategy in REPLAY_IN_FLIGHT and self.old_bodies:
            for peer in self.sync.peers():
                while self.in_flight(peer) < REPLAY_IN_FLIGHT[self.strategy]:
                    events = self.old_bodies[self._i % len(self.old_bodies)]
                    self._i += 1
                    body = emit_body(SyncBody(self.node.site_id, self.have_max_hlc(), tuple(events), (), ()))
                    n = len(events)
                    user = {P_KIND: KIND_BATCH, P_START: "0", P_END: "0", P_COUNT: str(n), P_PART: "1/1"}
                    corr = self.link.push(peer, body, user)
                    from agent.runner import _Pending
                    self.pending[corr] = _Pending(peer, KIND_BATCH, 0, 0, [], now, 0, False, None, len(body))

    def have_max_hlc(self):
        return self.sync.have_max()

    def _on_answer(self, m) -> None:
        if self.strategy in REPLAY_IN_FLIGHT:
            self.link.ack(m)
            self.pending.pop(m.correlation, None)
            return
        super()._on_answer(m)


# ------------------------------------------------------------------ one run
def _nodes(root: Path, names: list[str]) -> dict[str, Node]:
    nodes = {n: Node.init(root / n, MANIFEST)[0] for n in names}
    for x in nodes.values():
        for y in nodes.values():
            if x is not y:
                x.add_peer(y.site_id, y.keyring[y.site_id][0], None)
    return nodes


def run(strategy: str, attack: bool, root: Path, events: int = 200, attack_s: float = 6.0, flood: int = 3000,
        timeout_s: float = 120.0) -> dict:
    """One run of `strategy` (attack=False: M honest). Returns the figures for B."""
    relay = strategy == "dropping_relay"
    names = ["a", "b", "m"] + (["c"] if relay else [])
    nodes = _nodes(root, names)
    a, b, m = nodes["a"], nodes["b"], nodes["m"]
    ids = {k: n.site_id for k, n in nodes.items()}
    topo = ({"a": {ids["m"], ids["c"]}, "b": {ids["m"], ids["c"]}, "m": {ids["a"], ids["b"]},
             "c": {ids["a"], ids["b"]}} if relay else {k: None for k in names})
    out: dict = {"strategy": strategy, "attack": attack}
    with Broker(workdir=root / "broker") as br:
        settings = MqttSettings.from_url(br.url, backoff_min_s=0.05, backoff_max_s=0.5)
        cfg = dict(cadence_s=0.5, answer_timeout_s=3.0, secure=True, realtime=not relay)
        runners = {}
        for k in names:
            if k == "m":
                if attack and strategy == "lying_watermarks":
                    port = LyingPort(nodes[k], topo[k], path="mqtt", secure=True)
                elif attack and relay:
                    port = DroppingPort(nodes[k], topo[k], ids["a"], path="mqtt", secure=True)
                else:
                    port = Topology(nodes[k], topo[k], path="mqtt", secure=True)
                r = AttackerRunner(nodes[k], settings, RunConfig(**cfg), port=port)
                r.strategy = strategy if attack and strategy in (
                    "never_answers", "slow_trickle", *REPLAY_IN_FLIGHT) else "honest"
                r.hold_s = cfg["answer_timeout_s"] * 0.9
            else:
                r = Runner(nodes[k], settings, RunConfig(**cfg), port=Topology(nodes[k], topo[k], path="mqtt",
                                                                                 secure=True))
            assert r.start(10), r.link.last_error
            runners[k] = r
        rb = runners["b"]
        b_cpu = [0.0]
        # How many requests B handled while a body of A waited in B's inbox (scheduling fairness):
        # each arrival is stamped with B's count of handled requests.
        stamp: dict[int, int] = {}
        handled = [0]
        ahead: list[int] = []
        put, handle = rb.link.inbound.put, rb._handle

        def stamped_put(item, *x, **kw):
            stamp[id(item)] = handled[0]
            return put(item, *x, **kw)

        def counted_handle(msg):
            if msg.kind == "req":
                arrived = stamp.pop(id(msg), handled[0])
                if msg.sender == ids["a"]:
                    ahead.append(handled[0] - arrived)
                handled[0] += 1
            return handle(msg)
        rb.link.inbound.put, rb._handle = stamped_put, counted_handle
        # Each node's loop in its own thread (as on its own device: one node's fsyncs do not stall
        # another's loop); the harness touches a node only under its lock.
        locks = {k: threading.Lock() for k in names}
        stop = threading.Event()

        def loop(k: str, r: Runner) -> None:
            while not stop.is_set():
                with locks[k]:
                    t = time.thread_time()
                    r.step(0.005)
                    if k == "b":
                        b_cpu[0] += time.thread_time() - t
                time.sleep(0)  # let the harness take the lock between steps
        threads = [threading.Thread(target=loop, args=(k, r), daemon=True) for k, r in runners.items()]
        for th in threads:
            th.start()

        def on(k: str, fn):
            with locks[k]:
                return fn()

        # Settle: presence seen, an empty exchange done.
        time.sleep(1.0)
        if strategy in REPLAY_IN_FLIGHT:
            own = on("m", lambda: m.write_many([(T, {"device": "m", "seq": i}, {"temp": 3.0, "note": "m"}, False)
                                                for i in range(20)]))
            old = on("a", lambda: [a.write(T, {"device": "old", "seq": i}, {"temp": 0.0, "note": "o"})
                                   for i in range(20)])
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not set(old) <= on("m", lambda: _ids(m)):
                time.sleep(0.01)
            raws = on("m", lambda: [bytes(r[0]) for r in m.conn.execute("SELECT unseal(event_id, raw) FROM events WHERE site_id=?",
                                                                        (ids["a"],))])
            runners["m"].old_bodies = [raws[i:i + 10] for i in range(0, len(raws), 10)]
        on("b", lambda: b.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall())  # the store, not the WAL's high-water mark
        disk0, cpu0, rss0 = home_bytes(root / "b"), b_cpu[0], rss_kb()
        sent0 = runners["m"].sent_bytes
        t0 = time.monotonic()
        flood_left = flood if (attack and strategy == "signer_flood") else 0
        written: list[bytes] = []
        a_done_at = None
        attack_until = t0 + attack_s
        while True:
            now = time.monotonic()
            if len(written) < events and now >= t0 + 0.1 * (len(written) // 20):
                n0 = len(written)
                written += on("a", lambda: a.write_many([(T, {"device": "a", "seq": n0 + j}, {"temp": 1.0, "note": "a"},
                                                          False) for j in range(20)]))
            if flood_left and now < attack_until:
                k, f0 = min(100, flood_left), flood - flood_left
                on("m", lambda: m.write_many([(T, {"device": "flood", "seq": f0 + j}, {"temp": 2.0, "note": "f" * 40},
                                               False) for j in range(k)]))
                flood_left -= k
            time.sleep(0.005)
            # Relayed events never advance B's watermark for A (only A's own authenticated stream does,
            # docs/protocol.md §3): in the relay topology convergence is holding the events.
            if a_done_at is None and len(written) >= events and set(written) <= on("b", lambda: _ids(b)) and (
                    relay or on("b", lambda: on("a", lambda: _covered(b, a)))):
                a_done_at = time.monotonic()
            if a_done_at is not None and now >= attack_until:
                break
            if now - t0 > timeout_s:
                break
        stop.set()
        for th in threads:
            th.join()
        out["converged_s"] = None if a_done_at is None else round(a_done_at - t0, 3)
        out["b_has_all_of_a"] = set(written) <= _ids(b)
        out["b_watermark_covers_a"] = _covered(b, a)
        out["b_cpu_s"] = round(b_cpu[0] - cpu0, 3)
        b.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        out["b_disk_growth"] = home_bytes(root / "b") - disk0
        out["rss_growth_kb"] = rss_kb() - rss0
        out["attacker_bytes"] = runners["m"].sent_bytes - sent0
        out["elapsed_s"] = round(time.monotonic() - t0, 3)
        out["a_pending_for_m"] = runners["a"].in_flight(ids["m"]) if "a" in runners else 0
        out["a_sent_bodies_for_m"] = a.conn.execute("SELECT count(*) FROM sent_bodies WHERE peer=?",
                                                    (ids["m"],)).fetchone()[0]
        out["b_events"] = b.conn.execute("SELECT count(*) FROM events").fetchone()[0]
        # have_max_hlc is advisory (docs/protocol.md §2): a lie of 2^62 must not move B's clock.
        out["b_clock_ahead_ms"] = b.clock.physical_ms - int(time.time() * 1000)
        out["b_stats"] = {k: v for k, v in rb.stats.items() if v}
        out["b_max_handled_ahead_of_a"] = max(ahead, default=0)
        out["m_lost_own"] = None
        if strategy == "lying_watermarks":
            # A kept M's report (secure binding) and skips what it claims: whatever M then lacks is
            # its own loss (it may have taken some of A's events before its first report arrived).
            out["a_kept_lie"] = any(tuple(h) == LIE for h in st.peer_watermarks(a.conn, ids["m"]).values())
            out["m_lost_own"] = not set(written) <= _ids(m)
        if strategy in REPLAY_IN_FLIGHT:
            out["m_lost_own"] = not set(own) <= _ids(b)  # attack: B lacks what M withheld (its own loss)
        if relay and attack:
            out["m_dropped"] = runners["m"].sync.dropped
        for r in runners.values():
            r.close()
    for n in nodes.values():
        n.close()
    return out


def _ids(node: Node) -> set[bytes]:
    return {bytes(r[0]) for r in node.conn.execute("SELECT event_id FROM events")}


def _covered(b: Node, a: Node) -> bool:
    """B's own applied watermark for A's stream covers A's newest event (secure binding, §3)."""
    top = a.conn.execute("SELECT hlc_p, hlc_l FROM events WHERE site_id=? ORDER BY hlc_p DESC, hlc_l DESC LIMIT 1",
                         (a.site_id,)).fetchone()
    if top is None:
        return True
    wm = st.own_watermarks(b.conn).get((a.site_id, T))
    return wm is not None and tuple(wm) >= tuple(top)


def compare(strategy: str, root: Path, **kw) -> dict:
    base = run(strategy, False, root / f"{strategy}-base", **kw)
    att = run(strategy, True, root / f"{strategy}-attack", **kw)
    ab = att["attacker_bytes"]
    per = ab >= 1024  # per-byte figures only where the attacker sent something to speak of
    return {"strategy": strategy, "base": base, "attack": att,
            "slowdown": (att["converged_s"] / base["converged_s"]) if att["converged_s"] and base["converged_s"] else None,
            "cpu_us_per_attacker_byte": 1e6 * (att["b_cpu_s"] - base["b_cpu_s"]) / ab if per else None,
            "disk_bytes_per_attacker_byte": (att["b_disk_growth"] - base["b_disk_growth"]) / ab if per else None}


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("strategies", nargs="*", default=list(STRATEGIES))
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--attack-s", type=float, default=6.0)
    ap.add_argument("--flood", type=int, default=3000)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ssp-bench-strategies-"))
    print(f"{'strategy':18s} {'conv base s':>11s} {'conv attack s':>13s} {'slowdown':>8s} {'attacker B':>10s} "
          f"{'B cpu s (base/att)':>19s} {'B disk (base/att)':>20s} {'cpu us/B':>9s} {'disk B/B':>8s}")
    for s in args.strategies:
        c = compare(s, root, events=args.events, attack_s=args.attack_s, flood=args.flood)
        b, a = c["base"], c["attack"]
        sd = f"{c['slowdown']:.2f}" if c["slowdown"] else "never"
        print(f"{s:18s} {b['converged_s']!s:>11s} {a['converged_s']!s:>13s} {sd:>8s} {a['attacker_bytes']:>10d} "
              f"{b['b_cpu_s']:>9.2f}/{a['b_cpu_s']:<9.2f} {b['b_disk_growth']:>10d}/{a['b_disk_growth']:<9d} "
              f"{_f(c['cpu_us_per_attacker_byte']):>9s} {_f(c['disk_bytes_per_attacker_byte']):>8s}", flush=True)
        extra = {k: a[k] for k in ("b_max_handled_ahead_of_a", "m_lost_own", "a_kept_lie", "m_dropped", "a_pending_for_m", "a_sent_bodies_for_m", "rss_growth_kb",
                                   "b_clock_ahead_ms", "b_has_all_of_a", "b_watermark_covers_a")
                 if a.get(k) is not None}
        print(f"{'':18s} {extra}", flush=True)


if __name__ == "__main__":
    main()
