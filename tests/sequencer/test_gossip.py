"""Receipt heads and sequencer bindings in the sync plane's `records` (agent/sequencing.py,
agent/core/seqrecords.py; SOVM §22.5-§22.6): real Nodes (real SQLite,
real sessions) syncing, a real Sequencer for honest receipts, a rogue P-256 signer for dishonest
ones (an honest sequencer cannot be made to double-sign)."""
from __future__ import annotations

import json
import os

import pytest

from agent import sequencing
from agent.core import seqrecords as sr
from agent.sequencer import receipts
from agent.sequencer.framing import encode_private_message
from agent.sync import SyncDriver

from tests.sequencer.test_member import RogueSequencer
from tests.sync.helpers import NOW, mesh, reopen, sync

G = bytes.fromhex("d4" * 16)


def surfaced(node, kind: str) -> list[dict]:
    return [dict(json.loads(d), reason=r) for r, d in node.conn.execute(
        "SELECT reason, detail FROM surfaced WHERE kind=? ORDER BY rowid", (kind,))]


def converge(nodes, links, t):
    """Sync along ``links`` (index pairs) twice over: records relay through the middle."""
    ds = [SyncDriver(n) for n in nodes]
    for _ in range(2):
        for a, b in links:
            t = sync(ds[a], ds[b], t + 1)
            t = sync(ds[b], ds[a], t + 1)
    return t


@pytest.fixture
def nodes(tmp_path):
    ns = mesh(tmp_path, 3, authority=0)
    yield ns
    for n in ns:
        n.close()


def rogue_chain(rs: RogueSequencer, n: int, gid: bytes = G, start: int = 0, prev=None) -> list[bytes]:
    out = []
    for e in range(start, start + n):
        out.append(rs.sign(e, b"commit%d" % e, prev, gid))
        prev = receipts.receipt_hash(out[-1])
    return out


def test_a_member_that_never_talks_to_the_sequencer_learns_the_chain(nodes, seq):
    n0, n1, n2 = nodes
    seq.register(G, 0)
    got = [seq.submit(encode_private_message(G, e)).receipt for e in range(3)]
    assert sequencing.bind(n0, G, seq.public_key, 0, NOW)["generation"] == 0
    for raw in got:                               # n1 heard them from the sequencer
        out = sequencing.gossip(n1, raw, NOW)
        assert out["gossiped"] and out["verdict"] == "held"   # n1 does not hold the binding yet
    # n2 talks only to n0 (the authority), never to n1, the sequencer or its broker
    converge(nodes, [(0, 1), (0, 2)], NOW)
    for n in nodes:
        st = sequencing.status(n, G)["groups"][0]
        assert [r["epoch"] for r in st["receipts"]] == [0, 1, 2], st
        assert st["head"]["receipt_hash"] == receipts.receipt_hash(got[2]).hex()
        assert st["held"] == 0 and not st["equivocation"] and st["bindings"] == {"0": seq.public_key.hex()}
    # gossiping a receipt the mesh already carries issues nothing new
    assert sequencing.gossip(n2, got[1], NOW) == {"group": G.hex(), "epoch": 1, "gossiped": False,
                                                  "verdict": "duplicate"}
    # the records survive a restart (stored, not in memory)
    n2b = reopen(n2)
    try:
        assert [r["epoch"] for r in sequencing.status(n2b, G)["groups"][0]["receipts"]] == [0, 1, 2]
    finally:
        nodes[2] = n2b


def test_a_double_signing_sequencer_is_flagged_by_both_member_sets_and_bystanders(nodes):
    """The malicious sequencer of §22.6: receipt A for epoch 2 to one member set, B to another.
    Each set only ever holds its own; gossip over the mesh puts both in front of everyone,
    including the authority, which never talked to the sequencer."""
    n0, n1, n2 = nodes
    rs = RogueSequencer()
    sequencing.bind(n0, G, rs.kid, 0, NOW)
    common = rogue_chain(rs, 2)
    a = rs.sign(2, b"commit-for-set-A", receipts.receipt_hash(common[1]), G)
    b = rs.sign(2, b"commit-for-set-B", receipts.receipt_hash(common[1]), G)
    converge(nodes, [(0, 1), (0, 2)], NOW)         # both hold the binding
    for raw in common + [a]:
        assert sequencing.gossip(n1, raw, NOW)["verdict"] == "accepted"
    for raw in common + [b]:
        sequencing.gossip(n2, raw, NOW)
    assert not sequencing.status(n2, G)["groups"][0]["equivocation"]     # alone, B looks fine
    converge(nodes, [(0, 1), (0, 2)], NOW + 1000)
    for n in nodes:
        ev = sequencing.status(n, G)["groups"][0]["equivocation"]
        assert [(e["kind"], e["epoch"]) for e in ev] == [("double_receipt", 2)], ev
        assert set(ev[0]["receipts"]) == {a.hex(), b.hex()}
        loud = surfaced(n, "sequencer_equivocation")
        assert [(s["reason"], s["epoch"]) for s in loud] == [("double_receipt", 2)]


def test_a_malicious_sequencer_double_signs_then_declares_a_discontinuity_flagged_through_gossip(nodes):
    """§22.6: receipt A for epoch 3 to member set {n1}, B to {n2}; then the sequencer declares
    epoch 3 a discontinuity (a signed statement) and chains epoch 4 across it. The bystander n0
    (the authority) hears only the statement and the later receipt from the sequencer: it cannot
    check the claim and accepts the gap. Relayed over the mesh, the statement reaches n1, which
    holds A: the claim is falsified by A (equivocation, with both signed byte strings), before n1
    ever sees B; then n2, which holds B, the same."""
    n0, n1, n2 = nodes
    rs = RogueSequencer()
    sequencing.bind(n0, G, rs.kid, 0, NOW)
    common = rogue_chain(rs, 3)
    prev = receipts.receipt_hash(common[2])
    a = rs.sign(3, b"commit-for-set-A", prev, G)
    b = rs.sign(3, b"commit-for-set-B", prev, G)
    stmt = rs.statement(3, prev, G)
    after = rs.sign(4, b"commit-4", prev, G)
    converge(nodes, [(0, 1), (0, 2)], NOW)              # everyone holds the binding
    for raw in common + [stmt, after]:
        sequencing.gossip(n0, raw, NOW)
    st0 = sequencing.status(n0, G)["groups"][0]
    assert not st0["equivocation"] and [d["epoch"] for d in st0["discontinuities"]] == [3]
    assert st0["head"]["receipt_hash"] == receipts.receipt_hash(after).hex()
    for raw in common + [a]:
        sequencing.gossip(n1, raw, NOW)
    for raw in common + [b]:
        sequencing.gossip(n2, raw, NOW)
    t = converge([n0, n1], [(0, 1)], NOW + 1000)        # n2 not yet: n1 has never seen B
    ev = sequencing.status(n1, G)["groups"][0]["equivocation"]
    # n1 keeps A in its chain, so epoch 4 (naming epoch 2 across the claimed gap) diverges from it too
    assert [(e["kind"], e["epoch"], set(e["receipts"])) for e in ev] == \
        [("discontinuity_contradicted", 3, {a.hex(), stmt.hex()}), ("divergent_chain", 4, {a.hex(), after.hex()})], ev
    assert [s["reason"] for s in surfaced(n1, "sequencer_equivocation")] == ["discontinuity_contradicted",
                                                                             "divergent_chain"]
    converge(nodes, [(0, 1), (0, 2)], t + 1000)
    for n in nodes:
        ev = sequencing.status(n, G)["groups"][0]["equivocation"]
        got = {(e["kind"], e["epoch"], frozenset(e["receipts"])) for e in ev}
        assert {("discontinuity_contradicted", 3, frozenset({a.hex(), stmt.hex()})),
                ("discontinuity_contradicted", 3, frozenset({b.hex(), stmt.hex()}))} <= got, ev
        assert surfaced(n, "sequencer_equivocation")


def test_an_honest_gap_statement_relayed_over_the_mesh_lets_every_member_continue(nodes, seq):
    """A real sequencer's recorded gap (intent without receipt) and its signed statement: n1
    relays the statement and the receipts; n2, which never talks to the sequencer, accepts the
    gap as a durability gap (continuous on both sides) and holds nothing."""
    from firmware_bridge import ReceiptIdentity
    from firmware_bridge.journal import INTENT
    from agent.sequencer import service
    n0, n1, n2 = nodes
    seq.register(G, 0)
    r0 = seq.submit(encode_private_message(G, 0)).receipt
    m1 = encode_private_message(G, 1)
    seq.store.put_pending(G, 1, receipts.commit_hash(m1), m1, False)
    seq.bridge._journal.commit([(INTENT, ReceiptIdentity(G, 1).encode(), service.RECEIPT_KEY)])
    home = seq.home
    seq.close()
    with service.Sequencer(home) as s:               # resume: the gap, and its statement signed
        stmt = s.receipt(G, 1).statement
        r2 = s.submit(encode_private_message(G, 2)).receipt
        key = s.public_key
    sequencing.bind(n0, G, key, 0, NOW)
    for raw in (r0, r2):
        sequencing.gossip(n1, raw, NOW)
    out = sequencing.gossip(n1, stmt, NOW)
    assert out["gossiped"] and out["discontinuity"] and out["epoch"] == 1
    assert sequencing.gossip(n1, stmt, NOW)["gossiped"] is False
    converge(nodes, [(0, 1), (0, 2)], NOW)
    for n in nodes:
        st = sequencing.status(n, G)["groups"][0]
        assert [r["epoch"] for r in st["receipts"]] == [0, 2] and st["held"] == 0 and not st["equivocation"]
        assert st["discontinuities"] == [{"epoch": 1, "statement_hash": receipts.receipt_hash(stmt).hex(),
                                          "signer": key.hex()}]


def test_a_rotated_out_sequencer_that_keeps_signing_is_rejected_and_attributed_everywhere(nodes):
    n0, n1, n2 = nodes
    old, new = RogueSequencer(), RogueSequencer()
    sequencing.bind(n0, G, old.kid, 0, NOW)
    first = rogue_chain(old, 3)                      # epochs 0..2 under the old sequencer
    sequencing.bind(n0, G, new.kid, 3, NOW)          # migration: the new one from epoch 3
    handed = new.sign(3, b"canonical-3", receipts.receipt_hash(first[2]), G)
    stray = old.sign(3, b"stray-3", receipts.receipt_hash(first[2]), G)
    for raw in first + [handed]:
        sequencing.gossip(n1, raw, NOW)
    sequencing.gossip(n2, stray, NOW)                # n2 took it from the rotated-out sequencer
    converge(nodes, [(0, 1), (0, 2)], NOW)
    for n in nodes:
        st = sequencing.status(n, G)["groups"][0]
        assert st["bindings"] == {"0": old.kid.hex(), "3": new.kid.hex()}
        assert [r["epoch"] for r in st["receipts"]] == [0, 1, 2, 3]
        assert st["head"]["receipt_hash"] == receipts.receipt_hash(handed).hex()
        # an attributable rejection, not a fork that freezes an honest group (§22.6)
        assert not st["equivocation"] and st["attributed"] == [{"signer": old.kid.hex(), "receipt": stray.hex()}]
        assert [s["signer"] for s in surfaced(n, "receipt_attributed")] == [old.kid.hex()]


def test_a_link_whose_binding_cannot_be_resolved_is_held_until_it_can(nodes):
    n0, n1, n2 = nodes
    rs = RogueSequencer()
    chain = rogue_chain(rs, 2)
    for raw in chain:
        assert sequencing.gossip(n1, raw, NOW)["verdict"] == "held"       # no binding for G anywhere
    converge(nodes, [(1, 2)], NOW)
    st = sequencing.status(n2, G)["groups"][0]
    assert st["held"] == 2 and not st["receipts"] and not st["attributed"] and not st["equivocation"]
    sequencing.bind(n0, G, rs.kid, 0, NOW)
    converge(nodes, [(0, 2)], NOW + 1000)
    st = sequencing.status(n2, G)["groups"][0]
    assert st["held"] == 0 and [r["epoch"] for r in st["receipts"]] == [0, 1]


def test_two_bindings_for_one_generation_are_a_fork_surfaced_and_held(tmp_path):
    """Two authorities each hand the group to a different sequencer at generation 5 (a contested
    hand-off): the binding record forks; receipts below 5 stand, from 5 on they are held, the fork
    is surfaced, and no third binding may paper over it."""
    ns = mesh(tmp_path, 2, authority=0)
    try:
        for n in ns:                                  # both nodes are authorities
            auths = sorted(x.site_id for x in ns)
            n.conn.execute("INSERT OR REPLACE INTO meta VALUES ('authorities', ?)", (json.dumps([a.hex() for a in auths]),))
            n.authorities = set(auths)
        base, k1, k2 = RogueSequencer(), RogueSequencer(), RogueSequencer()
        sequencing.bind(ns[0], G, base.kid, 0, NOW)
        converge(ns, [(0, 1)], NOW)
        sequencing.bind(ns[0], G, k1.kid, 5, NOW)
        sequencing.bind(ns[1], G, k2.kid, 5, NOW)
        early = rogue_chain(base, 5)
        late = k1.sign(5, b"c5", receipts.receipt_hash(early[4]), G)
        for raw in early + [late]:
            sequencing.gossip(ns[0], raw, NOW)
        converge(ns, [(0, 1)], NOW + 1000)
        for n in ns:
            st = sequencing.status(n, G)["groups"][0]
            assert [f["generation"] for f in st["binding_forks"]] == [5]
            assert [r["epoch"] for r in st["receipts"]] == [0, 1, 2, 3, 4] and st["held"] == 1
            assert [s["reason"] for s in surfaced(n, "record_fork")] == ["sequencer_binding_fork"]
            with pytest.raises(sequencing.SequencingRefused, match="forked"):
                sequencing.bind(n, G, k1.kid, 9, NOW)
    finally:
        for n in ns:
            n.close()


def test_records_from_outside_the_mesh_or_with_bad_receipts_are_dropped(nodes):
    n0, n1, _ = nodes
    rs = RogueSequencer()
    good = rogue_chain(rs, 1)[0]
    # a head record whose receipt does not verify: dropped and surfaced, never stored or relayed
    bad = bytearray(good)
    bad[-1] ^= 1
    protected, payload, tbs = sr.head_to_be_signed(n1.site_id, n1.mesh_id, G, bytes(bad))
    from agent.core.cose import assemble
    raw = n1.release_signed(tbs, lambda sig: assemble(protected, payload, sig), NOW)
    assert n0.apply_records([raw], NOW)["sequencing"] == {"stored": 0, "known": 0, "dropped": 1, "refused": 0}
    assert [s["reason"] for s in surfaced(n0, "record_dropped")] == ["bad_receipt"]
    # a binding issued by a member that is not an authority: dropped
    protected, payload, tbs = sr.binding_to_be_signed(n1.site_id, n1.mesh_id, G, rs.kid, 0, None)
    raw = n1.release_signed(tbs, lambda sig: assemble(protected, payload, sig), NOW)
    assert n0.apply_records([raw], NOW)["sequencing"]["dropped"] == 1
    with pytest.raises(sequencing.SequencingRefused, match="authority"):
        sequencing.bind(n1, G, rs.kid, 0, NOW)
    assert sequencing.status(n0)["groups"] == []
    assert os.path.exists(n0.home)


def test_end_to_end_through_the_cli_queue_gossip_mailbox(tmp_path):
    """Real processes only: a standalone authority binds the sequencer to the group; member b
    queues its Commit, gets it sequenced through `sequencer run` on a real mosquitto, gossips the
    receipt from its queue (by itself: `commits send` feeds the node's gossip); b's file reaches the gateway, the gateway's reaches c, which never
    talked to the sequencer nor its broker and now holds the receipt under the binding."""
    import subprocess
    from agent.transport.broker import Broker
    from tests.cli_cmd import agent_cmd, agent_env
    from tests.sequencer.test_commit_queue import spawn, stop
    from tests.sync.helpers import MESH, TABLES
    env = agent_env(dict(os.environ, SSP_AGENT_WITNESS_DIR=str(tmp_path / "w")))

    def j(home, *args):
        p = subprocess.run([*agent_cmd(), "--home", str(home), *map(str, args)], capture_output=True, text=True,
                           env=env)
        assert p.returncode == 0, (args, p.stdout, p.stderr)
        return json.loads(p.stdout.splitlines()[-1]) if p.stdout.strip() else None

    auth_dir = tmp_path / "authority"
    auth = j(tmp_path / "unused", "authority", "create", "--out", auth_dir)
    man = tmp_path / "mesh.toml"
    man.write_text(f'mesh_id = "{MESH.hex()}"\nauthorities = ["{auth["site_id"]}"]\n'
                   f'[[peers]]\nsite_id = "{auth["site_id"]}"\npublic_key = "{auth["public_key"]}"\n' + TABLES)
    gw, b, c = (tmp_path / x for x in ("gw", "b", "c"))
    ids = {h: j(h, "init", "--manifest", man) for h in (gw, b, c)}
    for h in (gw, b, c):
        j(gw, "record", "issue-vouch", "--subject", ids[h]["site_id"], "--public-key", ids[h]["public_key"],
          "--authority-key", auth_dir)
    seq_home = tmp_path / "seq"
    key = j(seq_home, "sequencer", "init")["sequencer_key"]
    j(seq_home, "sequencer", "register", "--group", G.hex(), "--epoch", "0")
    bound = j(gw, "sequencing", "bind", "--group", G.hex(), "--sequencer-key", key, "--generation", "0",
              "--authority-key", auth_dir)
    assert bound["generation"] == 0 and bound["previous_record_hash"] is None
    n = [0]

    def carry(src, dst):
        n[0] += 1
        f = tmp_path / f"m{n[0]}.cbor"
        j(src, "mailbox", "export", "--peer", ids[dst]["site_id"], "--out", f)
        j(dst, "mailbox", "import", f)

    carry(gw, b)                      # vouches and the binding reach b
    commit = tmp_path / "commit.mls"
    commit.write_bytes(encode_private_message(G, 0, ciphertext=b"b" * 16))
    j(b, "commits", "queue", commit, "--sequencer-key", key)
    # §22.7: the sequencer's broker is not there yet; the Commit waits, data sync does not
    broker = Broker(workdir=tmp_path / "broker")
    down = subprocess.run([*agent_cmd(), "--home", str(b), "commits", "send", "--broker", broker.url, "--timeout", "1"],
                          capture_output=True, text=True, env=env)
    assert down.returncode == 1 and json.loads(down.stdout)["outstanding"] == 1
    wrote = subprocess.run([*agent_cmd(), "--home", str(b), "write", "app.readings", "--key",
                            json.dumps({"device": "b", "seq": 1}), "--set", json.dumps({"temp": 21.5})],
                           capture_output=True, text=True, env=env)
    assert wrote.returncode == 0, wrote.stderr
    carry(b, gw)
    def dump(home):
        p = subprocess.run([*agent_cmd(), "--home", str(home), "dump"], capture_output=True, text=True, env=env)
        return json.loads(p.stdout)["app.readings"]
    assert dump(gw) == dump(b) != []
    broker.start()
    seqp, _ = spawn(seq_home, "sequencer", "run", "--broker", broker.url)
    try:
        sent = j(b, "commits", "send", "--broker", broker.url, "--timeout", "60")
        assert sent["commits"][0]["state"] == "accepted"
    finally:
        stop(seqp)
        broker.close()
    # `commits send` handed the receipt to b's gossip itself; the CLI step finds it there already
    gossip = j(b, "sequencing", "gossip", "--from-queue")["gossip"]
    assert [(g["epoch"], g["gossiped"], g["verdict"]) for g in gossip] == [(0, False, "duplicate")]
    carry(b, gw)
    carry(gw, c)
    st = j(c, "sequencing", "status", "--group", G.hex())["groups"][0]
    assert st["bindings"] == {"0": key} and [r["epoch"] for r in st["receipts"]] == [0]
    assert st["head"]["receipt_hash"] == receipts.receipt_hash(bytes.fromhex(sent["commits"][0]["receipt"])).hex()
    assert not st["equivocation"] and st["held"] == 0


def test_bindings_and_gossip_signed_through_softhsm2_tokens(tmp_path):
    """The sequencer's receipt key and the authority node's key each in its own SoftHSM2 token:
    the binding and the head records go through the node's signing bridge like its events."""
    from agent.node import Node
    from agent.sequencer import service
    from agent.store import db
    from bridge_helpers import softhsm_token
    from tests.sync.helpers import manifest
    seq_conf = softhsm_token(tmp_path / "t-seq", "seq-receipts")
    node_conf = softhsm_token(tmp_path / "t-node", "node-key")
    service.init(tmp_path / "seq", seq_conf)
    a, pk_a = Node.init(tmp_path / "a", manifest(), node_conf)
    b, pk_b = Node.init(tmp_path / "b", manifest(), {"kind": "software"})
    try:
        assert a.bridge.keystore.describe()["kind"] == "pkcs11"
        a.add_peer(b.site_id, pk_b, None)
        b.add_peer(a.site_id, pk_a, None)
        for n in (a, b):
            n.conn.execute("INSERT OR REPLACE INTO meta VALUES ('authorities', ?)", (json.dumps([a.site_id.hex()]),))
            n.authorities = {a.site_id}
        with service.Sequencer(tmp_path / "seq") as seq:
            assert seq.bridge.keystore.describe()["kind"] == "pkcs11"
            seq.register(G, 0)
            got = [seq.submit(encode_private_message(G, e)).receipt for e in range(2)]
            key = seq.public_key
        sequencing.bind(a, G, key, 0, NOW)
        for raw in got:
            assert sequencing.gossip(a, raw, NOW)["verdict"] == "accepted"
        converge([a, b], [(0, 1)], NOW)
        st = sequencing.status(b, G)["groups"][0]
        assert [r["epoch"] for r in st["receipts"]] == [0, 1] and st["bindings"] == {"0": key.hex()}
        assert db.get_meta(b.conn, "public_key") == pk_b
    finally:
        a.close()
        b.close()


def test_a_head_record_released_but_not_stored_is_stored_on_open(nodes):
    """A crash between the bridge's release of a head record and its store: the journal holds
    the bytes; the next open stores them (and relays them), it never signs a second one."""
    n0, n1, _ = nodes
    rs = RogueSequencer()
    raw_receipt = rogue_chain(rs, 1)[0]
    protected, payload, tbs = sr.head_to_be_signed(n1.site_id, n1.mesh_id, G, raw_receipt)
    from agent.core.cose import assemble
    released = n1.release_signed(tbs, lambda sig: assemble(protected, payload, sig), NOW)   # ... and the crash
    assert sequencing.status(n1)["groups"] == []
    n1b = reopen(n1)
    nodes[1] = n1b
    from agent.store import sequencing as seqstore
    assert seqstore.raws(n1b.conn, G, "head") == [released]
    # and, now held, it is compacted out of the journal like any record the store holds
    assert released not in [raw for _i, raw in n1b.bridge.iter_released()]
    assert sequencing.gossip(n1b, raw_receipt, NOW)["gossiped"] is False       # not signed twice


def test_commits_run_feeds_every_receipt_into_the_nodes_gossip_without_a_cli_step(tmp_path):
    """The member's `commits run` hands each receipt it gets to its node's gossip
    records by itself — opening the node while no agent holds the home, and through the running
    agent's control socket while `ssp-agent run` holds it. No `sequencing gossip` is called; the
    node's `sequencing status` shows the receipts under the binding."""
    import signal
    import subprocess
    import time
    from agent.transport.broker import Broker
    from tests.cli_cmd import agent_cmd, agent_env
    from tests.sequencer.test_commit_queue import spawn, stop
    from tests.sync.helpers import MESH, TABLES
    env = agent_env(dict(os.environ, SSP_AGENT_WITNESS_DIR=str(tmp_path / "w")))

    def j(home, *args):
        p = subprocess.run([*agent_cmd(), "--home", str(home), *map(str, args)], capture_output=True, text=True,
                           env=env)
        assert p.returncode == 0, (args, p.stdout, p.stderr)
        return json.loads(p.stdout.splitlines()[-1]) if p.stdout.strip() else None

    def held(home, n, limit=90.0):
        end = time.monotonic() + limit
        while True:
            gs = j(home, "sequencing", "status", "--group", G.hex())["groups"]
            if (gs and len(gs[0]["receipts"]) >= n) or time.monotonic() > end:
                return gs[0] if gs else None
            time.sleep(0.3)

    auth_dir = tmp_path / "authority"
    auth = j(tmp_path / "unused", "authority", "create", "--out", auth_dir)
    man = tmp_path / "mesh.toml"
    man.write_text(f'mesh_id = "{MESH.hex()}"\nauthorities = ["{auth["site_id"]}"]\n'
                   f'[[peers]]\nsite_id = "{auth["site_id"]}"\npublic_key = "{auth["public_key"]}"\n' + TABLES)
    b = tmp_path / "b"
    j(b, "init", "--manifest", man)
    seq_home = tmp_path / "seq"
    key = j(seq_home, "sequencer", "init")["sequencer_key"]
    j(seq_home, "sequencer", "register", "--group", G.hex(), "--epoch", "0")
    j(b, "sequencing", "bind", "--group", G.hex(), "--sequencer-key", key, "--generation", "0",
      "--authority-key", auth_dir)
    broker = Broker(workdir=tmp_path / "broker").start()
    seqp, _ = spawn(seq_home, "sequencer", "run", "--broker", broker.url)
    member = agentp = None
    try:
        c0 = tmp_path / "c0.mls"
        c0.write_bytes(encode_private_message(G, 0, ciphertext=b"b" * 16))
        j(b, "commits", "queue", c0, "--sequencer-key", key)
        member, _ = spawn(b, "commits", "run", "--broker", broker.url)
        st = held(b, 1)                                   # no agent holds b: the node is opened
        assert st is not None and [r["epoch"] for r in st["receipts"]] == [0], st
        assert not st["equivocation"] and st["held"] == 0
        # now the agent holds b's home; the next receipt goes through its control socket
        agentp = subprocess.Popen([*agent_cmd(), "--home", str(b), "run", "--broker", broker.url, "--cadence", "0.3"],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        end = time.monotonic() + 60
        while not (b / "control.sock").exists() and time.monotonic() < end:
            assert agentp.poll() is None, agentp.communicate()[1][-2000:]
            time.sleep(0.1)
        c1 = tmp_path / "c1.mls"
        c1.write_bytes(encode_private_message(G, 1, ciphertext=b"c" * 16))
        j(b, "commits", "queue", c1)
        st = held(b, 2)
        q = j(b, "commits", "status")
        assert [r["epoch"] for r in st["receipts"]] == [0, 1], (st, q)
        assert [c["state"] for c in q["commits"]] == ["accepted", "accepted"]
        assert st["head"]["receipt_hash"] == receipts.receipt_hash(bytes.fromhex(q["commits"][1]["receipt"])).hex()
        assert [e["via"] for e in q["events"] if e["kind"] == "gossiped"] == ["node", "agent"]
        # a gap: the sequencer stopped after an intent for epoch 2 and no receipt; on resume it
        # records the gap, signs its statement and publishes it (retained) for every member; b's
        # queue keeps it and hands it to the mesh too (§22.6 step 4)
        stop(seqp)
        from firmware_bridge import ReceiptIdentity
        from firmware_bridge.journal import INTENT
        from agent.sequencer import service
        m2 = encode_private_message(G, 2, ciphertext=b"d" * 16)
        with service.Sequencer(seq_home) as s:
            s.store.put_pending(G, 2, receipts.commit_hash(m2), m2, False)
            s.bridge._journal.commit([(INTENT, ReceiptIdentity(G, 2).encode(), service.RECEIPT_KEY)])
        seqp, _ = spawn(seq_home, "sequencer", "run", "--broker", broker.url)
        end = time.monotonic() + 90
        while True:
            st = j(b, "sequencing", "status", "--group", G.hex())["groups"][0]
            if st["discontinuities"] or time.monotonic() > end:
                break
            time.sleep(0.3)
        assert [(d["epoch"], d["signer"]) for d in st["discontinuities"]] == [(2, key)], st
        assert not st["equivocation"]
        q = j(b, "commits", "status")
        assert [(d["group"], d["epoch"]) for d in q["discontinuities"]] == [(G.hex(), 2)]
    finally:
        if member is not None:
            stop(member)
        if agentp is not None:
            agentp.send_signal(signal.SIGTERM)
            agentp.communicate(timeout=30)
        stop(seqp)
        broker.close()


def test_the_queue_checks_receipts_against_the_sequencer_bound_at_their_generation(tmp_path):
    """§22.6 singularity, through the member's Commit queue with real processes: the
    node's binding records bind S1 to G from epoch 0 and S2 from epoch 1 (a hand-off). A copy of
    S1 restored from before the hand-off keeps serving G on the broker: its receipt for epoch 1 is
    rejected and retained for attribution, and the Commit stays queued (before, the queue took any
    valid signature and settled it as accepted on the rotated-out sequencer's word). S2's receipt
    then settles it. Group H is bound only from generation 5: a receipt for epoch 0 is held."""
    import shutil
    import subprocess
    from agent.transport.broker import Broker
    from tests.cli_cmd import agent_cmd, agent_env
    from tests.sequencer.test_commit_queue import spawn, stop
    from tests.sync.helpers import MESH, TABLES
    env = agent_env(dict(os.environ, SSP_AGENT_WITNESS_DIR=str(tmp_path / "w")))
    H = bytes.fromhex("e5" * 16)

    def run(home, *args):
        return subprocess.run([*agent_cmd(), "--home", str(home), *map(str, args)], capture_output=True, text=True,
                              env=env)

    def j(home, *args):
        p = run(home, *args)
        assert p.returncode == 0, (args, p.stdout, p.stderr)
        return json.loads(p.stdout.splitlines()[-1]) if p.stdout.strip() else None

    def mls(name, gid, epoch):
        f = tmp_path / name
        f.write_bytes(encode_private_message(gid, epoch, ciphertext=name.encode() * 4))
        return f

    auth_dir = tmp_path / "authority"
    auth = j(tmp_path / "unused", "authority", "create", "--out", auth_dir)
    man = tmp_path / "mesh.toml"
    man.write_text(f'mesh_id = "{MESH.hex()}"\nauthorities = ["{auth["site_id"]}"]\n'
                   f'[[peers]]\nsite_id = "{auth["site_id"]}"\npublic_key = "{auth["public_key"]}"\n' + TABLES)
    b, s1, s2, rogue = (tmp_path / x for x in ("b", "s1", "s2", "rogue"))
    j(b, "init", "--manifest", man)
    k1 = j(s1, "sequencer", "init")["sequencer_key"]
    k2 = j(s2, "sequencer", "init")["sequencer_key"]
    j(s1, "sequencer", "register", "--group", G.hex(), "--epoch", "0")
    j(s1, "sequencer", "submit", mls("g0", G, 0))
    shutil.copytree(s1, rogue)                                   # S1 as it was before the hand-off
    j(s1, "sequencer", "migrate", "--group", G.hex(), "--out", tmp_path / "handoff.json")
    assert j(s2, "sequencer", "adopt", tmp_path / "handoff.json")["generation"] == 1
    j(s2, "sequencer", "register", "--group", H.hex(), "--epoch", "0")
    for args in ((G, k1, 0), (G, k2, 1), (H, k2, 5)):
        j(b, "sequencing", "bind", "--group", args[0].hex(), "--sequencer-key", args[1], "--generation", args[2],
          "--authority-key", auth_dir)
    # b's queue is given no --sequencer-key: the binding records decide
    j(b, "commits", "queue", mls("g1", G, 1))
    j(b, "commits", "queue", mls("h0", H, 0))
    broker = Broker(workdir=tmp_path / "broker").start()
    try:   # the broker goes whatever fails first (a failed first half left it running)
        rogue_p, _ = spawn(rogue, "sequencer", "run", "--broker", broker.url)
        try:
            sent = run(b, "commits", "send", "--broker", broker.url, "--timeout", "8")
            assert sent.returncode == 1, (sent.stdout, sent.stderr)      # nothing settled on the rogue's word
            q = j(b, "commits", "status")
            assert [c["state"] for c in q["commits"]] == ["queued", "queued"]
            stray = [u for u in q["unsettled"] if u["verdict"] == "attributed"]
            assert len(stray) == 1 and receipts.parse_receipt(bytes.fromhex(stray[0]["receipt"])).kid.hex() == k1
            assert [e["signer"] for e in q["events"] if e["kind"] == "receipt_attributed"] == [k1]
        finally:
            stop(rogue_p)
        s2_p, _ = spawn(s2, "sequencer", "run", "--broker", broker.url)
        try:
            run(b, "commits", "send", "--broker", broker.url, "--timeout", "8")
            q = j(b, "commits", "status")
            g1, h0 = q["commits"]
            assert g1["state"] == "accepted" and receipts.parse_receipt(bytes.fromhex(g1["receipt"])).kid.hex() == k2
            # H: S2's valid receipt for epoch 0, but H is bound only from generation 5: held, undecided
            assert h0["state"] == "queued" and h0["reason"] == "binding_unresolved"
            # (the rogue bootstrapped H on first sight and signed one too: held as well, not attributed —
            # with no binding resolvable there is nobody to compare its signer with)
            held = [receipts.parse_receipt(bytes.fromhex(u["receipt"])) for u in q["unsettled"] if u["verdict"] == "held"]
            assert {r.group_id for r in held} == {H} and {r.kid.hex() for r in held} == {k1, k2}
            assert [u["verdict"] for u in q["unsettled"]].count("attributed") == 1     # still retained
        finally:
            stop(s2_p)
    finally:
        broker.close()
