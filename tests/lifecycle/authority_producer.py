"""Producer subprocess for test_authority_crash.py: issues role records as a standalone authority
through a node, printing every record the moment issue_record returns it:

    REL <record hex>
    DONE

Env AUTH_CRASH="point:hit" SIGKILLs this process the hit-th time the point is reached: the
bridge's points (after_intent, after_sign, before_persist, journal_before_fsync, after_persist)
or the producer's (before_store: released, not yet stored on the node; after_print)."""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

from agent import authority  # noqa: E402
from agent import sync as sync_mod  # noqa: E402
from agent.node import Node  # noqa: E402
from crashpoint import hook_from_env  # noqa: E402

hook = hook_from_env("AUTH_CRASH")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--auth", required=True)
    ap.add_argument("--home", required=True)
    ap.add_argument("--subject", required=True)
    ap.add_argument("--count", type=int, required=True)
    ap.add_argument("--tag", required=True)
    args = ap.parse_args()
    real = sync_mod.SyncDriver.apply_records

    def apply_records(self, raws, now):
        hook("before_store")
        return real(self, raws, now)
    sync_mod.SyncDriver.apply_records = apply_records
    node = Node.open(args.home)
    auth = authority.Authority(args.auth, fault_hook=hook)
    for i in range(args.count):
        raw, _info = sync_mod.issue_record(node, "role", bytes.fromhex(args.subject), f"{args.tag}-{i}",
                                           authority=auth)
        sys.stdout.write(f"REL {raw.hex()}\n")
        sys.stdout.flush()
        hook("after_print")
    auth.close()
    node.close()
    sys.stdout.write("DONE\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
