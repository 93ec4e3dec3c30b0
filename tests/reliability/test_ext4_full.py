"""A full disk on real small ext4 filesystems (docs/reliability.md "Full disk"), through the real
CLI. On 1 KiB blocks SQLite's WAL index (store.sqlite-shm), grown sparsely and then mapped, killed
writes and read verbs by SIGBUS with a few KiB free. Every verb must succeed or fail with one line
(exit 1), never die by a signal; tools/full_disk.py runs every figure from 0 to 64 KiB."""
from __future__ import annotations

import time

import nacl.signing
import pytest

from agent.simpeer import SimPeer, manifest_text, readings_table

from .ext4img import cli, ext4, leave_free, unavailable, verbs_at

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
