"""Manifest and table-schema input defects (probe r01, r06): names SQLite treats as one (it folds
ASCII case) and tables wider than SQLite allows passed validation and failed inside SQLite (exit
1, a traceback, and a half-made home); wrong shapes and deep nesting gave Python tracebacks.
Every one is now a ManifestError (exit 2, one line) raised before anything is made."""
from __future__ import annotations

import json

import pytest

from agent.core.schema import MAX_COLUMNS, ManifestError, parse_manifest, table_def_from
from tests.cli_cmd import run_cli

MESH = "00112233445566778899aabbccddeeff"
GOOD = f'''mesh_id = "{MESH}"

[[tables]]
schema = "app"
name = "readings"
category = "syncable"
key = ["device", "seq"]
columns = {{ device = "text", seq = "integer", temp = "real" }}
'''


def _wide(n: int) -> str:
    cols = ", ".join(f'c{i} = "text"' for i in range(n - 1))
    return (f'mesh_id = "{MESH}"\n[[tables]]\nschema = "app"\nname = "w"\ncategory = "syncable"\n'
            f'key = ["k"]\ncolumns = {{ k = "text", {cols} }}\n')


def _refused(text: str, *words: str) -> str:
    with pytest.raises(ManifestError) as e:
        parse_manifest(text)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, msg
    return msg


# ------------------------------------------------------------------ names SQLite folds to one
def test_columns_differing_only_in_case_are_refused():
    _refused(GOOD.replace('temp = "real"', 'temp = "real", TEMP = "text"'), "TEMP", "temp")


def test_tables_differing_only_in_case_are_refused():
    second = GOOD.split("\n", 1)[1].replace('name = "readings"', 'name = "READINGS"')
    _refused(GOOD + second, "READINGS")
    other_schema = GOOD.split("\n", 1)[1].replace('schema = "app"', 'schema = "APP"')
    _refused(GOOD + other_schema, "APP")


def test_a_schema_spelled_in_two_cases_is_refused():
    other = GOOD.split("\n", 1)[1].replace('schema = "app"', 'schema = "App"').replace('"readings"', '"other"')
    _refused(GOOD + other, "App", "app")


def test_table_def_from_checks_against_existing_tables():
    spec = {"schema": "APP", "name": "readings", "key": ["k"], "columns": {"k": "text"}}
    existing = [table_def_from({"schema": "app", "name": "readings", "key": ["k"], "columns": {"k": "text"}})]
    with pytest.raises(ManifestError, match="readings"):
        table_def_from(spec, existing)
    with pytest.raises(ManifestError, match="App"):
        table_def_from({**spec, "schema": "App", "name": "other"}, existing)
    assert table_def_from({**spec, "schema": "app", "name": "other"}, existing).qualified == "app.other"


# ------------------------------------------------------------------ width
def test_the_column_limit():
    assert 2 * MAX_COLUMNS + 4 < 2000   # the store's own columns included (agent/store/rows.py)
    assert len(parse_manifest(_wide(MAX_COLUMNS)).tables[0].columns) == MAX_COLUMNS
    _refused(_wide(MAX_COLUMNS + 1), str(MAX_COLUMNS))
    _refused(_wide(3000), str(MAX_COLUMNS))


def test_a_table_at_the_column_limit_works(tmp_path):
    """The widest table accepted is one SQLite takes: made, written, read, evolved no further."""
    from agent.node import Node, NodeError
    node, _ = Node.init(tmp_path / "h", _wide(MAX_COLUMNS), {"kind": "software"})
    try:
        node.write("app.w", {"k": "a"}, {f"c{i}": "x" for i in range(MAX_COLUMNS - 1)}, now=1_790_000_000_000)
        assert len(node.dump()["app.w"][0]["values"]) == MAX_COLUMNS - 1
        with pytest.raises(NodeError, match=str(MAX_COLUMNS)):
            node.add_column("app.w", "extra", "text")
    finally:
        node.close()


# ------------------------------------------------------------------ wrong shapes
SHAPES = [
    ('tables = "x"', "tables"),
    ("tables = [1, 2]", "tables"),
    ("tables = [[1]]", "tables"),
    ("tables = {a = 1}", "tables"),
    ('peers = "x"', "peers"),
    ("peers = [1]", "peers"),
    ('peers = ["x"]', "peers"),
    ('authorities = "x"', "authorities"),
    ("authorities = {a = 1}", "authorities"),
    ("authorities = [1]", "authorit"),
    ("mesh_id = 5", "mesh_id"),
    ('[[tables]]\nschema = "app"\nname = "t"\nkey = "k"\ncolumns = { k = "text" }', "key"),
    ('[[tables]]\nschema = "app"\nname = "t"\nkey = ["k"]\ncolumns = [1]', "columns"),
    ('[[tables]]\nschema = "app"\nname = "t"\nkey = ["k"]\ncolumns = { k = ["text"] }', "k"),
    ('[[tables]]\nschema = "app"\nname = "t"\nkey = ["k"]\ncolumns = { k = { a = 1 } }', "k"),
    ('[[tables]]\nschema = "app"\nname = "t"\ncategory = ["x"]\nkey = ["k"]\ncolumns = { k = "text" }', "category"),
    ('[[tables]]\nschema = "app"\nname = "t"\nkey = ["k"]\ncolumns = { k = "text" }\nretention = 5', "retention"),
    ('[[tables]]\nschema = 5\nname = "t"\nkey = ["k"]\ncolumns = { k = "text" }', "schema"),
    ('[[peers]]\nsite_id = 5\npublic_key = "x"', "site_id"),
    ('[[peers]]\nsite_id = "00112233445566778899aabbccddeeff"\npublic_key = ' + '"' + "ab" * 32 + '"'
     + '\nretired_after = 5', "HLC"),
]


@pytest.mark.parametrize("line,word", SHAPES)
def test_wrong_shapes_are_refused_naming_the_key(line, word):
    if line.startswith("mesh_id"):
        text = line + "\n"
    elif line.startswith("[["):
        text = f'mesh_id = "{MESH}"\n' + line + "\n"
    else:
        text = f'mesh_id = "{MESH}"\n' + line + "\n"
    _refused(text, word)


def test_table_def_from_refuses_a_spec_that_is_not_a_table():
    for spec in (1, "x", [1], None):
        with pytest.raises(ManifestError, match="table"):
            table_def_from(spec)


def test_deep_nesting_is_refused():
    _refused(f'mesh_id = "{MESH}"\nx = ' + "[" * 3000 + "]" * 3000 + "\n", "manifest")
    _refused(f'mesh_id = "{MESH}"\nx = ' + "{a = " * 3000 + "1" + "}" * 3000 + "\n", "manifest")


# ------------------------------------------------------------------ through the command
def _cli(home, *args):
    return run_cli("--home", home, *args)


def _one_line_refusal(p):
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_init_refuses_before_making_anything_and_the_home_stays_usable(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text(GOOD)
    bads = {"dupcase": GOOD.replace('temp = "real"', 'temp = "real", TEMP = "text"'), "wide": _wide(3000),
            "shape": f'mesh_id = "{MESH}"\ntables = "x"\n',
            "deep": f'mesh_id = "{MESH}"\nx = ' + "[" * 3000 + "]" * 3000 + "\n"}
    h = tmp_path / "h"
    for name, text in bads.items():
        f = tmp_path / f"{name}.toml"
        f.write_text(text)
        _one_line_refusal(_cli(h, "init", "--manifest", f))
        assert not h.exists() or list(h.iterdir()) == [], (name, list(h.iterdir()))
    p = _cli(h, "init", "--manifest", good)
    assert p.returncode == 0, p.stderr
    assert _cli(h, "status").returncode == 0


def test_live_home_schema_changes_that_sqlite_would_refuse_are_refused(tmp_path):
    good = tmp_path / "good.toml"
    good.write_text(GOOD)
    h = tmp_path / "h"
    assert _cli(h, "init", "--manifest", good).returncode == 0
    before = _cli(h, "dump").stdout
    _one_line_refusal(_cli(h, "table", "add-column", "app.readings", "--column", "TEMP", "--type", "real"))
    spec = {"schema": "app", "name": "READINGS", "category": "syncable", "key": ["k"], "columns": {"k": "text"}}
    _one_line_refusal(_cli(h, "table", "create", "--spec", json.dumps(spec)))
    _one_line_refusal(_cli(h, "table", "create", "--spec", json.dumps({**spec, "schema": "APP", "name": "readings"})))
    _one_line_refusal(_cli(h, "table", "create", "--spec", json.dumps({**spec, "schema": "APP", "name": "other"})))
    wide = {**spec, "name": "wide", "columns": {"k": "text", **{f"c{i}": "text" for i in range(1100)}}}
    _one_line_refusal(_cli(h, "table", "create", "--spec", json.dumps(wide)))
    assert _cli(h, "dump").stdout == before
    ok = _cli(h, "table", "create", "--spec", json.dumps({**spec, "name": "other"}))
    assert ok.returncode == 0, ok.stderr


def test_a_misspelt_key_of_a_table_is_refused_not_ignored():
    """`retension = "raw"` was ignored: the table kept no retention class, so eviction treated
    its history otherwise than the manifest's author meant, without a word."""
    with pytest.raises(ManifestError, match="retension"):
        parse_manifest(GOOD + 'retension = "raw"\n')
    with pytest.raises(ManifestError, match="colums"):
        table_def_from({"schema": "app", "name": "x", "key": ["k"], "columns": {"k": "text"}, "colums": {}})
