"""Superseded values in the store's free space (docs/reliability.md "At rest",
"Superseded values"). The log is sealed, but the materialized tables are clear by design: the
current value is the application's data, a value it has overwritten or deleted is not, and must
not stay readable in the raw files of the home (a pulled card) once the node has checkpointed it.

Two ways an old value stays: in the SQLite file's free space (a freed cell or overflow page that
is not zeroed: SQLite's own default, secure_delete off, which distributions such as Debian change
at compile time and others do not), and in the WAL file, whose old frames outlive the
checkpoints SQLite runs by itself (they are overwritten in place, never truncated)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from agent.node import Node
from agent.simpeer import SimPeer, manifest_text, readings_table

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")
T = "app.readings"
ROOT = Path(__file__).resolve().parents[2]

# A build whose SQLite was compiled without SQLITE_SECURE_DELETE (SQLite's own default): every new
# connection starts with secure_delete off. Interposed on sqlite3_open_v2, which Python's sqlite3
# module calls for every connection.
_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
typedef struct sqlite3 sqlite3;
int sqlite3_open_v2(const char *name, sqlite3 **db, int flags, const char *vfs) {
    static int (*real_open)(const char *, sqlite3 **, int, const char *);
    static int (*real_exec)(sqlite3 *, const char *, void *, void *, char **);
    if (!real_open) {
        /* the sqlite3 extension module loads libsqlite3 with RTLD_LOCAL: look it up by name */
        void *lib = dlopen("libsqlite3.so.0", RTLD_LAZY | RTLD_NOLOAD);
        if (!lib)
            lib = dlopen("libsqlite3.so.0", RTLD_LAZY);
        real_open = dlsym(lib, "sqlite3_open_v2");
        real_exec = dlsym(lib, "sqlite3_exec");
    }
    int rc = real_open(name, db, flags, vfs);
    if (rc == 0 && *db)
        real_exec(*db, "PRAGMA secure_delete=0", 0, 0, 0);
    return rc;
}
"""

_CHILD = r"""
import json, sqlite3, sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from agent.node import Node
from agent.profile import load_profile
from agent.simpeer import SimPeer, manifest_text, readings_table
prof = load_profile(None)
if sys.argv[2] != "default":
    from dataclasses import replace
    prof = replace(prof, secure_delete=sys.argv[2])
mesh = bytes.fromhex("00112233445566778899aabbccddeeff")
home = Path(sys.argv[1])
node, _ = Node.init(home, manifest_text(mesh, readings_table(), [SimPeer(mesh)]), {"kind": "software"}, prof)
T = "app.readings"
# a long value (it spills to overflow pages) then a short one over it, and one deleted
node.write(T, {"device": "d", "seq": 1}, {"temp": 1.0, "note": "z" * 6000 + "MARK-OVERWRITTEN-51c7"})
node.write(T, {"device": "d", "seq": 1}, {"temp": 2.0, "note": "now"})
node.write(T, {"device": "d", "seq": 2}, {"temp": 1.0, "note": "z" * 6000 + "MARK-DELETED-0e94"})
node.write_many([(T, {"device": "d", "seq": 2}, None, True)])
node.close()
print(json.dumps({"build_default": sqlite3.connect(":memory:").execute("PRAGMA secure_delete").fetchone()[0]}))
"""

MARKERS = {"overwritten": b"MARK-OVERWRITTEN-51c7", "deleted": b"MARK-DELETED-0e94"}


def _leaks(home: Path) -> list[str]:
    out = []
    for name in sorted(os.listdir(home)):
        p = home / name
        if p.is_file():
            data = p.read_bytes()
            out += [f"{what} in {name}" for what, m in MARKERS.items() if m in data]
    return out


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    if shutil.which("gcc") is None:
        pytest.fail("gcc is needed to build the test's LD_PRELOAD shim (apt-get install gcc)")
    d = tmp_path_factory.mktemp("shim")
    (d / "shim.c").write_text(_SHIM)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(d / "shim.so"), str(d / "shim.c"), "-ldl"],
                   check=True, capture_output=True)
    p = subprocess.run([sys.executable, "-c", "import sqlite3; print(sqlite3.connect(':memory:')"
                        ".execute('PRAGMA secure_delete').fetchone()[0])"], capture_output=True, text=True,
                       env=dict(os.environ, LD_PRELOAD=str(d / "shim.so")), timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "0", \
        ("the shim needs Python's sqlite3 linked to libsqlite3.so.0", p.returncode, p.stderr)
    return d / "shim.so"


def _run_child(home: Path, setting: str, shim: Path) -> dict:
    env = dict(os.environ, LD_PRELOAD=str(shim), PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _CHILD, str(home), setting, str(ROOT)], capture_output=True,
                       text=True, env=env, timeout=120, cwd=str(ROOT))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_overwritten_and_deleted_values_are_zeroed_whatever_the_sqlite_build(tmp_path, shim):
    out = _run_child(tmp_path / "h", "default", shim)
    assert out["build_default"] == 0          # the shim stands for a build with secure_delete off
    assert _leaks(tmp_path / "h") == []


def test_the_profile_can_turn_zeroing_off_and_then_the_values_stay(tmp_path, shim):
    """The negative control: with `[store] secure_delete = "off"` (the cost saved, the trade-off
    taken) the same writes leave the deleted row's value in store.sqlite (its overflow pages are
    freed as they are; the overwritten one happened to be written over here): the grep above can fail."""
    _run_child(tmp_path / "h", "off", shim)
    assert "deleted in store.sqlite" in _leaks(tmp_path / "h")


def test_a_superseded_value_leaves_the_wal_after_an_automatic_checkpoint(tmp_path):
    """A running node (its connection held open, as `run` holds it): SQLite's own checkpoints
    (PASSIVE, every 1 000 pages) copy the WAL into the store but leave the WAL file as it is, so the
    frame holding the old value stayed there, overwritten only if the WAL grew past it again. With
    `journal_size_limit` 0 the WAL is truncated when it restarts, at the first commit after a
    complete checkpoint."""
    node, _ = Node.init(tmp_path / "h", manifest_text(MESH, readings_table(), [SimPeer(MESH)]), {"kind": "software"})
    try:
        node.write(T, {"device": "d", "seq": 1}, {"temp": 1.0, "note": "MARK-OVERWRITTEN-51c7"})
        node.write(T, {"device": "d", "seq": 1}, {"temp": 2.0, "note": "now"})
        busy, log, done = node.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        assert busy == 0 and log == done       # complete: every frame is in the store now
        node.write(T, {"device": "d", "seq": 2}, {"temp": 3.0})
        assert (tmp_path / "h" / "store.sqlite-wal").exists()
        assert _leaks(tmp_path / "h") == []
    finally:
        node.close()


def test_the_profile_setting_is_checked_and_reaches_the_nodes_connection(tmp_path):
    import dataclasses
    from agent.profile import ProfileError, load_profile, parse_profile
    base = 'name = "x"\n[store]\n'
    assert parse_profile(base).secure_delete == "on"
    assert parse_profile(base + 'secure_delete = "fast"\n').secure_delete == "fast"
    with pytest.raises(ProfileError, match="secure_delete"):
        parse_profile(base + 'secure_delete = "sometimes"\n')
    prof = dataclasses.replace(load_profile(None), secure_delete="fast")
    node, _ = Node.init(tmp_path / "h", manifest_text(MESH, readings_table(), [SimPeer(MESH)]), {"kind": "software"},
                        prof)
    try:
        assert node.conn.execute("PRAGMA secure_delete").fetchone()[0] == 2
        assert node.conn.execute("PRAGMA journal_size_limit").fetchone()[0] == 0
    finally:
        node.close()
    with Node.open(tmp_path / "h") as again:     # the profile is the node's (kept in its store)
        assert again.conn.execute("PRAGMA secure_delete").fetchone()[0] == 2
