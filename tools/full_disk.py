"""Full disks on real small ext4 filesystems, every figure (docs/reliability.md "Full disk"): as
root, on loop images with 1 KiB and 4 KiB blocks, `write`, `mailbox import`, `status`, `dump` and
`events` with every free-space figure from 0 to 64 KiB (each must succeed or fail with one line,
never die by a signal), the same for the `sequencer` verbs on a sequencer home, then `run` on a
full home with stores of 1, 8 and 64 MB, which must evict
from the home's reserve and sync again by itself. CI runs a handful of these figures
(tests/reliability/test_ext4_full.py); this runs them all.

    sudo .venv/bin/python tools/full_disk.py [--max-kib 64] [--stores 1,8,64]"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-kib", type=int, default=64)
    ap.add_argument("--stores", default="1,8,64", help="store sizes in MB for the `run` trials")
    args = ap.parse_args()
    from tests.reliability.ext4img import cli, ext4, seq_verbs_at, unavailable, verbs_at
    from tests.reliability import test_ext4_full as t
    why = unavailable()
    if why:
        print(f"full_disk: {why}", file=sys.stderr)
        return 2
    os.environ.setdefault("SSP_AGENT_CLOCK_TRUSTED", "1")
    bad = 0
    with tempfile.TemporaryDirectory(prefix="full-disk-") as tmp:
        tmp = Path(tmp)
        os.environ["SSP_AGENT_WITNESS_DIR"] = str(tmp / "witness")
        for block in (1024, 4096):
            work = tmp / f"verbs-{block}"
            work.mkdir()
            with ext4(work, "48M", block) as fs:
                home = t.make_home(fs, work)
                f = work / "b.ssp"
                f.write_bytes(t.body(t.peer(), range(20), 1000))
                for kib in range(0, args.max_kib + 1):
                    res = verbs_at(fs, home, kib * 1024, f, 1000 + kib)
                    wrong = {v: w for v, w in res.items() if w is not None}
                    bad += bool(wrong)
                    print(f"block {block} free {kib:2d} KiB: {'ok' if not wrong else wrong}", flush=True)
        from agent.sequencer.framing import encode_private_message
        from agent.transport.broker import Broker
        for block in (1024, 4096):
            work = tmp / f"seq-{block}"
            work.mkdir()
            broker = Broker(workdir=work / "broker").start()
            try:
                with ext4(work, "48M", block) as fs:
                    home = fs / "seq"
                    assert cli(home, "sequencer", "init").returncode == 0
                    f = work / "c0"
                    f.write_bytes(encode_private_message(bytes.fromhex("ab" * 16), 0))
                    assert cli(home, "sequencer", "submit", f).returncode == 0
                    for kib in range(0, args.max_kib + 1):
                        res = seq_verbs_at(fs, home, kib * 1024, work, 1 + kib, broker.url)
                        wrong = {v: w for v, w in res.items() if w is not None}
                        bad += bool(wrong)
                        print(f"sequencer, block {block} free {kib:2d} KiB: {'ok' if not wrong else wrong}", flush=True)
            finally:
                broker.close()
        for mb in (int(x) for x in args.stores.split(",") if x):
            work = tmp / f"run-{mb}"
            work.mkdir()
            broker = Broker(workdir=work / "broker").start()
            t0 = time.monotonic()
            try:
                t.test_run_on_a_full_disk_evicts_from_the_reserve_and_syncs_again(work, broker, mb)
                print(f"run on a full home, store {mb} MB: ok ({time.monotonic() - t0:.0f} s)", flush=True)
            except AssertionError as e:
                bad += 1
                print(f"run on a full home, store {mb} MB: FAILED {str(e)[:500]}", flush=True)
            finally:
                broker.close()
    print("full_disk: all held" if not bad else f"full_disk: {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
