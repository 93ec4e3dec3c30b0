"""Signed acknowledgements on MQTT (docs/protocol.md §5): what they cost.

    python bench/bench_acks.py [--events 2000] [--max-events 5] [--window 4]

Without the broker's ACLs the sender moves its cursor only on an answer that carries the
receiver's signed `sovm/ssp-ack-v1` record; signing persists through the keystore bridge (two
journal fsyncs and a witness write per signature), so the receiver groups the answers of one pump
per sender into one record. A holds N events, B starts empty and catches up through a private
mosquitto in bodies of `max-events` events (small, so that answers, not applies, dominate):

- insecure binding *without* acknowledgements (signed acknowledgements left out, emulated here by
  `_Unsigned`: answers answered unsigned and taken on their properties) = the baseline;
- secure binding (no acknowledgement asked for: the ACL path, unchanged);
- insecure binding, acknowledgements grouped per pump (as shipped);
- insecure binding, one signature per answer (grouping off: `mqtt_acks.MAX_ACK_ANSWERS = 1`);
- and the bridge alone: `Node.release_signed` per second.

Each mode runs `--repeat` times, interleaved (the machine's load moves); the median is printed:
answers/s (bodies answered and taken by A per second) and signatures per answer."""
from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from _harness import bench_env, catch_up as timed_catch_up, introduce, record  # noqa: E402  (bench/: the shared set-up)

bench_env()
from agent import mqtt_acks as acks_mod  # noqa: E402
from agent.core.records import AckAnswer  # noqa: E402
from agent.node import Node  # noqa: E402
from agent.runner import RunConfig, Runner  # noqa: E402
from agent.simpeer import manifest_text, readings_table  # noqa: E402
from agent.transport.broker import Broker  # noqa: E402
from agent.transport.mqtt import MqttSettings  # noqa: E402

MESH = bytes.fromhex("ac4c0000000000000000000000000042")
MANIFEST = manifest_text(MESH, readings_table())


def pair(root: Path, name: str, n: int) -> tuple[Node, Node]:
    a = Node.init(root / f"{name}-a", MANIFEST)[0]
    b = Node.init(root / f"{name}-b", MANIFEST)[0]
    introduce(a, b)
    for i in range(0, n, 500):
        a.write_many([("app.readings", {"device": "d", "seq": j}, {"temp": float(j), "note": "x"}, False)
                      for j in range(i, min(n, i + 500))])
    return a, b


class _Unsigned(Runner):
    """The insecure path as it was: answers carry no acknowledgement and count on their properties."""

    def _answer_owed(self, force: bool = False) -> None:
        owed, self._owed = self._owed, {}
        for sender, items in owed.items():
            for m, user, _a in items:
                if self.link.answer(m, self.sync.answer_body(sender), user):
                    self.stats["answers_sent"] += 1
                self.link.ack(m)

    def _on_answer(self, m) -> None:
        self._current = m
        super()._on_answer(m)

    def _proof(self, p, payload):
        props = self._current.props
        n = int(props.get("ssp-processed", "0"))
        return AckAnswer(p.body_hash or b"", n, len(p.seqs) + p.n_backfill, ())


def catch_up(url: str, a: Node, b: Node, secure: bool, max_events: int, window: int,
             ack_interval: float | None = None, unsigned: bool = False) -> dict:
    cfg = dict(cadence_s=3600, realtime=False, window=window, max_events=max_events, secure=secure,
               answer_timeout_s=60)
    if ack_interval is not None:
        cfg["ack_interval_s"] = ack_interval
    cls = _Unsigned if unsigned else Runner
    ra = cls(a, MqttSettings.from_url(url), RunConfig(**cfg))
    rb = cls(b, MqttSettings.from_url(url), RunConfig(**cfg))
    assert ra.start(10) and rb.start(10)
    dt = timed_catch_up(ra, rb, a, b)
    out = {"seconds": dt, "answers": ra.stats["answers"], "answers_per_s": ra.stats["answers"] / dt,
           "signed": rb.stats["acks_signed"], "unproven": ra.stats["answers_unproven"]}
    ra.close(), rb.close()
    return out


def release_rate(root: Path, n: int) -> float:
    """Signatures per second through the bridge alone (persist-before-release, witness)."""
    from agent.sync_port import PortAdapter
    a = Node.init(root / "sign", MANIFEST)[0]
    pa = PortAdapter(a)
    subject = os.urandom(16)
    t0 = time.perf_counter()
    for i in range(n):
        pa.sign_ack(subject, [AckAnswer(os.urandom(32), 1, 1, ())])
    dt = time.perf_counter() - t0
    a.close()
    return n / dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--events", type=int, default=2000)
    ap.add_argument("--max-events", type=int, default=5)
    ap.add_argument("--window", type=int, default=4)
    ap.add_argument("--signatures", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--ack-interval", type=float, default=None, help="RunConfig.ack_interval_s (default: as shipped)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ssp-bench-acks-"))
    modes = (("insecure, no acks (before)", False, True, True),
             ("secure binding (no acks asked)", True, True, False),
             ("insecure, acks grouped per pump", False, True, False),
             ("insecure, one signature per answer", False, False, False))
    runs: dict[str, list[dict]] = {m[0]: [] for m in modes}
    with Broker(workdir=root / "broker") as br:
        for rep in range(args.repeat):
            for name, secure, group, unsigned in modes:
                a, b = pair(root, f"r{rep}-{len(runs[name])}-{modes.index((name, secure, group, unsigned))}", args.events)
                saved = acks_mod.MAX_ACK_ANSWERS
                acks_mod.MAX_ACK_ANSWERS = saved if group else 1
                try:
                    runs[name].append(catch_up(br.url, a, b, secure, args.max_events, args.window,
                                               args.ack_interval, unsigned))
                finally:
                    acks_mod.MAX_ACK_ANSWERS = saved
                a.close(), b.close()
    sig = release_rate(root, args.signatures)
    med = {k: sorted(v, key=lambda r: r["answers_per_s"])[len(v) // 2] for k, v in runs.items()}
    base = med[modes[0][0]]["answers_per_s"]
    print(f"events: {args.events}; bodies of <= {args.max_events} events, window {args.window}; "
          f"median of {args.repeat}")
    for name, r in med.items():
        per = r["signed"] / r["answers"] if r["answers"] else 0
        spread = ", ".join(f"{x['answers_per_s']:.0f}" for x in runs[name])
        print(f"{name:36s} {r['answers_per_s']:7.1f} answers/s [{spread}]  {per:.2f} signatures/answer, "
              f"{r['unproven']} unproven  = {100 * r['answers_per_s'] / base:.0f}% of no acks")
    print(f"bridge alone (sign_ack, persist-before-release): {sig:7.1f} signatures/s")
    tag = {m[0]: t for m, t in zip(modes, ("insecure_no_acks", "secure_binding", "acks_grouped", "acks_one_per_answer"))}
    record({f"answers_per_s_{tag[k]}": r["answers_per_s"] for k, r in med.items()}
           | {f"ratio_{tag[k]}_no_acks": r["answers_per_s"] / base for k, r in med.items() if k != modes[0][0]}
           | {f"signatures_per_answer_{tag[k]}": r["signed"] / r["answers"] for k, r in med.items() if r["answers"]},
           {"answers_per_s_no_acks": base, "bridge_signatures_per_s": sig},
           "answers/s against no acknowledgements: " + ", ".join(
               f"{k} {r['answers_per_s'] / base:.2f}" for k, r in med.items() if k != modes[0][0])
           + f"; the bridge alone {sig:.0f} signatures/s", parameters=vars(args))

if __name__ == "__main__":
    main()
