"""Hostile-peer strategies, measured. Beyond the poison inputs
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
- signer_flood      M, a trusted signer, writes `--flood` valid events as fast as it can while A writes
                    (all of them, however long that takes; the run ends once B holds them too).

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
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from _harness import ROOT, bench_env, home_bytes, of_rounds, record  # noqa: E402  (bench/: the shared set-up)

bench_env()
from agent.core.cose import parse_sign1  # noqa: E402
from agent.core.messages import SyncBody, Watermark, emit_body, parse_body  # noqa: E402
from agent.node import Node  # noqa: E402
from agent.outcomes import Outcome  # noqa: E402
from agent.runner import KIND_BATCH, P_ACK, RunConfig, Runner  # noqa: E402
from agent.simpeer import manifest_text, readings_table  # noqa: E402
from agent.store import db, sync_state as st  # noqa: E402
from agent.sync_port import PortAdapter  # noqa: E402
from agent.transport.broker import Broker  # noqa: E402
from agent.transport.mqtt import P_COUNT, P_END, P_KIND, P_META, P_PART, P_START, MqttSettings  # noqa: E402

MESH = bytes.fromhex("57a70000000000000000000000000042")
MANIFEST = manifest_text(MESH, readings_table())
T = "app.readings"
STRATEGIES = ("never_answers", "lying_watermarks", "slow_trickle", "withhold_replay", "replay_flood",
              "dropping_relay", "signer_flood")
REPLAY_IN_FLIGHT = {"withhold_replay": 8, "replay_flood": 200}  # replayed bodies M keeps unanswered
LIE = (2 ** 62, 0)


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

    def receive(self, data, meta=None, sender=None, parsed=None):
        # PortAdapter.receive's signature: the Runner hands over its early parse (`parsed`).
        b = parse_body(data) if parsed is None else parsed
        keep = tuple(e for e in b.events if parse_sign1(e).kid != self.victim)
        kept = replace(b, events=keep)
        body, outs, _k = super().receive(emit_body(kept), None, sender, parsed=kept)
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
                    if not self.cfg.secure:
                        user[P_ACK] = "1"  # as an honest sender asks there: B signs for its replays too
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


class NodeProc:
    """The honest receiver B in its own process (bench/strategy_node.py): its CPU and memory are
    its own, not the harness's (A, M and C share this process)."""

    def __init__(self, home: Path, url: str, cfg: dict, allowed: set[bytes] | None, watch: bytes) -> None:
        conf = {"run": cfg, "allowed": None if allowed is None else sorted(x.hex() for x in allowed),
                "watch": watch.hex(), "table": T}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "bench" / "strategy_node.py"), str(home), url,
                                      json.dumps(conf)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONPATH=str(ROOT)))
        first = self._line()
        if not first.get("ready"):
            raise RuntimeError(f"B did not start: {first}")
        self.peak_rss_kb = 0

    def _line(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"B exited ({self.proc.wait()})")
        return json.loads(line)

    def ask(self, cmd: str) -> dict:
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        out = self._line()
        if "rss_kb" in out:
            self.peak_rss_kb = max(self.peak_rss_kb, out["rss_kb"])
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask("stop")
            finally:
                self.proc.wait(30)


BINDINGS = ("secure", "signed-ack")   # RunConfig.secure True / False (the default: answers carry signed acks)


def run(strategy: str, attack: bool, root: Path, events: int = 200, attack_s: float = 6.0, flood: int = 3000,
        timeout_s: float = 120.0, binding: str = "secure", poll_s: float = 0.02, min_attack_bytes: int = 0) -> dict:
    """One run of `strategy` (attack=False: M honest) on `binding`. Returns the figures for B.

    Times from A's first write (t0): `held_s` B holds every event of A; `watermark_s` B's own
    applied watermark for A's stream covers A's newest (secure binding only: elsewhere nothing
    moves it); `acked_s` A's cursor for B covers A's newest (A has B's answers for all of it: on
    the default binding signed acknowledgements). `converged_s`: held and, where A's stream reaches
    B directly, watermark (secure) or acked (default binding).

    The attack lasts `attack_s` and, however slow the machine, until M has published
    `min_attack_bytes` (a count, not a rate); `timeout_s` only catches a run that never ends."""
    secure = binding == "secure"
    relay = strategy == "dropping_relay"
    names = ["a", "b", "m"] + (["c"] if relay else [])
    nodes = _nodes(root, names)
    a, m = nodes["a"], nodes["m"]
    ids = {k: n.site_id for k, n in nodes.items()}
    b_home = nodes["b"].home
    nodes.pop("b").close()   # B runs in its own process
    topo = ({"a": {ids["m"], ids["c"]}, "b": {ids["m"], ids["c"]}, "m": {ids["a"], ids["b"]},
             "c": {ids["a"], ids["b"]}} if relay else {k: None for k in names})
    out: dict = {"strategy": strategy, "attack": attack, "binding": binding}
    with Broker(workdir=root / "broker") as br:
        settings = MqttSettings.from_url(br.url, backoff_min_s=0.05, backoff_max_s=0.5)
        cfg = dict(cadence_s=0.5, answer_timeout_s=3.0, secure=secure, realtime=not relay)
        runners = {}
        for k in names:
            if k == "b":
                continue
            if k == "m":
                if attack and strategy == "lying_watermarks":
                    port = LyingPort(nodes[k], topo[k], path="mqtt", secure=secure)
                elif attack and relay:
                    port = DroppingPort(nodes[k], topo[k], ids["a"], path="mqtt", secure=secure)
                else:
                    port = Topology(nodes[k], topo[k], path="mqtt", secure=secure)
                r = AttackerRunner(nodes[k], settings, RunConfig(**cfg), port=port)
                r.strategy = strategy if attack and strategy in (
                    "never_answers", "slow_trickle", *REPLAY_IN_FLIGHT) else "honest"
                r.hold_s = cfg["answer_timeout_s"] * 0.9
            else:
                r = Runner(nodes[k], settings, RunConfig(**cfg), port=Topology(nodes[k], topo[k], path="mqtt",
                                                                                 secure=secure))
            assert r.start(60), r.link.last_error
            runners[k] = r
        bp = NodeProc(b_home, br.url, cfg, topo["b"], ids["a"])
        try:
            out.update(_drive(strategy, attack, root, nodes, runners, bp, ids, events, attack_s, flood, timeout_s,
                              secure, relay, poll_s, min_attack_bytes))
        finally:
            for r in runners.values():
                r.close()
            bp.stop()
    # B's final state, read from its store once its process has closed it.
    conn = db.connect_readonly(b_home / Node.STORE_FILE)
    try:
        b_ids = _ids_of(conn)
        out["b_has_all_of_a"] = set(out.pop("_written")) <= b_ids
        out["b_watermark_covers_a"] = _covered_by(conn, a)
        out["b_events"] = len(b_ids)
        if "_own" in out:
            out["m_lost_own"] = not set(out.pop("_own")) <= b_ids  # attack: B lacks what M withheld
    finally:
        conn.close()
    out["b_disk_growth"] = home_bytes(b_home) - out.pop("_disk0")
    for n in nodes.values():
        n.close()
    return out


def _drive(strategy, attack, root, nodes, runners, bp: NodeProc, ids, events, attack_s, flood, timeout_s, secure,
           relay, poll_s, min_attack_bytes) -> dict:
    a, m = nodes["a"], nodes["m"]
    out: dict = {}
    # Each node's loop in its own thread (as on its own device: one node's fsyncs do not stall
    # another's loop); the harness touches a node only under its lock.
    locks = {k: threading.Lock() for k in runners}
    stop = threading.Event()
    failed: dict[str, BaseException] = {}

    def loop(k: str, r: Runner) -> None:
        try:
            while not stop.is_set():
                with locks[k]:
                    r.step(0.005)
                time.sleep(0)  # let the harness take the lock between steps
        except BaseException as e:  # noqa: BLE001 - raised again by the harness (below)
            # A node whose loop died is no node: the run must say so, not end with an honest
            # path carrying everything and a figure of the dead node at 0 (the dropping relay's
            # override lagged behind PortAdapter.receive's signature for a whole CI cycle).
            failed[k] = e
            stop.set()
    threads = [threading.Thread(target=loop, args=(k, r), daemon=True) for k, r in runners.items()]
    for th in threads:
        th.start()

    def on(k: str, fn):
        with locks[k]:
            return fn()
    try:
        # Settle: presence seen, an empty exchange done.
        time.sleep(1.0)
        if strategy in REPLAY_IN_FLIGHT:
            out["_own"] = on("m", lambda: m.write_many([(T, {"device": "m", "seq": i}, {"temp": 3.0, "note": "m"},
                                                         False) for i in range(20)]))
            old = on("a", lambda: [a.write(T, {"device": "old", "seq": i}, {"temp": 0.0, "note": "o"})
                                   for i in range(20)])
            deadline = time.monotonic() + timeout_s   # a ceiling for a hang: M replays all of them
            while not set(old) <= on("m", lambda: _ids(m)):
                if time.monotonic() > deadline or failed:
                    raise RuntimeError(f"M did not get A's {len(old)} old events in {timeout_s} s: {failed}")
                time.sleep(0.01)
            raws = on("m", lambda: [bytes(r[0]) for r in m.conn.execute(
                "SELECT unseal(event_id, raw) FROM events WHERE site_id=?", (ids["a"],))])
            runners["m"].old_bodies = [raws[i:i + 10] for i in range(0, len(raws), 10)]
        bp.ask("checkpoint")   # the store, not the WAL's high-water mark
        out["_disk0"] = home_bytes(nodes["a"].home.parent / "b")
        s0 = bp.ask("status")
        cpu0, rss0 = s0["cpu_s"], s0["rss_kb"]
        bp.peak_rss_kb = rss0
        sent0 = runners["m"].sent_bytes
        t0 = time.monotonic()
        flood_left = flood if (attack and strategy == "signer_flood") else 0
        flooded = 0   # events M wrote in the flood: B must hold them all before the run ends
        written: list[bytes] = []
        held = wm = acked = None
        attack_until = t0 + attack_s
        next_poll = t0
        st_b = s0
        while True:
            now = time.monotonic()
            if len(written) < events and now >= t0 + 0.1 * (len(written) // 20):
                n0 = len(written)
                written += on("a", lambda: a.write_many([(T, {"device": "a", "seq": n0 + j},
                                                          {"temp": 1.0, "note": "a"}, False) for j in range(20)]))
            if flood_left:   # the whole flood, however long it takes to write (a count, not a rate)
                k, f0 = min(100, flood_left), flood - flood_left
                flooded += len(on("m", lambda: m.write_many([(T, {"device": "flood", "seq": f0 + j},
                                                                  {"temp": 2.0, "note": "f" * 40}, False)
                                                                 for j in range(k)])))
                flood_left -= k
            time.sleep(0.005)
            if len(written) >= events and now >= next_poll:
                next_poll = now + poll_s
                st_b = bp.ask("status")
                n_a, top, top_seq = on("a", lambda: _own_top(a))
                t = time.monotonic() - t0
                if held is None and st_b["watch_events"] >= n_a:
                    held = t
                if secure and wm is None and st_b["watermark"] is not None and tuple(st_b["watermark"]) >= top:
                    wm = t
                if not relay and acked is None and on("a", lambda: st.cursor(a.conn, ids["b"], "mqtt")[0]) >= top_seq:
                    acked = t
            progress = None if relay else (wm if secure else acked)
            done = held is not None and (relay or progress is not None)
            attacked = (now >= attack_until and not flood_left
                        and runners["m"].sent_bytes - sent0 >= min_attack_bytes
                        and st_b["events"] >= len(written) + flooded)
            if done and attacked:
                break
            if now - t0 > timeout_s or failed:
                break
        if failed:
            k, e = next(iter(failed.items()))
            raise RuntimeError(f"node {k}'s loop failed: {e!r}") from e
        end = bp.ask("status")
        out["held_s"], out["watermark_s"], out["acked_s"] = _r(held), _r(wm), _r(acked)
        out["converged_s"] = _r(max(held, progress)) if done and not relay else _r(held) if done else None
        out["_written"] = written
        out["b_cpu_s"] = round(end["cpu_s"] - cpu0, 3)
        out["b_rss_growth_kb"] = bp.peak_rss_kb - rss0
        out["b_rss_kb"] = end["rss_kb"]
        out["attacker_bytes"] = runners["m"].sent_bytes - sent0
        out["elapsed_s"] = round(time.monotonic() - t0, 3)
        out["a_pending_for_m"] = on("a", lambda: runners["a"].in_flight(ids["m"]))
        out["a_sent_bodies_for_m"] = on("a", lambda: a.conn.execute("SELECT count(*) FROM sent_bodies WHERE peer=?",
                                                                   (ids["m"],)).fetchone()[0])
        # have_max_hlc is advisory (docs/protocol.md §2): a lie of 2^62 must not move B's clock.
        out["b_clock_ahead_ms"] = end["clock_ms"] - int(time.time() * 1000)
        out["b_stats"] = end["stats"]
        out["b_max_handled_ahead_of_a"] = end["max_handled_ahead"]
        out["m_lost_own"] = None
        if strategy == "lying_watermarks":
            # A kept M's report (secure binding) and skips what it claims: whatever M then lacks is
            # its own loss (it may have taken some of A's events before its first report arrived).
            out["a_kept_lie"] = on("a", lambda: any(tuple(h) == LIE for h in st.peer_watermarks(a.conn, ids["m"]).values()))
            out["m_lost_own"] = not set(written) <= on("m", lambda: _ids(m))
        if strategy == "dropping_relay" and attack:
            out["m_dropped"] = runners["m"].sync.dropped
    finally:
        stop.set()
        for th in threads:
            th.join()
    return out


def _r(x):
    return None if x is None else round(x, 3)


def _own_top(a: Node) -> tuple[int, tuple[int, int], int]:
    """A's own events: how many, the newest HLC, the newest seq in A's log."""
    n, p, lg, sq = a.conn.execute(
        "SELECT count(*), max(hlc_p), 0, max(seq) FROM events WHERE site_id=?", (a.site_id,)).fetchone()
    top = a.conn.execute("SELECT hlc_p, hlc_l FROM events WHERE site_id=? ORDER BY hlc_p DESC, hlc_l DESC LIMIT 1",
                         (a.site_id,)).fetchone()
    return n, (tuple(top) if top else (0, 0)), sq or 0


def _ids(node: Node) -> set[bytes]:
    return _ids_of(node.conn)


def _ids_of(conn) -> set[bytes]:
    return {bytes(r[0]) for r in conn.execute("SELECT event_id FROM events")}


def _covered_by(conn, a: Node) -> bool:
    """B's own applied watermark for A's stream covers A's newest event (secure binding, §3)."""
    top = a.conn.execute("SELECT hlc_p, hlc_l FROM events WHERE site_id=? ORDER BY hlc_p DESC, hlc_l DESC LIMIT 1",
                         (a.site_id,)).fetchone()
    if top is None:
        return True
    wm = st.own_watermarks(conn).get((a.site_id, T))
    return wm is not None and tuple(wm) >= tuple(top)


def compare(strategy: str, root: Path, rounds: int = 1, binding: str = "secure", **kw) -> dict:
    """`rounds` pairs of runs (honest M, attacking M; the order alternates per round) on `binding`:
    per-round figures and their medians and ranges."""
    pairs = []
    for k in range(rounds):
        order = (False, True) if k % 2 == 0 else (True, False)
        got = {att: run(strategy, att, root / f"{strategy}-{binding}-{k}-{'attack' if att else 'base'}", binding=binding,
                        **kw) for att in order}
        pairs.append((got[False], got[True]))
    return {"strategy": strategy, "binding": binding, "rounds": [summarize(b, a) for b, a in pairs]}


def summarize(base: dict, att: dict) -> dict:
    """One round: the honest run against the attacked one. Per attacker byte only where M sent
    more than 1 KiB (the difference of B's figures between the two runs)."""
    ab = att["attacker_bytes"]
    per = ab >= 1024
    return {"base": base, "attack": att,
            "slowdown": (att["converged_s"] / base["converged_s"]) if att["converged_s"] and base["converged_s"] else None,
            "cpu_us_per_attacker_byte": 1e6 * (att["b_cpu_s"] - base["b_cpu_s"]) / ab if per else None,
            "disk_bytes_per_attacker_byte": (att["b_disk_growth"] - base["b_disk_growth"]) / ab if per else None,
            "rss_bytes_per_attacker_byte": 1024 * (att["b_rss_growth_kb"] - base["b_rss_growth_kb"]) / ab if per else None}


def spread(xs) -> str:
    """median [min-max] of the values that exist; "never" for runs that did not converge."""
    vals = [x for x in xs if x is not None]
    miss = len(xs) - len(vals)
    if not vals:
        return "never" if xs else "-"
    med = statistics.median(vals)
    txt = f"{med:.2f} [{min(vals):.2f}-{max(vals):.2f}]"
    return txt + (f" ({miss} never)" if miss else "")


def _f(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def report(c: dict) -> str:
    rs = c["rounds"]
    col = lambda side, key: [r[side][key] for r in rs]  # noqa: E731
    def med(key):
        vals = [r[key] for r in rs if r[key] is not None]
        return statistics.median(vals) if vals else None
    progress = "watermark_s" if c["binding"] == "secure" else "acked_s"
    lines = [f"{c['strategy']:17s} {c['binding']:10s} conv {spread(col('base', 'converged_s')):>22s} / "
             f"{spread(col('attack', 'converged_s')):<26s} {progress[:-2]} {spread(col('base', progress)):>22s} / "
             f"{spread(col('attack', progress)):<26s}",
             f"{'':28s} attacker B {statistics.median(col('attack', 'attacker_bytes')):>9.0f}  "
             f"B cpu s {spread(col('base', 'b_cpu_s'))} / {spread(col('attack', 'b_cpu_s'))}  "
             f"B rss growth KiB {spread(col('base', 'b_rss_growth_kb'))} / {spread(col('attack', 'b_rss_growth_kb'))}  "
             f"B disk KiB {statistics.median(col('base', 'b_disk_growth')) / 1024:.0f} / "
             f"{statistics.median(col('attack', 'b_disk_growth')) / 1024:.0f}",
             f"{'':28s} per attacker byte (median): cpu {_f(med('cpu_us_per_attacker_byte'))} us, disk "
             f"{_f(med('disk_bytes_per_attacker_byte'))} B, rss {_f(med('rss_bytes_per_attacker_byte'))} B"]
    a = rs[-1]["attack"]
    extra = {k: a[k] for k in ("b_max_handled_ahead_of_a", "m_lost_own", "a_kept_lie", "m_dropped", "a_pending_for_m",
                               "a_sent_bodies_for_m", "b_clock_ahead_ms", "b_has_all_of_a", "b_watermark_covers_a")
             if a.get(k) is not None}
    lines.append(f"{'':28s} last attack run: {extra}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("strategies", nargs="*", default=list(STRATEGIES))
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--attack-s", type=float, default=6.0)
    ap.add_argument("--flood", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--binding", choices=(*BINDINGS, "both"), default="both")
    ap.add_argument("--json", help="write every run's figures here")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ssp-bench-strategies-"))
    bindings = BINDINGS if args.binding == "both" else (args.binding,)
    print(f"{args.events} honest events, attack {args.attack_s} s, {args.rounds} rounds; times from A's first write: "
          "median [min-max] over the rounds, honest M / attacking M; B in its own process", flush=True)
    results = []
    for s in args.strategies:
        for bnd in bindings:
            c = compare(s, root, rounds=args.rounds, binding=bnd, events=args.events, attack_s=args.attack_s,
                        flood=args.flood)
            results.append(c)
            print(report(c), flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    figures, denominators, line = {}, {}, []
    for c in results:
        tag, rs = f"{c['strategy']}_{c['binding']}", c["rounds"]
        for key in ("slowdown", "cpu_us_per_attacker_byte", "disk_bytes_per_attacker_byte"):
            vals = [r[key] for r in rs if r[key] is not None]
            if vals:
                figures[f"{tag}_{key}"] = of_rounds(vals)
        figures[f"{tag}_attacked_runs_never_converged"] = sum(r["attack"]["converged_s"] is None for r in rs)
        honest = [r["base"]["converged_s"] for r in rs if r["base"]["converged_s"] is not None]
        if honest:
            denominators[f"{tag}_honest_converged_s"] = of_rounds(honest)
        slow = [r["slowdown"] for r in rs if r["slowdown"] is not None]
        line.append(f"{tag} " + (f"x{statistics.median(slow):.2f}" if slow else "never converged"))
    record(figures, denominators, "convergence under attack / honest (median): " + ", ".join(line),
           parameters={k: v for k, v in vars(args).items() if k != "strategies"} | {"strategies": ",".join(args.strategies)})


if __name__ == "__main__":
    main()
