"""The operator verbs of the runbooks on a live home (docs/operations.md "A running service other
commands can talk to"): while `ssp-agent run` holds a gateway's home, `authority add`, `record
issue-vouch` / `list`, `peer add` / `list`, `keystore show`, `evict --auto`, `rehydrate --status`
are forwarded to it through its control socket and run on its node; `sync --once` and the verbs it
does not serve are refused (exit 2) with a line saying what to do, never "journal in use" (exit 1).
A real `run` on a real mosquitto, every verb through the CLI."""
from __future__ import annotations

import json
import time

from agent.node import Node
from tests.cli_cmd import run_cli

from .helpers import MANIFEST, make_nodes, start_run, stop_run, wait_serving








def ok(p) -> str:
    assert p.returncode == 0, (p.returncode, p.stderr)
    assert "in use" not in p.stderr, p.stderr
    return p.stdout


def test_runbook_verbs_work_on_a_live_gateway(broker, tmp_path):
    gw, dev = make_nodes(tmp_path, 2)
    hg = gw.home
    gw_site = gw.site_id.hex()
    dev_site, dev_pk = dev.site_id.hex(), dev.keyring[dev.site_id][0].hex()
    gw.close(); dev.close()
    new, new_pk = Node.init(tmp_path / "new", MANIFEST)
    new_site = new.site_id.hex()
    new.close()
    auth = json.loads(ok(run_cli("--home", tmp_path / "unused", "authority", "create", "--out", tmp_path / "auth")))
    p = start_run(hg, broker)
    try:
        wait_serving(hg, p)
        # §0: an authority named after init, amended on the live node
        out = json.loads(ok(run_cli("--home", hg, "authority", "add", "--site-id", auth["site_id"],
                                    "--public-key", auth["public_key"])))
        assert auth["site_id"] in out["authorities"]
        # fleet §5 / replacement §3: the vouch issued on the live gateway; paths relative to the
        # operator's working directory, not the agent's
        out = json.loads(ok(run_cli("--home", hg, "record", "issue-vouch", "--subject", new_site, "--public-key",
                                    new_pk.hex(), "--authority-key", "auth", "--out", "vouch.cose", cwd=tmp_path)))
        assert (tmp_path / "vouch.cose").stat().st_size > 0, out
        # a record file handed to the live node: verified and stored by it (known already here)
        out = json.loads(ok(run_cli("--home", hg, "record", "import", "vouch.cose", cwd=tmp_path)))
        assert out["known"] == 1, out
        q = run_cli("--home", hg, "record", "import", "00ff")
        assert q.returncode == 2 and "not a vouch" in q.stderr, (q.returncode, q.stderr)
        recs = [json.loads(line) for line in ok(run_cli("--home", hg, "record", "list")).splitlines()]
        assert any(r["kind"] == "vouch" and r["subject"] == new_site and r["head"] for r in recs), recs
        # small meshes without an authority: peer add
        ok(run_cli("--home", hg, "peer", "add", "--site-id", dev_site[:-2] + "ee", "--public-key", dev_pk))
        sites = {e["site_id"] for e in json.loads(ok(run_cli("--home", hg, "peer", "list")))}
        assert dev_site[:-2] + "ee" in sites and new_site in sites
        ks = json.loads(ok(run_cli("--home", hg, "keystore", "show")))
        assert ks["site_id"] == gw_site and ks["event_key"]["matches_node"] is True
        ok(run_cli("--home", hg, "evict", "--auto", "--clock-trusted"))
        st = json.loads(ok(run_cli("--home", hg, "rehydrate", "--status")))
        assert st["site_id"] == gw_site
        # the health verbs read the store read-only beside the service
        q = run_cli("--home", hg, "check", "--json", "--broker", broker.url)
        assert q.returncode in (0, 3) and "in use" not in q.stdout + q.stderr, (q.returncode, q.stdout, q.stderr)
        ok(run_cli("--home", hg, "metrics", "--out", tmp_path / "gw.prom"))
        assert "ssp_" in (tmp_path / "gw.prom").read_text()
        # the service syncs this home already: `sync --once` is refused with what to do
        q = run_cli("--home", hg, "sync", "--once", "--broker", broker.url, "--timeout", "5")
        assert q.returncode == 2 and "run" in q.stderr and f"pid {p.pid}" in q.stderr, (q.returncode, q.stderr)
        # a verb the service does not serve: refused with what to do, nothing done
        q = run_cli("--home", hg, "mailbox", "export", "--peer", dev_site, "--out", tmp_path / "body.ssp")
        assert q.returncode == 2 and "stop" in q.stderr and f"pid {p.pid}" in q.stderr, (q.returncode, q.stderr)
        assert not (tmp_path / "body.ssp").exists()
        # a read verb reads the store beside the service
        q = run_cli("--home", hg, "policy", "list")
        assert q.returncode == 0 and '"effect": "allow"' in q.stdout, (q.returncode, q.stdout, q.stderr)
        for argv in (["policy", "deny", "--peer", dev_site, "--table", "app.*", "--layer", "user"],
                     ["identity", "rebind", "--confirm-original-destroyed"],
                     ["keystore", "rotate-data-key"], ["table", "add-column", "app.readings", "--column", "x",
                                                       "--type", "text"]):
            q = run_cli("--home", hg, *argv)
            assert q.returncode == 2 and "stop the service" in q.stderr, (argv, q.returncode, q.stderr)
        # a second `run` on the same home: refused, the first one keeps it
        q = run_cli("--home", hg, "run", "--broker", broker.url)
        assert q.returncode == 2 and f"pid {p.pid}" in q.stderr, (q.returncode, q.stderr)
        assert p.poll() is None
        stop_run(p)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    # stopped: the same verbs open the home themselves and see what the service did
    recs = [json.loads(line) for line in ok(run_cli("--home", hg, "record", "list")).splitlines()]
    assert any(r["kind"] == "vouch" and r["subject"] == new_site for r in recs)


def test_rehydrate_from_the_gateway_on_a_live_device(broker, tmp_path):
    """Replacement runbook §4 on a device whose service runs (a fleet device enrolled with its
    unit enabled): `rehydrate --from GW` is forwarded to it and the history arrives while it runs."""
    from .helpers import T
    gw, dev = make_nodes(tmp_path, 2)
    hg, hd, gw_site = gw.home, dev.home, gw.site_id.hex()
    for i in range(5):
        gw.write(T, {"device": "g", "seq": i}, {"temp": float(i)})
    gw.close(); dev.close()
    pg, pd = start_run(hg, broker), start_run(hd, broker)
    try:
        wait_serving(hg, pg)
        wait_serving(hd, pd)
        st = json.loads(ok(run_cli("--home", hd, "rehydrate", "--from", gw_site)))
        assert st["from"] == gw_site
        deadline = time.monotonic() + 120
        rows = []
        while time.monotonic() < deadline:
            rows = [r for r in json.loads(ok(run_cli("--home", hd, "dump")))[T] if r["key"]["device"] == "g"]
            if len(rows) == 5:
                break
            time.sleep(0.2)
        assert len(rows) == 5
        st = json.loads(ok(run_cli("--home", hd, "rehydrate", "--status")))
        assert st["rehydrating"]["from"] == gw_site and st["rehydrating"]["generation"] == 0
        stop_run(pd)
        stop_run(pg)
    finally:
        for p in (pg, pd):
            if p.poll() is None:
                p.kill()
                p.wait()
