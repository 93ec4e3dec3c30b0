"""A hostile or restored sequencer against its members (SOVM §22.5-§22.6; docs/sequencer.md
"Threat model"): a copied sequencer home run on as a second branch, a gap claim without the
sequencer's signature, a claim contradicted by a member's own receipt. Through the CLI: real
sequencer homes, real member nodes, the receipts their commands print."""
from __future__ import annotations

import json
import shutil

import pytest

from agent.sequencer import member, receipts
from agent.sequencer.framing import encode_private_message
from tests.cli_cmd import run_cli
from tests.sequencer.test_member import RogueSequencer
from tests.sync.helpers import MESH, TABLES

G = bytes.fromhex("c3" * 16)


def j(home, *args, code=0, env=None):
    p = run_cli("--home", home, *args, env=env)
    assert p.returncode == code, (args, p.stdout, p.stderr)
    return json.loads(p.stdout.splitlines()[-1]) if p.stdout.strip() else None


def message(tmp_path, epoch: int, tag: bytes):
    f = tmp_path / f"m{epoch}-{tag.hex()}.mls"
    f.write_bytes(encode_private_message(G, epoch, ciphertext=tag * 16))
    return f


def lose_receipt(home, epoch: int, msg: bytes) -> None:
    """The state of a sequencer whose receipt for ``epoch`` did not survive (§22.6 "epoch advanced,
    receipt absent"): an intent in its journal and no receipt; the next open records the gap."""
    from firmware_bridge import ReceiptIdentity
    from firmware_bridge.journal import INTENT
    from agent.sequencer import service
    with service.Sequencer(home) as s:
        s.store.put_pending(G, epoch, receipts.commit_hash(msg), msg, False)
        s.bridge._journal.commit([(INTENT, ReceiptIdentity(G, epoch).encode(), service.RECEIPT_KEY)])


def member_node(tmp_path, key: str, name: str = "m"):
    """A member node bound (by a standalone authority) to the sequencer ``key`` from epoch 0."""
    auth_dir = tmp_path / f"authority-{name}"
    auth = j(tmp_path / "unused", "authority", "create", "--out", auth_dir)
    man = tmp_path / f"mesh-{name}.toml"
    man.write_text(f'mesh_id = "{MESH.hex()}"\nauthorities = ["{auth["site_id"]}"]\n'
                   f'[[peers]]\nsite_id = "{auth["site_id"]}"\npublic_key = "{auth["public_key"]}"\n' + TABLES)
    home = tmp_path / name
    j(home, "init", "--manifest", man)
    j(home, "sequencing", "bind", "--group", G.hex(), "--sequencer-key", key, "--generation", "0",
      "--authority-key", auth_dir)
    return home


def two_branches(tmp_path, six_a: bytes, six_b: bytes):
    """One sequencer home run to epoch 4, copied to another machine (its own witness directory:
    on the same machine the receipt witness would stop the copy); branch A runs on to 5 and 6,
    branch B (the copy) lost its receipt for 5, records the gap and receipts its own 6 (which
    names 4). Returns the key, r0..r4, A's r5 and r6, B's r6 and B's signed statement of the gap."""
    import os
    elsewhere = {"SSP_AGENT_WITNESS_DIR": str(tmp_path / "other-machine")}
    a = tmp_path / "seq"
    key = j(a, "sequencer", "init")["sequencer_key"]
    j(a, "sequencer", "register", "--group", G.hex(), "--epoch", "0")
    base = [bytes.fromhex(j(a, "sequencer", "submit", message(tmp_path, e, b"%d" % e))["receipt"]) for e in range(5)]
    b = tmp_path / "seq-copy"
    shutil.copytree(a, b)
    r5 = bytes.fromhex(j(a, "sequencer", "submit", message(tmp_path, 5, b"5"))["receipt"])
    r6a = bytes.fromhex(j(a, "sequencer", "submit", message(tmp_path, 6, six_a))["receipt"])
    here = os.environ["SSP_AGENT_WITNESS_DIR"]
    os.environ["SSP_AGENT_WITNESS_DIR"] = elsewhere["SSP_AGENT_WITNESS_DIR"]
    try:
        lose_receipt(b, 5, encode_private_message(G, 5, ciphertext=b"x" * 16))
    finally:
        os.environ["SSP_AGENT_WITNESS_DIR"] = here
    assert j(b, "sequencer", "receipt", "--group", G.hex(), "--epoch", "5", env=elsewhere) == \
        {"receipt": None, "absent": True, "discontinuity": True}
    r6b = bytes.fromhex(j(b, "sequencer", "submit", message(tmp_path, 6, six_b), env=elsewhere)["receipt"])
    stated = [g for g in j(b, "sequencer", "status", env=elsewhere)["groups"] if g["group"] == G.hex()][0]["statements"]
    assert receipts.parse_receipt(r6b).previous_receipt_hash == receipts.receipt_hash(base[4])
    assert receipts.parse_receipt(r6a).previous_receipt_hash == receipts.receipt_hash(r5)
    return key, base, r5, r6a, r6b, bytes.fromhex(stated["5"])


def tags_sorting(first: str) -> tuple[bytes, bytes]:
    """Commit bodies for A's and B's epoch 6 whose receipts sort ``first`` first by bytes (the
    commit hash is the first payload field in which they differ)."""
    ch = {t: receipts.commit_hash(encode_private_message(G, 6, ciphertext=t * 16)) for t in (b"a", b"b", b"c", b"d")}
    pairs = [(x, y) for x in ch for y in ch if x != y and (ch[x] < ch[y]) == (first == "a")]
    return pairs[0]


@pytest.mark.parametrize("first", ["a", "b"])
def test_a_fork_of_one_home_is_equivocation_whichever_receipt_sorts_first(tmp_path, first):
    """§22.5: two valid receipts for (G, 6) with different commit hashes are proof, whatever order
    they are held in. The member holds r0..r4 and both epoch-6 receipts, never r5 nor B's statement:
    A's r6 names a receipt it never saw (held for its predecessor), and still counts."""
    six_a, six_b = tags_sorting(first)
    key, base, _r5, r6a, r6b, _st = two_branches(tmp_path, six_a, six_b)
    assert (r6a < r6b) == (first == "a")
    node = member_node(tmp_path, key)
    j(node, "sequencing", "gossip", *[r.hex() for r in base + [r6a, r6b]])
    st = j(node, "sequencing", "status", "--group", G.hex())["groups"][0]
    assert ("double_receipt", 6) in [(e["kind"], e["epoch"]) for e in st["equivocation"]], st
    assert [r["epoch"] for r in st["receipts"]] == [0, 1, 2, 3, 4]


def test_a_contradicted_gap_claim_leaves_the_members_receipt_in_its_chain(tmp_path):
    """§22.6: a member holding r5 hears the copy's signed statement that 5 is a gap. It keeps its
    receipt (the chain lists 5, no gap at 5) and the statement is evidence."""
    key, base, r5, r6a, _r6b, stmt = two_branches(tmp_path, b"a", b"b")
    node = member_node(tmp_path, key)
    j(node, "sequencing", "gossip", *[r.hex() for r in base + [r5, r6a]])
    j(node, "sequencing", "gossip", stmt.hex())
    st = j(node, "sequencing", "status", "--group", G.hex())["groups"][0]
    assert [r["epoch"] for r in st["receipts"]] == [0, 1, 2, 3, 4, 5, 6], st
    assert st["discontinuities"] == []
    assert [(e["kind"], e["epoch"]) for e in st["equivocation"]] == [("discontinuity_contradicted", 5)]
    assert set(st["equivocation"][0]["receipts"]) == {r5.hex(), stmt.hex()}


def test_member_library_fork_in_every_arrival_order():
    """The same fork at the library: every order of arrival of r6a, r6b (and r4 before or after)."""
    import itertools
    rs = RogueSequencer()
    base, prev = [], None
    for e in range(5):
        base.append(rs.sign(e, b"c%d" % e, prev, G))
        prev = receipts.receipt_hash(base[-1])
    r5 = rs.sign(5, b"c5", receipts.receipt_hash(base[4]), G)
    r6a = rs.sign(6, b"c6a", receipts.receipt_hash(r5), G)
    r6b = rs.sign(6, b"c6b", receipts.receipt_hash(base[4]), G)
    for order in itertools.permutations(base[3:] + [r6a, r6b]):
        c = member.ReceiptChain(G, rs.kid)
        for raw in base[:3] + list(order):
            c.add(raw)
        assert [(e.kind, e.epoch) for e in c.evidence] == [("double_receipt", 6)], order
        assert sorted(c.receipts) == [0, 1, 2, 3, 4]


def test_an_evidence_file_with_an_unsigned_gap_claim_does_not_freeze_an_honest_group(tmp_path):
    """§22.6: only a gap the sequencer recorded and signed counts. An evidence file naming epoch 2
    a discontinuity without the sequencer's statement, beside a member holding the real receipt
    for 2: `sequencer recover` resumes (the claim is neither a gap nor evidence) and names the
    claim `discontinuity_unsigned`; it never fails the group closed."""
    old = tmp_path / "old"
    key = j(old, "sequencer", "init")["sequencer_key"]
    j(old, "sequencer", "register", "--group", G.hex(), "--epoch", "0")
    rx = [j(old, "sequencer", "submit", message(tmp_path, e, b"%d" % e))["receipt"] for e in range(4)]
    alice, mallory = tmp_path / "alice.json", tmp_path / "mallory.json"
    alice.write_text(json.dumps({"member": "alice", "receipts": rx, "attested_epoch": 4}))
    mallory.write_text(json.dumps({"member": "mallory", "receipts": rx[:2], "attested_epoch": 2,
                                   "discontinuities": [2]}))
    new = tmp_path / "new"
    j(new, "sequencer", "init")
    out = j(new, "sequencer", "recover", "--group", G.hex(), "--binding", f"0:{key}", alice, mallory)
    assert out["outcome"] == "resume" and out["current_epoch"] == 4 and out["discontinuities"] == [], out
    assert out["unsigned_claims"] == [{"member": "mallory", "epoch": 2, "reason": "discontinuity_unsigned"}]
    assert bytes.fromhex(j(new, "sequencer", "receipt", "--group", G.hex(), "--epoch", "2")["receipt"]) == \
        bytes.fromhex(rx[2])


def test_a_forged_retained_discontinuity_record_is_not_a_gap(tmp_path, broker):
    """A client allowed to publish on a group's `discontinuity/E` topic (a real mosquitto, retained)
    writes a gap with no statement over the epoch the member holds a receipt for, and one signed by
    a stranger. The member's queue records neither as a gap (its evidence claims none, so no
    recovery reads the honest group as equivocating) and surfaces the unsigned one as
    `discontinuity_unsigned`."""
    import time
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion
    from agent.core import codec
    from tests.sequencer.test_broker_sizes import decided, member_with_a_commit, spawn, stop
    from tests.sequencer.test_broker_sizes import G as G5
    seq_home, member_home = member_with_a_commit(tmp_path)
    runner = spawn(member_home, "commits", "run", "--broker", broker.url)
    seq = spawn(seq_home, "sequencer", "run", "--broker", broker.url)
    evil = None
    try:
        assert runner.stdout.readline() and json.loads(seq.stdout.readline())
        assert [c["state"] for c in decided(member_home)["commits"]] == ["accepted"]
        evil = paho.Client(CallbackAPIVersion.VERSION2, client_id="mallory", protocol=paho.MQTTv5)
        evil.connect("127.0.0.1", broker.port)
        evil.loop_start()
        stranger = RogueSequencer()
        evil.publish(f"sovm-seq/{G5.hex()}/discontinuity/1",
                     codec.encode({"epoch": 1, "statement": stranger.statement(1, None, G5)}),
                     qos=1, retain=True).wait_for_publish(60)
        evil.publish(f"sovm-seq/{G5.hex()}/discontinuity/0", codec.encode({"epoch": 0}),
                     qos=1, retain=True).wait_for_publish(60)
        end = time.monotonic() + 90
        while True:
            st = json.loads(run_cli("--home", member_home, "commits", "status", "--all").stdout)
            kinds = [(e["kind"], e.get("epoch")) for e in st["events"]]
            if any(k in ("discontinuity", "discontinuity_unsigned") for k, _e in kinds) or time.monotonic() > end:
                break
            time.sleep(0.3)
        assert st["discontinuities"] == [], st
        assert "discontinuity" not in [k for k, _e in kinds], kinds
        assert ("discontinuity_unsigned", 0) in kinds, kinds
        ev = j(member_home, "commits", "evidence", "--group", G5.hex())
        assert ev["discontinuities"] == [] and ev["statements"] == [] and len(ev["receipts"]) == 1
    finally:
        if evil is not None:
            evil.loop_stop()
        stop(runner, seq)


def test_a_group_recovery_sent_to_genesis_reset_is_never_bootstrapped_again(tmp_path):
    """§22.6: never resume from a naked epoch assertion; §22.10: the reset uses a new group_id.
    A sequencer that lost G answers `genesis_reset` to evidence with no usable receipt; the next
    Commit framed at the epoch the member asserted (7) is refused `group_retired`, not taken as the
    first Commit of an unknown group; so is registering G again. Another group still bootstraps."""
    home = tmp_path / "new"
    j(home, "sequencer", "init")
    bob = tmp_path / "bob.json"
    bob.write_text(json.dumps({"member": "bob", "receipts": [], "attested_epoch": 7}))
    stranger = RogueSequencer()
    assert j(home, "sequencer", "recover", "--group", G.hex(), "--binding", f"0:{stranger.kid.hex()}", bob,
             code=2)["outcome"] == "genesis_reset"
    ans = j(home, "sequencer", "submit", message(tmp_path, 7, b"7"), code=2)
    assert ans["accepted"] is False and ans["reason"] == "group_retired", ans
    p = run_cli("--home", home, "sequencer", "register", "--group", G.hex(), "--epoch", "7")
    assert p.returncode == 2 and "group_retired" in p.stderr, (p.stdout, p.stderr)
    assert [g["group"] for g in j(home, "sequencer", "status")["groups"]] == []
    other = tmp_path / "other.mls"
    other.write_bytes(encode_private_message(bytes.fromhex("c4" * 16), 3))
    assert j(home, "sequencer", "submit", other)["accepted"] is True


def test_a_whole_home_restored_never_signs_a_second_receipt_for_an_epoch_it_released(tmp_path):
    """§22.5 cl. 2, §22.6 "a restore from backup": the whole sequencer home (state and signing
    journal) is copied back from a backup taken at epoch 3, after receipts for 3 and 4 were
    released. The receipt witness outside the home holds r4: the restored sequencer serves r4 byte
    for byte, refuses another Commit at 3 or 4 as stale, names 3 lost (members give it back) and
    chains its next receipt to r4."""
    home = tmp_path / "seq"
    j(home, "sequencer", "init")
    j(home, "sequencer", "register", "--group", G.hex(), "--epoch", "0")
    for e in range(3):
        j(home, "sequencer", "submit", message(tmp_path, e, b"%d" % e))
    backup = tmp_path / "backup"
    shutil.copytree(home, backup)
    r3 = bytes.fromhex(j(home, "sequencer", "submit", message(tmp_path, 3, b"3"))["receipt"])
    r4 = bytes.fromhex(j(home, "sequencer", "submit", message(tmp_path, 4, b"4"))["receipt"])
    shutil.rmtree(home)
    shutil.copytree(backup, home)                          # the whole home, journal included
    again = j(home, "sequencer", "submit", message(tmp_path, 3, b"another"), code=2)
    assert again["accepted"] is False and again["reason"] == "stale_epoch", again
    assert j(home, "sequencer", "submit", message(tmp_path, 4, b"another"), code=2)["reason"] == "stale_epoch"
    assert j(home, "sequencer", "receipt", "--group", G.hex(), "--epoch", "4") == {"receipt": r4.hex()}
    assert j(home, "sequencer", "receipt", "--group", G.hex(), "--epoch", "3") == \
        {"receipt": None, "absent": True, "discontinuity": False}
    st = j(home, "sequencer", "status")
    g = [x for x in st["groups"] if x["group"] == G.hex()][0]
    assert g["current_epoch"] == 5 and g["discontinuities"] == [], g
    r5 = bytes.fromhex(j(home, "sequencer", "submit", message(tmp_path, 5, b"5"))["receipt"])
    assert receipts.parse_receipt(r5).previous_receipt_hash == receipts.receipt_hash(r4)
    # what members hold gives epoch 3 back (`sequencer recover` on a group that lost receipts)
    alice = tmp_path / "alice.json"
    alice.write_text(json.dumps({"member": "alice", "receipts": [r3.hex(), r4.hex()], "attested_epoch": 5}))
    out = j(home, "sequencer", "recover", "--group", G.hex(), "--binding",
            f"0:{receipts.parse_receipt(r4).kid.hex()}", alice)
    assert out["outcome"] == "refilled" and out["refilled"] == 1 and out["missing"] == 0, out
    assert j(home, "sequencer", "receipt", "--group", G.hex(), "--epoch", "3") == {"receipt": r3.hex()}


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_whole_home_restores_at_random_points_never_release_two_receipts_for_one_epoch(tmp_path, seed):
    """The sequencer (real SQLite state, real signing journal, real witness file) serves three
    groups through rounds of Commits; between rounds its whole home is snapshotted, or copied back
    from a random earlier snapshot. Over everything it ever released: one receipt per (group_id,
    epoch), and every receipt names the one released for the epoch below it, when there is one."""
    import random
    from agent.sequencer import service
    rng = random.Random(seed)
    groups = [bytes([0xd0 + i]) * 16 for i in range(3)]
    home = tmp_path / "seq"
    service.init(home)
    with service.Sequencer(home) as s:
        for g in groups:
            s.register(g, 0)
    released: dict[tuple[bytes, int], set] = {}
    snapshots = []
    for round_ in range(14):
        with service.Sequencer(home) as s:
            for _ in range(rng.randint(1, 4)):
                g = rng.choice(groups)
                st = s.store.group(g)
                # mostly the current epoch; now and then one a restored copy may think is current
                e = st.current_epoch - rng.choice([0, 0, 0, 1, 2]) if st.current_epoch else 0
                ans = s.submit(encode_private_message(g, max(e, 0), ciphertext=rng.randbytes(8)))
                if isinstance(ans, service.Accepted):
                    released.setdefault((g, ans.epoch), set()).add(ans.receipt)
            for g in groups:        # what it serves is released too
                top = s.store.group(g).current_epoch
                for e in range(max(0, top - 3), top):
                    got = s.receipt(g, e)
                    if isinstance(got, bytes):
                        released.setdefault((g, e), set()).add(got)
        what = rng.choice(["snapshot", "restore", "none"]) if snapshots else "snapshot"
        if what == "snapshot":
            snapshots.append(tmp_path / f"snap{round_}")
            shutil.copytree(home, snapshots[-1])
        elif what == "restore":
            shutil.rmtree(home)
            shutil.copytree(rng.choice(snapshots), home)
    assert released
    twice = {k: v for k, v in released.items() if len(v) > 1}
    assert not twice, sorted((k[0].hex()[:4], k[1]) for k in twice)
    for (g, e), (raw,) in released.items():
        below = released.get((g, e - 1))
        if below:
            assert receipts.parse_receipt(raw).previous_receipt_hash == receipts.receipt_hash(next(iter(below)))
