"""The layout versions of the sequencer's state (HOME/sequencer.db) and of a member's Commit queue
(HOME/commit-queue.db): agent/sequencer/layout.py, docs/sequencer.md "State".

- A file written by a newer release (user_version = latest + 1) is refused by the real CLI with
  exit 1 and a message naming both versions, and is byte for byte what it was (read-only opens
  beside a running `sequencer run` included).
- A file as the release before versioning wrote it (user_version 0, its tables; built here from
  that release's DDL, copied below so later layout changes cannot alter it) opens as version 1
  with its rows and tables unchanged.
- A new file gets the latest version; version 1 is exactly the released layout.
- A version-1 Commit queue with rows migrates to version 2 keeping them (followed groups, gossip
  outbox filled from them).
- A version-2 Commit queue as the release before version 3 wrote it migrates to version 3 keeping
  every row (its retained receipts by group, the prunable events indexed); a read-only open of it
  never migrates.
- A step that fails or is killed half-way leaves the previous version and nothing of the step.
"""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from agent.sequencer import layout
from agent.sequencer.commit_queue import CommitQueue
from agent.sequencer.framing import encode_private_message
from agent.sequencer.store import Store
from tests.cli_cmd import agent_cmd, agent_env

ROOT = Path(__file__).resolve().parents[2]
G = "a7" * 16

# The DDL of the release before versioning (agent/sequencer/store.py and client.py SCHEMA at
# 16b3ab7), run by that release with executescript on every open. Fixtures: never edit.
RELEASED_STATE_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS groups (
  group_id BLOB PRIMARY KEY, current_epoch INTEGER NOT NULL, head_epoch INTEGER, head_hash BLOB,
  origin TEXT NOT NULL, failed_closed INTEGER NOT NULL DEFAULT 0, migrated INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS pending (
  group_id BLOB NOT NULL, epoch INTEGER NOT NULL, commit_hash BLOB NOT NULL, message BLOB NOT NULL,
  bootstrap INTEGER NOT NULL, PRIMARY KEY (group_id, epoch));
CREATE TABLE IF NOT EXISTS receipts (
  group_id BLOB NOT NULL, epoch INTEGER NOT NULL, commit_hash BLOB NOT NULL, receipt BLOB NOT NULL,
  receipt_hash BLOB NOT NULL, message BLOB, PRIMARY KEY (group_id, epoch));
CREATE TABLE IF NOT EXISTS discontinuities (
  group_id BLOB NOT NULL, epoch INTEGER NOT NULL, commit_hash BLOB, message BLOB, cause TEXT NOT NULL,
  PRIMARY KEY (group_id, epoch));
CREATE TABLE IF NOT EXISTS statements (
  group_id BLOB NOT NULL, epoch INTEGER NOT NULL, statement BLOB NOT NULL, PRIMARY KEY (group_id, epoch));
CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, detail TEXT NOT NULL);
"""

RELEASED_QUEUE_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS commits (
  commit_hash BLOB PRIMARY KEY, group_id BLOB NOT NULL, epoch INTEGER NOT NULL, message BLOB NOT NULL,
  state TEXT NOT NULL, reason TEXT, receipt BLOB, queued_seq INTEGER NOT NULL, submissions INTEGER NOT NULL DEFAULT 0);
CREATE UNIQUE INDEX IF NOT EXISTS one_outstanding ON commits (group_id) WHERE state = 'queued';
CREATE TABLE IF NOT EXISTS events (seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, detail TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS heads (
  group_id BLOB NOT NULL, epoch INTEGER NOT NULL, receipt BLOB NOT NULL, PRIMARY KEY (group_id, epoch, receipt));
CREATE TABLE IF NOT EXISTS gaps (group_id BLOB NOT NULL, epoch INTEGER NOT NULL, PRIMARY KEY (group_id, epoch));
CREATE TABLE IF NOT EXISTS statements (
  group_id BLOB NOT NULL, epoch INTEGER NOT NULL, statement BLOB NOT NULL, PRIMARY KEY (group_id, epoch, statement));
CREATE TABLE IF NOT EXISTS gossiped (hash BLOB PRIMARY KEY);
CREATE TABLE IF NOT EXISTS unsettled (
  receipt BLOB PRIMARY KEY, group_id BLOB NOT NULL, epoch INTEGER NOT NULL, verdict TEXT NOT NULL, signer BLOB NOT NULL);
"""


def agent(home, *args, check=None):
    p = subprocess.run([*agent_cmd(), "--home", str(home), *args], capture_output=True, text=True,
                       env=agent_env(), timeout=300)
    if check is not None:
        assert p.returncode == check, (args, p.returncode, p.stdout, p.stderr)
    return p


def commit_file(tmp_path, name: str, epoch: int, tag: bytes, gid: str = G) -> str:
    f = tmp_path / name
    f.write_bytes(encode_private_message(bytes.fromhex(gid), epoch, ciphertext=tag))
    return str(f)


def user_version(path) -> int:
    c = sqlite3.connect(path)
    try:
        return c.execute("PRAGMA user_version").fetchone()[0]
    finally:
        c.close()


def set_user_version(path, v: int) -> None:
    c = sqlite3.connect(path, isolation_level=None)
    c.execute(f"PRAGMA user_version = {v}")
    c.close()


def layout_of(path) -> set[tuple[str, str, str]]:
    """Every table, index and trigger with its DDL (whitespace normalised)."""
    c = sqlite3.connect(path)
    try:
        return {(t, n, " ".join((s or "").split())) for t, n, s in
                c.execute("SELECT type, name, sql FROM sqlite_master WHERE name NOT LIKE 'sqlite_%'")}
    finally:
        c.close()


def rows_of(path) -> dict[str, list]:
    c = sqlite3.connect(path)
    try:
        tables = [t for (t,) in c.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name")]
        return {t: c.execute(f"SELECT * FROM {t} ORDER BY rowid").fetchall() for t in tables}
    finally:
        c.close()


def released_file(path, ddl: str, rows: dict[str, list[tuple]]) -> None:
    """A file as the release before versioning left it: WAL, executescript of its DDL, no version."""
    c = sqlite3.connect(str(path), isolation_level=None)
    c.execute("PRAGMA journal_mode=WAL")
    c.executescript(ddl)
    for table, items in rows.items():
        for r in items:
            c.execute(f"INSERT INTO {table} VALUES ({', '.join('?' * len(r))})", r)
    assert c.execute("PRAGMA user_version").fetchone()[0] == 0
    c.close()


def assert_refused_newer(p, what: str, latest: int) -> None:
    assert p.returncode == 1, (p.returncode, p.stdout, p.stderr)
    assert f"{what}" in p.stderr and \
        f"layout version {latest + 1}, newer than this agent understands ({latest})" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr, p.stderr


# -- a newer release's file is refused, and left as it was -----------------------------------------
def test_a_state_file_from_a_newer_release_is_refused_by_sequencer_status_and_left_byte_identical(tmp_path):
    import fcntl
    home = tmp_path / "seq"
    agent(home, "sequencer", "init", check=0)
    agent(home, "sequencer", "register", "--group", G, "--epoch", "2", check=0)
    db = home / "sequencer.db"
    newer = layout.STATE.latest + 1
    set_user_version(db, newer)
    before = db.read_bytes()
    for verb in (("status",), ("register", "--group", "b8" * 8, "--epoch", "0"),
                 ("receipt", "--group", G, "--epoch", "2")):
        p = agent(home, "sequencer", *verb)
        assert_refused_newer(p, "sequencer state", layout.STATE.latest)
        assert db.read_bytes() == before, verb
    # beside a running `sequencer run` (which holds run.lock exclusively) `status` reads read-only:
    # it never migrates, and refuses the newer file all the same
    fd = os.open(str(home / "run.lock"), os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for verb in (("status",), ("receipt", "--group", G, "--epoch", "2")):
            p = agent(home, "sequencer", *verb)
            assert_refused_newer(p, "sequencer state", layout.STATE.latest)
            assert db.read_bytes() == before, verb
    finally:
        os.close(fd)
    assert user_version(db) == newer


def test_a_commit_queue_from_a_newer_release_is_refused_by_the_commits_verbs_and_left_byte_identical(tmp_path):
    member = tmp_path / "m"
    agent(member, "commits", "queue", commit_file(tmp_path, "c0", 0, b"a"), check=0)
    db = member / "commit-queue.db"
    newer = layout.QUEUE.latest + 1
    set_user_version(db, newer)
    before = db.read_bytes()
    for verb in (("commits", "status"), ("commits", "queue", commit_file(tmp_path, "c1", 0, b"b", "b8" * 8)),
                 ("commits", "send", "--broker", "mqtt://127.0.0.1:1", "--timeout", "1"),
                 ("sequencing", "gossip", "--from-queue")):
        p = agent(member, *verb)
        assert_refused_newer(p, "Commit queue", layout.QUEUE.latest)
        assert db.read_bytes() == before, verb
    assert user_version(db) == newer


# -- the release before versioning: version 1, rows and tables as they were ---------------------------
def test_a_state_file_of_the_release_before_versioning_opens_as_version_1_and_keeps_its_rows(tmp_path):
    home = tmp_path / "seq"
    agent(home, "sequencer", "init", check=0)
    db = home / "sequencer.db"
    meta = rows_of(db)["meta"]
    gid = bytes.fromhex(G)
    receipt = b"\xd2\x84exact receipt bytes"
    db.unlink()
    released_file(db, RELEASED_STATE_SCHEMA, {
        "meta": meta,
        "groups": [(gid, 8, 7, b"\x11" * 32, "registered", 0, 0)],
        "receipts": [(gid, 7, b"\x22" * 32, receipt, b"\x11" * 32, b"commit")],
        "events": [(1, "registered", json.dumps({"group": G}))]})
    tables, rows = layout_of(db), rows_of(db)
    st = json.loads(agent(home, "sequencer", "status", check=0).stdout)
    assert [(g["group"], g["current_epoch"], g["head"]["epoch"]) for g in st["groups"]] == [(G, 8, 7)]
    got = json.loads(agent(home, "sequencer", "receipt", "--group", G, "--epoch", "7", check=0).stdout)
    assert got == {"receipt": receipt.hex()}
    # the first writing open took it to the latest version (layout.py STATE_V2 adds the empty table
    # of retired groups, STATE_V3 that of held groups): every version-1 table and row as it was
    assert user_version(db) == layout.STATE.latest == 3
    now = rows_of(db)
    assert now.pop("retired") == [] and now.pop("held") == [] and now == rows
    assert layout_of(db) - tables == {("table", "retired", "CREATE TABLE retired (group_id BLOB PRIMARY KEY, "
                                                     "outcome TEXT NOT NULL)"),
                                      ("table", "held", "CREATE TABLE held (group_id BLOB PRIMARY KEY, "
                                                  "reason TEXT NOT NULL, detail TEXT NOT NULL)")}
    assert tables <= layout_of(db)
    ro = Store(db, readonly=True)
    try:
        assert layout.version(ro.conn, layout.STATE) == 3
    finally:
        ro.close()
    agent(home, "sequencer", "register", "--group", "c9" * 8, "--epoch", "0", check=0)
    assert user_version(db) == 3


def test_a_read_only_open_of_the_release_before_versioning_writes_nothing(tmp_path):
    db = tmp_path / "sequencer.db"
    released_file(db, RELEASED_STATE_SCHEMA, {"groups": [(bytes.fromhex(G), 3, None, None, "bootstrap", 0, 0)]})
    before = db.read_bytes()
    ro = Store(db, readonly=True)
    try:
        assert layout.version(ro.conn, layout.STATE) == 1
        assert ro.group(bytes.fromhex(G)).current_epoch == 3
    finally:
        ro.close()
    assert db.read_bytes() == before and user_version(db) == 0


def test_a_commit_queue_of_the_release_before_versioning_opens_as_version_1_and_keeps_its_rows(tmp_path):
    member = tmp_path / "m"
    member.mkdir()
    db = member / "commit-queue.db"
    msg = encode_private_message(bytes.fromhex(G), 4, ciphertext=b"q")
    from agent.sequencer import receipts
    ch = receipts.commit_hash(msg)
    released_file(db, RELEASED_QUEUE_SCHEMA, {
        "meta": [("member_id", "0123456789abcdef")],
        "commits": [(ch, bytes.fromhex(G), 4, msg, "queued", None, None, 1, 2)],
        "heads": [(bytes.fromhex(G), 3, b"\xd2head")],
        "events": [(1, "queued", json.dumps({"commit_hash": ch.hex()}))]})
    tables, rows = layout_of(db), rows_of(db)
    st = json.loads(agent(member, "commits", "status", check=0).stdout)
    assert st["member_id"] == "0123456789abcdef"
    assert [(c["commit_hash"], c["state"], c["submissions"]) for c in st["commits"]] == [(ch.hex(), "queued", 2)]
    # version 1's tables and rows exactly as they were; the later steps only add (the queue is at
    # version 2: test_a_version_1_commit_queue_with_rows_migrates_to_2_keeping_them)
    assert user_version(db) == layout.QUEUE.latest
    assert tables <= layout_of(db) and {t: r for t, r in rows_of(db).items() if t in rows} == rows
    # one outstanding per group still holds (the released unique index is the one in use)
    p = agent(member, "commits", "queue", commit_file(tmp_path, "c5", 4, b"other"), check=2)
    assert "already has a Commit outstanding" in p.stderr


@pytest.mark.parametrize("stamped", [0, 1])
def test_a_version_1_commit_queue_with_rows_migrates_to_2_keeping_them(tmp_path, stamped):
    """Version 2 (layout.py QUEUE_V2): the queue order indexed, the followed groups, the gossip
    outbox. A version-1 file (as the release before versioning left it, user_version 0, or as
    the versioned release did, 1) keeps every row; `followed` gets its groups and the outbox
    exactly what version 1 would have handed to gossip next, in its order."""
    from agent.sequencer import receipts
    from agent.sequencer.commit_queue import ACCEPTED
    db = tmp_path / "commit-queue.db"
    g, h = bytes.fromhex(G), bytes.fromhex("b8" * 16)
    ca, cb, cc = (encode_private_message(gid, ep, ciphertext=t) for gid, ep, t in ((g, 3, b"a"), (g, 4, b"b"),
                                                                                   (h, 0, b"c")))
    ra, rw, rh1, st = b"\xd2receipt a", b"\xd2receipt w", b"\xd2head h1", b"\xd2statement g5"
    ha, hb, hc = (receipts.commit_hash(m) for m in (ca, cb, cc))
    released_file(db, RELEASED_QUEUE_SCHEMA, {
        "meta": [("member_id", "0123456789abcdef")],
        "commits": [(ha, g, 3, ca, "accepted", None, ra, 1, 1), (hb, g, 4, cb, "queued", None, None, 2, 3),
                    (hc, h, 0, cc, "lost", "stale_epoch", rw, 3, 1)],
        "heads": [(g, 3, ra), (h, 0, rw), (h, 1, rh1)],
        "statements": [(g, 5, st)],
        "gossiped": [(receipts.receipt_hash(rw),)],
        "events": [(1, "accepted", json.dumps({"commit_hash": ha.hex(), "reason": None}))]})
    set_user_version(db, stamped)
    tables, rows = layout_of(db), rows_of(db)
    q = CommitQueue(db)
    try:
        assert user_version(db) == layout.QUEUE.latest      # 2, then 3 (below)
        assert tables <= layout_of(db) and {t: r for t, r in rows_of(db).items() if t in rows} == rows
        assert q.member_id == "0123456789abcdef"
        assert q.groups() == [g, h]
        # rw was handed over already; ra is an outcome and a head: once
        assert q.ungossiped() == [ra, rh1, st]
        assert [(e.commit_hash, e.state, e.submissions) for e in q.outstanding()] == [(hb, "queued", 3)]
        with pytest.raises(Exception, match="already has a Commit outstanding"):
            q.enqueue(encode_private_message(g, 4, ciphertext=b"other"))
        # the queue goes on where version 1 left it
        nxt = q.enqueue(encode_private_message(h, 1, ciphertext=b"d"))
        assert [e.commit_hash for e in q.entries()] == [ha, hb, hc, nxt.commit_hash]
        q.settle(nxt.commit_hash, ACCEPTED, None, b"\xd2receipt d")
        q.mark_gossiped([ra, rh1])
        assert q.ungossiped() == [st, b"\xd2receipt d"]
    finally:
        q.close()


# Version 2 of the queue as its release wrote it (layout.py QUEUE_V2 after QUEUE_V1, at a9a08f2).
# Fixture: never edit.
RELEASED_QUEUE_V2 = """
CREATE INDEX commits_in_order ON commits (queued_seq);
CREATE INDEX queued_in_order ON commits (queued_seq) WHERE state = 'queued';
CREATE TABLE followed (group_id BLOB PRIMARY KEY);
INSERT INTO followed SELECT DISTINCT group_id FROM commits;
CREATE TABLE outbox (seq INTEGER PRIMARY KEY, hash BLOB NOT NULL UNIQUE, raw BLOB NOT NULL);
PRAGMA user_version = 2;
"""


def released_v2_queue(db, rows: dict[str, list[tuple]]) -> None:
    released_file(db, RELEASED_QUEUE_SCHEMA, rows)
    c = sqlite3.connect(str(db), isolation_level=None)
    c.executescript(RELEASED_QUEUE_V2)
    c.close()
    assert user_version(db) == 2


def test_a_version_2_commit_queue_migrates_to_3_keeping_every_row_and_a_read_only_open_does_not(tmp_path):
    """Version 3 (layout.py QUEUE_V3): the retained receipts by group with the binding state they
    were last looked at under (unsettled_groups, filled from `unsettled`: never looked at yet), and
    the prunable events indexed. A version-2 file keeps every row; the first recheck looks at every
    retained receipt once, the next at none; the first event added prunes the routine ones to the
    retention and keeps every attribution record."""
    from agent.sequencer import answers, client, commit_queue, receipts, serve
    from tests.sequencer.test_member import RogueSequencer
    db = tmp_path / "commit-queue.db"
    g, h = bytes.fromhex(G), bytes.fromhex("b8" * 16)
    s1, s2 = RogueSequencer(), RogueSequencer()
    held = [s1.sign(e, b"g%d" % e, None, gid=g) for e in range(3)]
    attributed = [s1.sign(e, b"h%d" % e, None, gid=h) for e in range(2)]
    msg = encode_private_message(g, 7, ciphertext=b"q")
    ch = receipts.commit_hash(msg)
    events = [(i + 1, "gossiped", json.dumps({"receipts": 1, "via": "node"})) for i in range(1100)]
    events += [(1101 + i, "receipt_attributed", json.dumps({"receipt": r.hex()})) for i, r in enumerate(attributed)]
    released_v2_queue(db, {
        "meta": [("member_id", "0123456789abcdef")],
        "commits": [(ch, g, 7, msg, "queued", "binding_unresolved", None, 1, 4)],
        "unsettled": [(r, g, e, "held", s1.kid) for e, r in enumerate(held)] +
                     [(r, h, e, "attributed", s1.kid) for e, r in enumerate(attributed)],
        "events": events})
    tables, rows = layout_of(db), rows_of(db)
    before = db.read_bytes()
    # a read-only open (as `sequencer status` opens its file) never migrates, and reads it
    ro = layout.open_file(db, layout.QUEUE, readonly=True)
    try:
        assert layout.version(ro, layout.QUEUE) == 2
        assert ro.execute("SELECT count(*) FROM unsettled").fetchone()[0] == 5
    finally:
        ro.close()
    assert db.read_bytes() == before and user_version(db) == 2
    q = CommitQueue(db)
    try:
        assert user_version(db) == 3
        assert tables <= layout_of(db) and {t: r for t, r in rows_of(db).items() if t in rows} == rows
        assert q.unsettled_groups() == sorted([(g, None), (h, None)])
        assert [e.commit_hash for e in q.outstanding()] == [ch]
        looked = []

        def signer_for(gid, epoch):
            looked.append(gid)
            return answers.Signer(s2.kid) if gid == h else answers.Signer(None, unresolved=True)
        c = client.CommitClient(q, serve.BrokerSettings.from_url("mqtt://127.0.0.1:1"), signer_for=signer_for,
                                binding_state=lambda gid: b"h:s2" if gid == h else b"g:none")
        try:
            c.recheck()
            assert sorted(looked) == sorted([g] * 3 + [h] * 2)
            looked.clear()
            c.recheck()
            assert looked == []
        finally:
            c.client.loop_stop()
        assert sorted(q.unsettled()) == sorted([(r, "held") for r in held] + [(r, "attributed") for r in attributed])
        q.record_event("gossiped", {"receipts": 1, "via": "node"})
        kinds = [e["kind"] for e in q.events()]
        assert kinds.count("gossiped") == commit_queue.EVENTS_KEPT and kinds.count("receipt_attributed") == 2
        assert q.events()[-1]["seq"] == 1103
    finally:
        q.close()


def test_a_development_layout_is_not_taken_for_version_1(tmp_path):
    """A file with the marker table but not the released columns (groups without `migrated`, as
    a development build before the hand-off wrote it) is refused, unchanged, not stamped 1."""
    db = tmp_path / "sequencer.db"
    released_file(db, RELEASED_STATE_SCHEMA.replace(", migrated INTEGER NOT NULL DEFAULT 0", ""), {})
    before = layout_of(db)
    with pytest.raises(layout.LayoutError, match="groups are not the version-1 layout"):
        Store(db)
    assert user_version(db) == 0 and layout_of(db) == before


# -- a new file --------------------------------------------------------------------------------------
def test_new_files_get_the_latest_version(tmp_path):
    home, member = tmp_path / "seq", tmp_path / "m"
    agent(home, "sequencer", "init", check=0)
    assert user_version(home / "sequencer.db") == layout.STATE.latest
    agent(member, "commits", "queue", commit_file(tmp_path, "c0", 0, b"a"), check=0)
    assert user_version(member / "commit-queue.db") == layout.QUEUE.latest


def test_version_1_is_exactly_the_released_layout(tmp_path, monkeypatch):
    monkeypatch.setattr(layout.STATE, "steps", layout.STATE.steps[:1])
    monkeypatch.setattr(layout.QUEUE, "steps", layout.QUEUE.steps[:1])
    Store(tmp_path / "new-state.db").close()
    CommitQueue(tmp_path / "new-queue.db").close()
    released_file(tmp_path / "old-state.db", RELEASED_STATE_SCHEMA, {})
    released_file(tmp_path / "old-queue.db", RELEASED_QUEUE_SCHEMA, {})
    assert layout_of(tmp_path / "new-state.db") == layout_of(tmp_path / "old-state.db")
    assert layout_of(tmp_path / "new-queue.db") == layout_of(tmp_path / "old-queue.db")
    assert user_version(tmp_path / "new-state.db") == user_version(tmp_path / "new-queue.db") == 1


# -- one step, one transaction (a test of the runner: the step lists are replaced) ----------------------
def _extra_step(conn):
    conn.execute("CREATE TABLE extra (x INTEGER)")
    conn.execute("INSERT INTO extra VALUES (1)")
    conn.execute("DELETE FROM events")


@pytest.mark.parametrize("which", ["state", "queue"])
def test_a_step_that_fails_leaves_the_previous_version_and_nothing_of_the_step(tmp_path, monkeypatch, which):
    lay, opener = (layout.STATE, Store) if which == "state" else (layout.QUEUE, CommitQueue)
    path = tmp_path / f"{which}.db"
    first = opener(path)
    first.record_event("before", {"n": 1})
    first.close()
    rows = rows_of(path)
    v = lay.latest

    def failing(conn):
        _extra_step(conn)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(lay, "steps", [*lay.steps, (v + 1, "a step that fails", failing)])
    with pytest.raises(OSError, match="No space left"):
        opener(path)
    assert user_version(path) == v and "extra" not in {n for _t, n, _s in layout_of(path)} and rows_of(path) == rows
    # the step in full on the next open
    monkeypatch.setattr(lay, "steps", [*lay.steps[:-1], (v + 1, "the step", _extra_step)])
    opener(path).close()
    assert user_version(path) == v + 1 and rows_of(path)["extra"] == [(1,)] and rows_of(path)["events"] == []
    # a read-only open never migrates: one more step known, the file stays at v + 1
    if which == "state":
        more = (v + 2, "another", lambda c: c.execute("CREATE TABLE more (y)"))
        monkeypatch.setattr(lay, "steps", [*lay.steps, more])
        before = path.read_bytes()
        Store(path, readonly=True).close()
        assert user_version(path) == v + 1 and path.read_bytes() == before
        monkeypatch.setattr(lay, "steps", lay.steps[:-1])
    # and this agent, which knows only v, refuses the file now, writing nothing
    monkeypatch.setattr(lay, "steps", lay.steps[:-1])
    before = path.read_bytes()
    newer = f"layout version {v + 1}, newer than this agent understands \\({v}\\)"
    with pytest.raises(layout.LayoutError, match=newer):
        opener(path)
    if which == "state":
        with pytest.raises(layout.LayoutError, match=f"layout version {v + 1}"):
            Store(path, readonly=True)
    assert path.read_bytes() == before


KILLED_IN_A_STEP = """
import os, signal, sys
from agent.sequencer import layout
from agent.sequencer.store import Store
lay = layout.STATE

def step(conn):
    conn.execute("CREATE TABLE extra (x INTEGER)")
    conn.execute("INSERT INTO extra VALUES (1)")
    conn.execute("DELETE FROM groups")
    os.kill(os.getpid(), signal.SIGKILL)

lay.steps = [*lay.steps, (lay.latest + 1, "killed half-way", step)]
Store(sys.argv[1])
"""


def test_a_step_killed_half_way_leaves_the_previous_version(tmp_path):
    path = tmp_path / "sequencer.db"
    s = Store(path)
    from agent.sequencer.core import GroupState
    s.register(GroupState(bytes.fromhex(G), 5, None, "registered"))
    s.close()
    rows = rows_of(path)
    p = subprocess.run([sys.executable, "-c", KILLED_IN_A_STEP, str(path)], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=str(ROOT), timeout=120)
    assert p.returncode == -signal.SIGKILL, (p.returncode, p.stderr)
    s = Store(path)
    try:
        assert layout.version(s.conn, layout.STATE) == layout.STATE.latest
        assert s.group(bytes.fromhex(G)).current_epoch == 5
    finally:
        s.close()
    assert "extra" not in {n for _t, n, _s in layout_of(path)} and rows_of(path) == rows


def test_a_forwarded_verb_whose_arguments_fail_exits_with_its_code_not_a_traceback(tmp_path):
    """`sequencing gossip` reads its receipts (and the queue) before it knows whether an agent
    runs on the home: a refusal there exits 2, a fault 1, each one line (the queue case above)."""
    p = agent(tmp_path / "m", "sequencing", "gossip", "zz-neither-file-nor-hex")
    assert p.returncode == 2 and "neither a file nor hex" in p.stderr and "Traceback" not in p.stderr, p.stderr
