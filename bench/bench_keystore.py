"""Signed-and-persisted local writes per second through each keystore backend.

Denominators measured in the same run:
  raw_fsync             append a 300-byte record + fsync, no signing (the disk's flush rate)
  one_fsync_per_write   sign + COSE-assemble + append + fsync for every write (the best a design
                        without group commit can do; SigningBridge.release needs two fsyncs)
  sqlite_row_commit     one-row SQLite WAL synchronous=FULL commit (the store's unbatched rate)
  raw_sign_*            signatures/s with no persistence at all, one at a time
  raw_sign_ed25519_software_batch256
                        signatures/s through the software keystore's batch signing (worker threads:
                        libsodium releases the GIL), no persistence: the ceiling of group commit
  node_core_apply       events/s through Node.apply_batch (the one apply path, batches of 256) of
                        already-signed events: the core apply rate
  node_write_many_*     signed-and-persisted local writes/s through Node.write_many (software
                        keystore, group commit: HLC tick, bridge intent+sign+persist, witness, apply),
                        journal compaction included

``--rounds R`` repeats the write figures (raw two-core batch sign, bridge groups
of 256, Node.write_many of 256, core apply) R times and prints the median and range of
Node.write_many / raw two-core batch sign rate (target >= 0.5) and where a write's wall time goes
(the journal's two commits, the signing, the witness, the apply, the store's commit, the rest);
then the same rounds again in a
child process whose every fsync/fdatasync (SQLite's, the journal's, the witness's) is followed by a
``--slow-flush-ms`` delay (an SD card's ~1.6 ms; an LD_PRELOAD shim, bench/fsync_shim.c: the
harness only, the agent is unchanged), to show group commit holding up on a slow disk.

    python bench/bench_keystore.py [--quick] [--json] [--rounds R] [--slow-flush-ms 1.6] [--write-only]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time

import cbor2

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))
# --code DIR (before/after comparisons): the agent and bridge of another checkout, this harness
if "--code" in sys.argv:
    sys.path.insert(0, os.path.abspath(sys.argv[sys.argv.index("--code") + 1]))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import fsyncshim  # noqa: E402
from _harness import median as _median, rate, record  # noqa: E402  (bench/: the shared set-up)

from firmware_bridge import EventIdentity, ReceiptIdentity, SigningBridge, open_keystore  # noqa: E402
from firmware_bridge.journal import encode_released  # noqa: E402
from agent.core import cose  # noqa: E402
from agent.simpeer import manifest_text, readings_table  # noqa: E402

SITE = bytes.fromhex("00112233445566778899aabbccddeeff")
MESH = bytes(16)
PROT_EV = cbor2.dumps({1: -8, 3: "sovm/ssp-event-v1", 4: SITE}, canonical=True)


def payload(i: int) -> bytes:
    return cbor2.dumps({"table_schema": "t1", "table_name": "readings", "row_key": {"sensor": "s-%04d" % (i % 97)},
                        "operation": "upsert", "payload": {"temp_c": 20.5 + i % 10, "note": "x" * 120},
                        "hlc_physical_ms": 1_764_669_600_000 + i, "hlc_logical": 0}, canonical=True)


def tbs(pay: bytes) -> bytes:
    return cose.sig_structure(PROT_EV, MESH, pay)   # the agent's own encoders (agent/core/cose.py)


def assembler(pay: bytes):
    return lambda sig: cose.assemble(PROT_EV, pay, sig)


class Workload:
    def __init__(self, n: int, base: int = 0) -> None:
        self.items = []
        for i in range(base, base + n):
            pay = payload(i)
            self.items.append((EventIdentity(SITE, 1_764_669_600_000 + i, 0), "site", tbs(pay), assembler(pay)))


def bench_raw_fsync(d: str, n: int) -> float:
    fd = os.open(os.path.join(d, "fsync.bin"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    rec = os.urandom(300)
    t = time.perf_counter()
    for _ in range(n):
        os.write(fd, rec)
        os.fsync(fd)
    dt = time.perf_counter() - t
    os.close(fd)
    return rate(n, dt)


def bench_one_fsync_per_write(d: str, ks, n: int) -> float:
    fd = os.open(os.path.join(d, "naive.bin"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    wl = Workload(n, 10_000_000)
    t = time.perf_counter()
    for ident, key, data, asm in wl.items:
        out = asm(ks._sign(key, ident, data))
        os.write(fd, encode_released(ident.encode(), out))
        os.fsync(fd)
    dt = time.perf_counter() - t
    os.close(fd)
    return rate(n, dt)


def bench_sqlite(d: str, n: int) -> float:
    db = sqlite3.connect(os.path.join(d, "bench.db"), isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("CREATE TABLE ev (id INTEGER PRIMARY KEY, b BLOB)")
    rec = os.urandom(300)
    t = time.perf_counter()
    for _ in range(n):
        db.execute("BEGIN")
        db.execute("INSERT INTO ev (b) VALUES (?)", (rec,))
        db.execute("COMMIT")
    dt = time.perf_counter() - t
    db.close()
    return rate(n, dt)


def bench_raw_sign(ks, key: str, n: int, receipt: bool = False) -> float:
    wl = Workload(n, 20_000_000)
    t = time.perf_counter()
    for k, (ident, _, data, _) in enumerate(wl.items):
        ks._sign(key, ReceiptIdentity(b"bench", 20_000_000 + k) if receipt else ident, data)
    return rate(n, time.perf_counter() - t)


def bench_raw_sign_batch(ks, key: str, n: int, group: int) -> float:
    wl = Workload(n, 25_000_000)
    reqs = [(key, ident, data) for ident, _, data, _ in wl.items]
    t = time.perf_counter()
    for i in range(0, n, group):
        sigs, failure = ks._sign_many(reqs[i:i + group])
        assert failure is None and len(sigs) == len(reqs[i:i + group])
    return rate(n, time.perf_counter() - t)


def bench_bridge(ks, journal: str, n: int, group: int, base: int, threads: int = 1) -> float:
    wl = Workload(n, base)
    with SigningBridge(ks, journal) as bridge:
        t = time.perf_counter()
        if threads == 1:
            for i in range(0, n, group):
                bridge.release_many(wl.items[i:i + group])
        else:
            def work(part):
                for it in part:
                    bridge.release(*it)
            ths = [threading.Thread(target=work, args=(wl.items[k::threads],)) for k in range(threads)]
            for th in ths:
                th.start()
            for th in ths:
                th.join()
        dt = time.perf_counter() - t
    return rate(n, dt)


NODE_MANIFEST = manifest_text(MESH, readings_table())
LAST_CPU: dict[str, float] = {}
# Where a Node.write_many's wall time goes, per write (the calling thread's wall clock, summed
# over the timed groups): the journal's intent and output commits (their fsyncs), the signing,
# the witness written after the signing (a group of 64 or more is witnessed beside it), the
# apply of the released events (the one apply path) and the store's commit inside it; `other`
# is the rest (the checks, the HLC ticks, the CBOR and COSE encoding, the bridge's bookkeeping).
PHASES = ("journal_intents", "sign", "journal_outputs", "witness", "apply", "store_commit")
LAST_PHASES: dict[str, float] = {}


class _Phases:
    """Times the phases of write_many by wrapping the functions they run in (per group, not per
    event: the wrappers cost nothing measurable); restores them on exit."""

    def __init__(self) -> None:
        from agent import apply, produce
        from agent.store import db
        from firmware_bridge import journal, software
        self.t = dict.fromkeys(PHASES, 0.0)
        self.saved = []
        self._wrap(journal.Journal, "commit",
                   lambda a, k: "journal_intents" if next(iter(a[1]), (None,))[0] == journal.INTENT else "journal_outputs")
        self._wrap(software.SoftwareKeystore, "_sign_many", lambda a, k: "sign")
        self._wrap(produce, "witness", lambda a, k: "witness")
        self._wrap(apply, "apply_batch", lambda a, k: "apply")
        self._wrap(db.transaction, "__exit__", lambda a, k: "store_commit")

    def _wrap(self, obj, name: str, phase) -> None:
        real = getattr(obj, name, None)
        if real is None:
            return
        t = self.t

        def timed(*a, **k):
            if threading.current_thread() is not threading.main_thread():
                return real(*a, **k)   # beside the caller (the witness during the signing): not on its path
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                t[phase(a, k)] += time.perf_counter() - t0
        self.saved.append((obj, name, real))
        setattr(obj, name, timed)

    def __enter__(self) -> "_Phases":
        return self

    def __exit__(self, *exc) -> None:
        for obj, name, real in reversed(self.saved):
            setattr(obj, name, real)


def bench_node(d: str, n: int, group: int) -> tuple[float, float]:
    """-> (Node.write_many writes/s in groups of ``group``, core apply events/s of the same events)."""
    os.environ.setdefault("SSP_AGENT_WITNESS_DIR", os.path.join(d, "witness"))
    from agent.node import Node
    a, pk = Node.init(os.path.join(d, f"node-a-{group}"), NODE_MANIFEST, {"kind": "software"})
    b, _ = Node.init(os.path.join(d, f"node-b-{group}"), NODE_MANIFEST, {"kind": "software"})
    try:
        b.add_peer(a.site_id, pk, None)
        writes = [("app.readings", {"device": f"s-{i % 97:04d}", "seq": i}, {"temp": 20.5 + i % 10, "note": "x" * 120},
                   False) for i in range(n)]
        with _Phases() as ph:
            t, ct, pt = time.perf_counter(), time.thread_time(), time.process_time()
            for i in range(0, n, group):
                a.write_many(writes[i:i + group])
            dt = time.perf_counter() - t
        w = rate(n, dt)
        # the store's commit is timed inside the apply: the apply's own share is the rest
        ph.t["apply"] -= ph.t["store_commit"]
        LAST_PHASES.update({k: v / n * 1e6 for k, v in ph.t.items()},
                           other=(dt - sum(ph.t.values())) / n * 1e6, total=dt / n * 1e6)
        # CPU per write: the calling thread's (it holds the GIL for all but signing, fsync and
        # SQLite's own work) and the whole process's (the signing threads too)
        LAST_CPU.update(thread_us=(time.thread_time() - ct) / n * 1e6, process_us=(time.process_time() - pt) / n * 1e6)
        raws = [bytes(r) for (r,) in a.conn.execute("SELECT unseal(event_id, raw) FROM events ORDER BY seq")]
        t = time.perf_counter()
        for i in range(0, n, 256):
            b.apply_batch(raws[i:i + 256])
        ap = rate(n, time.perf_counter() - t)
        assert b.conn.execute("SELECT count(*) FROM events").fetchone()[0] == n
    finally:
        a.close()
        b.close()
    return w, ap


def write_rounds(d: str, rounds: int, n: int) -> list[dict[str, float]]:
    """Per round, the raw two-core batch sign rate (no persistence), the bridge
    in groups of 256 and Node.write_many in groups of 256 (sign, persist, witness, apply), and
    the core apply rate, all in the same round."""
    out = []
    for r in range(rounds):
        rd = os.path.join(d, f"round{r}")
        os.makedirs(rd)
        ks = open_keystore({"kind": "software", "dir": os.path.join(rd, "keys")})
        ks.generate_key("site", "ed25519")
        fig = {"raw_sign_batch256": bench_raw_sign_batch(ks, "site", n, 256)}
        fig["bridge_group256"] = bench_bridge(ks, os.path.join(rd, "j"), n, 256, 50_000_000 + r * n)
        fig["write_many_256"], fig["core_apply"] = bench_node(rd, n, 256)
        fig["write_many_thread_cpu_us"], fig["write_many_process_cpu_us"] = LAST_CPU["thread_us"], LAST_CPU["process_us"]
        fig.update({f"write_many_us_{k}": v for k, v in LAST_PHASES.items()})
        ks.close()
        out.append(fig)
    return out


def summarize_rounds(title: str, rows: list[dict[str, float]]) -> dict[str, float]:
    ratio = [r["write_many_256"] / r["raw_sign_batch256"] for r in rows]
    bridge = [r["bridge_group256"] / r["raw_sign_batch256"] for r in rows]
    print(f"{title}: {len(rows)} round(s)")
    for k in ("raw_sign_batch256", "bridge_group256", "write_many_256", "core_apply"):
        v = [r[k] for r in rows]
        print(f"  {k:24s} median {_median(v):9.0f}/s  range {min(v):.0f}-{max(v):.0f}")
    for k in ("write_many_thread_cpu_us", "write_many_process_cpu_us"):
        v = [r[k] for r in rows if k in r]
        if v:
            print(f"  {k:24s} median {_median(v):9.1f} us/write  range {min(v):.1f}-{max(v):.1f}")
    phases = [k for k in rows[0] if k.startswith("write_many_us_")]
    if phases:
        print("  where a write's wall time goes (the calling thread, us/write, medians):")
        print("    " + "  ".join(f"{k[len('write_many_us_'):]} {_median([r[k] for r in rows]):.1f}" for k in phases))
        # What bounds it: the signing is all the raw rate pays for; at 0.5 everything else must fit
        # in the time the signing takes again.
        # (the write's total at or under twice the raw signing time)
        rest = _median([r["write_many_us_total"] - r["write_many_us_sign"] for r in rows])
        room = _median([2e6 / r["raw_sign_batch256"] - r["write_many_us_sign"] for r in rows])
        print(f"  a write besides its signing takes {rest:.1f} us; 0.5 leaves it {room:.1f} us "
              f"({rest / room:.1f}x less than now)")
    print(f"  Node.write_many (256) / raw two-core batch sign = median {_median(ratio):.3f} "
          f"(range {min(ratio):.3f}-{max(ratio):.3f})  (target >= 0.5)")
    print(f"  bridge group 256 / raw two-core batch sign      = median {_median(bridge):.3f} "
          f"(range {min(bridge):.3f}-{max(bridge):.3f})")
    return {"write_many_ratio_median": _median(ratio), "write_many_ratio_min": min(ratio),
            "write_many_ratio_max": max(ratio), "bridge_ratio_median": _median(bridge),
            **{f"{k}_median": _median([r[k] for r in rows]) for k in rows[0]}}


def softhsm_config(d: str):
    util = shutil.which("softhsm2-util")
    mods = [m for m in ["/usr/lib/softhsm/libsofthsm2.so", *glob.glob("/usr/lib/*/softhsm/libsofthsm2.so")]
            if os.path.exists(m)]
    if not util or not mods:
        return None
    os.makedirs(os.path.join(d, "tokens"))
    conf = os.path.join(d, "softhsm2.conf")
    with open(conf, "w") as f:
        f.write(f"directories.tokendir = {d}/tokens\nobjectstore.backend = file\nlog.level = ERROR\n")
    subprocess.run([util, "--init-token", "--free", "--label", "bench", "--so-pin", "12345678", "--pin", "1234"],
                   check=True, capture_output=True, env=dict(os.environ, SOFTHSM2_CONF=conf))
    return {"kind": "pkcs11", "module": mods[0], "token_label": "bench", "pin": "1234", "env": {"SOFTHSM2_CONF": conf}}


class _RoundsOnly(Exception):
    """--rounds-only: skip the single figures."""


def _print_figures(fig: dict[str, float]) -> None:
    base = fig["one_fsync_per_write"]
    print(f"{'figure':42s} {'per second':>12s} {'x one-fsync/write':>18s}")
    for k, v in fig.items():
        print(f"{k:42s} {v:12.0f} {v / base:18.2f}")
    g = fig["bridge_software_group256"]
    print()
    print(f"software group commit (256) / one-fsync-per-write = {g / base:.1f}x  (target >= 20x)")
    print(f"software group commit (256) / raw Ed25519 sign    = {g / fig['raw_sign_ed25519_software']:.2f}"
          "  (one signature at a time, one core)")
    print(f"software group commit (256) / bridge one write per call = "
          f"{g / fig['bridge_software_one_per_call']:.1f}x  (the same bridge without group commit: 2 fsyncs a write)")
    ceiling = max(fig["raw_sign_ed25519_software"], fig["raw_sign_ed25519_software_batch256"])
    print(f"raw Ed25519 batch sign / one-fsync-per-write      = {ceiling / base:.1f}x"
          f"  (upper bound on the achievable ratio on this disk with {os.cpu_count()} cores)")
    nw, na = fig["node_write_many_256"], fig["node_core_apply"]
    print(f"Node.write_many (256, software) / core apply rate = {nw / na:.2f}  (target >= 0.5)")
    print(f"Node.write_many (256, software) / raw two-core batch sign = "
          f"{nw / fig['raw_sign_ed25519_software_batch256']:.3f}  (target >= 0.5; rounds below)")
    print(f"Node.write_many (256, software) / one-fsync-per-write = {nw / base:.1f}x")
    if "raw_sign_ed25519_serial_emulator" in fig:
        print("serial emulator runs over a pty, which ignores baud: on a real 115200-baud line a SIGN "
              "(a ~380-byte request with a 300-byte event, an ~84-byte reply) is ~41 ms of line time, "
              "i.e. ~24 signatures/s")


def _child_round(args, code: str | None, env: dict | None) -> dict[str, float]:
    p = subprocess.run([sys.executable, os.path.abspath(__file__), "--write-only", "--rounds", "1"]
                       + (["--quick"] if args.quick else []) + (["--code", code] if code else []),
                       capture_output=True, text=True, env=env)
    line = [ln for ln in p.stdout.splitlines() if ln.startswith("ROUNDS ")]
    if p.returncode != 0 or not line:
        raise SystemExit(f"write round failed ({code or 'this checkout'}): {p.stderr[-2000:]}")
    return json.loads(line[0][len("ROUNDS "):])[0]


def _against(d: str, args, rounds: int) -> None:
    """--against DIR: per round, this checkout then DIR, on this disk, then both with every fsync
    delayed by --slow-flush-ms (the shim); medians and ranges of each, in one run."""
    shim = fsyncshim.build(d) if args.slow_flush_ms > 0 else None
    slow = fsyncshim.env(shim, delay_us=int(args.slow_flush_ms * 1000)) if shim else None
    rows: dict[str, list] = {"after": [], "before": [], "after_slow": [], "before_slow": []}
    for _ in range(rounds):
        rows["after"].append(_child_round(args, None, None))
        rows["before"].append(_child_round(args, args.against, None))
        if slow is not None:
            rows["after_slow"].append(_child_round(args, None, slow))
            rows["before_slow"].append(_child_round(args, args.against, slow))
    out = {}
    for name, rs in rows.items():
        if rs:
            label = f"{'this checkout' if name.startswith('after') else args.against}" + \
                (f", every fsync + {args.slow_flush_ms} ms" if name.endswith("slow") else ", this disk's flush")
            out.update({f"{name}_{k}": v for k, v in summarize_rounds(label, rs).items()})
    if args.json:
        print(json.dumps({k: round(v, 3) for k, v in out.items()}))


def main() -> None:
    # docs/apply.md "Clocks without an RTC": simulated or back-dated clocks, on machines that may run no time sync; declare the wall clock trustworthy
    os.environ.setdefault("SSP_AGENT_CLOCK_TRUSTED", "1")
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller counts (CI smoke run)")
    ap.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    ap.add_argument("--rounds", type=int, default=None, help="rounds of the write figures (default 5; 1 with --quick)")
    ap.add_argument("--slow-flush-ms", type=float, default=1.6,
                    help="simulated flush time for the slow-disk rounds (0: skip them)")
    ap.add_argument("--code", help="measure the agent of another checkout (before/after comparisons)")
    ap.add_argument("--write-only", action="store_true", help="only the write rounds (used for the slow-flush child)")
    ap.add_argument("--against", metavar="DIR",
                    help="the write rounds of this checkout and of DIR's (the code before a change) alternately, "
                         "each round in child processes, on this disk and with the slow flush: before/after ratios "
                         "measured in the same run")
    ap.add_argument("--rounds-only", action="store_true",
                    help="only the --rounds rounds (this disk's flush, then the simulated slow flush)")
    args = ap.parse_args()
    s = 0.2 if args.quick else 1.0
    N = lambda k: max(50, int(k * s))  # noqa: E731
    rounds = args.rounds or (1 if args.quick else 5)
    d = tempfile.mkdtemp(prefix="bench-keystore-")
    if args.against:
        try:
            _against(d, args, rounds)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        return
    if args.write_only:
        try:
            rows = write_rounds(d, rounds, N(20000))
        finally:
            shutil.rmtree(d, ignore_errors=True)
        print("ROUNDS " + json.dumps(rows))
        return
    fig: dict[str, float] = {}
    try:
        if args.rounds_only:
            raise _RoundsOnly
        sw = open_keystore({"kind": "software", "dir": os.path.join(d, "keys")})
        sw.generate_key("site", "ed25519")
        sw.generate_key("seq", "p256")
        fig["raw_sign_ed25519_software"] = bench_raw_sign(sw, "site", N(20000))
        fig["raw_sign_ed25519_software_batch256"] = bench_raw_sign_batch(sw, "site", N(20000), 256)
        fig["raw_sign_p256_software"] = bench_raw_sign(sw, "seq", N(10000), receipt=True)
        fig["raw_fsync"] = bench_raw_fsync(d, N(3000))
        fig["one_fsync_per_write"] = bench_one_fsync_per_write(d, sw, N(3000))
        fig["sqlite_row_commit"] = bench_sqlite(d, N(2000))
        fig["bridge_software_group256"] = bench_bridge(sw, os.path.join(d, "j1"), N(40000), 256, 0)
        fig["bridge_software_group32"] = bench_bridge(sw, os.path.join(d, "j2"), N(20000), 32, 0)
        fig["bridge_software_one_per_call"] = bench_bridge(sw, os.path.join(d, "j3"), N(3000), 1, 0)
        fig["bridge_software_8_threads_one_per_call"] = bench_bridge(sw, os.path.join(d, "j4"), N(6000), 1, 0, threads=8)
        fig["node_write_many_256"], fig["node_core_apply"] = bench_node(d, N(20000), 256)
        fig["node_write_many_32"], _ = bench_node(d, N(8000), 32)
        fig["node_write_one_per_call"], _ = bench_node(d, N(1500), 1)

        cfg = softhsm_config(os.path.join(d, "hsm"))
        if cfg:
            hsm = open_keystore(cfg)
            hsm.generate_key("site", "ed25519")
            hsm.generate_key("seq", "p256")
            fig["raw_sign_ed25519_pkcs11"] = bench_raw_sign(hsm, "site", N(3000))
            fig["raw_sign_p256_pkcs11"] = bench_raw_sign(hsm, "seq", N(3000), receipt=True)
            fig["bridge_pkcs11_group256"] = bench_bridge(hsm, os.path.join(d, "j5"), N(6000), 256, 0)
            fig["bridge_pkcs11_one_per_call"] = bench_bridge(hsm, os.path.join(d, "j6"), N(2000), 1, 0)
            hsm.close()
        else:
            print("pkcs11: skipped (SoftHSM2 not installed: apt-get install -y softhsm2)")

        port = os.path.join(d, "ksdev")
        proc = subprocess.Popen([sys.executable, "-m", "firmware_bridge.serial_device", "--port-link", port,
                                 "--state", os.path.join(d, "dev")], stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONPATH=os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))))
        try:
            assert proc.stdout is not None and proc.stdout.readline().startswith("READY")
            ser = open_keystore({"kind": "serial", "port": port, "baud": 115200, "timeout_s": 2.0})
            ser.generate_key("site", "ed25519")
            fig["raw_sign_ed25519_serial_emulator"] = bench_raw_sign(ser, "site", N(1000))
            fig["bridge_serial_emulator_group64"] = bench_bridge(ser, os.path.join(d, "j7"), N(2000), 64, 30_000_000)
            fig["bridge_serial_emulator_one_per_call"] = bench_bridge(ser, os.path.join(d, "j8"), N(500), 1, 40_000_000)
            ser.close()
        finally:
            proc.kill()
            proc.wait()
    except _RoundsOnly:
        pass
    finally:
        shutil.rmtree(d, ignore_errors=True)

    if fig:
        _print_figures(fig)
    print()
    w = tempfile.mkdtemp(prefix="bench-keystore-w-")
    try:
        fig.update({f"rounds_{k}": v for k, v in summarize_rounds(
            "write rounds (this disk's flush)", write_rounds(w, rounds, N(20000))).items()})
        shim = fsyncshim.build(w) if args.slow_flush_ms > 0 else None
        if args.slow_flush_ms > 0 and shim is None:
            print("slow-flush rounds: skipped (no C compiler for bench/fsync_shim.c)")
        elif shim is not None:
            env = fsyncshim.env(shim, delay_us=int(args.slow_flush_ms * 1000))
            p = subprocess.run([sys.executable, os.path.abspath(__file__), "--write-only", "--rounds", str(rounds)]
                               + (["--quick"] if args.quick else []) + (["--code", args.code] if args.code else []),
                               capture_output=True, text=True, env=env)
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("ROUNDS ")]
            if p.returncode != 0 or not line:
                raise SystemExit(f"slow-flush child failed: {p.stderr[-2000:]}")
            rows = json.loads(line[0][len("ROUNDS "):])
            fig.update({f"slow_flush_{k}": v for k, v in summarize_rounds(
                f"write rounds, every fsync + {args.slow_flush_ms} ms (simulated slow flush)", rows).items()})
    finally:
        shutil.rmtree(w, ignore_errors=True)
    if args.json:
        print(json.dumps({k: round(v, 3) for k, v in fig.items()}))
    # the raw limits measured in this run (signing, fsync, SQLite, the core apply) are the denominators
    raw = ("raw_", "rounds_raw_", "slow_flush_raw_", "one_fsync_per_write", "sqlite_row_commit", "node_core_apply",
           "rounds_core_apply", "slow_flush_core_apply")
    slow = (f"; with every fsync + {args.slow_flush_ms} ms {fig['slow_flush_write_many_ratio_median']:.2f} "
            f"({fig['slow_flush_write_many_ratio_min']:.2f}-{fig['slow_flush_write_many_ratio_max']:.2f})"
            if "slow_flush_write_many_ratio_median" in fig else "")
    record({k: v for k, v in fig.items() if not k.startswith(raw)}, {k: v for k, v in fig.items() if k.startswith(raw)},
           f"Node.write_many of 256 / raw two-core batch sign = {fig['rounds_write_many_ratio_median']:.2f} "
           f"({fig['rounds_write_many_ratio_min']:.2f}-{fig['rounds_write_many_ratio_max']:.2f}, {rounds} rounds){slow}; "
           f"the bridge alone {fig['rounds_bridge_ratio_median']:.2f}"
           + (f"; bridge groups of 256 {fig['bridge_software_group256']:.0f}/s"
              f" = {fig['bridge_software_group256'] / fig['one_fsync_per_write']:.1f}x one fsync per write"
              if "bridge_software_group256" in fig else ""),
           parameters=vars(args))


if __name__ == "__main__":
    main()
