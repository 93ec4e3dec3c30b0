"""Real MLS clients (rfc9420 1.3.0) racing Commits through the sequencer (the
test "concurrent Commits for one epoch from several members"): every member builds a competing
Commit for the same epoch; they are submitted at once, each by its own `ssp-agent sequencer submit`
process; exactly one is accepted, every other sender is told to rebuild (stale, with the winner's
receipt); everyone processes the canonical Commit and reaches the same next epoch with the same
group secret; the losers rebuild on it and retry until every member's change is in."""
from __future__ import annotations

import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

from mls_clients import founding_group

from agent.sequencer import member as validator
from agent.sequencer.framing import CT_COMMIT, WIRE_PUBLIC, parse_mls_message
from tests.cli_cmd import agent_cmd, agent_env


def submit(home, path):
    p = subprocess.run([*agent_cmd(), "--home", str(home), "sequencer", "submit", str(path)],
                       capture_output=True, text=True, env=agent_env())
    assert p.returncode in (0, 2), p.stderr
    return p.returncode, json.loads(p.stdout)


def test_real_members_race_commits_one_wins_losers_rebuild(tmp_path):
    home = tmp_path / "seq"
    key = json.loads(subprocess.run([*agent_cmd(), "--home", str(home), "sequencer", "init"],
                                    capture_output=True, text=True, check=True).stdout)["sequencer_key"]
    gid = os.urandom(16)                      # §22.5: random opaque group identifiers
    members = founding_group(gid, [b"alice", b"bob", b"carol", b"dave"])
    start = members[0].epoch
    assert all(m.epoch == start for m in members)
    subprocess.run([*agent_cmd(), "--home", str(home), "sequencer", "register",
                    "--group", gid.hex(), "--epoch", str(start)], check=True, capture_output=True)
    chains = {m.name: validator.ReceiptChain(gid, bytes.fromhex(key)) for m in members}
    waiting = list(members)                   # members whose change is not in yet
    rounds = 0
    while waiting:
        rounds += 1
        epoch = members[0].epoch
        commits = {m.name: m.build_add_commit(b"joiner-" + m.name) for m in waiting}
        for m in waiting:
            f = parse_mls_message(commits[m.name])   # the real client's framing, read blind
            assert (f.wire_format, f.group_id, f.epoch, f.content_type) == (WIRE_PUBLIC, gid, epoch, CT_COMMIT)
        paths = {}
        for name, raw in commits.items():
            paths[name] = tmp_path / f"commit-{rounds}-{name.decode()}"
            paths[name].write_bytes(raw)
        with ThreadPoolExecutor(max_workers=len(waiting)) as pool:
            answers = dict(zip(commits, pool.map(lambda n: submit(home, paths[n]), list(commits))))
        winners = [n for n, (rc, _a) in answers.items() if rc == 0]
        assert len(winners) == 1, answers
        receipt = answers[winners[0]][1]["receipt"]
        assert answers[winners[0]][1]["epoch"] == epoch
        for name, (rc, ans) in answers.items():
            if rc == 2:
                assert ans["reason"] == "stale_epoch" and ans["head"] == receipt and ans["current_epoch"] == epoch + 1
        winner = next(m for m in waiting if m.name == winners[0])
        winner.accepted()
        for m in members:
            if m is not winner:
                m.rejected()
                m.process(winner, commits[winner.name])
            assert chains[m.name].add(bytes.fromhex(receipt)) == validator.ACCEPTED
        assert {m.epoch for m in members} == {epoch + 1}
        assert len({m.secret() for m in members}) == 1        # one group state, no fork
        waiting.remove(winner)
    assert rounds == 4 and members[0].epoch == start + 4
    assert not any(c.equivocation for c in chains.values())
