"""Applications through agent.client against a running agent: batched client writes against
`Node.write_many` in this process, one client write against one `ssp-agent write` (wall and CPU per
write, the agent's included), the change feed's latency from a local write and from a peer's body
to the record reaching a watcher with 1 and 10 watchers, the write and apply rates with 10 watchers
against none, and what recording the feed costs the apply path (a peer's events applied with and without it).

Each measurement runs in one temporary directory with a private mosquitto and one `ssp-agent run`
holding the client's home; `Node.write_many` runs on a second home of the same manifest, in this
process, with the same batches. Watchers are separate processes (`WATCHER` below) that note
CLOCK_MONOTONIC (system-wide) as each record arrives. A peer's bodies come from a SimPeer the
home trusts, pushed through the broker on its own MQTT link as a real peer's are, and applied by
`run`'s loop: the commit happens inside `run`, so a body's latency is timed from the push (an upper
bound) and from its answer reaching the peer (sent after the commit: about a lower bound).
"0 watchers" means no watch session is open: the feed's records are still written in every apply
transaction (they always are), nobody reads them. `--pin` puts `run` on CPU 0 and the watchers
on CPU 1 for the peer rounds (what the watchers' CPU costs the apply when they share its core).

    python bench/client.py [--writes 2000] [--batch 100] [--singles 100] [--latency 200] [--rounds 3] [--pin] [--record]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import ROOT, bench_env, child_env, cli, median, proc_cpu_s, proc_tree_cpu_s, record, stop  # noqa: E402

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")
T = "app.readings"
# A watcher as light as a reader of the protocol can be (docs/client.md "Protocol"): it notes each
# record's arrival and its cursor, acknowledges every 64th, and prints them once it has seen `upto`, so what the figures
# show is the agent's side, not a watcher's JSON decoding (two cores are shared by all of it).
WATCHER = """
import json, socket, sys, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
f = s.makefile("rb")
s.sendall(json.dumps({"hello": "ssp-agent", "version": 1}).encode() + b"\\n")
assert json.loads(f.readline())["ok"]
s.sendall(json.dumps({"op": "watch", "tables": ["app.readings"], "since": int(sys.argv[2])}).encode() + b"\\n")
assert json.loads(f.readline())["ok"]
print("ready", flush=True)
upto, seen, cpu0 = int(sys.argv[3]), [], time.process_time()
for line in f:
    if not line.startswith(b'{"cursor":'):
        raise SystemExit("watcher: " + line.decode()[:200])
    cur = int(line[10:line.index(b",")])   # {"cursor":N,...
    seen.append((cur, time.monotonic_ns()))
    if len(seen) % 64 == 0:   # what it consumed: the agent sends at most a window beyond it
        s.sendall(b'{"ack":%d}\\n' % cur)
    if cur >= upto:
        break
print(f"cpu {time.process_time() - cpu0}", flush=True)
print("\\n".join(f"{c} {t}" for c, t in seen), flush=True)
"""


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


def batches(n: int, size: int, tag: str) -> list[list[tuple]]:
    rows = [(T, {"device": tag, "seq": i}, {"temp": float(i % 100), "note": f"r{i}"}) for i in range(n)]
    return [rows[i:i + size] for i in range(0, n, size)]


def start_watchers(home: Path, n: int, since: int, upto: int, cpus: set[int] | None = None) -> list[subprocess.Popen]:
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    ps = [subprocess.Popen([sys.executable, "-c", WATCHER, str(home / "control.sock"), str(since), str(upto)],
                           stdout=subprocess.PIPE, text=True, env=child_env(), preexec_fn=pin) for _ in range(n)]
    for p in ps:
        assert p.stdout.readline().strip() == "ready"
    return ps


def collect(ps: list[subprocess.Popen], upto: int, cpu: list | None = None) -> list[dict[int, int]]:
    """Each watcher's arrival times (cursor -> monotonic ns) until it saw cursor `upto`; the CPU
    seconds they used following the feed are added to `cpu[0]`."""
    out = []
    for p in ps:
        seen: dict[int, int] = {}
        for line in p.stdout:
            if line.startswith("cpu "):
                if cpu is not None:
                    cpu[0] += float(line.split()[1])
                continue
            cur, ns = map(int, line.split())
            seen[cur] = ns
            if cur >= upto:
                break
        out.append(seen)
        stop(p)
    return out


class Peer:
    """A SimPeer the home trusts, on its own MQTT link: signs bodies and pushes them to `run` as a
    real peer does, and waits for each body's answer (sent once its apply committed)."""

    def __init__(self, url: str, peer, to: bytes) -> None:
        from agent.transport.mqtt import MqttLink, MqttSettings
        self.peer, self.to, self.n = peer, to, 0
        self.link = MqttLink(MqttSettings.from_url(url), MESH, peer.site_id).start()
        if not self.link.wait_connected(30):
            raise SystemExit("the peer's MQTT link did not connect")

    def bodies(self, n: int, size: int, tag: str) -> list[bytes]:
        now = int(time.time() * 1000)
        evs = []
        for i in range(n):
            self.n += 1
            evs.append(self.peer.event(T, {"device": tag, "seq": i}, {"temp": float(i % 100), "note": f"p{i}"},
                                       (now, self.n)))
        return [self.peer.body(evs[i:i + size]) for i in range(0, n, size)]

    def push(self, bodies: list[bytes], window: int = 4) -> list[tuple[int, int]]:
        """Push `bodies` with at most `window` unanswered; (push, answer) monotonic ns of each."""
        times: dict[bytes, list[int]] = {}
        order, todo = [], list(bodies)
        while todo or any(len(t) == 1 for t in times.values()):
            while todo and sum(len(t) == 1 for t in times.values()) < window:
                t0 = time.monotonic_ns()
                c = self.link.push(self.to, todo.pop(0), {})
                times[c] = [t0]
                order.append(c)
            m = self.link.inbound.get(timeout=120)
            t1 = time.monotonic_ns()
            self.link.ack(m)   # the agent's own pushes to this peer are taken and left unanswered
            if m.kind == "ans" and m.correlation in times:
                if m.props.get("ssp-status") != "ok" or m.props.get("ssp-applied") == "0":
                    raise SystemExit(f"a body was not applied: {m.props}")
                times[m.correlation].append(t1)
        return [tuple(times[c]) for c in order]

    def close(self) -> None:
        self.link.close()


def feed_cost(tmp: Path, man: str, rounds: int, n: int = 6000) -> float:
    from agent import feed
    from agent.node import Node
    from agent.simpeer import SimPeer, manifest_text, readings_table
    peer = SimPeer(MESH)
    man = manifest_text(MESH, readings_table(), [peer])
    now = int(time.time() * 1000) - 60_000
    evs = [peer.event(T, {"device": "p", "seq": i}, {"temp": float(i), "note": f"n{i}"}, (now, i)) for i in range(n)]
    real = feed.note_change
    rates: dict[bool, list[float]] = {True: [], False: []}
    os.environ["SSP_AGENT_APPLY_WORKERS"] = "0"   # the applying thread alone: what the record adds to it
    try:
        for rnd in range(rounds):
            for on in (False, True):
                feed.note_change = real if on else (lambda *a, **k: None)
                node = Node.init(tmp / f"apply-{rnd}-{on}", man)[0]
                t = time.perf_counter()
                for i in range(0, n, 1000):
                    node.apply_batch(evs[i:i + 1000])
                rates[on].append(n / (time.perf_counter() - t))
                node.close()
    finally:
        feed.note_change = real
        os.environ.pop("SSP_AGENT_APPLY_WORKERS", None)
    return median(rates[True]) / median(rates[False])


def import_figures(home: Path, sim, args, fig: dict, den: dict) -> None:
    """A peer's body imported on this thread as `run`'s loop takes one (the apply, then the control
    server's turn that tells the watchers), into a node this process holds and serves on its
    socket: from the import's return (its commit) and from its start to the record at each watcher,
    1 and 10 watchers; and the import rate with 10 watchers against none, alternating rounds."""
    from agent.control import ControlServer
    from agent.node import Node
    from agent.store import feed
    from agent.sync import import_mailbox_body
    node = Node.open(home)
    srv = ControlServer(home, lambda argv: (2, "", "not served here\n"), node=node)
    peer = Peer.__new__(Peer)
    peer.peer, peer.n = sim, 0

    def load(bodies: list[bytes]) -> list[tuple[int, int]]:
        out = []
        for b in bodies:
            t0 = time.monotonic_ns()
            r = import_mailbox_body(node, b)
            t1 = time.monotonic_ns()
            srv.serve()   # what the loop does after each turn: the watchers learn of the new head
            out.append((t0, t1))
        assert r["applied"] > 0, r
        return out
    try:
        load(peer.bodies(1, 1, "iwarm"))
        for n in (1, 10):
            head = feed.bounds(node.conn)[1]
            ws = start_watchers(home, n, head, head + args.latency)
            sent: dict[int, tuple[int, int]] = {}
            for i, b in enumerate(peer.bodies(args.latency, 1, f"ilat{n}")):
                sent[head + i + 1] = load([b])[0]
                time.sleep(0.005)
            got = collect(ws, head + args.latency)
            start = [(seen[cur] - t[0]) / 1e6 for seen in got for cur, t in sent.items() if cur in seen]
            ret = [(seen[cur] - t[1]) / 1e6 for seen in got for cur, t in sent.items() if cur in seen]
            fig[f"import_feed_latency_ms_{n}_watchers_median"] = round(median(ret), 2)
            fig[f"import_feed_latency_ms_{n}_watchers_p99"] = round(p99(ret), 2)
            fig[f"import_feed_latency_from_start_ms_{n}_watchers_median"] = round(median(start), 2)
            fig[f"import_feed_latency_from_start_ms_{n}_watchers_p99"] = round(p99(start), 2)
        rates: dict[int, list[float]] = {0: [], 10: []}
        for rnd in range(args.rounds):
            for n in (0, 10):
                bodies = peer.bodies(args.writes, args.batch, f"irate{n}-{rnd}")
                head = feed.bounds(node.conn)[1]
                ws = start_watchers(home, n, head, head + args.writes) if n else []
                t = time.perf_counter()
                load(bodies)
                rates[n].append(args.writes / (time.perf_counter() - t))
                collect(ws, head + args.writes)
    finally:
        srv.close()
        node.close()
    den["import_events_per_s_no_watchers"] = round(median(rates[0]), 1)
    fig["import_events_per_s_10_watchers"] = round(median(rates[10]), 1)
    fig["ratio_import_10_watchers_to_none"] = round(median(rates[10]) / median(rates[0]), 3)
    print("import rate rounds (0 / 10 watchers):", [round(x) for x in rates[0]], [round(x) for x in rates[10]])


def pin_tree(pid: int, cpus: str) -> None:
    """Every thread of `pid` and of its child processes (the apply workers) onto `cpus`."""
    kids = [int(k) for c in Path(f"/proc/{pid}/task").glob("*/children") for k in c.read_text().split()]
    for p in (pid, *kids):
        subprocess.run(["taskset", "-a", "-p", "-c", cpus, str(p)], check=True, capture_output=True)


def peer_figures(home: Path, peer: Peer, run: subprocess.Popen, c, args, fig: dict, den: dict) -> None:
    """A peer's body -> the record at each watcher (1 and 10 watchers, one one-event body at a
    time), and the apply rate of a peer's bodies with 10 watchers against none, alternating."""
    cpus = ({0}, {1}) if args.pin else (None, None)
    try:
        if cpus[0]:
            pin_tree(run.pid, "0")
        for n in (1, 10):
            head = c.head()
            ws = start_watchers(home, n, head, head + args.latency, cpus[1])
            sent: dict[int, tuple[int, int]] = {}
            for i, b in enumerate(peer.bodies(args.latency, 1, f"plat{n}")):
                sent[head + i + 1] = peer.push([b], 1)[0]   # one body, one event, one record
                time.sleep(0.005)
            got = collect(ws, head + args.latency)
            push = [(seen[cur] - t[0]) / 1e6 for seen in got for cur, t in sent.items() if cur in seen]
            fig[f"peer_push_feed_latency_ms_{n}_watchers_median"] = round(median(push), 2)
            fig[f"peer_push_feed_latency_ms_{n}_watchers_p99"] = round(p99(push), 2)
        # the apply rate: --writes events in bodies of --batch, 4 unanswered at most; run's CPU per
        # event and the watchers' CPU, to see what the watchers cost
        rates: dict[int, list[float]] = {0: [], 10: []}
        run_cpu: dict[int, list[float]] = {0: [], 10: []}
        w_cpu: list[float] = []
        for rnd in range(args.rounds):
            for n in (0, 10):
                bodies = peer.bodies(args.writes, args.batch, f"prate{n}-{rnd}")
                head = c.head()
                ws = start_watchers(home, n, head, head + args.writes, cpus[1]) if n else []
                a0 = proc_tree_cpu_s(run.pid)
                t = time.perf_counter()
                peer.push(bodies)
                rates[n].append(args.writes / (time.perf_counter() - t))
                run_cpu[n].append((proc_tree_cpu_s(run.pid) - a0) / args.writes * 1e6)
                spent = [0.0]
                collect(ws, head + args.writes, spent)
                if n:
                    w_cpu.append(spent[0] / args.writes * 1e6)
    finally:
        peer.close()
        if cpus[0]:
            pin_tree(run.pid, f"0-{(os.cpu_count() or 1) - 1}")
    den["peer_apply_events_per_s_no_watchers"] = round(median(rates[0]), 1)
    fig["peer_apply_events_per_s_10_watchers"] = round(median(rates[10]), 1)
    fig["ratio_peer_apply_10_watchers_to_none"] = round(median(rates[10]) / median(rates[0]), 3)
    den["peer_apply_run_cpu_us_per_event_no_watchers"] = round(median(run_cpu[0]), 1)
    fig["peer_apply_run_cpu_us_per_event_10_watchers"] = round(median(run_cpu[10]), 1)
    fig["peer_apply_watchers_cpu_us_per_event_10_watchers"] = round(median(w_cpu), 1)
    print("peer apply rate rounds (0 / 10 watchers):", [round(x) for x in rates[0]], [round(x) for x in rates[10]])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--writes", type=int, default=2000, help="rows written in batches, per run")
    ap.add_argument("--batch", type=int, default=100, help="rows per write_many")
    ap.add_argument("--singles", type=int, default=100, help="one-row writes through the client and the CLI")
    ap.add_argument("--latency", type=int, default=200, help="writes timed to the watchers, per watcher count")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the rate comparisons")
    ap.add_argument("--pin", action="store_true", help="peer rounds: `run` on CPU 0, the watchers on CPU 1")
    args = ap.parse_args()
    bench_env()
    from agent.client import Client
    from agent.node import Node
    from agent.simpeer import SimPeer, manifest_text, readings_table
    from agent.transport.broker import Broker, find_mosquitto
    if find_mosquitto() is None:
        raise SystemExit("mosquitto is not installed: `ssp-agent run` needs a broker here")
    tmp = Path(tempfile.mkdtemp(prefix="ssp-bench-client-"))
    sim = SimPeer(MESH)
    man = manifest_text(MESH, readings_table(), [sim])
    broker = Broker(workdir=tmp / "broker").start()
    n0 = Node.init(tmp / "run", man)[0]
    run_site = n0.site_id
    n0.close()
    local = Node.init(tmp / "local", man)[0]
    run = subprocess.Popen(cli(tmp / "run", "run", "--broker", broker.url), env=child_env(),
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    fig: dict = {}
    den: dict = {}
    try:
        deadline = time.monotonic() + 120
        while not (tmp / "run" / "control.sock").exists():
            if time.monotonic() > deadline or run.poll() is not None:
                raise SystemExit("`ssp-agent run` did not start")
            time.sleep(0.05)
        c = Client(tmp / "run")
        c.write(T, {"device": "warm", "seq": 0}, set={"temp": 0.0})
        local.write(T, {"device": "warm", "seq": 0}, {"temp": 0.0})

        # 1. batched writes: the client through the running agent, Node.write_many here
        def client_rate(tag: str) -> float:
            bs = batches(args.writes, args.batch, tag)
            t = time.perf_counter()
            for b in bs:
                c.write_many(b)
            return args.writes / (time.perf_counter() - t)
        def node_rate(tag: str) -> float:
            bs = batches(args.writes, args.batch, tag)
            t = time.perf_counter()
            for b in bs:
                local.write_many([(tb, k, v, False) for tb, k, v in b])
            return args.writes / (time.perf_counter() - t)
        nodes, clients = [], []
        for rnd in range(args.rounds):   # alternating, so a busy moment costs both alike
            nodes.append(node_rate(f"n{rnd}"))
            clients.append(client_rate(f"c{rnd}"))
        node_rate, cl_rate = median(nodes), median(clients)
        den["node_write_many_rows_per_s"] = round(node_rate, 1)
        fig["client_batched_rows_per_s"] = round(cl_rate, 1)
        fig["ratio_client_batched_to_node"] = round(cl_rate / node_rate, 3)

        # 2. one write: the client's persistent session against `ssp-agent write` (forwarded)
        # CPU over the whole series (/proc counts whole ticks: one write is well under one)
        walls = []
        a0, s0 = proc_cpu_s(run.pid), time.process_time()
        for i in range(args.singles):
            t = time.perf_counter()
            c.write(T, {"device": "one", "seq": i}, set={"temp": 1.0})
            walls.append(time.perf_counter() - t)
        cpu_one = (time.process_time() - s0 + proc_cpu_s(run.pid) - a0) / args.singles
        cwalls = []
        n_cli = max(5, args.singles // 10)
        a0, r0 = proc_cpu_s(run.pid), resource.getrusage(resource.RUSAGE_CHILDREN)
        for i in range(n_cli):
            t = time.perf_counter()
            subprocess.run(cli(tmp / "run", "write", T, "--key", json.dumps({"device": "cli", "seq": i}),
                               "--set", '{"temp": 1.0}'), env=child_env(), check=True, capture_output=True)
            cwalls.append(time.perf_counter() - t)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu_cli = (r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime + proc_cpu_s(run.pid) - a0) / n_cli
        fig["client_write_wall_ms"] = round(median(walls) * 1000, 2)
        fig["client_write_cpu_ms"] = round(cpu_one * 1000, 2)
        den["cli_write_wall_ms"] = round(median(cwalls) * 1000, 1)
        den["cli_write_cpu_ms"] = round(cpu_cli * 1000, 1)
        fig["ratio_cli_to_client_wall"] = round(median(cwalls) / median(walls), 1)
        fig["ratio_cli_to_client_cpu"] = round(cpu_cli / cpu_one, 1)

        # 3. the feed: write -> record at each watcher, with 1 and 10 watchers
        for n in (1, 10):
            head = c.head()
            ws = start_watchers(tmp / "run", n, head, head + args.latency)
            sent: dict[int, int] = {}
            for i in range(args.latency):
                t0 = time.monotonic_ns()
                c.write(T, {"device": f"lat{n}", "seq": i}, set={"temp": 2.0})
                sent[head + i + 1] = t0
                time.sleep(0.005)   # one change at a time: latency, not throughput
            got = collect(ws, head + args.latency)
            lat = [(seen[cur] - t0) / 1e6 for seen in got for cur, t0 in sent.items() if cur in seen]
            fig[f"feed_latency_ms_{n}_watchers_median"] = round(median(lat), 2)
            fig[f"feed_latency_ms_{n}_watchers_p99"] = round(p99(lat), 2)

        # 4. the write rate with 10 watchers following against none (same run, alternating)
        rates0, rates10 = [], []
        for rnd in range(args.rounds):
            rates0.append(client_rate(f"r0-{rnd}"))
            head = c.head()
            ws = start_watchers(tmp / "run", 10, head, head + args.writes)
            rates10.append(client_rate(f"r10-{rnd}"))
            collect(ws, head + args.writes)
        den["client_batched_rows_per_s_no_watchers"] = round(median(rates0), 1)
        fig["client_batched_rows_per_s_10_watchers"] = round(median(rates10), 1)
        fig["ratio_rate_10_watchers_to_none"] = round(median(rates10) / median(rates0), 3)

        # 5. a peer's bodies: pushed through the broker, applied by run's loop, to each watcher
        peer_figures(tmp / "run", Peer(broker.url, sim, run_site), run, c, args, fig, den)
        c.close()
        # 6. a peer's body imported here, as run's loop takes one, timed from its commit
        Node.init(tmp / "import", man)[0].close()
        import_figures(tmp / "import", sim, args, fig, den)

        # 7. what recording the feed costs the apply path: a peer's events applied here with the
        # record and with it left out (feed.note_change stubbed), alternating rounds, one thread
        fig["ratio_apply_with_feed_to_without"] = round(feed_cost(tmp, man, args.rounds), 3)
    finally:
        stop(run)
        local.close()
        broker.close()
    for k, v in {**den, **fig}.items():
        print(f"{k:45s} {v}")
    record(fig, den,
           f"batched {fig['ratio_client_batched_to_node']:.2f} of Node.write_many; one write "
           f"{fig['client_write_wall_ms']:.0f} ms, {fig['client_write_cpu_ms']:.1f} ms CPU (1/{fig['ratio_cli_to_client_cpu']:.0f} "
           f"of the CLI's); feed {fig['feed_latency_ms_1_watchers_median']:.0f}/"
           f"{fig['feed_latency_ms_1_watchers_p99']:.0f} ms median/p99 (1 watcher), {fig['feed_latency_ms_10_watchers_median']:.0f}/"
           f"{fig['feed_latency_ms_10_watchers_p99']:.0f} (10); rate with 10 watchers "
           f"{fig['ratio_rate_10_watchers_to_none']:.2f}; a peer's body, commit to watcher "
           f"{fig['import_feed_latency_ms_1_watchers_median']:.1f}/{fig['import_feed_latency_ms_1_watchers_p99']:.1f} ms (1), "
           f"{fig['import_feed_latency_ms_10_watchers_median']:.1f}/{fig['import_feed_latency_ms_10_watchers_p99']:.1f} (10), "
           f"import rate with 10 watchers {fig['ratio_import_10_watchers_to_none']:.2f}, run's apply rate of pushed "
           f"bodies {fig['ratio_peer_apply_10_watchers_to_none']:.2f}"
           f"{' (pinned)' if args.pin else ''}; apply with the feed {fig['ratio_apply_with_feed_to_without']:.2f}", parameters=vars(args))


if __name__ == "__main__":
    main()
