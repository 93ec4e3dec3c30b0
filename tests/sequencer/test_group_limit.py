"""How many groups `sequencer run` tracks (docs/sequencer.md "How many groups").

§22.6 bootstrap: the first Commit for an unknown group_id creates the group, so anyone allowed
to submit creates groups at will. Before: nothing bounded them. Measured through `sequencer run`
on mosquitto: 20 000 tiny Commits for random group_ids were all accepted in 10.6 s, each group
~750 bytes of sequencer.db, 333 bytes of sign-journal (its last receipt is kept through every
compaction) and a retained `accepted` record at the broker, for good; reopened, the sequencer
needed ~1.2 KB resident a group (20 000 groups: +23 MB; a million: more than a 512 MB device
has, at every start). Now `sequencer run --max-groups N` (default serve.DEFAULT_MAX_GROUPS)
refuses the first Commit of a group beyond N with the stable reason `group_limit` (and a
`register` request with an error naming it); known groups are served as before.
"""
from __future__ import annotations

import json

from agent.sequencer import core, service
from agent.sequencer.framing import encode_private_message
from test_broker_sizes import agent, spawn
from test_run_broker import Member

G = bytes.fromhex("5e" * 16)


def test_run_refuses_new_groups_beyond_max_groups(tmp_path, broker):
    home = tmp_path / "seq"
    assert agent(home, "sequencer", "init").returncode == 0
    proc = spawn(home, "sequencer", "run", "--broker", broker.url, "--max-groups", "5")
    m = None
    try:
        json.loads(proc.stdout.readline())
        m = Member(broker.port, "alice")
        assert m.request(f"sovm-seq/{G.hex()}/register", b"0") == {"group": G.hex(), "epoch": 0}
        answers = []
        for i in range(8):
            g = bytes([i + 1]) * 16
            answers.append(m.request(f"sovm-seq/{g.hex()}/submit", encode_private_message(g, 0)))
        assert [a["accepted"] for a in answers] == [True] * 4 + [False] * 4, answers
        assert {a.get("reason") for a in answers[4:]} == {core.GROUP_LIMIT}
        assert answers[4]["group"] == (bytes([5]) * 16).hex() and answers[4]["current_epoch"] is None
        g9 = bytes([9]) * 16
        refused = m.request(f"sovm-seq/{g9.hex()}/register", b"0")
        assert refused.get("reason") == core.GROUP_LIMIT and "error" in refused, refused
        # the groups it tracks are served as before
        assert m.request(f"sovm-seq/{G.hex()}/submit", encode_private_message(G, 0))["accepted"] is True
        g1 = bytes([1]) * 16
        assert m.request(f"sovm-seq/{g1.hex()}/submit", encode_private_message(g1, 1))["accepted"] is True
    finally:
        if m is not None:
            m.close()
        proc.send_signal(15)
        assert proc.wait(30) == 0, proc.stderr.read()
    st = json.loads(agent(home, "sequencer", "status").stdout)
    assert len(st["groups"]) == 5


def test_the_bound_counts_groups_still_being_signed(tmp_path):
    """The Commits of one batch are decided before any of them is committed: the bound holds
    within a batch and across the batches in flight, not only against the committed groups."""
    home = tmp_path / "seq"
    service.init(home)
    with service.Sequencer(home) as s:
        s.max_groups = 10
        answers = s.submit_many([encode_private_message(i.to_bytes(16, "big"), 0) for i in range(1, 40)])
        assert sum(isinstance(a, service.Accepted) for a in answers) == 10
        assert {a.reason for a in answers if not isinstance(a, service.Accepted)} == {core.GROUP_LIMIT}
        assert len(s.store.group_ids()) == 10


def test_run_has_a_default_bound(tmp_path):
    from agent.sequencer import serve
    assert 10_000 <= serve.DEFAULT_MAX_GROUPS <= 1_000_000
