"""Fleet benchmark: many simulated devices through one mosquitto to a gateway.

What is real and what is simulated:
- **real**: one mosquitto (`agent.transport.broker.Broker`, the project's private-broker config,
  `sys_interval 1` added for its `$SYS` store counters); the gateway, a real `ssp-agent run`
  process on a home with the `gateway` profile (cadence 10 s, bodies of 2 000 events / 1 MiB);
  every device's session: a full `Node` (SQLite store, software keystore, signing journal, the
  one apply path) and its own `Runner` with its own paho client and MQTT v5 persistent session
  (its own client id = site_id), exactly the code `ssp-agent run` drives.
- **simulated**: the devices share this one process (one thread steps every device's runner in
  turn; each paho client keeps its own network thread) instead of one process per board, and
  their homes live on tmpfs (`/dev/shm` when present) instead of an SD card. A device's profile
  is `pi-3-4` (cadence 30 s unless --device-cadence, presence of its keyring only), realtime on,
  eviction off. The partition drops every device's TCP connection without DISCONNECT (the last
  will clears its presence). The devices' paho links wait on poll() rather than select(), which
  refuses the descriptors past 1 024 that 400 devices' sockets in one process reach.

Traffic: telemetry flows up (each device writes rows of its own in `app.readings`), configuration
flows down (the gateway writes `app.config` through its control socket: `ssp-agent write`); the
gateway's policy denies `app.readings` to every peer (`policy deny --peer * --layer system`), so
devices are not sent each other's telemetry. Every device's manifest trusts the gateway; the
gateway's keyring holds every device.

Per fleet size (fresh broker, gateway and devices each time):
1. connect every device; each writes --events rows, the gateway one config row; time until the
   fleet has converged (the gateway holds every device row, every device holds the config);
2. idle: gateway CPU (utime + stime from /proc) over --idle-s seconds, per device, and its RSS;
3. partition: every device drops off for --partition-s seconds; meanwhile the gateway writes
   --config-writes config rows and every device --events more rows (locally, offline). The
   broker's queue (`$SYS/broker/store/messages/count` and `/bytes`, and mosquitto's RSS) at the
   end, per offline device;
4. heal: every device reconnects (a new runner on the same home, the persistent session
   resumes); time until the fleet converges again, the gateway's CPU seconds for it, and the
   messages each device's link took meanwhile. The result's `points` (one per size: devices,
   convergence_s, gateway_cpu_s_per_device, ...) are the curve of docs/performance.md.

    python bench/bench_fleet.py [--sizes 25,50,100,200,400] [--events 20] [--partition-s 30] [--idle-s 10]
    python bench/bench_fleet.py --smoke       # 4 devices, short phases (tests/test_bench_smoke.py)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import ROOT, bench_env, child_env, cli, load_average, proc_cpu_s, proc_mem_mb, record  # noqa: E402  (bench/)

import paho.mqtt.client as paho  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402

from agent.node import Node  # noqa: E402
from agent.profile import load_profile  # noqa: E402
from agent.runner import RunConfig, Runner  # noqa: E402
from agent.transport.broker import Broker  # noqa: E402
from agent.transport.mqtt import MqttSettings  # noqa: E402

class PollSelect:
    """`select.select` over poll(), for the paho clients of this one process: select() refuses
    descriptors >= FD_SETSIZE (1024), and 400 devices' links hold 1 200 sockets (their TCP
    connection and paho's wake-up socket pair each); a board holds three."""
    error = OSError

    @staticmethod
    def select(rlist, wlist, xlist, timeout=None):
        import select as sel
        objs, flags = {}, {}
        for lst, flag in ((rlist, sel.POLLIN), (wlist, sel.POLLOUT)):
            for o in lst:
                if o is None:
                    raise TypeError("not a socket")   # what select() raises; paho handles it
                fd = o if isinstance(o, int) else o.fileno()
                objs[fd] = o
                flags[fd] = flags.get(fd, 0) | flag
        p = sel.poll()
        for fd, f in flags.items():
            p.register(fd, f)                          # a closed socket (-1): ValueError, as select()
        ready = p.poll(None if timeout is None else max(0.0, timeout) * 1000)
        gone = sel.POLLHUP | sel.POLLERR | sel.POLLNVAL
        r = [objs[fd] for fd, ev in ready if ev & (sel.POLLIN | gone) and flags[fd] & sel.POLLIN]
        w = [objs[fd] for fd, ev in ready if ev & (sel.POLLOUT | gone) and flags[fd] & sel.POLLOUT]
        return r, w, []


paho.select = PollSelect   # paho's module-level `select`: the simulated devices' links only (this process)

MESH = bytes.fromhex("f1ee7000000000000000000000000715")
TABLES = ('\n[[tables]]\nschema = "app"\nname = "readings"\ncategory = "syncable"\nkey = ["device", "seq"]\n'
          'columns = { device = "text", seq = "integer", temp = "real" }\n'
          '\n[[tables]]\nschema = "app"\nname = "config"\ncategory = "syncable"\nkey = ["k"]\n'
          'columns = { k = "text", v = "text" }\n')


class SysStore:
    """mosquitto's `$SYS` store counters (messages held for sessions, and their bytes)."""

    def __init__(self, port: int) -> None:
        self.values: dict[str, int] = {}
        self.c = paho.Client(CallbackAPIVersion.VERSION2, client_id="bench-sys", protocol=paho.MQTTv5)
        self.c.on_message = lambda c, u, m: self.values.__setitem__(m.topic.rsplit("/", 1)[1], int(m.payload))
        self.c.on_connect = lambda c, u, f, rc, p: c.subscribe([("$SYS/broker/store/messages/#", 0)])
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()

    def read(self, wait: float = 2.5) -> dict[str, int]:
        """The latest values (mosquitto publishes them, retained, when they change), after
        `wait` seconds: more than one `sys_interval`, so they are current."""
        time.sleep(wait)
        return dict(self.values)

    def close(self) -> None:
        self.c.loop_stop()
        self.c.disconnect()


class Fleet:
    def __init__(self, root: Path, n: int, args, env: dict) -> None:
        self.root, self.n, self.args, self.env = root, n, args, env
        self.gw_home = root / "gateway"
        gw, _ = Node.init(self.gw_home, f'mesh_id = "{MESH.hex()}"\n' + TABLES, profile="gateway")
        self.gw_site, gw_key = gw.site_id, gw.keyring[gw.site_id][0]
        man = (f'mesh_id = "{MESH.hex()}"\n[[peers]]\nsite_id = "{gw.site_id.hex()}"\npublic_key = "{gw_key.hex()}"\n'
               + TABLES)
        prof = load_profile("pi-3-4")
        self.nodes: list[Node] = []
        t = time.perf_counter()
        # paho waits on its socket with select(), which refuses descriptors >= 1024 (FD_SETSIZE):
        # with every device's SQLite files in this one process, the sockets of the 200-device run
        # got such numbers and those devices never connected (a real device opens a handful).
        # So the devices' files are opened above 1024: the low descriptors are held by
        # placeholders while the homes are made, and freed for the sockets afterwards.
        hold = []
        while not hold or hold[-1] < 1100:
            hold.append(os.open(os.devnull, os.O_RDONLY))
        try:
            for i in range(n):
                d, _ = Node.init(root / f"dev{i}", man, profile=prof)
                gw.add_peer(d.site_id, d.keyring[d.site_id][0], None)
                self.nodes.append(d)
        finally:
            for fd in hold:
                os.close(fd)
        self.init_s = time.perf_counter() - t
        gw.close()
        self.cfg = RunConfig.from_profile(prof, cadence_s=args.device_cadence)
        self.cfg.eviction_interval_s = None
        self.prof = prof
        self.seq = [0] * n
        self.runners: list[Runner] = []
        self.gw: subprocess.Popen | None = None
        self.config_rows = 0

    def cli(self, *argv: str) -> subprocess.CompletedProcess:
        p = subprocess.run(cli(self.gw_home, *argv), env=self.env,
                           capture_output=True, text=True, cwd=str(ROOT), timeout=120)
        if p.returncode:
            raise SystemExit(f"ssp-agent {' '.join(argv)}: {p.stderr}")
        return p

    def start_gateway(self, url: str) -> None:
        self.cli("policy", "deny", "--peer", "*", "--table", "app.readings", "--layer", "system")
        prof = os.environ.get("BENCH_FLEET_PROFILE")   # a file: the gateway runs under cProfile (diagnosis)
        wrap = ["-m", "cProfile", "-o", f"{prof}.{self.n}"] if prof else []
        self.gw = subprocess.Popen([sys.executable, *wrap, "-m", "agent.cli", "--home", str(self.gw_home), "run",
                                    "--broker", url], stdout=subprocess.DEVNULL,
                                   stderr=open(self.root / "gateway.log", "ab"), env=self.env, cwd=str(ROOT))
        t = time.monotonic()
        while not (self.gw_home / "control.sock").exists():
            if self.gw.poll() is not None or time.monotonic() - t > 60:
                raise SystemExit("the gateway did not start: " + (self.root / "gateway.log").read_text()[-2000:])
            time.sleep(0.05)

    def gw_write(self) -> None:
        self.config_rows += 1
        self.cli("write", "app.config", "--key", json.dumps({"k": f"c{self.config_rows}"}),
                 "--set", json.dumps({"v": "x" * 40}))

    def connect(self, url: str) -> float:
        settings = MqttSettings.from_url(url)
        settings.body_limit_bytes = int(self.prof.body_limit_bytes)
        settings.max_events = int(self.prof.batch_limit)
        settings.session_expiry_s = int(self.prof.session_expiry_s)
        settings.presence = self.prof.presence   # pi-3-4: its keyring's presence only (as `ssp-agent run`)
        t = time.perf_counter()
        self.runners = []
        # In waves: all devices' paho threads share this process's GIL, and a wave of 100 at once
        # starved some network threads past the link's 10 s CONNACK timeout, which then
        # reconnected in a loop (an artefact of one process, not of a fleet of boards).
        wave = max(1, self.args.connect_wave)
        for i in range(0, len(self.nodes), wave):
            new = []
            for node in self.nodes[i:i + wave]:
                r = Runner(node, settings, self.cfg)
                r.link.start()
                new.append(r)
            while not all(r.link.connected.is_set() for r in new):
                time.sleep(0.01)
                if time.perf_counter() - t > self.args.timeout:
                    late = [r for r in new if not r.link.connected.is_set()]
                    raise SystemExit(f"{len(late)} devices did not connect: {late[0].link.last_error}")
            self.runners.extend(new)
            self.step_all()   # take in what arrived (presence, queued bodies) between waves
        return time.perf_counter() - t

    def partition(self) -> None:
        for r in self.runners:
            r.link.abort()

    def write_devices(self, k: int) -> None:
        for i, node in enumerate(self.nodes):
            node.write_many([("app.readings", {"device": f"d{i}", "seq": self.seq[i] + j},
                              {"temp": float(j)}, False) for j in range(k)])
            self.seq[i] += k
        for r in self.runners:
            r.notify_produced()

    def spin(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.step_all()

    def step_all(self) -> None:
        for r in self.runners:
            r.step(0)
        time.sleep(0.005)

    def converged(self, gw_conn) -> tuple[int, int]:
        """(device rows the gateway lacks, devices lacking some config row)."""
        want = sum(self.seq)
        have = gw_conn.execute("SELECT count(*) FROM events WHERE site_id != ?", (self.gw_site,)).fetchone()[0]
        lacking = sum(1 for node in self.nodes
                      if node.conn.execute("SELECT count(*) FROM events WHERE site_id = ?",
                                           (self.gw_site,)).fetchone()[0] < self.config_rows)
        return want - have, lacking

    def until_converged(self, timeout: float) -> float:
        import sqlite3
        conn = sqlite3.connect(f"file:{self.gw_home / 'store.sqlite'}?mode=ro", uri=True)
        t = time.perf_counter()
        next_check = 0.0
        try:
            while True:
                self.step_all()
                now = time.perf_counter()
                if now >= next_check:
                    next_check = now + 0.25
                    missing, lacking = self.converged(conn)
                    if missing == 0 and lacking == 0:
                        return now - t
                if now - t > timeout:
                    raise SystemExit(f"no convergence in {timeout}s: gateway lacks {missing} rows, "
                                     f"{lacking} devices lack config")
        finally:
            conn.close()

    def close(self) -> None:
        for r in self.runners:
            try:
                r.close()
            except Exception:  # noqa: BLE001 - a bench tearing down
                pass
        if self.gw is not None:
            self.gw.terminate()
            try:
                self.gw.wait(30)
            except subprocess.TimeoutExpired:
                self.gw.kill()
        for node in self.nodes:
            node.close()


def phase(n: int, what: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {n} devices: {what}", file=sys.stderr, flush=True)


def one_size(n: int, args, base: Path) -> dict:
    root = base / f"fleet{n}"
    root.mkdir()
    env = child_env()
    out: dict = {"devices": n}
    with Broker(workdir=root / "broker", extra_conf="sys_interval 1") as br:
        fleet = Fleet(root, n, args, env)
        out["device_init_s"] = round(fleet.init_s, 1)
        sysc = SysStore(br.port)
        try:
            fleet.start_gateway(br.url)
            pid = fleet.gw.pid
            phase(n, "connecting")
            out["connect_s"] = round(fleet.connect(br.url), 2)
            phase(n, "first convergence")
            # 1. first convergence
            fleet.write_devices(args.events)
            fleet.gw_write()
            c0 = proc_cpu_s(pid)
            out["first_converge_s"] = round(fleet.until_converged(args.timeout), 2)
            out["first_converge_gw_cpu_s"] = round(proc_cpu_s(pid) - c0, 2)
            phase(n, "idle")
            # 2. idle (after a settle: the answers and acknowledgements of the first exchange)
            fleet.spin(args.idle_s / 2)
            c0, t0 = proc_cpu_s(pid), time.monotonic()
            fleet.spin(args.idle_s)
            idle = (proc_cpu_s(pid) - c0) / (time.monotonic() - t0)
            out["gw_idle_cpu_pct"] = round(100 * idle, 2)
            out["gw_rss_mb"] = round(proc_mem_mb(pid), 1)
            out["broker_rss_mb_online"] = round(proc_mem_mb(br.proc.pid), 1)
            out["broker_store_online"] = sysc.read()
            phase(n, "partition")
            # 3. partition: the queue is counted from just after every device dropped off (their
            # wills have cleared their retained presence) to the partition's end
            fleet.partition()
            t0 = time.monotonic()
            before = sysc.read()
            fleet.write_devices(args.events)
            for _ in range(args.config_writes):
                fleet.gw_write()
            c0 = proc_cpu_s(pid)
            time.sleep(max(0.0, args.partition_s - (time.monotonic() - t0)))
            out["gw_partition_cpu_pct"] = round(100 * (proc_cpu_s(pid) - c0) / max(1e-9, args.partition_s), 2)
            after = sysc.read()
            out["broker_store_partitioned"] = after
            out["broker_rss_mb_partitioned"] = round(proc_mem_mb(br.proc.pid), 1)
            msgs = after.get("count", 0) - before.get("count", 0)
            byts = after.get("bytes", 0) - before.get("bytes", 0)
            out["queue_msgs_per_offline_device"] = round(msgs / n, 2)
            out["queue_bytes_per_offline_device"] = round(byts / n)
            phase(n, "heal")
            # 4. heal
            c0 = proc_cpu_s(pid)
            t = time.perf_counter()
            fleet.connect(br.url)
            out["heal_reconnect_s"] = round(time.perf_counter() - t, 2)
            out["heal_converge_s"] = round(out["heal_reconnect_s"] + fleet.until_converged(args.timeout), 2)
            out["heal_gw_cpu_s"] = round(proc_cpu_s(pid) - c0, 2)
            # what each device's link took from the broker from its reconnection to convergence
            # (presence, bodies, answers): a constant when nothing a device takes grows with the fleet
            out["heal_msgs_per_device"] = round(sum(r.link.received for r in fleet.runners) / n, 1)
            out["gw_peak_rss_mb"] = round(proc_mem_mb(pid, "VmHWM"), 1)
        finally:
            sysc.close()
            fleet.close()
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="25,50,100,200,400")
    ap.add_argument("--events", type=int, default=20, help="rows each device writes before, and again during, the partition")
    ap.add_argument("--config-writes", type=int, default=3, help="config rows the gateway writes during the partition")
    ap.add_argument("--partition-s", type=float, default=30.0)
    ap.add_argument("--idle-s", type=float, default=10.0)
    ap.add_argument("--device-cadence", type=float, default=None, help="devices' batch cadence (default: pi-3-4's)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--connect-wave", type=int, default=25, help="devices (re)connecting at once")
    ap.add_argument("--keep", action="store_true", help="keep each size's homes and logs (a failed size always keeps them)")
    ap.add_argument("--smoke", action="store_true", help="4 devices, short phases")
    args = ap.parse_args()
    import logging
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s")
    if os.environ.get("BENCH_FLEET_DEBUG"):
        logging.getLogger("ssp_agent.mqtt").setLevel(logging.INFO)
    if args.smoke:
        args.sizes, args.events, args.config_writes, args.partition_s, args.idle_s = "4", 3, 1, 2.0, 1.0
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    print(f"load average before: {load_average()}", flush=True)
    shm = Path("/dev/shm")
    rows = []
    d = tempfile.mkdtemp(prefix="ssp-fleet-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK) else None)
    print(f"homes and logs under {d}", file=sys.stderr)
    try:
        bench_env(os.path.join(d, "witness"))
        for n in sizes:
            r = one_size(n, args, Path(d))
            rows.append(r)
            print(json.dumps(r), flush=True)
    except BaseException:
        print(f"failed: homes, gateway and broker logs kept in {d}", file=sys.stderr)
        raise
    shutil.rmtree(d, ignore_errors=True)
    print()
    print(f"{'devices':>7} {'first conv s':>12} {'gw idle %cpu':>12} {'/device':>8} {'gw RSS MB':>9} "
          f"{'queue msgs/dev':>14} {'queue B/dev':>11} {'heal conv s':>11} {'heal gw cpu s/dev':>17} {'msgs/dev':>9}")
    for r in rows:
        n = r["devices"]
        print(f"{n:>7} {r['first_converge_s']:>12} {r['gw_idle_cpu_pct']:>12} {r['gw_idle_cpu_pct'] / n:>8.3f} "
              f"{r['gw_rss_mb']:>9} {r['queue_msgs_per_offline_device']:>14} {r['queue_bytes_per_offline_device']:>11} "
              f"{r['heal_converge_s']:>11} {r['heal_gw_cpu_s'] / n:>17.3f} {r['heal_msgs_per_device']:>9}")
    if len(rows) > 1:
        a, b = rows[0], rows[-1]
        k = b["devices"] / a["devices"]
        print(f"growth from {a['devices']} to {b['devices']} devices (x{k:g}): gateway RSS "
              f"+{(b['gw_rss_mb'] - a['gw_rss_mb']) / (b['devices'] - a['devices']) * 1024:.0f} KiB per device, "
              f"idle CPU x{b['gw_idle_cpu_pct'] / max(1e-9, a['gw_idle_cpu_pct']):.1f}, heal convergence "
              f"x{b['heal_converge_s'] / max(1e-9, a['heal_converge_s']):.1f}, queue per offline device "
              f"x{b['queue_bytes_per_offline_device'] / max(1, a['queue_bytes_per_offline_device']):.2f}")
    print(f"load average after: {load_average()}")
    keys = ("gw_rss_mb", "gw_idle_cpu_pct", "queue_msgs_per_offline_device", "queue_bytes_per_offline_device",
            "heal_converge_s", "heal_reconnect_s", "first_converge_s", "heal_msgs_per_device")
    # the curve (docs/performance.md's plot): one point per fleet size
    points = [{"devices": r["devices"], "convergence_s": r["heal_converge_s"],
               "gateway_cpu_s_per_device": round(r["heal_gw_cpu_s"] / r["devices"], 4),
               "first_convergence_s": r["first_converge_s"], "reconnect_s": r["heal_reconnect_s"],
               "gateway_cpu_s": r["heal_gw_cpu_s"], "msgs_per_device": r["heal_msgs_per_device"],
               "gateway_rss_mb": r["gw_rss_mb"]} for r in rows]
    record({f"{k}_{r['devices']}_devices": r[k] for r in rows for k in keys if isinstance(r.get(k), (int, float))}
           | {f"heal_gw_cpu_ms_per_device_{r['devices']}_devices": 1000 * r["heal_gw_cpu_s"] / r["devices"] for r in rows},
           {"devices_max": max(sizes), "events_per_device": args.events, "partition_s": args.partition_s},
           " / ".join(str(r["devices"]) for r in rows) + " devices: gateway RSS "
           + " / ".join(str(r["gw_rss_mb"]) for r in rows) + " MB; idle CPU "
           + " / ".join(str(r["gw_idle_cpu_pct"]) for r in rows) + " % of a core; queue per offline device "
           + " / ".join(f"{r['queue_bytes_per_offline_device']}" for r in rows) + " B; convergence after the partition "
           + " / ".join(str(r["heal_converge_s"]) for r in rows) + " s", parameters=vars(args), points=points)
    return 0


if __name__ == "__main__":
    sys.exit(main())
