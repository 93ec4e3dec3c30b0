"""Migration between two sequencers (SOVM §22.6 singularity): the hand-off carries
the accepted epoch, the chain head and the recorded discontinuities; the new sequencer's first
receipt chains to the old one's last; the old one refuses the group afterwards; a rotated-out
sequencer that keeps signing (here: its state restored from before the hand-off) is rejected by
members and retained for attribution."""
from __future__ import annotations

import json
import shutil
import subprocess

from agent.sequencer import member, receipts, service
from agent.sequencer.framing import encode_private_message
from tests.cli_cmd import agent_cmd, agent_env

G = bytes.fromhex("9b" * 16)


def msg(e, tag=b""):
    return encode_private_message(G, e, ciphertext=b"m" * 16 + tag)


def cli(home, *args):
    return subprocess.run([*agent_cmd(), "--home", str(home), "sequencer", *args],
                          capture_output=True, text=True, env=agent_env())


def test_migration_chains_one_receipt_chain_and_rotated_out_signer_is_attributed(tmp_path):
    old_home, new_home = tmp_path / "old", tmp_path / "new"
    old_key = bytes.fromhex(json.loads(cli(old_home, "init").stdout)["sequencer_key"])
    new_key = bytes.fromhex(json.loads(cli(new_home, "init").stdout)["sequencer_key"])
    cli(old_home, "register", "--group", G.hex(), "--epoch", "0")
    released = []
    for e in range(3):
        f = tmp_path / f"m{e}"
        f.write_bytes(msg(e))
        released.append(bytes.fromhex(json.loads(cli(old_home, "submit", str(f)).stdout)["receipt"]))
    # a copy of the old sequencer's home from before the hand-off: the rogue that keeps signing
    shutil.copytree(old_home, tmp_path / "rogue")
    p = cli(old_home, "migrate", "--group", G.hex(), "--out", str(tmp_path / "handoff.json"))
    assert p.returncode == 0, p.stderr
    package = json.loads(p.stdout)
    assert package["generation"] == 3 and package["head"] == released[2].hex()
    assert package["from_key"] == old_key.hex() and package["discontinuities"] == []
    assert cli(old_home, "migrate", "--group", G.hex()).returncode == 2          # once only
    a = cli(new_home, "adopt", str(tmp_path / "handoff.json"))
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["current_epoch"] == 3
    # the old sequencer refuses the group from now on
    f = tmp_path / "m3"
    f.write_bytes(msg(3))
    refused = json.loads(cli(old_home, "submit", str(f)).stdout)
    assert refused["reason"] == "migrated" and refused["head"] == released[2].hex()
    # the new one serves it; its first receipt chains to the old one's last
    first_new = bytes.fromhex(json.loads(cli(new_home, "submit", str(f)).stdout)["receipt"])
    r = receipts.verify_receipt(first_new, new_key)
    assert r.epoch == 3 and r.previous_receipt_hash == receipts.receipt_hash(released[2])
    assert json.loads(cli(new_home, "receipt", "--group", G.hex(), "--epoch", "2").stdout)["receipt"] == released[2].hex()
    # the rotated-out sequencer keeps signing for the group at the new generation
    g = tmp_path / "rogue-commit"
    g.write_bytes(msg(3, b"rogue"))
    rogue = bytes.fromhex(json.loads(cli(tmp_path / "rogue", "submit", str(g)).stdout)["receipt"])
    assert receipts.verify_receipt(rogue, old_key).epoch == 3
    # members with the binding record {0: old, 3: new}: one chain, the rogue's link attributed
    chain = member.ReceiptChain(G, bindings={0: old_key, package["generation"]: new_key})
    for raw in released + [first_new]:
        assert chain.add(raw) == member.ACCEPTED
    assert chain.add(rogue) == member.REJECTED
    assert chain.attributed == [(old_key, rogue)] and not chain.equivocation
    # a member that has not yet learnt the new binding holds nothing of the new one's as equivocation
    unaware = member.ReceiptChain(G, bindings={0: old_key})
    for raw in released:
        unaware.add(raw)
    assert unaware.add(first_new) == member.REJECTED and not unaware.equivocation


def test_handoff_carries_discontinuities_and_adopt_checks_the_head(tmp_path):
    from firmware_bridge import ReceiptIdentity
    from firmware_bridge.journal import INTENT
    old_home, new_home = tmp_path / "old", tmp_path / "new"
    service.init(old_home)
    service.init(new_home)
    with service.Sequencer(old_home) as s:
        s.register(G, 0)
        r0 = s.submit(msg(0)).receipt
        s.store.put_pending(G, 1, receipts.commit_hash(msg(1)), msg(1), False)
        s.bridge._journal.commit([(INTENT, ReceiptIdentity(G, 1).encode(), service.RECEIPT_KEY)])
    with service.Sequencer(old_home) as s:                 # resume: epoch 1 is a recorded gap
        statement = s.receipt(G, 1).statement
        package = s.handoff(G)
    assert package["discontinuities"] == [1] and package["current_epoch"] == 2 and package["head"] == r0.hex()
    # §22.6 step 4: the old sequencer's signed statement of the gap transfers with it
    assert package["statements"] == {"1": statement.hex()}
    tampered = dict(package, head=r0[:-1].hex() + "00")
    forged = dict(package, statements={"1": statement[:-1].hex() + "00"})
    with service.Sequencer(new_home) as s:
        for bad in (tampered, forged):
            try:
                s.adopt(bad)
                raise AssertionError("a head or statement that does not verify was adopted")
            except service.SequencerRefused:
                pass
        st = s.adopt(package)
        assert st.discontinuities == (1,) and st.current_epoch == 2
        assert s.receipt(G, 1) == service.Absent(discontinuity=True)
        assert s.receipt(G, 1).statement == statement       # the old one's bytes, not re-signed here
        nxt = s.submit(msg(2)).receipt
        assert receipts.parse_receipt(nxt).previous_receipt_hash == receipts.receipt_hash(r0)


def test_adopt_refuses_a_malformed_package_and_keeps_nothing(tmp_path):
    """The hand-off package is bytes from outside (a file an operator carries): every field is
    checked before anything is stored. Before: an epoch beyond 64 bits in the gaps, or as the epoch
    of a package without a head, raised OverflowError out of `sequencer adopt` (a traceback, exit
    1), and a boolean epoch, a negative gap, a gap given as a string, a gap at the epoch and
    statements given as a list were taken."""
    old_home, new_home = tmp_path / "old", tmp_path / "new"
    service.init(old_home)
    service.init(new_home)
    with service.Sequencer(old_home) as s:
        s.register(G, 0)
        s.submit(msg(0))
        good = s.handoff(G)
    bad = [dict(good, current_epoch=2 ** 70), dict(good, current_epoch=-1), dict(good, current_epoch="2"),
           dict(good, current_epoch=True), dict(good, current_epoch=2 ** 63 - 1), dict(good, group=""),
           dict(good, group="ab" * 300), dict(good, discontinuities=[-1]), dict(good, discontinuities=["1"]),
           dict(good, discontinuities=[1]), dict(good, discontinuities=[2 ** 70]), dict(good, statements={"1_0": "00"}),
           dict(good, statements=[]), dict(good, from_key=7), dict(good, head=None, current_epoch=2 ** 70)]
    with service.Sequencer(new_home) as s:
        for package in bad + [[good]]:
            try:
                s.adopt(package)
            except service.SequencerRefused:
                pass
            else:
                raise AssertionError(f"adopted {bad.index(package) if package in bad else package}")
        assert s.store.group_ids() == []
    f = tmp_path / "p.json"
    f.write_text(json.dumps(dict(good, current_epoch=2 ** 70)))
    p = cli(new_home, "adopt", str(f))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    f.write_text(json.dumps(good))
    assert cli(new_home, "adopt", str(f)).returncode == 0
