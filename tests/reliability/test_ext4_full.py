"""A full disk on real small ext4 filesystems (docs/reliability.md "Full disk"), through the real
CLI. On 1 KiB blocks SQLite's WAL index (store.sqlite-shm), grown sparsely and then mapped, killed
writes and read verbs by SIGBUS with a few KiB free. Every verb must succeed or fail with one line
(exit 1), never die by a signal; tools/full_disk.py runs every figure from 0 to 64 KiB."""
from __future__ import annotations

import time

import nacl.signing
import pytest

from agent.simpeer import SimPeer, manifest_text, readings_table

from .ext4img import cli, ext4, leave_free, seq_verbs_at, unavailable, verbs_at, verdict

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")
T = "app.readings"
FREE_KIB = (0, 4, 16, 64)   # a handful here; tools/full_disk.py runs 0..64

pytestmark = pytest.mark.skipif(unavailable() is not None, reason=unavailable() or "")


def peer() -> SimPeer:
    return SimPeer(MESH, bytes(range(16, 32)), nacl.signing.SigningKey(bytes(32)))


def body(p: SimPeer, seqs, age_ms: int, note: int = 200) -> bytes:
    now = time.time_ns() // 1_000_000
    return p.body([p.event(T, {"device": "peer", "seq": s}, {"temp": s + 0.5, "note": "x" * note},
                           (now - age_ms + s, 0)) for s in seqs])


def make_home(fs, tmp_path, retention: str | None = "telemetry"):
    home = fs / "h"
    mf = tmp_path / "m.toml"
    mf.write_text(manifest_text(MESH, readings_table(retention=retention), [peer()]))
    p = cli(home, "init", "--manifest", mf)
    assert p.returncode == 0, p.stderr
    for i in range(3):
        assert cli(home, "write", T, "--key", f'{{"device": "d", "seq": {i}}}', "--set", '{"temp": 1.5}'
                   ).returncode == 0
    return home


@pytest.mark.parametrize("block", [1024, 4096])
def test_no_verb_dies_by_a_signal_with_a_few_kib_free(tmp_path, block):
    with ext4(tmp_path, "48M", block) as fs:
        home = make_home(fs, tmp_path)
        f = tmp_path / "b.ssp"
        f.write_bytes(body(peer(), range(20), 1000))
        bad = {}
        for i, kib in enumerate(FREE_KIB):
            for verb, what in verbs_at(fs, home, kib * 1024, f, 100 + i).items():
                if what is not None:
                    bad[(kib, verb)] = what
        assert bad == {}, bad
        # space back: the verbs work
        assert cli(home, "write", T, "--key", '{"device": "d", "seq": 999}', "--set", '{"temp": 1.5}'
                   ).returncode == 0
        assert cli(home, "status").returncode == 0


DAY_MS = 86_400_000


def full_home_with_store(fs, tmp_path, store_mb: int):
    """A node on `fs` holding about `store_mb` MB of a peer's events eight days old (the profile's
    eviction takes them) and one of now, its own writes, and a second node (B, off `fs`) both trust; then `fs`
    filled to the last block. (home, B's home, A's own event ids)."""
    from agent.mailbox import read_file
    from agent.node import Node
    from agent.sync import import_mailbox_body
    sim = peer()
    mf = manifest_text(MESH, readings_table(retention="telemetry"), [sim])
    b, _ = Node.init(tmp_path / "b", mf, {"kind": "software"})
    a, _ = Node.init(fs / "h", mf, {"kind": "software"})
    try:
        a.add_peer(b.site_id, b.keyring[b.site_id][0], None)
        b.add_peer(a.site_id, a.keyring[a.site_id][0], None)
        own = a.write_many([(T, {"device": "a", "seq": i}, {"temp": 0.5}, False) for i in range(5)])
        n, step = store_mb * 400, 500       # about 2.5 KB of store per event of this size
        for start in range(0, n, step):
            f = tmp_path / "old.ssp"
            f.write_bytes(body(sim, range(start, min(n, start + step)), 8 * DAY_MS, note=800))
            assert import_mailbox_body(a, read_file(f))["applied"] == min(step, n - start)
        assert a.store_bytes() >= store_mb * 10**6
        f.write_bytes(body(sim, [n], 10_000))   # the peer's clock now: eviction's evidence of time
        assert import_mailbox_body(a, read_file(f))["applied"] == 1
    finally:
        a.close()
        b.close()
    leave_free(fs, 0)
    return fs / "h", tmp_path / "b", own


@pytest.mark.parametrize("store_mb", [1, 8])
def test_run_on_a_full_disk_evicts_from_the_reserve_and_syncs_again(tmp_path, broker, store_mb):
    """`run` exited 1 at once on a full disk (its open wrote), so the shipped unit restarted it
    every 10 s and its eviction job never ran; the reserve (4 MiB) was too small for one eviction
    transaction of a store past it. Now it starts, evicts in batches, and a write through it reaches B."""
    import json
    import signal
    import subprocess
    from tests.cli_cmd import agent_cmd, agent_env

    def start(home):
        return subprocess.Popen([*agent_cmd(), "--home", str(home), "run", "--broker", broker.url, "--cadence", "0.3"],
                                env=agent_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def serving(home, proc):
        q = cli(home, "status")
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        return q.returncode == 0 and "run" in json.loads(q.stdout)

    with ext4(tmp_path / "img", f"{store_mb * 3 + 24}M", 1024) as fs:
        home, hb, own = full_home_with_store(fs, tmp_path, store_mb)
        pr, pb = start(home), start(hb)
        try:
            deadline = time.monotonic() + 600      # a hang, not a speed: the eviction takes seconds
            while not (serving(home, pr) and serving(hb, pb)):   # both serve the CLI (HOME/control.sock)
                assert time.monotonic() < deadline, "run never served"
                time.sleep(0.5)
            while True:
                assert pr.poll() is None, pr.communicate()[1][-3000:]
                assert time.monotonic() < deadline, "run never became writable again"
                p = cli(home, "write", T, "--key", '{"device": "a", "seq": 100}', "--set", '{"temp": 2.5}')
                if p.returncode == 0:
                    break
                assert p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1, p.stderr
                time.sleep(1)
            written = p.stdout.strip()
            st = json.loads(cli(home, "status").stdout)
            assert st["events"] == len(own) + 2, st   # the peer's old events went, its fresh one stays
            # B, running beside it, receives the write made after the disk filled
            while True:
                got = {r["key"]["seq"] for r in json.loads(cli(hb, "dump").stdout)[T] if r["key"]["device"] == "a"}
                if 100 in got:
                    break
                assert time.monotonic() < deadline, got
                time.sleep(0.5)
            log = {json.loads(x)["event_id"] for x in cli(home, "log").stdout.splitlines()}
            assert {e.hex() for e in own} | {written} <= log          # nothing of its own lost
        finally:
            for proc in (pr, pb):
                proc.send_signal(signal.SIGTERM)
            out, err = pr.communicate(timeout=120)
            pb.communicate(timeout=120)
        assert pr.returncode == 0, err[-3000:]
        assert "the disk is full: run uses" in err


def test_evict_auto_on_a_full_disk_frees_a_store_larger_than_the_reserve(tmp_path):
    """`evict --auto` freed a 3.7 MB store on a full disk but failed every try at 7.3 MB: one
    transaction's WAL did not fit in the 4 MiB reserve. It deletes in batches now."""
    import json
    with ext4(tmp_path / "img", "48M", 1024) as fs:
        home, _, own = full_home_with_store(fs, tmp_path, 8)
        p = cli(home, "evict", "--auto")
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["tables"][T]["events_deleted"] == 8 * 400
        log = {json.loads(x)["event_id"] for x in cli(home, "log").stdout.splitlines()}
        assert {e.hex() for e in own} <= log and len(log) == len(own) + 1     # and the peer's fresh one


def test_inodes_exhausted_say_so(tmp_path):
    """With no inode left (the blocks free), every verb said "check the permissions". A write
    says the filesystem has no inode left; the read verbs work."""
    from .ext4img import exhaust_inodes
    with ext4(tmp_path / "img", "24M", 1024, inodes=256) as fs:
        home = make_home(fs, tmp_path)
        many = exhaust_inodes(fs)
        p = cli(home, "write", T, "--key", '{"device": "d", "seq": 50}', "--set", '{"temp": 1.5}')
        assert verdict(p) is None and p.returncode == 1, p.stderr
        assert "inode" in p.stderr and "permissions" not in p.stderr, p.stderr
        for verb in ("status", "dump", "events"):
            q = cli(home, verb)
            assert q.returncode == 0, (verb, q.stderr)
        import shutil
        shutil.rmtree(many)
        assert cli(home, "write", T, "--key", '{"device": "d", "seq": 50}', "--set", '{"temp": 1.5}').returncode == 0


@pytest.mark.parametrize("block", [1024, 4096])
def test_no_sequencer_verb_dies_by_a_signal_with_a_few_kib_free(tmp_path, broker, block):
    """The sequencer's home on a small full ext4: each verb succeeds, refuses `disk_full`, or fails
    with one line (exit 1); none dies by a signal (its state and journal are SQLite and mmap too)."""
    from agent.sequencer.framing import encode_private_message
    with ext4(tmp_path / "img", "48M", block) as fs:
        home = fs / "seq"
        assert cli(home, "sequencer", "init").returncode == 0
        f = tmp_path / "c0"
        for epoch in range(3):
            f.write_bytes(encode_private_message(bytes.fromhex("ab" * 16), epoch))
            assert cli(home, "sequencer", "submit", f).returncode == 0
        bad = {}
        for i, kib in enumerate(FREE_KIB):
            for verb, what in seq_verbs_at(fs, home, kib * 1024, tmp_path, 1 + i, broker.url).items():
                if what is not None:
                    bad[(kib, verb)] = what
        assert bad == {}, bad
        f.write_bytes(encode_private_message(bytes.fromhex("ab" * 16), 3))   # space back: served
        assert cli(home, "sequencer", "submit", f).returncode == 0
