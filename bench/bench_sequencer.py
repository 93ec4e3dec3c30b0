"""Commits sequenced per second with durable receipts (Benchmark), as a ratio of the raw
ES256 signing rate of the same keystore measured in the same run.

  raw_es256_<ks>            receipt signatures/s straight from the keystore (its private _sign /
                            _sign_many, no persistence, no COSE; PKCS#11: sign_many round trips of
                            --batch to the token's worker, no verification): the denominator
  seq_one_<ks>              Sequencer.submit, one Commit per call: a pending commit, two journal
                            fsyncs (intent, receipt) and a state commit per Commit
  seq_stream<G>_<ks>        the pipelined group commit as `sequencer run` drives it (the headline):
                            G groups, each a closed loop — its next Commit is put when the answer to
                            its last one is released; batches of up to pipeline.CHUNK distinct groups,
                            one signing in the keystore (the software keystore: its own process)
                            while this process commits the batch before and prepares the next
  seq_stream<G>_<ks>_idle   the same with 10 000 idle groups registered, each of which committed
                            twice (receipts in the state and in the signing journal, compacted
                            before the rounds: groups active once and quiet since; no per-group cost)
  seq_batch<G>_<ks>         Sequencer.submit_many of G Commits for G different groups, one call per
                            round (each call fills and empties the pipeline)
  seq_batch<G>_<ks>_idle    the same with those 10 000 idle groups (no per-group cost)
  seq_stream<G>_<ks>_history<D>  (--history D) the stream over G groups that already hold D
                            receipts each: what the receipts table's growth costs (its
                            (group_id, epoch) index takes each batch's rows at G places)
  cpu_us_per_commit_*       this process's CPU per Commit in those rounds, and raw_cpu_us_per_signature_<ks>
                            per raw signature: the figures a neighbour's load disturbs least (a
                            shared machine's wall rates swing 2x between rounds; SoftHSM2's token
                            works in its worker process, outside this figure)
  tree_cpu_us_per_commit_stream<G>_<ks>, raw_tree_cpu_us_per_signature_<ks>
                            the same per Commit / per raw signature for this process and every
                            descendant (the software keystore's signing process, the PKCS#11 token
                            worker and anything else a keystore runs): all the CPU a Commit costs
  cpu_bound_stream<G>_<ks>  the ratio the machine's CPUs would allow if every process ran in
                            parallel without loss: (usable CPUs / tree CPU per Commit) / raw rate.
                            A goal above it cannot be met on this machine by scheduling alone
  broker_<G>_groups         (--broker) Commits/s through `sequencer run` on a real mosquitto: one
                            Commit for each of G groups published at once, every answer awaited

Each figure is the median of ``--rounds`` rounds with its range; every ratio is taken against the
raw rate measured just before and just after it.

    python bench/bench_sequencer.py [--quick] [--json] [--no-pkcs11] [--rounds N] [--batch G]
    python bench/bench_sequencer.py --against REV [--rounds N] [--no-pkcs11] [--cases 256:0,1024:0]

--against: same-run A/B, each case's rounds alternately from this checkout and REV's (a git
revision checked out in a temporary worktree, or a checkout's directory; one
child process per round, the order swapped every round), with the CPU figures beside the rates.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

# SSP_BENCH_TREE: the checkout whose sequencer is measured (--against runs one round of each tree
# alternately in a child process with it set); this one by default
sys.path.insert(0, os.environ.get("SSP_BENCH_TREE") or os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from firmware_bridge import ReceiptIdentity  # noqa: E402
from agent.sequencer import receipts, service  # noqa: E402
from agent.sequencer.framing import encode_private_message  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import checkout, of_rounds, rate, record  # noqa: E402  (bench/: the shared set-up)
from bench_keystore import softhsm_config  # noqa: E402


CPUS = len(os.sched_getaffinity(0))


def tree_cpu_s() -> float:
    """CPU seconds (user + system) used so far by this process and every live descendant (/proc):
    a keystore's worker processes count. Resolution: one clock tick (10 ms), so measure ~1 s."""
    me, parent, used = os.getpid(), {}, {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            with open(f"/proc/{p}/stat") as f:
                s = f.read()
        except OSError:        # gone meanwhile
            continue
        rest = s[s.rindex(")") + 2:].split()   # the name may hold spaces and parentheses
        parent[int(p)] = int(rest[1])
        used[int(p)] = int(rest[11]) + int(rest[12])
    tree, todo = {me}, [me]
    while todo:
        x = todo.pop()
        for pid, pp in parent.items():
            if pp == x and pid not in tree:
                tree.add(pid)
                todo.append(pid)
    return sum(used.get(pid, 0) for pid in tree) / os.sysconf("SC_CLK_TCK")


def raw_es256(seq: service.Sequencer, n: int, batch: int, cpu: list | None = None,
              tree: list | None = None) -> float:
    ks = seq.bridge.keystore
    c, tc = time.process_time(), tree_cpu_s()
    payload = receipts.payload_bytes(b"\x01" * 16, 0, b"\x02" * 32, None)
    _p, tbs = receipts.to_be_signed(seq.public_key, payload)
    reqs = [(service.RECEIPT_KEY, ReceiptIdentity(b"raw-bench", 10**9 + i), tbs) for i in range(n)]
    sign = ks._sign_many
    if ks.kind == "pkcs11":
        # the token's own rate: the PKCS#11 keystore's _sign_many also verifies every signature
        # (its verifier process, docs/keystore.md), which is the sequencer's cost, not the token's
        def sign(part):
            return ks._call("sign_many", requests=[[k, "p256", bytes(d)] for k, _, d in part])["sigs"], None
    t = time.perf_counter()
    for i in range(0, n, batch):
        sigs, failure = sign(reqs[i:i + batch])
        assert failure is None
    t = time.perf_counter() - t
    if cpu is not None:   # this process's CPU µs per signature (SoftHSM2: the token's is in its worker)
        cpu.append((time.process_time() - c) / n * 1e6)
    if tree is not None:  # and with every worker process of the keystore
        tree.append((tree_cpu_s() - tc) / n * 1e6)
    return rate(n, t)


def groups(n: int, tag: bytes) -> list[bytes]:
    return [tag + i.to_bytes(8, "big") for i in range(n)]


def seq_one(seq: service.Sequencer, n: int) -> float:
    gs = groups(8, b"one-")
    for g in gs:
        seq.register(g, 0)
    msgs = [encode_private_message(gs[i % 8], i // 8) for i in range(n)]
    t = time.perf_counter()
    for m in msgs:
        assert isinstance(seq.submit(m), service.Accepted)
    return rate(n, time.perf_counter() - t)


def seq_batch(seq: service.Sequencer, n: int, batch: int, tag: bytes, cpu: list | None = None) -> float:
    """Commits/s of ``submit_many`` of ``batch`` groups; ``cpu`` gets this process's CPU µs per
    Commit (what a neighbour's load disturbs least)."""
    gs = groups(batch, tag)
    for g in gs:
        seq.register(g, 0)
    rounds = max(n // batch, 1)
    msgs = [[encode_private_message(g, r) for g in gs] for r in range(rounds)]
    c = time.process_time()
    t = time.perf_counter()
    for ms in msgs:
        ans = seq.submit_many(ms)
        assert all(isinstance(a, service.Accepted) for a in ans)
    t = time.perf_counter() - t
    if cpu is not None:
        cpu.append((time.process_time() - c) / (rounds * batch) * 1e6)
    return rate(rounds * batch, t)


def seq_stream(seq: service.Sequencer, n: int, g: int, tag: bytes, cpu: list | None = None,
               tree: list | None = None, history: int = 0) -> float:
    """Commits/s through ``Sequencer.group_commit`` with ``g`` groups in closed loops (each group's
    next Commit is put as the answer to its last is released, as members do through `sequencer
    run`), until ``n`` answers are out; the Commits are built beforehand (members build them).
    ``history``: each group is first taken through that many epochs (not measured), so the
    receipts table holds that many receipts a group when the measured Commits come."""
    gs = groups(g, tag)
    for x in gs:
        seq.register(x, 0)
    rounds = history + n // g + 3
    msgs = {x: [encode_private_message(x, r) for r in range(rounds)] for x in gs}
    gc = seq.group_commit()
    if history:
        _closed_loop(gc, gs, msgs, {x: 0 for x in gs}, history * g, stop_at=history)
    c, tc = time.process_time(), tree_cpu_s()
    t = time.perf_counter()
    done = _closed_loop(gc, gs, msgs, {x: history for x in gs}, n)
    t = time.perf_counter() - t
    if cpu is not None:
        cpu.append((time.process_time() - c) / done * 1e6)
    if tree is not None:
        tree.append((tree_cpu_s() - tc) / done * 1e6)
    gc.queue.clear()     # what is in flight is finished (outside the figure)
    gc.drain()
    return rate(done, t)


def _closed_loop(gc, gs: list[bytes], msgs: dict, first: dict, n: int, stop_at: int | None = None) -> int:
    """Put each group's Commit for epoch ``first[group]``, then each group's next as its answer
    comes, until ``n`` answers are out (``stop_at``: a group answered for epoch ``stop_at - 1``
    puts nothing more, and the loop drains). Returns the answers counted."""
    for x in gs:
        gc.put(x, msgs[x][first[x]])
    done = 0
    while done < n:
        for x, ans in gc.step():
            assert type(ans) is service.Accepted, ans
            done += 1
            if stop_at is None or ans.epoch + 1 < stop_at:
                gc.put(x, msgs[x][ans.epoch + 1])
    if stop_at is not None:
        done += len(gc.drain())
    return done


def register_idle(seq: service.Sequencer, n: int) -> None:
    """``n`` groups registered, each taken through two Commits (receipts in the receipts table and
    the signing journal), then the journal compacted (each keeps its last receipt there): groups
    that were active once and went quiet, which neither a Commit nor a compaction should pay for
    afterwards."""
    gs = [b"idle-" + i.to_bytes(8, "big") for i in range(n)]
    with seq.store._tx():
        seq.store.conn.executemany("INSERT INTO groups (group_id, current_epoch, origin) VALUES (?, 0, 'registered')",
                                   [(g,) for g in gs])
    gc = seq.group_commit()
    for epoch in range(2):
        for g in gs:
            gc.put(g, encode_private_message(g, epoch))
        assert all(type(ans) is service.Accepted for _g, ans in gc.drain())
    assert seq.compact_journal()["receipts_dropped"] == n


def run_keystore(name: str, conf, d: str, n: int, batch: int, idle: int, rounds: int,
                 fig: dict, stream: int = 1024, history: int = 0) -> None:
    """Two homes, one of them with ``idle`` idle groups (register_idle), their rounds alternated (so the
    growth of the receipts table and a neighbour's load fall on both alike). A round: raw ES256,
    the pipelined stream, raw again; then raw, one ``submit_many`` per round of ``batch`` groups,
    raw. Each ratio's denominator is the mean of the two raw runs beside it. ``conf``: the
    keystore profile, or a callable giving one per home (a token each). ``history``: also the
    stream over groups that already hold that many receipts each (raw, stream, raw per round)."""
    homes = {"": os.path.join(d, name), f"_idle{idle}": os.path.join(d, name + "-idle")}
    seqs = {}
    try:
        for suffix, home in homes.items():
            service.init(home, conf(home + "-token") if callable(conf) else conf)
            seqs[suffix] = service.Sequencer(home)
        register_idle(seqs[f"_idle{idle}"], idle)
        fig[f"seq_one_{name}"] = [seq_one(seqs[""], max(n // 16, 16))]
        for seq in seqs.values():
            seq_stream(seq, 2 * stream, stream, b"warm-")    # starts the signing process, warms the caches
        for r in range(rounds):
            for suffix, seq in seqs.items():
                rcpu: list = []
                rtree: list = []
                raw1 = raw_es256(seq, n, batch, rcpu, rtree)
                cpu: list = []
                tree: list = []
                st = seq_stream(seq, 2 * n, stream, b"stream-%d-" % r, cpu, tree)
                raw2 = raw_es256(seq, n, batch, rcpu, rtree)
                raw = (raw1 + raw2) / 2
                got = [(f"seq_stream{stream}_{name}{suffix}", st),
                       (f"ratio_stream{stream}_{name}{suffix}", st / raw),
                       (f"cpu_us_per_commit_stream{stream}_{name}{suffix}", cpu[0]),
                       (f"tree_cpu_us_per_commit_stream{stream}_{name}{suffix}", tree[0]),
                       (f"cpu_bound_stream{stream}_{name}{suffix}", CPUS * 1e6 / tree[0] / raw)]
                if not suffix:
                    got += [(f"raw_es256_{name}", raw), (f"raw_cpu_us_per_signature_{name}", sum(rcpu) / 2),
                            (f"raw_tree_cpu_us_per_signature_{name}", sum(rtree) / 2)]
                for k, v in got:
                    fig.setdefault(k, []).append(v)
        for r in range(rounds):
            for suffix, seq in seqs.items():
                raw1 = raw_es256(seq, n, batch)
                cpu = []
                b = seq_batch(seq, n, batch, b"batch-%d-" % r, cpu)
                raw2 = raw_es256(seq, n, batch)
                for k, v in ((f"seq_batch{batch}_{name}{suffix}", b),
                             (f"ratio_batch{batch}_{name}{suffix}", b / ((raw1 + raw2) / 2)),
                             (f"cpu_us_per_commit_batch{batch}_{name}{suffix}", cpu[0])):
                    fig.setdefault(k, []).append(v)
        for r in range(rounds if history else 0):   # last: it grows the first home's receipts table
            seq = seqs[""]
            raw1 = raw_es256(seq, n, batch)
            cpu = []
            st = seq_stream(seq, 2 * n, stream, b"history-%d-" % r, cpu, history=history)
            raw = (raw1 + raw_es256(seq, n, batch)) / 2
            for k, v in ((f"seq_stream{stream}_{name}_history{history}", st),
                         (f"ratio_stream{stream}_{name}_history{history}", st / raw),
                         (f"cpu_us_per_commit_stream{stream}_{name}_history{history}", cpu[0])):
                fig.setdefault(k, []).append(v)
    finally:
        for seq in seqs.values():
            seq.close()


def through_broker(d: str, groups_n: int, rounds: int, fig: dict, pythonpath: str | None = None) -> None:
    """Commits/s through `sequencer run` on a real mosquitto: one member client publishes one
    Commit for each of ``groups_n`` groups at once (QoS 1, response topic) and waits for every
    answer; ``rounds`` times (each round the next epoch of every group). The server's stop line
    says in how many group commits it sequenced them."""
    import queue as _q
    import subprocess
    import uuid
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties
    from agent.transport.broker import Broker
    env = dict(os.environ, SSP_AGENT_CLOCK_TRUSTED="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    home = os.path.join(d, "broker-seq")
    cmd = [sys.executable, "-m", "agent.cli", "--home", home, "sequencer"]
    if not pythonpath:
        env["PYTHONPATH"] = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    subprocess.run(cmd + ["init"], check=True, capture_output=True, env=env, cwd=d)   # cwd: -m puts it first
    broker = Broker(workdir=os.path.join(d, "mosq")).start()
    srv = subprocess.Popen(cmd + ["run", "--broker", broker.url], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, env=env, cwd=d)
    srv.stdout.readline()
    answers: "_q.Queue" = _q.Queue()
    reply = f"sovm-member/bench-{uuid.uuid4().hex[:12]}/answers"
    c = paho.Client(CallbackAPIVersion.VERSION2, client_id=f"bench-{uuid.uuid4().hex[:8]}", protocol=paho.MQTTv5)
    c.max_inflight_messages_set(65535)
    c.on_message = lambda cl, u, m: answers.put(json.loads(m.payload))
    c.connect(broker.host, broker.port)
    c.loop_start()
    c.subscribe(reply, qos=1)
    time.sleep(0.5)
    gs = groups(groups_n, b"mqtt-")
    try:
        for r in range(rounds):
            msgs = [encode_private_message(g, r) for g in gs]
            t = time.perf_counter()
            for g, m in zip(gs, msgs):
                p = Properties(PacketTypes.PUBLISH)
                p.ResponseTopic = reply
                p.CorrelationData = g
                c.publish(f"sovm-seq/{g.hex()}/submit", m, qos=1, properties=p)
            got = [answers.get(timeout=300) for _ in gs]
            dt = time.perf_counter() - t
            assert all(a.get("accepted") for a in got), got[:3]
            fig.setdefault(f"broker_{groups_n}_groups", []).append(groups_n / dt)
    finally:
        c.loop_stop()
        c.disconnect()
        srv.terminate()
        out, _err = srv.communicate(timeout=60)
        broker.close()
    last = ([json.loads(x) for x in out.splitlines() if x.startswith("{")] or [{}])[-1]
    if "submit_batches" in last:
        fig.setdefault(f"broker_{groups_n}_commits_per_group_commit", []).append(
            last["submits"] / max(last["submit_batches"], 1))


def one_round(ks: str, batch: int, idle: int, n: int) -> dict:
    """One round in a fresh home (the --against child): raw ES256, a group commit of ``n``
    Commits in batches of ``batch`` groups (after ``idle`` idle groups are registered), raw again."""
    d = tempfile.mkdtemp(prefix="bench-seq-ab-")
    try:
        conf = None if ks == "software" else softhsm_config(os.path.join(d, "hsm"))
        home = os.path.join(d, ks)
        service.init(home, conf)
        with service.Sequencer(home) as seq:
            seq_batch(seq, 2 * batch, batch, b"warm-")
            if idle:
                register_idle(seq, idle)
            gs = groups(batch, b"ab-")
            for g in gs:
                seq.register(g, 0)
            msgs = [[encode_private_message(g, r) for g in gs] for r in range(max(n // batch, 1))]
            c0 = time.process_time()
            raw1 = raw_es256(seq, n, min(batch, 256))
            c1 = time.process_time()
            t = time.perf_counter()
            for ms in msgs:
                assert all(isinstance(x, service.Accepted) for x in seq.submit_many(ms))
            b = rate(len(msgs) * batch, time.perf_counter() - t)
            c2 = time.process_time()
            raw2 = raw_es256(seq, n, min(batch, 256))
            c3 = time.process_time()
        # this process's CPU per signature and per Commit: what a neighbour's load disturbs least;
        # for SoftHSM2 the token's share is in its worker process, not here
        return {"raw": (raw1 + raw2) / 2, "seq": b, "ratio": b / ((raw1 + raw2) / 2),
                "raw_cpu_us": (c1 - c0 + c3 - c2) / (2 * n) * 1e6, "seq_cpu_us": (c2 - c1) / (len(msgs) * batch) * 1e6}
    finally:
        shutil.rmtree(d, ignore_errors=True)


def against(other: str, rounds: int, kss: list[str], quick: bool, cases_arg: str) -> dict:
    """Same-run A/B: each case's rounds alternate between this checkout and ``other`` (the order
    swapped every round, so a neighbour's load falls on both alike), one child process per round."""
    import subprocess
    here = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
    trees = {"this": here, "other": os.path.abspath(other)}
    n = 512 if quick else 8192
    cases = [(ks, int(b), int(idle)) for ks in kss for b, idle in (c.split(":") for c in cases_arg.split(","))]
    out: dict = {}
    for ks, b, idle in cases:
        for r in range(rounds):
            for name in (("this", "other") if r % 2 == 0 else ("other", "this")):
                env = dict(os.environ, SSP_BENCH_TREE=trees[name])
                got = subprocess.run([sys.executable, os.path.abspath(__file__), "--one-round",
                                      f"{ks}:{b}:{idle}:{n if ks == 'software' else n // 4}"],
                                     env=env, capture_output=True, text=True, check=True)
                res = json.loads(got.stdout.strip().splitlines()[-1])
                for k, v in res.items():
                    out.setdefault(f"{ks}_{b}{'_idle%d' % idle if idle else ''}_{name}_{k}", []).append(v)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small counts (smoke run)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--no-pkcs11", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", type=int, default=None, help="Commits (distinct groups) per group commit")
    ap.add_argument("--broker", action="store_true", help="also through `sequencer run` on a real mosquitto")
    ap.add_argument("--broker-only", action="store_true", help="only the broker figure")
    ap.add_argument("--broker-pythonpath", help="run the served sequencer from this tree (compare a revision)")
    ap.add_argument("--against", metavar="REV", help="same-run A/B against a git revision or a checkout's directory: "
                    "--rounds of each, alternating, at 256 and 1 024 groups and with 10 000 idle groups")
    ap.add_argument("--cases", default="256:0,1024:0,256:10000", help="--against: groups:idle cases")
    ap.add_argument("--history", type=int, default=0, metavar="DEPTH",
                    help="also the stream over groups holding DEPTH receipts each (the receipts table's growth)")
    ap.add_argument("--one-round", help=argparse.SUPPRESS)
    a = ap.parse_args()
    # the collector as `sequencer run` sets it when it starts serving (pipeline.GC_THRESHOLDS); a
    # tree measured with --against that predates it keeps the default
    getattr(service, "tune_collector", lambda: None)()
    if a.one_round:
        ks, b, idle, n = a.one_round.split(":")
        print(json.dumps(one_round(ks, int(b), int(idle), int(n))))
        return
    if a.against:
        load0 = os.getloadavg()
        with checkout(a.against) as tree:
            fig = against(str(tree), a.rounds, ["software"] + ([] if a.no_pkcs11 else ["pkcs11"]), a.quick, a.cases)
        print(f"{a.rounds} rounds each, alternating; load average {load0[0]:.1f} at start, "
              f"{os.getloadavg()[0]:.1f} at end; median [min .. max]")
        for k, v in fig.items():
            fmt = "{:.3f}" if k.endswith("ratio") else "{:.1f}" if k.endswith("_us") else "{:.0f}"
            print(f"{k:40s} {fmt.format(statistics.median(v)):>8s}  [{fmt.format(min(v))} .. {fmt.format(max(v))}]")
        # this / REV, round by round (the two runs of a round ran back to back)
        ab = {k.replace("_this_", "_this/REV_", 1): [x / y for x, y in zip(v, fig[k.replace("_this_", "_other_", 1)]) if y]
              for k, v in fig.items() if "_this_" in k}
        for k, v in ab.items():
            print(f"{k:40s} {statistics.median(v):8.3f}  [{min(v):.3f} .. {max(v):.3f}]")
        if a.json:
            print(json.dumps({k: of_rounds(v) for k, v in {**fig, **ab}.items()}))
        return
    n, batch, idle, stream = (512, 64, 1000, 128) if a.quick else (8192, 256, 10_000, 1024)
    batch = a.batch or batch
    fig: dict = {}
    d = tempfile.mkdtemp(prefix="bench-seq-")
    try:
        if a.broker or a.broker_only:
            through_broker(d, 1024 if not a.quick else 64, a.rounds, fig, a.broker_pythonpath)
        if a.broker_only:
            pass
        else:
            run_keystore("software", None, d, n, batch, idle, a.rounds, fig, stream, a.history)
        if not a.no_pkcs11 and not a.broker_only:
            cfg = softhsm_config(os.path.join(d, "hsm"))
            if cfg is None:
                print("pkcs11: skipped (SoftHSM2 not installed: apt-get install -y softhsm2)")
            else:
                run_keystore("pkcs11", softhsm_config, d, n // 4, batch, idle, a.rounds, fig, stream, a.history)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    print(f"{a.rounds} rounds; median [min .. max]")
    for k, v in fig.items():
        fmt = "{:.3f}" if k.startswith(("ratio", "cpu_bound")) else "{:.1f}" if "cpu_" in k else "{:.0f}"
        print(f"{k:44s} {fmt.format(statistics.median(v)):>8s}  [{fmt.format(min(v))} .. {fmt.format(max(v))}]"
              + ("" if k.startswith("ratio") or "cpu_" in k else " /s"))
    for ks in ("software", "pkcs11"):
        for what, k in (("pipelined group commit, a stream of %d groups" % stream, f"ratio_stream{stream}_{ks}"),
                        ("submit_many of %d groups per call" % batch, f"ratio_batch{batch}_{ks}")):
            if k in fig:
                print(f"{ks}: {what} / raw ES256 = {statistics.median(fig[k]):.3f} "
                      f"[{min(fig[k]):.3f} .. {max(fig[k]):.3f}]; with {idle} idle groups "
                      f"{statistics.median(fig[k + '_idle' + str(idle)]):.3f} (goal 0.8)")
        k = f"cpu_bound_stream{stream}_{ks}"
        if k in fig:
            print(f"{ks}: the most {CPUS} CPUs allow at the stream's CPU per Commit (all processes) = "
                  f"{statistics.median(fig[k]):.3f} of raw ES256")
    if a.json:
        print(json.dumps({k: {"median": round(statistics.median(v), 3), "min": round(min(v), 3),
                              "max": round(max(v), 3)} for k, v in fig.items()}))
    record({k: of_rounds(v) for k, v in fig.items() if not k.startswith("raw_")},
           {k: of_rounds(v) for k, v in fig.items() if k.startswith("raw_")},
           "; ".join(f"{ks}: pipelined group commit ({stream} groups) / raw ES256 = {statistics.median(fig[k]):.2f} "
                     f"({min(fig[k]):.2f}-{max(fig[k]):.2f}), with {idle} idle groups "
                     f"{statistics.median(fig[f'{k}_idle{idle}']):.2f}; submit_many of {batch} per call "
                     f"{statistics.median(fig[f'ratio_batch{batch}_{ks}']):.2f}"
                     for ks in ("software", "pkcs11") if (k := f"ratio_stream{stream}_{ks}") in fig)
           + " (goal 0.8)"
           + "".join(f"; {ks}'s CPU bound on {CPUS} CPUs {statistics.median(fig[k]):.2f}"
                     for ks in ("software", "pkcs11") if (k := f"cpu_bound_stream{stream}_{ks}") in fig)
           + "".join(f"; through `sequencer run` {statistics.median(v):.0f} Commits/s ({k.split('_')[1]} groups)"
                     for k, v in fig.items() if k.startswith("broker_") and k.endswith("_groups")),
           parameters=vars(a))


if __name__ == "__main__":
    main()
