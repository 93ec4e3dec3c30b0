"""Upgrades: the store's layout version (PRAGMA user_version) is read on every
open; a writing open runs the forward-only migrations (agent/store/migrations.py), each in one
transaction; a read view writes nothing; a store written by a newer agent is refused (exit 1).

The previous release's home is built here: a node initialised by the command under test, then
its store taken back to the first release's layout (tests/lifecycle/fixtures/store_v1.sql, the
DDL of agent/store/db.py at 45c23df): every table, index and trigger added since dropped, the
views in their old form, no user_version. The test checks that layout against the fixture before
opening it with the current code."""
from __future__ import annotations

import json
import sqlite3
import subprocess
from pathlib import Path

import pytest

from agent.simpeer import readings_table
from agent.store import migrations
from tests.cli_cmd import agent_cmd, agent_env

MESH = "00112233445566778899aabbccddeeff"
V1_SQL = Path(__file__).parent / "fixtures" / "store_v1.sql"


def cli(tmp, home, *args):
    return subprocess.run([*agent_cmd(), "--home", str(home), *map(str, args)], capture_output=True, text=True,
                          env=agent_env({"SSP_AGENT_WITNESS_DIR": str(tmp / "witness")}), timeout=120)


def _layout(conn, names=None):
    """{name: normalised sql} of the tables, indexes and triggers (not the per-table row storage)."""
    rows = conn.execute("SELECT name, sql FROM sqlite_master WHERE type IN ('table','index','trigger') "
                        "AND sql IS NOT NULL AND name NOT LIKE '\\_ssp\\_rows.%' ESCAPE '\\' "
                        "AND name != 'sqlite_sequence'").fetchall()
    return {n: " ".join(s.split()) for n, s in rows if names is None or n in names}


def _v1_layout():
    c = sqlite3.connect(":memory:")
    c.executescript(V1_SQL.read_text())
    return _layout(c)


def _old_view(conn, qualified, cols):
    conn.execute(f'DROP VIEW "{qualified}"')
    conn.execute(f'CREATE VIEW "{qualified}" AS SELECT {", ".join(chr(34) + c + chr(34) for c in cols)} '
                 f'FROM "_ssp_rows.{qualified}" WHERE _ex = 1')


def make_v1_home(tmp: Path) -> Path:
    home = tmp / "old"
    man = tmp / "m.toml"
    man.write_text(f'mesh_id = "{MESH}"\n' + readings_table(None))
    assert cli(tmp, home, "init", "--manifest", man).returncode == 0
    for seq in (1, 2):
        p = cli(tmp, home, "write", "app.readings", "--key", json.dumps({"device": "d1", "seq": seq}),
                "--set", json.dumps({"temp": 20.0 + seq}))
        assert p.returncode == 0, p.stderr
    from tests.atrest_helpers import downgrade_to_clear
    downgrade_to_clear(home)   # the first release stored its log and journal outputs in clear
    v1 = _v1_layout()
    conn = sqlite3.connect(home / "store.sqlite", isolation_level=None)
    conn.execute("BEGIN")
    for typ in ("trigger", "index", "table"):
        for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type=? AND sql IS NOT NULL", (typ,)).fetchall():
            if name not in v1 and not name.startswith("_ssp_rows.") and name != "sqlite_sequence":
                conn.execute(f'DROP {typ.upper()} "{name}"')
    tdef = json.loads(conn.execute("SELECT key_json FROM tables WHERE qualified='app.readings'").fetchone()[0])
    vals = list(json.loads(conn.execute("SELECT columns_json FROM tables WHERE qualified='app.readings'"
                                        ).fetchone()[0]))
    _old_view(conn, "app.readings", tdef + [c for c in vals if c not in tdef])
    conn.execute("DELETE FROM meta WHERE key NOT IN ('site_id','mesh_id','public_key','authorities','profile',"
                 "'keystore','machine','clock_ceiling')")
    conn.execute("INSERT OR REPLACE INTO meta VALUES ('schema_version', 1)")
    conn.execute("COMMIT")
    conn.execute("PRAGMA user_version = 0")
    assert _layout(conn) == v1, "the home must have exactly the first release's layout"
    conn.close()
    return home


def _version(home):
    c = sqlite3.connect(home / "store.sqlite")
    try:
        return c.execute("PRAGMA user_version").fetchone()[0], _layout(c)
    finally:
        c.close()


def test_a_previous_release_home_migrates_on_the_first_writing_open(tmp_path):
    home = make_v1_home(tmp_path)
    p = cli(tmp_path, home, "write", "app.readings", "--key", '{"device": "d1", "seq": 3}', "--set", '{"temp": 1.5}')
    assert p.returncode == 0, p.stderr
    version, layout = _version(home)
    assert version == migrations.LATEST
    for name in ("held_counts", "surfaced_bound", "sync_cursors", "policy_rows", "control_records",
                 "truncation_records", "reoffer", "counters"):
        assert name in layout, name
    dump = json.loads(cli(tmp_path, home, "dump").stdout)["app.readings"]
    assert [(r["key"]["seq"], r["values"]["temp"]) for r in dump] == [(1, 21.0), (2, 22.0), (3, 1.5)]
    # The migration made the default policy (a fresh mesh syncs) and counted nothing held.
    pol = [json.loads(x) for x in cli(tmp_path, home, "policy", "list").stdout.splitlines() if x.strip()]
    assert {"peer": "*", "table": "app.*", "layer": "system", "role": None, "effect": "allow"} in pol
    st = cli(tmp_path, home, "status")
    assert st.returncode == 0, st.stderr
    assert json.loads(st.stdout)["store_schema"] == {"version": migrations.LATEST, "agent": migrations.LATEST}
    # The log's count (layout 7) counted the two events the old home held, then the write's.
    assert json.loads(st.stdout)["events"] == 3
    assert "log_count" in layout


def test_a_read_view_of_a_previous_release_home_writes_nothing(tmp_path):
    home = make_v1_home(tmp_path)
    before = _version(home)
    for verb in ("dump", "log", "status"):
        p = cli(tmp_path, home, verb)
        assert p.returncode == 0, p.stderr   # the older layout is read as it is
    assert json.loads(cli(tmp_path, home, "dump").stdout)["app.readings"][1]["values"] == {"temp": 22.0}
    assert _version(home) == before


def test_a_store_from_a_newer_agent_is_refused(tmp_path):
    home = make_v1_home(tmp_path)
    assert cli(tmp_path, home, "write", "app.readings", "--key", '{"device": "d1", "seq": 3}',
               "--set", '{"temp": 1.5}').returncode == 0
    c = sqlite3.connect(home / "store.sqlite")
    c.execute(f"PRAGMA user_version = {migrations.LATEST + 1}")
    n_events = c.execute("SELECT count(*) FROM events").fetchone()[0]
    c.close()
    for args in (("write", "app.readings", "--key", '{"device": "d1", "seq": 4}', "--set", '{"temp": 1.0}'),
                 ("dump",), ("status",), ("sync", "--broker", "mqtt://127.0.0.1:1", "--once")):
        p = cli(tmp_path, home, *args)
        assert p.returncode == 1, (args, p.stdout, p.stderr)
        assert f"layout version {migrations.LATEST + 1}, newer than this agent" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr
    c = sqlite3.connect(home / "store.sqlite")
    assert c.execute("PRAGMA user_version").fetchone()[0] == migrations.LATEST + 1
    assert c.execute("SELECT count(*) FROM events").fetchone()[0] == n_events
    c.close()


def test_each_migration_is_one_transaction(tmp_path, monkeypatch):
    """A step that fails half-way leaves the store at the previous version with nothing of the
    step in it; the next open runs it again in full."""
    home = make_v1_home(tmp_path)
    path = home / "store.sqlite"
    real = migrations.MIGRATIONS[1][2]

    def failing(conn):
        real(conn)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(migrations, "MIGRATIONS", [migrations.MIGRATIONS[0], (2, "v2", failing)])
    conn = sqlite3.connect(path, isolation_level=None)
    with pytest.raises(OSError):
        migrations.migrate(conn, path)
    assert migrations.store_version(conn) == 1
    assert "sync_cursors" not in _layout(conn) and "held_counts" not in _layout(conn)
    monkeypatch.undo()
    assert migrations.migrate(conn, path) == list(range(2, migrations.LATEST + 1)) and migrations.store_version(conn) == migrations.LATEST
    assert migrations.migrate(conn, path) == []
    conn.close()


def test_a_new_store_is_made_by_the_migrations(tmp_path):
    man = tmp_path / "m.toml"
    man.write_text(f'mesh_id = "{MESH}"\n' + readings_table(None))
    assert cli(tmp_path, tmp_path / "h", "init", "--manifest", man).returncode == 0
    version, layout = _version(tmp_path / "h")
    assert version == migrations.LATEST and "truncation_records" in layout


def test_a_refused_open_does_not_migrate(tmp_path):
    """An open refused for its identity (a home from another machine) leaves the older layout as
    it was: the migrations run only once the node may open."""
    home = make_v1_home(tmp_path)
    c = sqlite3.connect(home / "store.sqlite")
    c.execute("UPDATE meta SET value = 'another-machine' WHERE key = 'machine'")
    c.commit()
    c.close()
    before = _version(home)
    p = cli(tmp_path, home, "write", "app.readings", "--key", '{"device": "d1", "seq": 3}', "--set", '{"temp": 1.5}')
    assert p.returncode == 2 and "another machine" in p.stderr, p.stderr
    assert _version(home) == before
