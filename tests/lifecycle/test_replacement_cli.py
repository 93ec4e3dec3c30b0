"""Replacing a device, end to end through the `ssp-agent` CLI and mailbox files (docs/operations.md):
three field nodes and a gateway; one node's hardware dies (its home is deleted); a new node is
initialised with a new identity, vouched by a standalone mesh authority, the old one retired with a
cutoff and its successor named; the records spread; the new node rehydrates from the gateway and
matches it, except for rows whose history reaches below its horizon, which are listed as partial
rebuilds; an event signed with the retired key above the cutoff is dropped everywhere."""
from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

from agent.simpeer import NOTES_TABLE, readings_table
from tests.cli_cmd import agent_cmd, agent_env

MESH = "00112233445566778899aabbccddeeff"
TABLES = readings_table("telemetry") + NOTES_TABLE


class Cli:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.env = agent_env({"SSP_AGENT_WITNESS_DIR": str(tmp / "witness")})
        self.cmd = agent_cmd()
        self.n = 0

    def __call__(self, home, *args, ok=True):
        p = subprocess.run([*self.cmd, "--home", str(home), *map(str, args)], capture_output=True, text=True,
                           env=self.env)
        if ok:
            assert p.returncode == 0, f"{args}: {p.stderr}"
        return p

    def j(self, home, *args):
        return json.loads(self(home, *args).stdout)

    def lines(self, home, *args):
        return [json.loads(x) for x in self(home, *args).stdout.splitlines() if x.strip()]

    def carry(self, src, dst, dst_id):
        self.n += 1
        f = self.tmp / f"m{self.n}.cbor"
        self(src, "mailbox", "export", "--peer", dst_id, "--out", f)
        return self.j(dst, "mailbox", "import", f)


def test_replace_a_dead_device_through_the_cli(tmp_path):
    cli = Cli(tmp_path)
    # --- provisioning: a standalone authority key exists before any node, so manifests name it
    auth_file = tmp_path / "authority"      # a directory: keystore, signing journal, card
    auth = cli.j(tmp_path / "unused", "authority", "create", "--out", auth_file)
    assert oct(auth_file.stat().st_mode & 0o777) == "0o700" and auth["keystore"] == "software"
    assert all(oct(f.stat().st_mode & 0o777) == "0o600" for f in (auth_file / "keystore").iterdir())
    assert "secret" not in (auth_file / "authority.json").read_text()
    man = tmp_path / "mesh.toml"
    man.write_text(f'mesh_id = "{MESH}"\nauthorities = ["{auth["site_id"]}"]\n'
                   f'[[peers]]\nsite_id = "{auth["site_id"]}"\npublic_key = "{auth["public_key"]}"\n' + TABLES)
    gw, n1, n2, n3 = (tmp_path / x for x in ("gw", "n1", "n2", "n3"))
    ids = {}
    ids[gw] = cli.j(gw, "init", "--manifest", man, "--profile", "gateway")
    for h in (n1, n2, n3):
        ids[h] = cli.j(h, "init", "--manifest", man, "--profile", "pi-zero-2w")
    # the authority vouches for every device (issued on the gateway, spread by the mesh)
    for h in (gw, n1, n2, n3):
        cli(gw, "record", "issue-vouch", "--subject", ids[h]["site_id"], "--public-key", ids[h]["public_key"],
            "--authority-key", auth_file)

    def sid(h):
        return ids[h]["site_id"]

    def round_trip(nodes):
        for h in nodes:
            cli.carry(gw, h, sid(h))
        for h in nodes:
            cli.carry(h, gw, sid(gw))
        for h in nodes:
            cli.carry(gw, h, sid(h))

    round_trip([n1, n2, n3])  # records out, nothing else yet
    # --- field history
    for i, h in enumerate((n1, n2, n3)):
        for s in range(4):
            cli(h, "write", "app.readings", "--key", json.dumps({"device": f"d{i}", "seq": s}),
                "--set", json.dumps({"temp": 20.0 + i + s / 10}))
    cli(n3, "write", "app.notes", "--key", '{"id": "site"}', "--set", '{"body": "written by n3"}')
    # row X: a value, a delete, then a concurrent write from another site that beats the tombstone
    x = json.dumps({"device": "dx", "seq": 0})
    cli(n1, "write", "app.readings", "--key", x, "--set", '{"temp": 1.0}')
    cli(n1, "write", "app.readings", "--key", x, "--delete")
    round_trip([n1, n2, n3])
    gw_dump = cli.j(gw, "dump")
    assert cli.j(n1, "dump") == cli.j(n2, "dump") == cli.j(n3, "dump") == gw_dump
    # n2 writes X again (this beats the tombstone); it stays on n2 until n2 next syncs (a cellular outage)
    cli(n2, "write", "app.readings", "--key", x, "--set", '{"temp": 5.0}')
    # --- n3's hardware dies. (A copy of its SD card is stolen first: used at the end.)
    stolen = tmp_path / "stolen"
    shutil.copytree(n3, stolen)
    shutil.rmtree(n3)
    # --- a new device: a new site_id and key at init, never the old identity
    n4 = tmp_path / "n4"
    ids[n4] = cli.j(n4, "init", "--manifest", man, "--profile", "pi-zero-2w")
    assert sid(n4) != ids[n3]["site_id"]
    # the operator vouches for it and retires n3 at the last HLC of n3 that the gateway holds
    cut = max((e["hlc"] for e in cli.lines(gw, "log") if e["site_id"] == ids[n3]["site_id"]),
              key=lambda h: tuple(map(int, h.split("."))))
    cli(gw, "record", "issue-vouch", "--subject", sid(n4), "--public-key", ids[n4]["public_key"],
        "--authority-key", auth_file)
    cli(gw, "record", "issue-retire", "--subject", ids[n3]["site_id"], "--retired-after", cut,
        "--successor", sid(n4), "--authority-key", auth_file)
    for h in (n1, n2):
        cli.carry(gw, h, sid(h))  # the records spread
    for h in (n1, n2):
        recs = cli.lines(h, "record", "list")
        assert {r["kind"] for r in recs if r["subject"] == ids[n3]["site_id"]} == {"vouch", "retire"}
    # --- the new device rehydrates from the gateway
    start = cli.j(n4, "rehydrate", "--from", sid(gw))
    assert start["generation"] == 0
    cli.carry(n4, gw, sid(gw))  # carries the self-signed rehydrate record
    served = cli.j(gw, "rehydrate", "--status")["serving"]
    assert [s["subject"] for s in served] == [sid(n4)]
    res = cli.carry(gw, n4, sid(n4))
    assert res["dropped"] == 0 and res["rejected"] == 0
    cli.carry(gw, n4, sid(n4))  # nothing more: caught up
    st4 = cli.j(n4, "rehydrate", "--status")["rehydrating"]
    assert st4["events_applied"] > 0 and st4["rows_received"] == sum(len(v) for v in gw_dump.values())
    assert st4["caught_up"] is True and st4["remaining"] == 0
    cli.carry(n4, gw, sid(gw))  # n4's answer to those files (in its next file) moves the gateway's cursor
    assert cli.j(gw, "rehydrate", "--status")["serving"][0]["remaining_events"] == 0
    assert cli.j(n4, "dump") == gw_dump
    # --- days later: n4's profile eviction raises its horizon above all of that history ...
    top = max((e["hlc"] for e in cli.lines(n2, "log")), key=lambda h: tuple(map(int, h.split("."))))
    horizon = f"{int(top.split('.')[0]) + 1}.0"  # above everything written so far, n2's late write included
    ev = cli.j(n4, "evict", "app.readings", "--horizon", horizon)
    assert ev["events_deleted"] > 0
    # ... new activity above the horizon, and n1 resurrects row X (its history lies below the horizon)
    cli(n1, "write", "app.readings", "--key", json.dumps({"device": "d0", "seq": 9}), "--set", '{"temp": 9.9}')
    cli(n1, "write", "app.readings", "--key", x, "--set", '{"note": "back"}')
    cli.carry(n2, gw, sid(gw))  # n2 is back online: its write of X reaches the gateway (it keeps everything)
    cli.carry(n1, gw, sid(gw))
    res = cli.carry(gw, n4, sid(n4))  # on n4 it lands below the horizon: counted applied, writes nothing
    assert res["rejected"] == 0 and res["dropped"] == 0
    gw_dump, n4_dump = cli.j(gw, "dump"), cli.j(n4, "dump")
    partial = [e for e in cli.lines(n4, "events") if e["kind"] == "partial_rebuild"]
    assert [p["detail"]["row_key"] for p in partial] == [{"device": "dx", "seq": 0}]
    assert partial[0]["detail"]["horizon"] == horizon
    listed = {json.dumps(p["detail"]["row_key"], sort_keys=True) for p in partial}

    def rows(d):
        return {(t, json.dumps(r["key"], sort_keys=True)): r["values"] for t, rs in d.items() for r in rs}
    g, m = rows(gw_dump), rows(n4_dump)
    assert g.keys() == m.keys()
    differ = {k for k in g if g[k] != m[k]}
    assert {k[1] for k in differ} == listed  # every difference is a listed partial rebuild
    assert g[("app.readings", json.dumps({"device": "dx", "seq": 0}))] == {"temp": 5.0, "note": "back"}
    assert m[("app.readings", json.dumps({"device": "dx", "seq": 0}))] == {"temp": None, "note": "back"}
    # --- the stolen card signs with the retired key, above the cutoff: dropped everywhere
    shutil.copytree(stolen, n3)  # the card is booted somewhere, at its original paths
    stolen = n3
    cli(stolen, "write", "app.notes", "--key", '{"id": "site"}', "--set", '{"body": "forged after retirement"}')
    forged = cli.lines(stolen, "log")[-1]
    assert tuple(map(int, forged["hlc"].split("."))) > tuple(map(int, cut.split(".")))
    for h in (gw, n1, n2, n4):
        res = cli.carry(stolen, h, sid(h))  # the card also re-sends n3's old, legitimate history
        mine = [e for e in res["events"] if e.get("event_id") == forged["event_id"]]
        assert [(e["status"], e["reason"]) for e in mine] == [("dropped", "retired_signer")], res
        assert forged["event_id"] not in {e["event_id"] for e in cli.lines(h, "log")}
        assert cli.j(h, "dump")["app.notes"] == [{"key": {"id": "site"}, "values": {"body": "written by n3"}}]


def test_replacement_served_by_a_peer_that_evicted_lists_the_truncated_rows(tmp_path):
    """No gateway: the new device rehydrates from a field node that evicted below a horizon. Rows
    whose history reaches below that horizon are listed by `events` (serving_peer_horizon) and
    counted by `rehydrate --status`; every other row equals the server's."""
    cli = Cli(tmp_path)
    auth_file = tmp_path / "authority"
    auth = cli.j(tmp_path / "unused", "authority", "create", "--out", auth_file)
    man = tmp_path / "mesh.toml"
    man.write_text(f'mesh_id = "{MESH}"\nauthorities = ["{auth["site_id"]}"]\n'
                   f'[[peers]]\nsite_id = "{auth["site_id"]}"\npublic_key = "{auth["public_key"]}"\n' + TABLES)
    srv, w, new = (tmp_path / x for x in ("srv", "w", "new"))
    ids = {h: cli.j(h, "init", "--manifest", man, "--profile", "pi-zero-2w") for h in (srv, w, new)}
    for h in (srv, w, new):
        cli(srv, "record", "issue-vouch", "--subject", ids[h]["site_id"], "--public-key", ids[h]["public_key"],
            "--authority-key", auth_file)
    cli.carry(srv, w, ids[w]["site_id"])
    old = [json.dumps({"device": "old", "seq": s}) for s in range(3)]
    mix, fresh = json.dumps({"device": "mix", "seq": 0}), json.dumps({"device": "new", "seq": 0})
    for k in old + [mix]:
        cli(w, "write", "app.readings", "--key", k, "--set", '{"temp": 1.5}')
    cli.carry(w, srv, ids[srv]["site_id"])
    top = max((e["hlc"] for e in cli.lines(srv, "log")), key=lambda h: tuple(map(int, h.split("."))))
    horizon = f"{int(top.split('.')[0]) + 1}.0"
    assert cli.j(srv, "evict", "app.readings", "--horizon", horizon)["events_deleted"] == 4
    cli(w, "write", "app.readings", "--key", mix, "--set", '{"note": "late"}')
    cli(w, "write", "app.readings", "--key", fresh, "--set", '{"temp": 7.0, "note": "above"}')
    cli.carry(w, srv, ids[srv]["site_id"])
    cli.j(new, "rehydrate", "--from", ids[srv]["site_id"])
    cli.carry(new, srv, ids[srv]["site_id"])
    cli.carry(srv, new, ids[new]["site_id"])
    listed = [e for e in cli.lines(new, "events") if e["kind"] == "partial_rebuild"]
    assert sorted(json.dumps(e["detail"]["row_key"]) for e in listed) == sorted(old + [mix])
    assert {(e["reason"], e["detail"]["horizon"], e["detail"]["serving_peer"]) for e in listed} == \
        {("serving_peer_horizon", horizon, ids[srv]["site_id"])}
    st_new = cli.j(new, "rehydrate", "--status")
    assert st_new["rehydrating"]["partial_from_serving_peers"] == 4
    assert st_new["truncations"]["received"][0]["rows"] == 4
    assert cli.j(srv, "rehydrate", "--status")["truncations"]["issued"][0]["subject"] == ids[new]["site_id"]
    mine = {json.dumps(r["key"]): r["values"] for r in cli.j(new, "dump")["app.readings"]}
    theirs = {json.dumps(r["key"]): r["values"] for r in cli.j(srv, "dump")["app.readings"]}
    assert mine[fresh] == theirs[fresh] == {"temp": 7.0, "note": "above"}
    assert set(mine) - {json.dumps(json.loads(k)) for k in old + [mix]} == {fresh}
