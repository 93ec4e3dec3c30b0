"""`check` and the metrics count a fleet's vouched devices as peers (docs/operations.md "Health and
metrics"): a gateway whose peers came by vouch records (fleet workflow §5), not by the manifest or
`peer add`, has a `peer XXXXXXXX` line per device and `ssp_peer_lag_*{peer}` for each. Before, both
read only the provisioned keyring: `check` warned "no trusted peer in the keyring" (exit 3) on every
healthy gateway, and the lag metrics were empty."""
from __future__ import annotations

import json

from prometheus_client.parser import text_string_to_metric_families

from tests.cli_cmd import run_cli

MANIFEST = ('mesh_id = "5e5e0000000000000000000000000042"\nauthorities = ["{site}"]\n[[peers]]\nsite_id = "{site}"\n'
            'public_key = "{pk}"\n\n[[tables]]\nschema = "app"\nname = "readings"\ncategory = "syncable"\n'
            'key = ["device", "seq"]\ncolumns = {{ device = "text", seq = "integer", temp = "real" }}\n')


def _ok(p) -> str:
    assert p.returncode == 0, (p.returncode, p.stderr)
    return p.stdout


def test_check_and_metrics_count_vouched_devices_as_peers(tmp_path):
    auth = json.loads(_ok(run_cli("--home", tmp_path / "unused", "authority", "create", "--out", tmp_path / "auth")))
    man = tmp_path / "mesh.toml"
    man.write_text(MANIFEST.format(site=auth["site_id"], pk=auth["public_key"]))
    gw = json.loads(_ok(run_cli("--home", tmp_path / "gw", "init", "--manifest", man, "--profile", "gateway")))
    dev = json.loads(_ok(run_cli("--home", tmp_path / "dev", "init", "--manifest", man, "--profile", "pi-zero-2w")))
    _ok(run_cli("--home", tmp_path / "gw", "record", "issue-vouch", "--subject", dev["site_id"], "--public-key",
                dev["public_key"], "--authority-key", tmp_path / "auth"))
    p = run_cli("--home", tmp_path / "gw", "check", "--json")
    checks = {ln["check"]: ln for ln in json.loads(p.stdout)["checks"]}
    assert "peers" not in checks, checks.get("peers")           # not "no trusted peer in the keyring"
    assert f"peer {dev['site_id'][:8]}" in checks, sorted(checks)
    assert not any(auth["site_id"][:8] in c for c in checks)   # the authority is a key, not a peer
    text = _ok(run_cli("--home", tmp_path / "gw", "metrics", "--out", "-"))
    peers = {s.labels["peer"] for f in text_string_to_metric_families(text) for s in f.samples
             if s.name == "ssp_peer_lag_seconds"}
    assert peers == {dev["site_id"]}, peers
    assert gw["site_id"] not in peers
