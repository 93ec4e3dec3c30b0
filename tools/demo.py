"""The demo mesh: three nodes as separate processes syncing through a private mosquitto.

    bash tools/demo.sh          (installs what it needs, then runs this)
    python tools/demo.py [--rows 10]

They write; node C goes offline while A and B keep writing; C comes back and catches up from
its broker mailbox and the peers' cursors. Prints each node's table and how far each peer is
behind, with progress while it works.

The broker is configured as docs/mqtt.md recommends: every device logs in as its site_id with
its own password, and per-device ACLs pin the inbox topics to the device that publishes. That
makes the binding authenticated, so the nodes run with `secure` (`--secure-binding`): streams
advance the applied watermarks, and "behind" is measured from them (each peer's last reported
watermarks against what a node holds). `--insecure` runs an anonymous broker instead: no
watermark moves, and "behind" falls back to the cursors (events offered but not answered for)."""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MANIFEST = '''mesh_id = "{mesh}"

[[tables]]
schema = "farm"
name = "readings"
category = "syncable"
key = ["sensor", "seq"]
columns = {{ sensor = "text", seq = "integer", temp = "real", note = "text" }}
'''


# ---------------------------------------------------------------- a node process
def node_main(home: Path, url: str, name: str) -> None:
    from agent.node import Node
    from agent.runner import RunConfig, Runner
    from agent.transport.mqtt import MqttSettings
    node = Node.open(home)
    settings = MqttSettings.from_url(url, backoff_min_s=0.2, backoff_max_s=2,
                                     username=os.environ.get("SSP_MQTT_USERNAME"),
                                     password=os.environ.get("SSP_MQTT_PASSWORD"))
    secure = os.environ.get("SSP_MQTT_SECURE_BINDING") == "1"
    r = Runner(node, settings, RunConfig(cadence_s=1.0, secure=secure))
    if not r.start(10):
        print(f"{name}: broker unreachable: {r.link.last_error}", file=sys.stderr)
        sys.exit(1)
    stop = {"v": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.__setitem__("v", True))
    req = home / "demo-write"
    seq = node.conn.execute("SELECT count(*) FROM events WHERE origin='local'").fetchone()[0]
    done = seq  # the request file holds a running total: a restarted node does not write again
    while not stop["v"]:
        r.step(0.05)
        try:
            want = int(req.read_text() or 0)
        except (OSError, ValueError):
            want = done
        while done < want and not stop["v"]:
            seq += 1
            node.write("farm.readings", {"sensor": name, "seq": seq},
                       {"temp": round(18 + (seq * 7 % 50) / 10, 1), "note": f"{name}#{seq}"})
            done += 1
            r.step(0.02)  # realtime pushes go out as rows are produced
    r.close()
    node.close()


# ---------------------------------------------------------------- the orchestrator
def count(home: Path) -> int:
    c = sqlite3.connect(f"file:{home / 'store.sqlite'}?mode=ro", uri=True, timeout=5)
    try:
        return c.execute("SELECT count(*) FROM events").fetchone()[0]
    finally:
        c.close()


def behind(home: Path, peer: bytes, secure: bool) -> str:
    """How far `peer` is behind the node at `home`, as that node sees it (read-only)."""
    from agent.store.sync_state import peer_lag
    from agent.store import sync_state as st
    c = sqlite3.connect(f"file:{home / 'store.sqlite'}?mode=ro", uri=True, timeout=5)
    try:
        if secure:
            return f"{peer_lag(c, peer)} events behind (by its reported watermarks)"
        live = st.cursor(c, peer, "mqtt")[0]
        n = c.execute("SELECT count(*) FROM events WHERE seq > ? AND site_id != ?", (live, peer)).fetchone()[0]
        return f"{n} events offered but unanswered (cursor; no watermarks without --secure-binding)"
    finally:
        c.close()


def coverage(home: Path, site: bytes, names: dict[bytes, str]) -> str:
    """This node's own applied watermarks: of each origin's events held here, how many they cover."""
    from agent.store.sync_state import own_coverage
    c = sqlite3.connect(f"file:{home / 'store.sqlite'}?mode=ro", uri=True, timeout=5)
    try:
        cov = own_coverage(c, site)
    finally:
        c.close()
    return ", ".join(f"{names.get(s, s.hex()[:8])} {k}/{n}" for s, (n, k) in sorted(cov.items(), key=lambda kv: names.get(kv[0], "")))


def bar(n: int, total: int, width: int = 30) -> str:
    k = width if total == 0 else min(width, n * width // total)
    return "[" + "#" * k + "." * (width - k) + f"] {n}/{total}"


def main() -> int:
    # docs/apply.md "Clocks without an RTC": a demo on a machine that may run no time sync (a container); declare the wall clock trustworthy
    os.environ.setdefault("SSP_AGENT_CLOCK_TRUSTED", "1")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10, help="rows each writer adds per phase")
    ap.add_argument("--keep", action="store_true", help="keep the demo directory")
    ap.add_argument("--insecure", action="store_true",
                    help="an anonymous broker without ACLs: the binding is not authenticated, watermarks do not move")
    ap.add_argument("node", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.node:
        node_main(Path(args.node[0]), args.node[1], args.node[2])
        return 0
    from agent.node import Node
    from agent.transport.broker import Broker, acl_text, free_port, write_password_file
    secure = not args.insecure
    root = Path(tempfile.mkdtemp(prefix="ssp-demo-"))
    os.environ.setdefault("SSP_AGENT_WITNESS_DIR", str(root / "witness"))
    names = ["A", "B", "C"]
    mesh = os.urandom(16).hex()
    print(f"demo: 3 nodes in {root}")
    homes = {}
    nodes = {}
    for n in names:
        homes[n] = root / n
        nodes[n] = Node.init(homes[n], MANIFEST.format(mesh=mesh))[0]
    for x in names:
        for y in names:
            if x != y:
                nodes[x].add_peer(nodes[y].site_id, nodes[y].keyring[nodes[y].site_id][0], None)
    sites = {n: nodes[n].site_id for n in names}
    for n in names:
        nodes[n].close()
    passwords = {n: os.urandom(12).hex() for n in names}
    listener = None
    port = free_port()
    if secure:  # docs/mqtt.md: one login per device, ACLs pinning topics to it
        (root / "broker").mkdir(parents=True, exist_ok=True)
        pw = write_password_file(root / "broker" / "ssp.passwd", {sites[n].hex(): passwords[n] for n in names})
        acl = root / "broker" / "ssp.acl"
        acl.write_text(acl_text([bytes.fromhex(mesh)]))
        listener = f"listener {port} 127.0.0.1\nallow_anonymous false\npassword_file {pw}\nacl_file {acl}"
    broker = Broker(port=port, workdir=root / "broker", listener_conf=listener).start()
    print(f"demo: private mosquitto at {broker.url} (config {broker.conf_path})")
    print("demo: " + ("per-device passwords and ACLs: the binding is authenticated (--secure-binding)" if secure else
                      "anonymous broker: the binding is not authenticated, no watermark moves"))
    procs: dict[str, subprocess.Popen] = {}

    def spawn(n: str) -> None:
        env = os.environ.copy()
        if secure:
            env.update(SSP_MQTT_USERNAME=sites[n].hex(), SSP_MQTT_PASSWORD=passwords[n], SSP_MQTT_SECURE_BINDING="1")
        procs[n] = subprocess.Popen([sys.executable, __file__, str(homes[n]), broker.url, n], env=env)

    def request(n: str, total: int) -> None:
        (homes[n] / "demo-write").write_text(str(total))

    def wait_all(members: list[str], total: int, label: str, timeout: float = 60) -> bool:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            counts = {n: count(homes[n]) for n in members}
            line = "  ".join(f"{n} {bar(c, total, 16)}" for n, c in counts.items())
            print(f"\r  {label}: {line}", end="", flush=True)
            if all(c >= total for c in counts.values()):
                print(f"  ({time.monotonic() - t0:.1f}s)")
                return True
            time.sleep(0.2)
        print("  (timed out)")
        return False

    try:
        for n in names:
            spawn(n)
        time.sleep(1.0)
        print(f"\n1. every node writes {args.rows} rows; they sync through the broker")
        for n in names:
            request(n, args.rows)
        ok = wait_all(names, 3 * args.rows, "converging")
        print("\n2. C goes offline; A and B keep writing")
        procs["C"].send_signal(signal.SIGTERM)
        procs["C"].wait(10)
        for n in ("A", "B"):
            request(n, 2 * args.rows)
        ok &= wait_all(["A", "B"], 5 * args.rows, "A and B")
        print(f"   C is offline with {count(homes['C'])} of {5 * args.rows} events; "
              "its bodies wait at the broker and in A's and B's cursors")
        time.sleep(1.5)  # a batch cycle or so: A's view of C settles
        print(f"   as A sees it: B is {behind(homes['A'], sites['B'], secure)}; C is {behind(homes['A'], sites['C'], secure)}")
        print("\n3. C comes back and catches up")
        spawn("C")
        ok &= wait_all(["C"], 5 * args.rows, "C catching up")
        # a couple of batch cycles: answers settle the cursors and carry the peers' watermarks
        t0 = time.monotonic()
        while time.monotonic() - t0 < 15:
            lag = {(n, m): behind(homes[n], sites[m], secure) for n in names for m in names if n != m}
            if all(v.startswith("0 ") for v in lag.values()) and time.monotonic() - t0 > 2:
                break
            time.sleep(0.5)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        broker.close()

    print("\n4. the result")
    dumps = {}
    by_site = {sites[n]: n for n in names}
    for n in names:
        node = Node.open(homes[n])
        dumps[n] = node.dump()
        rows = dumps[n]["farm.readings"]
        print(f"\nnode {n} ({sites[n].hex()[:8]}): {len(rows)} rows")
        for m in names:
            if m != n:
                print(f"   as {n} sees it, {m} is {behind(homes[n], sites[m], secure)}")
        print(f"   {n}'s own applied watermarks cover, per origin: {coverage(homes[n], sites[n], by_site)} events held")
        by = {}
        for r in rows:
            by.setdefault(r["key"]["sensor"], []).append(r)
        for sensor, rs in sorted(by.items()):
            sample = ", ".join(f"#{r['key']['seq']}={r['values']['temp']}" for r in rs[:4])
            print(f"   sensor {sensor}: {len(rs)} rows  {sample}{', ...' if len(rs) > 4 else ''}")
        node.close()
    same = dumps["A"] == dumps["B"] == dumps["C"]
    print(f"\nall three tables identical: {'yes' if same else 'NO'}")
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)
    else:
        print(f"kept {root}")
    return 0 if (same and ok) else 1


if __name__ == "__main__":
    sys.exit(main())
