"""A mesh authority listed under [[peers]] (docs/operations.md §0: its key must be in every
keyring, so that its records verify) is a key that signs control records, not a node that syncs:
no node offers it events, waits for its confirmations or counts its lag. Before, every node
offered it windows for ever, `check` warned "has not confirmed N events" on every node (a
healthy fleet exited 3 for ever) and `ssp_peer_lag_events` grew for it.

A real fleet shape: an authority made by `authority create`, a gateway and a device initialised
from a manifest listing it, the docs' mosquitto (per-device passwords and ACLs) and
`--secure-binding`, so that confirmations are watermark reports."""
from __future__ import annotations

import json
import sqlite3

from agent.simpeer import manifest_text, readings_table
from tests.cli_cmd import run_cli

from .test_broker_security import docs_broker, make_pki
from .test_health import parse_prom

MESH = bytes.fromhex("5e5e0000000000000000000000000042")


def _init(tmp_path, name: str, manifest) -> tuple:
    home = tmp_path / name
    p = run_cli("--home", home, "init", "--manifest", manifest)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    return home, out["site_id"], out["public_key"]


def _sync(home, url: str, ca, site: str, password: str) -> dict:
    p = run_cli("--home", home, "sync", "--broker", url, "--once", "--timeout", "60", "--secure-binding",
                "--ca-file", ca, "--username", site, env={"SSP_MQTT_PASSWORD": password})
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_an_authority_under_peers_is_not_a_sync_peer_and_check_is_ok(tmp_path):
    p = run_cli("--home", tmp_path / "unused", "authority", "create", "--out", tmp_path / "authority")
    assert p.returncode == 0, p.stderr
    auth = json.loads(p.stdout)
    man = tmp_path / "mesh.toml"
    man.write_text(manifest_text(MESH, readings_table(None)).replace(
        "\n[[tables]]", f'authorities = ["{auth["site_id"]}"]\n[[peers]]\nsite_id = "{auth["site_id"]}"\n'
        f'public_key = "{auth["public_key"]}"\n\n[[tables]]', 1))
    gw, gsite, gpk = _init(tmp_path, "gw", man)
    dev, dsite, dpk = _init(tmp_path, "dev", man)
    for home, site, pk in ((gw, dsite, dpk), (dev, gsite, gpk)):
        assert run_cli("--home", home, "peer", "add", "--site-id", site, "--public-key", pk).returncode == 0
    for i, home in enumerate((gw, dev)):
        assert run_cli("--home", home, "write", "app.readings", "--key", json.dumps({"device": f"d{i}", "seq": 1}),
                       "--set", '{"temp": 1.0}').returncode == 0
    pki = make_pki(tmp_path / "pki", [])
    pw = {gsite: "gw-secret", dsite: "dev-secret"}
    broker = docs_broker(tmp_path, pki, pw)
    url = f"mqtts://127.0.0.1:{broker.port}"
    try:
        for _ in range(3):   # the two nodes wake in turn; the authority is never online (it is a key)
            og = _sync(gw, url, pki["ca"], gsite, pw[gsite])
            od = _sync(dev, url, pki["ca"], dsite, pw[dsite])
        for out in (og, od):
            assert auth["site_id"] not in out["peers"], out["peers"]
        for home in (gw, dev):
            with sqlite3.connect(f"file:{home}/store.sqlite?mode=ro", uri=True) as c:
                sent = c.execute("SELECT count(*) FROM sent_bodies WHERE peer=?",
                                 (bytes.fromhex(auth["site_id"]),)).fetchone()[0]
            assert sent == 0, "a body was offered to the authority key"
            site = gsite if home == gw else dsite
            p = run_cli("--home", home, "check", "--json", "--broker", url, "--ca-file", pki["ca"], "--username", site,
                        env={"SSP_MQTT_PASSWORD": pw[site]})
            out = json.loads(p.stdout)
            bad = [ln for ln in out["checks"] if ln["status"] != "OK"]
            # a healthy node exits 0 (the clock line may WARN where this machine's kernel clock is unsynced)
            assert [ln["check"] for ln in bad if ln["check"] != "clock"] == [], bad
            assert p.returncode == (0 if not bad else 3), out
            assert not any(auth["site_id"][:8] in ln["check"] for ln in out["checks"]), out["checks"]
            m = run_cli("--home", home, "metrics", "--out", "-")
            assert m.returncode == 0, m.stderr
            lags = {dict(k[1]).get("peer") for k in parse_prom(m.stdout) if k[0] == "ssp_peer_lag_events"}
            assert auth["site_id"] not in lags and lags, lags
    finally:
        broker.close()
