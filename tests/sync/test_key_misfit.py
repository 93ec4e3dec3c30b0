"""A row key that does not fit its table names the column (docs/apply.md): `write` says which key
column and why, and a peer's event dropped as `row_key_type` or `row_key_columns` carries the
column in its surfaced detail (`ssp-agent events`). The reason codes stay what they are."""
from __future__ import annotations

import json
import time

from agent.simpeer import SimPeer, manifest_text, readings_table
from tests.cli_cmd import run_cli

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")
T = "app.readings"


def _home(tmp_path, peers=()):
    m = tmp_path / "m.toml"
    m.write_text(manifest_text(MESH, readings_table(None), list(peers)))
    assert run_cli("--home", tmp_path / "h", "init", "--manifest", m).returncode == 0
    return tmp_path / "h"


def test_write_names_the_key_column_that_does_not_fit(tmp_path):
    home = _home(tmp_path)
    p = run_cli("--home", home, "write", T, "--key", '{"device": "d", "seq": "1"}', "--set", '{"temp": 1.0}')
    assert p.returncode == 2 and "key column seq is integer" in p.stderr and "'1'" in p.stderr, p.stderr
    p = run_cli("--home", home, "write", T, "--key", '{"device": null, "seq": 1}', "--set", '{"temp": 1.0}')
    assert p.returncode == 2 and "key column device" in p.stderr and "null" in p.stderr, p.stderr
    p = run_cli("--home", home, "write", T, "--key", '{"device": "d"}', "--set", '{"temp": 1.0}')
    assert p.returncode == 2 and "missing seq" in p.stderr, p.stderr
    p = run_cli("--home", home, "write", T, "--key", '{"device": "d", "seq": 1, "x": 2}', "--set", '{"temp": 1.0}')
    assert p.returncode == 2 and "not key columns: 'x'" in p.stderr, p.stderr


def test_a_dropped_peer_event_names_the_key_column(tmp_path):
    peer = SimPeer(MESH)
    home = _home(tmp_path, [peer])
    now = int(time.time() * 1000)
    body = tmp_path / "b.cbor"
    body.write_bytes(peer.body([peer.event(T, {"device": "p", "seq": "1"}, {"temp": 1.0}, (now, 0)),
                                peer.event(T, {"device": "p"}, {"temp": 1.0}, (now, 1))]))
    p = run_cli("--home", home, "mailbox", "import", body)
    assert p.returncode == 0, p.stderr
    rows = [json.loads(x) for x in run_cli("--home", home, "events").stdout.splitlines()]
    by = {r["reason"]: r for r in rows if r["reason"] in ("row_key_type", "row_key_columns")}
    assert by["row_key_type"]["detail"]["column"] == "seq", by
    assert by["row_key_columns"]["detail"]["missing"] == ["seq"], by
