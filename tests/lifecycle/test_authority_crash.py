"""Real SIGKILLs while a standalone authority issues records (agent/authority.py): at every point
of the bridge and between release and store. After each kill: every record the producer printed
is in the authority's journal with identical bytes. At the end: every released record is stored
on the node and the chain has exactly one record per generation (no fork, no gap)."""
from __future__ import annotations

import os
import subprocess
import sys

from agent import authority as auth_mod
from agent.core import records as rec
from agent.node import Node
from agent.store import sync_state as st
from agent.sync import resolve_chains

from ..sync.helpers import TABLES, manifest

PRODUCER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "authority_producer.py")
SUBJECT = bytes(range(16))
POINTS = ["after_intent", "after_sign", "before_persist", "journal_before_fsync", "after_persist",
          "before_store", "after_print"]


def _run(auth, home, tag, crash=None, count=3):
    env = dict(os.environ)
    env.pop("AUTH_CRASH", None)
    if crash:
        env["AUTH_CRASH"] = crash
    p = subprocess.run([sys.executable, PRODUCER, "--auth", str(auth), "--home", str(home), "--subject",
                        SUBJECT.hex(), "--count", str(count), "--tag", tag],
                       capture_output=True, text=True, env=env, timeout=60)
    released = [bytes.fromhex(line.split()[1]) for line in p.stdout.splitlines() if line.startswith("REL ")]
    return p.returncode, released, "DONE" in p.stdout


def test_sigkill_while_an_authority_issues_records(tmp_path):
    card = auth_mod.create(tmp_path / "auth")
    text = manifest(TABLES).replace("\n", f'\nauthorities = ["{card["site_id"]}"]\n[[peers]]\nsite_id = '
                                    f'"{card["site_id"]}"\npublic_key = "{card["public_key"]}"\n', 1)
    node, _ = Node.init(tmp_path / "gw", text)
    st.ensure_schema(node.conn)
    node.close()
    printed: list[bytes] = []
    kills = 0
    for k, point in enumerate(POINTS):
        for hit in (1, 2):
            rc, released, done = _run(tmp_path / "auth", tmp_path / "gw", f"{point}{hit}", f"{point}:{hit}")
            assert rc == -9 and not done, (point, hit, rc)     # really killed at that point
            kills += 1
            printed += released
            with auth_mod.Authority(tmp_path / "auth") as a:
                journal = a.released()
            assert all(r in journal for r in printed)           # everything that left is durable, same bytes
    rc, released, done = _run(tmp_path / "auth", tmp_path / "gw", "final", None, count=2)
    assert rc == 0 and done
    printed += released
    with auth_mod.Authority(tmp_path / "auth") as a:
        journal = a.released()
    node = Node.open(tmp_path / "gw")
    try:
        held = {r.record_hash: r for r in st.records(node.conn)}
        assert all(rec.record_hash(r) in held for r in journal)  # the crash survivors were stored first
        chain = resolve_chains(st.records(node.conn))[("role", SUBJECT)]
        assert not chain.forked
        gens = sorted(r.generation for r in held.values() if r.subject == SUBJECT)
        assert gens == list(range(len(gens))) and len(gens) == len(journal)   # one per generation
    finally:
        node.close()
    assert kills == 2 * len(POINTS) and len(printed) >= 2
