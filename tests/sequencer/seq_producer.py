"""A sequencer process for the crash tests (tests/sequencer/test_sequencer_crash.py).

Opens the sequencer home (resume runs first, §22.6 step 1), then drives three groups until each
has accepted ``--target`` epochs: for the group's current epoch it submits Commits from three
members in a seeded order (exactly one is accepted, the others are stale), and now and then asks
for an earlier epoch's receipt. Every byte string the sequencer lets out goes to stdout before
anything else sees it:

  REL <group> <epoch> <receipt hex>     an accepted Commit's receipt
  HEAD <group> <epoch> <receipt hex>    the head carried by a stale answer
  GET <group> <epoch> <receipt hex>     a receipt re-served on request
  ABSENT <group> <epoch> <0|1>          a stated absence (1: a recorded discontinuity)
  COMPACTED <full|tail>                 a compaction of the signing journal rewrote it whole, or only
                                        what was appended since the last one (--idle groups make those)

SEQ_CRASH="point:n" SIGKILLs the process the n-th time the named point is reached.
"""
from __future__ import annotations

import argparse
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from agent.sequencer import home as seq_home, receipts, resume as seq_resume, service  # noqa: E402
from agent.sequencer.framing import encode_private_message  # noqa: E402
from tests.crashpoint import hook_from_env  # noqa: E402

IDLE_TAG = b"\x1d\x1e"
GROUPS = [(bytes.fromhex("01" * 16), "register", 0), (bytes.fromhex("02" * 16), "register", 100),
          (bytes.fromhex("03" * 16), "bootstrap", 7)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--home", required=True)
    ap.add_argument("--target", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", action="store_true", help="group commit: every group's competing Commits "
                                                        "in one submit_many per round")
    ap.add_argument("--chunk", type=int, default=0, help="Commits per step of the pipelined group commit "
                                                         "(1: every group its own overlapping batch)")
    ap.add_argument("--compact-bytes", type=int, default=0, help="compact the signing journal whenever it grew "
                                                                 "this much (and on open above it)")
    ap.add_argument("--settle-chunk", type=int, default=0, help="epochs per transaction of resume's settlement "
                                                                "(seq_resume.SETTLE_CHUNK)")
    ap.add_argument("--statement-batch", type=int, default=0, help="statements of absence per bridge call "
                                                                   "(seq_resume.STATEMENT_BATCH)")
    ap.add_argument("--idle", type=int, default=0, help="this many more groups, taken to epoch 2 first and "
                                                        "then left alone: the journal's compactions keep their "
                                                        "entries as they are and rewrite what came since")
    ap.add_argument("--unsafe", default="", help="negative control: 'advance-first' moves the epoch "
                                                 "before the receipt is durable (violates §22.5 cl. 3)")
    a = ap.parse_args()
    if a.unsafe == "advance-first":
        from agent.sequencer.store import Store
        orig = Store._put_pending_rows

        def put_pending_rows(self, rows):
            orig(self, rows)
            for group_id, epoch, _h, _m, _b in rows:
                self.conn.execute("INSERT INTO groups (group_id, current_epoch, origin) VALUES (?, ?, 'bootstrap') "
                                  "ON CONFLICT (group_id) DO UPDATE SET current_epoch = excluded.current_epoch",
                                  (group_id, epoch + 1))
        Store._put_pending_rows = put_pending_rows
    if a.settle_chunk:
        seq_resume.SETTLE_CHUNK = a.settle_chunk
    if a.statement_batch:
        seq_resume.STATEMENT_BATCH = a.statement_batch
    if a.compact_bytes:
        seq_home.JOURNAL_COMPACT_BYTES = seq_home.JOURNAL_OPEN_COMPACT_BYTES = a.compact_bytes
        seq_home.JOURNAL_COMPACT_KEPT_RATIO = 0      # every compact_bytes: its crash points come often
    hook = hook_from_env("SEQ_CRASH")
    rng = random.Random(a.seed)
    out = sys.stdout

    def emit(line: str) -> None:
        out.write(line + "\n")
        out.flush()

    compact = service.Sequencer.compact_journal

    def compact_journal(self):
        stats = compact(self)
        if stats["bytes_after"] != stats["bytes_before"]:
            emit(f"COMPACTED {'full' if stats['full'] else 'tail'}")
        return stats
    service.Sequencer.compact_journal = compact_journal
    seq = service.Sequencer(a.home, fault_hook=hook)
    if a.chunk:
        seq.chunk = a.chunk
    emit("READY")
    for gid, how, start in GROUPS:
        if how == "register" and seq.store.group(gid) is None:
            seq.register(gid, start)
    idle = [IDLE_TAG + i.to_bytes(14, "big") for i in range(a.idle)]
    for gid in idle:
        if seq.store.group(gid) is None:
            seq.register(gid, 0)
    while todo := [(g, st.current_epoch) for g in idle if (st := seq.store.group(g)).current_epoch < 2]:
        for ans in seq.submit_many([encode_private_message(g, e, ciphertext=os.urandom(8)) for g, e in todo]):
            if isinstance(ans, service.Accepted):
                emit(f"REL {ans.group_id.hex()} {ans.epoch} {ans.receipt.hex()}")
    while True:
        todo = []
        for gid, how, start in GROUPS:
            st = seq.store.group(gid)
            epoch = start if st is None else st.current_epoch
            if epoch - start < a.target:
                todo.append((gid, epoch))
        if not todo:
            break
        if a.batch:
            batch = [encode_private_message(g, e, ciphertext=m + os.urandom(8))
                     for g, e in todo for m in (b"alice", b"bob", b"carol")]
            rng.shuffle(batch)
            for ans in seq.submit_many(batch):
                if isinstance(ans, service.Accepted):
                    emit(f"REL {ans.group_id.hex()} {ans.epoch} {ans.receipt.hex()}")
                    hook("after_release")
                elif ans.head is not None:
                    emit(f"HEAD {ans.group_id.hex()} {receipts.parse_receipt(ans.head).epoch} {ans.head.hex()}")
            continue
        gid, epoch = rng.choice(todo)
        members = [b"alice", b"bob", b"carol"]
        rng.shuffle(members)
        for m in members:
            msg = encode_private_message(gid, epoch, ciphertext=m + os.urandom(8))
            ans = seq.submit(msg)
            if isinstance(ans, service.Accepted):
                emit(f"REL {gid.hex()} {ans.epoch} {ans.receipt.hex()}")
                hook("after_release")
            else:
                if ans.head is not None:
                    emit(f"HEAD {gid.hex()} {receipts.parse_receipt(ans.head).epoch} {ans.head.hex()}")
        if rng.random() < 0.3:
            st = seq.store.group(gid)
            e = rng.randrange(max(st.current_epoch - 5, 0), st.current_epoch + 1)
            got = seq.receipt(gid, e)
            if isinstance(got, bytes):
                emit(f"GET {gid.hex()} {e} {got.hex()}")
            else:
                emit(f"ABSENT {gid.hex()} {e} {int(got.discontinuity)}")
    seq.close()
    emit("DONE")


if __name__ == "__main__":
    main()
