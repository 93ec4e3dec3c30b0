"""At-rest sealing overhead (docs/reliability.md "At rest"): the same work with
the event log sealed (XChaCha20-Poly1305 under the store's data key, agent/store/atrest.py) and
with the seal replaced by a pass-through (the values stored clear, everything else identical),
in the same run, alternating rounds; the ratio is the median of the per-round ratios.

  apply:  one mailbox body of N events imported into a fresh node (the one apply path, which
          seals each event before its log insert)
  offer:  the sync layer's offer selection over the whole log (SyncDriver.select_for, which reads
          every row through `unseal`), and the bare log read (SELECT ... unseal(event_id, raw))
          against the column read as stored (what the read path cost before sealing)

    python bench/bench_atrest.py [--events 20000] [--rounds 3]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _harness import of_rounds, record  # noqa: E402  (bench/: the shared set-up; puts this checkout on sys.path)
from agent.node import Node  # noqa: E402
from agent.simpeer import SimPeer, manifest_text, readings_table  # noqa: E402
from agent.store import atrest  # noqa: E402
from agent.sync import SyncDriver, import_mailbox_body  # noqa: E402
from apply import make_events  # noqa: E402  (bench/apply.py: the same events as the apply benchmark)
from firmware_bridge.sealing import OVERHEAD  # noqa: E402

MESH = bytes.fromhex("be4c0000000000000000000000000002")


class _Clear(atrest.LogSeal):
    """The baseline: the same calls, values stored as they are."""

    def seal(self, event_id: bytes, raw: bytes) -> bytes:
        return raw

    def open(self, event_id: bytes, blob: bytes) -> bytes:
        return bytes(blob)


def _node(home: Path, manifest: str, clear: bool) -> Node:
    node, _ = Node.init(home, manifest, {"kind": "software"})
    if clear:
        node.log_seal = _Clear(node.log_seal.sealer, True)
        atrest.install(node.conn, node.log_seal)
    return node


def _round(d: Path, k: int, manifest: str, body: bytes, n: int, clear: bool, peer: bytes) -> dict:
    node = _node(d / f"{'clear' if clear else 'sealed'}{k}", manifest, clear)
    try:
        t = time.perf_counter()
        res = import_mailbox_body(node, body)
        apply_s = time.perf_counter() - t
        assert res["applied"] == n, res
        drv = SyncDriver(node, batch_limit=n)
        t = time.perf_counter()
        sel, _bf, _s, _ro = drv.select_for(peer, "bench", start=0, limit=n, backfill=False)
        offer_s = time.perf_counter() - t
        assert len(sel.events) == n, len(sel.events)
        t = time.perf_counter()
        got = node.conn.execute("SELECT seq, site_id, qualified, hlc_p, hlc_l, unseal(event_id, raw), origin "
                                "FROM events ORDER BY seq").fetchall()
        read_s = time.perf_counter() - t
        t = time.perf_counter()
        node.conn.execute("SELECT seq, site_id, qualified, hlc_p, hlc_l, raw, origin FROM events ORDER BY seq").fetchall()
        stored_s = time.perf_counter() - t
        size = node.conn.execute("SELECT sum(length(raw)) FROM events").fetchone()[0]
        assert len(got) == n
        return {"apply": n / apply_s, "offer": n / offer_s, "read": n / read_s, "stored_read": n / stored_s,
                "bytes": size / n}
    finally:
        node.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sites = [SimPeer(MESH) for _ in range(5)]
    manifest = manifest_text(MESH, readings_table(), sites)
    events = make_events(args.events, sites, rows=2000)
    body = sites[0].body(events)
    reader = b"\x42" * 16   # the peer the offer is selected for (none of the signers)
    sealed, clear = [], []
    with tempfile.TemporaryDirectory() as d:
        for k in range(args.rounds):
            order = (False, True) if k % 2 == 0 else (True, False)
            for c in order:
                (clear if c else sealed).append(_round(Path(d), k, manifest, body, args.events, c, reader))
    med = lambda rs, f: statistics.median(r[f] for r in rs)  # noqa: E731
    ratio = lambda f: statistics.median(s[f] / c[f] for s, c in zip(sealed, clear))  # noqa: E731
    print(f"events: {args.events}, rounds: {args.rounds} (medians; ratio = median of per-round sealed/clear)")
    print(f"apply (mailbox import):  sealed {med(sealed, 'apply'):9.0f} ev/s   clear {med(clear, 'apply'):9.0f} ev/s"
          f"   ratio {ratio('apply'):.3f}")
    print(f"offer selection:         sealed {med(sealed, 'offer'):9.0f} ev/s   clear {med(clear, 'offer'):9.0f} ev/s"
          f"   ratio {ratio('offer'):.3f}")
    print(f"log read through unseal: sealed {med(sealed, 'read'):9.0f} ev/s   clear {med(clear, 'read'):9.0f} ev/s"
          f"   ratio {ratio('read'):.3f}")
    print(f"log read as stored (no function, the pre-sealing read): {med(sealed, 'stored_read'):9.0f} ev/s; "
          f"sealed read / that: {statistics.median(s['read'] / s['stored_read'] for s in sealed):.3f}")
    print(f"stored bytes per event:  sealed {med(sealed, 'bytes'):.0f}   clear {med(clear, 'bytes'):.0f}"
          f"   (+{OVERHEAD} per value: format byte, key id, 24-byte nonce, 16-byte tag)")
    print("at-rest overhead ratio (apply, offer): "
          f"{ratio('apply'):.3f} {ratio('offer'):.3f}")
    figures = {f"ratio_{f}_sealed_clear": of_rounds(s[f] / c[f] for s, c in zip(sealed, clear))
               for f in ("apply", "offer", "read")}
    record(figures | {"stored_bytes_per_event_sealed": med(sealed, "bytes")},
           {f"{f}_events_per_s_clear": of_rounds(c[f] for c in clear) for f in ("apply", "offer", "read")}
           | {"stored_bytes_per_event_clear": med(clear, "bytes")},
           "sealed / clear: apply " + f"{ratio('apply'):.3f}, offer {ratio('offer'):.3f}, read {ratio('read'):.3f}; "
           f"{med(sealed, 'bytes'):.0f} stored bytes per event against {med(clear, 'bytes'):.0f}", parameters=vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
