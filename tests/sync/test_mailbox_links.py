"""The mailbox path as a link (docs/protocol.md §6): a refused import changes nothing, an export
that cannot be written whole fails and moves nothing, and the cursor moves only on the peer's
answer (a signed `sovm/ssp-mailbox-ack-v1` record in the peer's next file, §14.1)."""
from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import subprocess
from pathlib import Path

import cbor2
import pytest

from tests.cli_cmd import agent_cmd, agent_env

from .helpers import MESH, TABLES


def cli(*args, env, ok=True):
    p = subprocess.run([*agent_cmd(), *map(str, args)], capture_output=True, text=True, env=agent_env(env))
    if ok:
        assert p.returncode == 0, p.stderr
    return p


def snapshot(home: Path) -> dict:
    """Everything a home holds: the store's full SQL dump (schema, every table, meta, policy rows)
    and the bytes of every other file (journal, identity), SQLite's WAL/SHM aside."""
    out = {}
    with sqlite3.connect(f"file:{home}/store.sqlite?mode=ro", uri=True) as c:
        out["store"] = list(c.iterdump())
    for p in sorted(home.rglob("*")):
        if p.is_file() and not p.name.startswith("store.sqlite"):
            out[str(p.relative_to(home))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def env(tmp_path):
    e = dict(os.environ, SSP_AGENT_WITNESS_DIR=str(tmp_path / "w"))
    man = tmp_path / "m.toml"
    man.write_text(f'mesh_id = "{MESH.hex()}"\n' + TABLES)
    e["_MAN"] = str(man)
    return e


def init(home: Path, env) -> dict:
    return json.loads(cli("--home", home, "init", "--manifest", env["_MAN"], env=env).stdout)


def _good_body(tmp_path, env, home: Path) -> bytes:
    """A well-formed mailbox body from another home of the same mesh, whose key `home` trusts."""
    src = tmp_path / "src"
    ident = init(src, env)
    cli("--home", home, "peer", "add", "--site-id", ident["site_id"], "--public-key", ident["public_key"], env=env)
    cli("--home", src, "write", "app.readings", "--key", '{"device": "s", "seq": 1}', "--set", '{"temp": 1.5}', env=env)
    f = tmp_path / "good.cbor"
    cli("--home", src, "mailbox", "export", "--peer", "ab" * 16, "--out", f, env=env)
    return f.read_bytes()


@pytest.mark.parametrize("case", ["not_a_map", "trailing_bytes", "version_2", "events_not_bytes"])
def test_a_refused_import_changes_nothing_in_a_fresh_home(tmp_path, env, case):
    """A refused `mailbox import` created the sync tables and the default policy rows
    before the strict parser refused the body. The refusal must come before any write."""
    home = tmp_path / "a"
    init(home, env)
    good = _good_body(tmp_path, env, home)
    body = cbor2.loads(good)
    data = {"not_a_map": b"\x82\x01\x02", "trailing_bytes": good + b"\x00",
            "version_2": cbor2.dumps({**body, "ssp_version": 2}),
            "events_not_bytes": cbor2.dumps({**body, "events": [1]})}[case]
    before = snapshot(home)
    bad = tmp_path / "bad.cbor"
    bad.write_bytes(data)
    p = cli("--home", home, "mailbox", "import", bad, env=env, ok=False)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "nothing was changed" in p.stderr
    assert snapshot(home) == before
    # the same home then imports a good body normally
    ok = tmp_path / "ok.cbor"
    ok.write_bytes(good)
    assert json.loads(cli("--home", home, "mailbox", "import", ok, env=env).stdout)["applied"] == 1


@pytest.fixture
def small_fs(tmp_path):
    """A real, small filesystem (a tmpfs of 32 KiB), like a nearly full USB stick."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "stick"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def _mailbox_state(home: Path, peer: bytes) -> tuple:
    with sqlite3.connect(f"file:{home}/store.sqlite?mode=ro", uri=True) as c:
        names = {n for (n,) in c.execute("SELECT name FROM sqlite_master")}
        cur = c.execute("SELECT live, bf_next FROM sync_cursors WHERE peer=? AND path='mailbox'", (peer,)).fetchall() \
            if "sync_cursors" in names else []
        rec = c.execute("SELECT count(*) FROM records_delivered WHERE peer=? AND path='mailbox'", (peer,)).fetchone()[0] \
            if "records_delivered" in names else 0
        sent = c.execute("SELECT count(*) FROM sent_bodies WHERE peer=? AND path='mailbox'", (peer,)).fetchone()[0] \
            if "sent_bodies" in names else 0
    return cur, rec, sent


def test_export_onto_a_full_filesystem_fails_and_moves_nothing(tmp_path, env, small_fs):
    """An export onto a full USB stick wrote a truncated file, exited 0 and moved
    the cursor. It must exit 1 with one line, leave no file, and move nothing."""
    from agent.node import Node
    homes = [tmp_path / "a", tmp_path / "b"]
    ids = [init(h, env) for h in homes]
    cli("--home", homes[0], "peer", "add", "--site-id", ids[1]["site_id"], "--public-key", ids[1]["public_key"], env=env)
    a = Node.open(homes[0])
    for i in range(300):  # ~100 KiB of events: more than the stick holds
        a.write("app.readings", {"device": "a", "seq": i}, {"temp": float(i), "note": "x" * 100})
    a.close()
    peer = bytes.fromhex(ids[1]["site_id"])
    before = _mailbox_state(homes[0], peer)
    out = small_fs / "to-b.cbor"
    p = cli("--home", homes[0], "mailbox", "export", "--peer", ids[1]["site_id"], "--out", out, env=env, ok=False)
    assert p.returncode == 1 and p.stderr.count("\n") == 1 and "No space left" in p.stderr, p.stderr
    assert list(small_fs.iterdir()) == []  # neither a truncated file nor a temporary
    after = _mailbox_state(homes[0], peer)
    assert after == before == ([], 0, 0)
    # written elsewhere, the same export works and the peer takes in all 300 events
    ok = tmp_path / "to-b.cbor"
    assert json.loads(cli("--home", homes[0], "mailbox", "export", "--peer", ids[1]["site_id"], "--out", ok,
                          env=env).stdout)["events"] == 300
    cli("--home", homes[1], "peer", "add", "--site-id", ids[0]["site_id"], "--public-key", ids[0]["public_key"], env=env)
    assert json.loads(cli("--home", homes[1], "mailbox", "import", ok, env=env).stdout)["applied"] == 300


# ---------------------------------------------------------------- the cursor moves on the peer's answer
def _cursor(node, peer) -> int:
    from agent.store import sync_state as st
    return st.cursor(node.conn, peer.site_id, "mailbox")[0]


def _events_in(path: Path) -> list[bytes]:
    return list(cbor2.loads(path.read_bytes())["events"])


def test_a_lost_file_is_offered_again(tmp_path):
    """Export advanced the cursor when the file was written, so a file lost on the
    way was never offered again on the mailbox path."""
    from agent.sync import SyncDriver
    from .helpers import NOW, mesh
    a, b = mesh(tmp_path, 2)
    da, dbb = SyncDriver(a), SyncDriver(b)
    ids = [a.write("app.readings", {"device": "a", "seq": i}, {"temp": 1.0}, now=NOW + i) for i in range(3)]
    f1, f2 = tmp_path / "f1", tmp_path / "f2"
    assert da.export_mailbox(b.site_id, f1)["events"] == 3
    f1.unlink()  # lost on the way
    assert _cursor(a, b) == 0
    assert da.export_mailbox(b.site_id, f2)["events"] == 3  # offered again
    assert dbb.import_mailbox(f2.read_bytes(), NOW + 10)["applied"] == 3
    assert {e for e, in b.conn.execute("SELECT event_id FROM events")} >= set(ids)


def test_rejected_events_are_offered_again_until_the_peer_answers_past_them(tmp_path):
    """A receiver whose clock is behind rejects (clock_skew) what is too far ahead; its answer,
    carried back in its next file, says how far it processed (stopping before the first rejected
    event), and the sender's cursor moves exactly that far: the rest is offered again."""
    from agent.sync import SyncDriver
    from .helpers import NOW, mesh
    a, b = mesh(tmp_path, 2)
    da, dbb = SyncDriver(a), SyncDriver(b)
    early = [a.write("app.readings", {"device": "a", "seq": i}, {"temp": 1.0}, now=NOW + i) for i in range(2)]
    late = [a.write("app.readings", {"device": "a", "seq": i}, {"temp": 2.0}, now=NOW + 600_000 + i) for i in (2, 3)]
    f = [tmp_path / f"f{i}" for i in range(8)]
    da.export_mailbox(b.site_id, f[0])
    res = dbb.import_mailbox(f[0].read_bytes(), NOW + 1_000)  # b's clock is 10 minutes behind a's
    assert res["applied"] == 2 and res["rejected"] == 2
    assert _cursor(a, b) == 0  # a file cannot answer: nothing moved yet
    dbb.export_mailbox(a.site_id, f[1])  # b's next file carries its answer to f0
    res = da.import_mailbox(f[1].read_bytes(), NOW + 600_010)
    seq = {bytes(e): s for e, s in a.conn.execute("SELECT event_id, seq FROM events")}
    assert _cursor(a, b) == seq[early[-1]]  # up to the event before the first rejected one
    assert res["acknowledged"] == {"bodies": 1, "events": 2, "relayed": 0}
    da.export_mailbox(b.site_id, f[2])
    assert [bytes(x) for x in _events_in(f[2])] and len(_events_in(f[2])) == 2  # the rejected two, again
    assert dbb.import_mailbox(f[2].read_bytes(), NOW + 600_100)["applied"] == 2  # b's clock is right now
    dbb.export_mailbox(a.site_id, f[3])
    da.import_mailbox(f[3].read_bytes(), NOW + 600_200)
    assert _cursor(a, b) == max(seq[e] for e in late)
    assert da.export_mailbox(b.site_id, f[4])["events"] == 0  # everything answered for
    # an answer travels in every file until it is superseded; a repeat moves nothing back
    dbb.export_mailbox(a.site_id, f[5])
    da.import_mailbox(f[5].read_bytes(), NOW + 600_300)
    assert _cursor(a, b) == max(seq[e] for e in late)


def test_a_forged_or_misaddressed_answer_moves_nothing(tmp_path):
    from agent import mailbox
    from agent.core.messages import SyncBody, emit_body, parse_body
    from agent.sync import SyncDriver
    from .helpers import NOW, mesh
    a, b, c = mesh(tmp_path, 3)
    del SyncBody
    da, dbb, dc = SyncDriver(a), SyncDriver(b), SyncDriver(c)
    for i in range(3):
        a.write("app.readings", {"device": "a", "seq": i}, {"temp": 1.0}, now=NOW + i)
    f = [tmp_path / f"f{i}" for i in range(6)]
    da.export_mailbox(b.site_id, f[0])
    dbb.import_mailbox(f[0].read_bytes(), NOW + 100)
    dbb.export_mailbox(a.site_id, f[1])
    genuine = parse_body(f[1].read_bytes())
    acks = [r for r in genuine.records if mailbox.is_ack(r)]
    assert len(acks) == 1
    # 1. the ack, its signature broken (one byte of the payload changed): dropped and surfaced
    bad = bytearray(acks[0])
    bad[-70] ^= 1
    from agent.core.messages import SyncBody
    forged = SyncBody(b.site_id, genuine.have_max_hlc, (), (bytes(bad),), ())
    res = da.import_mailbox(emit_body(forged), NOW + 200)
    assert _cursor(a, b) == 0 and res["acknowledged"] == {"bodies": 0, "events": 0, "relayed": 0}
    assert a.conn.execute("SELECT count(*) FROM surfaced WHERE kind='record_dropped' AND detail LIKE '%mailbox-ack%'"
                          ).fetchone()[0] == 1
    # 2. b's answer seen by c (not its subject): nothing moves at c, c keeps it for a
    res = dc.import_mailbox(f[1].read_bytes(), NOW + 300)
    assert res["acknowledged"] == {"bodies": 0, "events": 0, "relayed": 1}
    assert _cursor(c, a) == 0 and _cursor(c, b) == 0
    # 3. c's file to a carries b's answer: it speaks for b (its issuer), never for c
    dc.export_mailbox(a.site_id, f[2])
    res = da.import_mailbox(f[2].read_bytes(), NOW + 400)
    assert res["acknowledged"]["bodies"] == 1 and _cursor(a, b) > 0 and _cursor(a, c) == 0
    # 4. the same answer again, in b's own file: that file was answered already, nothing moves
    moved = _cursor(a, b)
    res = da.import_mailbox(f[1].read_bytes(), NOW + 500)
    assert res["acknowledged"]["bodies"] == 0 and _cursor(a, b) == moved


def test_an_answer_released_before_a_crash_is_stored_on_open_and_leaves_the_journal(tmp_path):
    """Answer records are signed through the keystore bridge (persist-before-release). One the
    store lacks (a crash between release and store) is stored on the next open, and the journal
    then drops it like every other record the store holds: answers never pile up in the journal."""
    from agent import mailbox
    from agent.core.messages import parse_body
    from agent.sync import SyncDriver
    from .helpers import NOW, mesh
    a, b = mesh(tmp_path, 2)
    a.write("app.readings", {"device": "a", "seq": 1}, {"temp": 1.0}, now=NOW)
    f0, f1 = tmp_path / "f0", tmp_path / "f1"
    SyncDriver(a).export_mailbox(b.site_id, f0)
    SyncDriver(b).import_mailbox(f0.read_bytes(), NOW + 1)
    SyncDriver(b).export_mailbox(a.site_id, f1)
    (ack,) = [r for r in parse_body(f1.read_bytes()).records if mailbox.is_ack(r)]
    home = b.home
    b.close()  # the journal still holds the answer (it is compacted on the next open)
    assert ack in [raw for _i, raw in _journal(home)]
    with sqlite3.connect(home / "store.sqlite") as c:
        c.execute("DELETE FROM mailbox_acks")  # the store a crash between release and store leaves
    from agent.node import Node
    b = Node.open(home)
    try:
        assert [bytes(r) for (r,) in b.conn.execute("SELECT raw FROM mailbox_acks")] == [ack]
        assert ack not in [raw for _i, raw in b.bridge.iter_released()]  # held now: compacted
        assert b.conn.execute("SELECT count(*) FROM surfaced WHERE kind='record_dropped'").fetchone()[0] == 0
    finally:
        b.close()


def _journal(home):
    """The signing journal's released outputs, read without opening the node (opening compacts);
    sealed at rest, opened with the home's data keys."""
    from tests.atrest_helpers import journal_outputs
    return journal_outputs(home)


def test_answers_do_not_pile_up_in_the_signing_journal(tmp_path, monkeypatch):
    import agent.produce
    from agent.sync import SyncDriver
    # compaction on open runs past this size or after a recovery (docs/keystore.md): here, always
    monkeypatch.setattr(agent.produce, "JOURNAL_OPEN_COMPACT_BYTES", 0)
    from .helpers import NOW, mesh, reopen
    a, b = mesh(tmp_path, 2)
    for i in range(6):
        a.write("app.readings", {"device": "a", "seq": i}, {"temp": 1.0}, now=NOW + i)
        f, g = tmp_path / f"a{i}", tmp_path / f"b{i}"
        SyncDriver(a).export_mailbox(b.site_id, f)
        SyncDriver(b).import_mailbox(f.read_bytes(), NOW + 10 + i)
        SyncDriver(b).export_mailbox(a.site_id, g)
        SyncDriver(a).import_mailbox(g.read_bytes(), NOW + 20 + i)
    b = reopen(b)
    assert list(b.bridge.iter_released()) == []  # every answer b signed is held by its store
    # the next export (an answer that changed) keeps the newest four; the others left the journal
    a.write("app.readings", {"device": "a", "seq": 99}, {"temp": 1.0}, now=NOW + 99)
    SyncDriver(a).export_mailbox(b.site_id, tmp_path / "a99")
    SyncDriver(b).import_mailbox((tmp_path / "a99").read_bytes(), NOW + 100)
    SyncDriver(b).export_mailbox(a.site_id, tmp_path / "b99")
    assert b.conn.execute("SELECT count(*) FROM mailbox_acks").fetchone()[0] == 4
    b = reopen(b)
    assert list(b.bridge.iter_released()) == []
    assert b.conn.execute("SELECT count(*) FROM mailbox_acks").fetchone()[0] == 4
    assert b.conn.execute("SELECT count(*) FROM surfaced WHERE kind='record_dropped'").fetchone()[0] == 0


def test_a_ring_of_files_moves_every_cursor(tmp_path):
    """Files go only round a ring (a -> b -> c -> a), as a courier's round trip does: b's answer to
    a's file reaches a through c's file (the answer is b's signature, whoever carries it), so every
    cursor moves and the files stop re-offering what was answered."""
    from agent.sync import SyncDriver
    from .helpers import NOW, mesh
    nodes = mesh(tmp_path, 3)
    drv = [SyncDriver(n) for n in nodes]
    for k, n in enumerate(nodes):
        for i in range(5):
            n.write("app.readings", {"device": f"d{k}", "seq": i}, {"temp": float(i)}, now=NOW + i)
    t = NOW + 100
    for rnd in range(4):
        for k in range(3):
            src, dst = k, (k + 1) % 3
            f = tmp_path / f"r{rnd}-{src}-{dst}"
            drv[src].export_mailbox(nodes[dst].site_id, f)
            t += 10
            drv[dst].import_mailbox(f.read_bytes(), t)
    ids = [{bytes(e) for (e,) in n.conn.execute("SELECT event_id FROM events")} for n in nodes]
    assert ids[0] == ids[1] == ids[2] and len(ids[0]) == 15
    for k, n in enumerate(nodes):
        nxt = nodes[(k + 1) % 3]
        top = n.conn.execute("SELECT max(seq) FROM events").fetchone()[0]
        assert _cursor(n, nxt) == top  # every event in k's log answered for by the next node
        assert drv[k].export_mailbox(nxt.site_id, tmp_path / f"last-{k}")["events"] == 0


def test_a_file_from_a_stranger_is_owed_no_answer(tmp_path):
    """A well-formed file from a site this node does not trust (a stranger, another mesh) is
    imported (docs/cli.md `mailbox import`: exit 0, its events dropped), but owes no answer: nothing is signed
    for it and no file carries an answer to it."""
    from agent import mailbox
    from agent.core.messages import parse_body
    from agent.sync import SyncDriver
    from .helpers import NOW, mesh
    a, b = mesh(tmp_path, 2)
    (stranger,) = mesh(tmp_path / "other", 1)
    stranger.write("app.readings", {"device": "s", "seq": 1}, {"temp": 1.0}, now=NOW)
    f = tmp_path / "from-stranger"
    SyncDriver(stranger).export_mailbox(a.site_id, f)
    res = SyncDriver(a).import_mailbox(f.read_bytes(), NOW + 1)
    # an unknown kid is rejected, not dropped (a vouch may still admit it); not applied
    assert (res["rejected"], res["applied"]) == (1, 0)
    assert a.conn.execute("SELECT count(*) FROM mailbox_owed").fetchone()[0] == 0
    g = tmp_path / "a-to-b"
    SyncDriver(a).export_mailbox(b.site_id, g)
    assert [r for r in parse_body(g.read_bytes()).records if mailbox.is_ack(r)] == []
