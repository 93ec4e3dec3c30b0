"""Producer subprocess for the crash tests (run as a script; see test_bridge_crash.py).

Does signed writes through a SigningBridge and prints every released byte string to stdout,
flushed, *before* anything else sees it; the parent is the independent checker.  Output lines:

    ISSUE <physical> <logical>        an HLC handed out by the clock (before it is used)
    REL <ident hex> <cose hex>        bytes returned by the bridge
    UNK <ident hex>                   the bridge said OutcomeUnknown for a retried identity
    DONE

Crash points: env BRIDGE_CRASH="point:hit" SIGKILLs this process at the hit-th time the named
point is reached (bridge points: after_intent, after_sign, before_persist, after_persist,
journal_torn_write, journal_before_fsync, compact_torn_write, compact_before_fsync,
compact_before_rename, compact_after_rename, compact_after_dirsync; producer points: after_print,
after_pending, after_record).

Compaction mode (--compact N, events): the producer also keeps a durable *record* of released
outputs (file "recorded", one fsynced line each, like the agent's event log), one batch behind
(so a compaction always meets released-but-unrecorded outputs). On start it records whatever the
journal released that the record lacks (the agent's recovery) and compacts; then every N batches
it compacts with recorded = "in the record".
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time

import blake3

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from bridge_helpers import (assembler, event_payload, event_protected, receipt_payload,  # noqa: E402
                            receipt_protected, sig_structure)
from firmware_bridge import EventIdentity, OutcomeUnknown, ReceiptIdentity, SigningBridge, Status  # noqa: E402
from firmware_bridge.fsutil import atomic_write  # noqa: E402
from crashpoint import hook_from_env  # noqa: E402

SITE = bytes.fromhex("5a5a5a5a000000000000000000000001")
GROUP = b"crash-group"

hook = hook_from_env("BRIDGE_CRASH")


def emit(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


class DurableHlc:
    """Minimal durable HLC: a persisted physical-time ceiling, reserved ahead (SSP/1 §13.5:
    persist the clock's high-water mark before issuing anything above it)."""

    RESERVE_MS = 1000

    def __init__(self, path: str, floor: tuple[int, int] | None) -> None:
        self.path = path
        ceiling = 0
        if os.path.exists(path):
            with open(path, "rb") as f:
                (ceiling,) = struct.unpack(">Q", f.read())
        self.last = max((ceiling, 0), floor or (0, 0))
        self.ceiling = ceiling

    def tick(self) -> tuple[int, int]:
        now = int(time.time() * 1000)
        nxt = (now, 0) if now > self.last[0] else (self.last[0], self.last[1] + 1)
        if nxt[0] >= self.ceiling:
            self.ceiling = nxt[0] + self.RESERVE_MS
            atomic_write(self.path, struct.pack(">Q", self.ceiling))
        self.last = nxt
        emit(f"ISSUE {nxt[0]} {nxt[1]}")
        return nxt


def make_bridge(args: argparse.Namespace) -> SigningBridge:
    from keystores_for_tests import RandomNonceSoftwareKeystore
    from firmware_bridge.software import SoftwareKeystore
    # "plain": the production software keystore (large groups sign on worker threads)
    cls = SoftwareKeystore if args.keystore == "plain" else RandomNonceSoftwareKeystore
    ks = cls(os.path.join(args.state, "keys"), sign_threads=2) if args.keystore == "plain" else \
        cls(os.path.join(args.state, "keys"))
    if args.unsafe:
        import unsafe_bridge
        return getattr(unsafe_bridge, args.unsafe)(ks, os.path.join(args.state, "journal"), fault_hook=hook)
    return SigningBridge(ks, os.path.join(args.state, "journal"), fault_hook=hook)


def release_and_print(bridge: SigningBridge, items: list) -> list:
    outs = bridge.release_many(items)
    for (ident, *_), out in zip(items, outs):
        emit(f"REL {ident.encode().hex()} {out.hex()}")
        hook("after_print")
    return outs


class Record:
    """The producer's durable record of released outputs (what the agent's log is to the node)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.have: dict[bytes, bytes] = {}
        if os.path.exists(path):
            with open(path, "rb") as f:
                data = f.read()
            good = data[:data.rfind(b"\n") + 1]          # a torn last line was never acknowledged
            for line in good.decode().split("\n")[:-1]:
                ih, oh = line.split()
                self.have[bytes.fromhex(ih)] = bytes.fromhex(oh)
            if len(good) != len(data):
                with open(path, "r+b") as f:
                    f.truncate(len(good))
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def add(self, pairs: list) -> None:
        pairs = [(i, o) for i, o in pairs if i not in self.have]
        if not pairs:
            return
        os.write(self.fd, "".join(f"{i.hex()} {o.hex()}\n" for i, o in pairs).encode())
        os.fsync(self.fd)
        for i, o in pairs:
            self.have[i] = o
        hook("after_record")

    def recorded(self, identity) -> bool:
        return identity.encode() in self.have


def events(args: argparse.Namespace, bridge: SigningBridge) -> None:
    pending_path = os.path.join(args.state, "pending.json")
    record = Record(os.path.join(args.state, "recorded")) if args.compact else None
    if record is not None:
        # the agent's recovery: record released outputs the record lacks, then compact
        record.add([(i.encode(), o) for i, o in bridge.iter_released()])
        bridge.compact_events(record.recorded)
    # 1. retry whatever was in flight when we last died: persisted -> exact bytes, else refusal
    if os.path.exists(pending_path):
        with open(pending_path) as f:
            pending = json.load(f)
        for p, l, v in pending:
            if record is not None and EventIdentity(SITE, p, l).encode() in record.have:
                continue   # recorded (and possibly compacted): nothing to retry
            prot, pay = event_protected(SITE), event_payload(p, l, v)
            item = (EventIdentity(SITE, p, l), "site", sig_structure(prot, pay), assembler(prot, pay))
            try:
                release_and_print(bridge, [item])
            except OutcomeUnknown:
                emit(f"UNK {item[0].encode().hex()}")
    # 2. resume the clock above everything ever intended, then produce the remaining writes
    clock = DurableHlc(os.path.join(args.state, "hlc"), bridge.max_event_hlc(SITE))
    done, value = 0, args.start_value
    behind: list = []
    batches = 0
    while done < args.remaining:
        if record is not None:
            batches += 1
            if batches % args.compact == 0:   # the last batch is released, not yet recorded
                bridge.compact_events(record.recorded)
            record.add(behind)   # one batch behind, like an apply queue
        n = min(args.batch, args.remaining - done)
        batch = [(*clock.tick(), value + k) for k in range(n)]
        atomic_write(pending_path, json.dumps(batch).encode())
        hook("after_pending")
        items = []
        for p, l, v in batch:
            prot, pay = event_protected(SITE), event_payload(p, l, v)
            items.append((EventIdentity(SITE, p, l), "site", sig_structure(prot, pay), assembler(prot, pay)))
        outs = release_and_print(bridge, items)
        behind = [(i[0].encode(), o) for i, o in zip(items, outs)]
        done += n
        value += n
    if record is not None:
        record.add(behind)


def receipts(args: argparse.Namespace, bridge: SigningBridge) -> None:
    kid = bridge.keystore.public_key("seq")
    top = bridge.max_receipt_epoch(GROUP)
    prev: bytes | None = None
    epoch = 0
    if top is not None:
        # §22.6 step 1: on resume, check the head; find the last persisted receipt to chain to
        for e in range(top, -1, -1):
            got = bridge.released(ReceiptIdentity(GROUP, e))
            if got is not None:
                prev = blake3.blake3(got).digest()
                break
        # the highest intended epoch: re-request it (exact re-transmission, or refusal)
        st = bridge.status(ReceiptIdentity(GROUP, top))
        item = receipt_item(kid, top, prev if st is not Status.RELEASED else None)
        try:
            out = bridge.release_many([item])[0]
            emit(f"REL {item[0].encode().hex()} {out.hex()}")
        except OutcomeUnknown:
            emit(f"UNK {item[0].encode().hex()}")  # §22.6: a stated absence, chain forward
        epoch = top + 1
    done = 0
    while done < args.remaining:
        n = min(args.batch, args.remaining - done)
        items = []
        for k in range(n):
            items.append(receipt_item(kid, epoch + k, prev))
            prev = None  # chained below once the bytes are known
        outs = bridge.release_many(items)
        for (ident, *_), out in zip(items, outs):
            emit(f"REL {ident.encode().hex()} {out.hex()}")
            hook("after_print")
            prev = blake3.blake3(out).digest()
        epoch += n
        done += n


def receipt_item(kid: bytes, epoch: int, prev: bytes | None):
    prot = receipt_protected(kid)
    pay = receipt_payload(GROUP, epoch, blake3.blake3(b"commit %d" % epoch).digest(), prev)
    return ReceiptIdentity(GROUP, epoch), "seq", sig_structure(prot, pay), assembler(prot, pay)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--state", required=True)
    ap.add_argument("--mode", choices=["event", "receipt"], default="event")
    ap.add_argument("--remaining", type=int, required=True)
    ap.add_argument("--start-value", type=int, default=0)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--compact", type=int, default=0, help="events: compact every N batches (0: never)")
    ap.add_argument("--unsafe", default="", help="test-only bridge class from unsafe_bridge.py")
    ap.add_argument("--keystore", choices=["random-nonce", "plain"], default="random-nonce")
    args = ap.parse_args()
    bridge = make_bridge(args)
    emit("READY")
    (events if args.mode == "event" else receipts)(args, bridge)
    bridge.close()
    emit("DONE")


if __name__ == "__main__":
    main()
