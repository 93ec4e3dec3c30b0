"""Every label in the metrics file carries only its documented values (docs/operations.md
"Metrics"): the gateway's `run --metrics-file`, with events that came from a peer under the secure
binding, by mailbox and locally, read with the Prometheus text-format parser itself."""
from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.cli_cmd import agent_cmd, agent_env, run_cli

from .helpers import make_nodes, write

DOCS = Path(__file__).resolve().parents[2] / "docs" / "operations.md"
HEX32 = re.compile(r"^[0-9a-f]{32}$")
# Labels whose values are names (a peer, a table, a column, a surfaced kind): their shape.
SHAPES = {"peer": HEX32, "site_id": HEX32, "table": re.compile(r"^[a-z_][a-z0-9_]*\.[a-z_][a-z0-9_]*$"),
          "column": re.compile(r"^[a-z_][a-z0-9_]*$"), "kind": re.compile(r"^[a-z_]+$")}


def documented() -> dict[str, dict[str, set[str] | None]]:
    """{metric: {label: documented values, or None for a name-shaped label}} from the metrics table:
    a row's `name{a,b}` gives the labels, and the values are the backquoted words the row's text
    gives after `label`."""
    out: dict = {}
    rows = [ln for ln in DOCS.read_text().split("## Metrics", 1)[1].splitlines() if ln.startswith("| `ssp_")]
    for row in rows:
        names, _kind, what = [c.strip() for c in row.strip("|").split("|")][:3]
        for name, labels in re.findall(r"`(ssp_[a-z_]+)(?:\{([a-z_,]+)\})?`", names):
            out[name] = {}
            for lab in filter(None, labels.split(",")):
                if lab in SHAPES:
                    out[name][lab] = None
                    continue
                m = re.search(rf"\b{lab}\b([^;|]*)", what)
                assert m, f"{name}: label {lab} has no documented values in docs/operations.md"
                out[name][lab] = set(re.findall(r"`([a-z_]+)`", m.group(1)))
    return out


def documented_labels(text: str) -> set[tuple[str, str, str]]:
    """Parse a metrics file with the Prometheus text-format parser and check that every sample
    carries exactly its documented labels, each with a documented value; (metric, label, value) seen."""
    docs, seen = documented(), set()
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            assert fam.name in docs or s.name in docs, f"{s.name} is not in docs/operations.md"
            allowed = docs.get(s.name, docs.get(fam.name))
            assert set(s.labels) == set(allowed), (s.name, s.labels, allowed)
            for lab, v in s.labels.items():
                ok = SHAPES[lab].match(v) if allowed[lab] is None else v in allowed[lab]
                assert ok, f"{s.name}{{{lab}={v!r}}}: not a documented value ({allowed[lab] or SHAPES[lab].pattern})"
                seen.add((s.name, lab, v))
    return seen


def test_every_label_has_a_documented_value(broker, tmp_path):
    gw, dev = make_nodes(tmp_path, 2)
    write(dev, 1, "dev")
    write(gw, 1, "gw")
    hg, hd = str(gw.home), str(dev.home)
    dev_id = dev.site_id.hex()
    gw.close(); dev.close()
    # a mailbox body from the device too (origin `mailbox`), before the gateway runs
    body = tmp_path / "d.cbor"
    assert run_cli("--home", hd, "mailbox", "export", "--peer", gw.site_id.hex(), "--out", body).returncode == 0
    assert run_cli("--home", hg, "mailbox", "import", body).returncode == 0
    write_dev = run_cli("--home", hd, "write", "app.readings", "--key", '{"device": "dev", "seq": 2}',
                        "--set", '{"temp": 2.0}')
    assert write_dev.returncode == 0, write_dev.stderr
    out = tmp_path / "gw.prom"
    proc = subprocess.Popen([*agent_cmd(), "--home", hg, "run", "--broker", broker.url, "--secure-binding",
                             "--cadence", "0.3", "--metrics-file", str(out), "--metrics-interval", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env())
    try:
        deadline = time.monotonic() + 180   # a bound on waiting, not a timing assertion
        remote = 0
        while time.monotonic() < deadline and not remote:
            p = run_cli("--home", hd, "sync", "--broker", broker.url, "--secure-binding", "--once", "--timeout", "3")
            assert p.returncode == 0, p.stderr
            if out.exists():
                remote = sum(s.value for f in text_string_to_metric_families(out.read_text())
                             for s in f.samples if s.name == "ssp_events_total" and s.labels["origin"] == "mqtt")
        text = out.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert remote >= 1, text
    seen = documented_labels(text)
    assert {("ssp_events_total", "origin", o) for o in ("local", "mailbox", "mqtt")} <= seen
    assert ("ssp_peer_lag_seconds", "peer", dev_id) in seen


def test_counter_keys_of_a_peer_tag_fold_into_remote():
    """A store's `events` counter may hold `peer:<site_id>:<outcome>` keys (the log's tag was the
    counter's origin): the outcome is after the last colon and the origin a documented value."""
    from agent.metrics import event_labels
    sid = "ab" * 16
    got = event_labels({f"peer:{sid}:applied": 2, "remote:applied": 1, "mqtt:duplicate": 4, "local:applied": 5})
    assert got == {("remote", "applied"): 3, ("mqtt", "duplicate"): 4, ("local", "applied"): 5}
