"""`ssp-agent check` (one line per check, OK/WARN/FAIL with a hint, --json, exit
0/3/4 by the worst) and the metrics file (Prometheus text format for node_exporter's textfile
collector) from `metrics --out`, `run --metrics-file` and `sync --once --metrics-file`. Every case
drives the real command against real mosquitto brokers and real homes."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from agent.metrics import write_atomic
from agent.simpeer import SimPeer, manifest_text, readings_table
from agent.transport.broker import Broker, write_password_file
from tests.cli_cmd import agent_cmd, agent_env, run_cli

MESH = bytes.fromhex("00112233445566778899aabbccddeeff")
NOW_MS = int(time.time() * 1000)


def _home(tmp: Path, peers=(), name="h", profile: Path | None = None) -> Path:
    man = tmp / f"{name}.toml"
    man.write_text(manifest_text(MESH, readings_table(None), list(peers)))
    home = tmp / name
    extra = ("--profile", profile) if profile else ()
    p = run_cli("--home", home, "init", "--manifest", man, *extra)
    assert p.returncode == 0, p.stderr
    return home


def check(home, *args, env=None):
    p = run_cli("--home", home, "check", "--json", *args, env={"SSP_MQTT_BROKER": "", **(env or {})})
    out = json.loads(p.stdout)
    assert p.returncode == out["exit"] == {"OK": 0, "WARN": 3, "FAIL": 4}[out["worst"]], (p.returncode, out)
    return p.returncode, {ln["check"]: ln for ln in out["checks"]}


# ---------------------------------------------------------------- a tiny exposition-format reader
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*",?)*\})? (\S+)$')


def parse_prom(text: str) -> dict:
    """{(name, frozenset(labels)): value}; asserts the format: HELP and TYPE before each family's samples."""
    assert text.endswith("\n")
    typed, out = set(), {}
    for ln in text.splitlines():
        if ln.startswith("# HELP "):
            continue
        if ln.startswith("# TYPE "):
            _, _, name, kind = ln.split(" ", 3)
            assert kind in ("counter", "gauge"), ln
            typed.add(name)
            continue
        m = _SAMPLE.match(ln)
        assert m, f"not a sample line: {ln!r}"
        assert m.group(1) in typed, f"sample before its TYPE: {ln}"
        labels = frozenset(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        out[(m.group(1), labels)] = float(m.group(3))
    return out


def metric(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, frozenset(labels.items())))


# ---------------------------------------------------------------- check
def test_check_a_healthy_node_with_its_broker(broker, tmp_path):
    peer = SimPeer(MESH)
    home = _home(tmp_path, [peer])
    rc, lines = check(home, "--broker", broker.url)
    assert lines["home"]["status"] == "OK" and lines["keystore"]["status"] == "OK"
    assert lines["broker"]["status"] == "OK" and lines["disk"]["status"] == "OK"
    assert lines["faults"]["status"] == "OK"
    assert lines["clock"]["status"] in ("OK", "WARN")    # WARN when this machine's kernel clock is not NTP-synced
    assert lines[f"peer {peer.site_id.hex()[:8]}"]["status"] == "OK"   # nothing written: nothing to confirm
    assert rc in (0, 3)
    # Text form: one line per check, status first, a hint under each line that is not OK.
    p = run_cli("--home", home, "check", "--broker", broker.url)
    text = p.stdout.splitlines()
    assert re.match(r"^OK\s+home\s", text[0]) and re.match(r"^OK\s+broker\s", text[2])
    for i, ln in enumerate(text[:-1]):
        if ln.startswith(("WARN", "FAIL")):
            assert "hint:" in text[i + 1]


def test_check_finds_each_problem_and_exits_by_the_worst(broker, tmp_path):
    peer, stranger = SimPeer(MESH), SimPeer(MESH)
    home = _home(tmp_path, [peer])
    assert run_cli("--home", home, "write", "app.readings", "--key", '{"device":"d","seq":1}',
                   "--set", '{"temp":1.0}').returncode == 0
    # A peer that never confirmed this node's event is lagging (WARN), with a hint.
    rc, lines = check(home, "--broker", broker.url)
    pl = lines[f"peer {peer.site_id.hex()[:8]}"]
    assert pl["status"] == "WARN" and pl["detail"]["behind_events"] == 1 and pl["hint"]
    assert rc == 3 or lines["clock"]["status"] == "FAIL"
    # An event from an unknown signer is rejected and surfaced: the faults line says so.
    body = tmp_path / "b.cbor"
    body.write_bytes(stranger.body([stranger.event("app.readings", {"device": "x", "seq": 1}, {"temp": 2.0},
                                                   (NOW_MS, 0))]))
    assert json.loads(run_cli("--home", home, "mailbox", "import", body).stdout)["rejected"] == 1
    _, lines = check(home, "--broker", broker.url)
    assert lines["faults"]["status"] == "WARN" and "rejected:unknown_kid" in lines["faults"]["message"]
    # An unreachable broker is a FAIL: exit 4.
    rc, lines = check(home, "--broker", "mqtt://127.0.0.1:1", "--timeout", "2")
    assert lines["broker"]["status"] == "FAIL" and "unreachable" in lines["broker"]["message"] and rc == 4


def test_check_broker_credentials(tmp_path):
    pw = write_password_file(tmp_path / "passwd", {"dev1": "s3cret"})
    b = Broker(workdir=tmp_path / "abroker")
    b.listener_conf = f"listener {b.port} 127.0.0.1\nallow_anonymous false\npassword_file {pw}"
    b.start()
    try:
        home = _home(tmp_path)
        good, bad = tmp_path / "good", tmp_path / "bad"
        good.write_text("s3cret\n")
        bad.write_text("wrong\n")
        _, lines = check(home, "--broker", b.url, "--username", "dev1", "--password-file", good)
        assert lines["broker"]["status"] == "OK" and "dev1" in lines["broker"]["message"]
        rc, lines = check(home, "--broker", b.url, "--username", "dev1", "--password-file", bad)
        assert lines["broker"]["status"] == "FAIL" and "refused" in lines["broker"]["message"] and rc == 4
        assert "password" in lines["broker"]["hint"]
        # From the configuration file, as the service reads it.
        conf = tmp_path / "agent.toml"
        conf.write_text(f'[mqtt]\nbroker = "{b.url}"\nusername = "dev1"\npassword_file = "{good}"\n')
        _, lines = check(home, env={"SSP_AGENT_CONFIG": str(conf)})
        assert lines["broker"]["status"] == "OK"
    finally:
        b.close()


def test_check_a_missing_home_and_a_newer_store_fail(tmp_path):
    rc, lines = check(tmp_path / "nowhere")
    assert lines["home"]["status"] == "FAIL" and rc == 4 and "init" in lines["home"]["hint"]
    import sqlite3
    home = _home(tmp_path)
    c = sqlite3.connect(home / "store.sqlite")
    c.execute("PRAGMA user_version = 99")
    c.close()
    rc, lines = check(home)
    assert lines["home"]["status"] == "FAIL" and "newer than this agent" in lines["home"]["message"] and rc == 4


@pytest.mark.skipif(shutil.which("faketime") is None, reason="faketime (Debian `faketime`) is not installed")
def test_check_a_clock_set_back_is_a_failure(tmp_path):
    """The node signed at the real time; then the wall clock reads 30 days earlier (a Pi without RTC)."""
    home = _home(tmp_path)
    assert run_cli("--home", home, "write", "app.readings", "--key", '{"device":"d","seq":1}',
                   "--set", '{"temp":1.0}').returncode == 0
    p = subprocess.run(["faketime", "-f", "-30d", *agent_cmd(), "--home", str(home), "check", "--json"],
                       capture_output=True, text=True, env=agent_env({"SSP_MQTT_BROKER": ""}), timeout=120)
    out = json.loads(p.stdout)
    clock = next(ln for ln in out["checks"] if ln["check"] == "clock")
    assert clock["status"] == "FAIL" and "behind" in clock["message"] and clock["hint"], clock
    assert p.returncode == 4


def test_check_fails_on_a_full_disk(tmp_path):
    """A filesystem with no room left is a FAIL (nothing can be written: no event, no answer, no
    cursor), not a WARN; on a real tmpfs filled to the last block."""
    from tests.lifecycle.test_damage import fill
    mnt = tmp_path / "fs"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({p.stderr.strip()})")
    try:
        home = _home(mnt)
        filler = fill(mnt)
        rc, lines = check(home)
        assert lines["disk"]["status"] == "FAIL" and "full" in lines["disk"]["message"], lines["disk"]
        assert lines["disk"]["hint"] and rc == 4
        filler.unlink()
        _, lines = check(home)   # room again, though less than the 1 GiB budget allows: a WARN
        assert lines["disk"]["status"] == "WARN" and "less free space" in lines["disk"]["message"], lines["disk"]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_check_disk_near_budget(tmp_path):
    prof = tmp_path / "tiny.toml"
    text = Path(__file__).resolve().parents[2].joinpath("agent/profiles/pi-zero-2w.toml").read_text()
    text = re.sub(r"disk_budget_mb\s*=\s*\S+", "disk_budget_mb = 1", text)
    text = re.sub(r"warn_fraction\s*=\s*\S+", "warn_fraction = 0.05", text)
    prof.write_text(text)
    home = _home(tmp_path, profile=prof)
    _, lines = check(home)
    assert lines["disk"]["status"] == "WARN" and "near the budget" in lines["disk"]["message"]
    assert lines["disk"]["detail"]["budget_bytes"] == 2**20


# ---------------------------------------------------------------- metrics
def test_metrics_count_outcomes_and_ignored_columns(tmp_path):
    peer, stranger = SimPeer(MESH), SimPeer(MESH)
    home = _home(tmp_path, [peer])
    assert run_cli("--home", home, "write", "app.readings", "--key", '{"device":"d","seq":0}',
                   "--set", '{"temp":1.0}').returncode == 0
    evs = [peer.event("app.readings", {"device": "p", "seq": i}, {"temp": float(i), "extra": "x"}, (NOW_MS, i))
           for i in range(3)]
    body = tmp_path / "b.cbor"
    body.write_bytes(peer.body(evs + [stranger.event("app.readings", {"device": "s", "seq": 1}, {"temp": 1.0},
                                                     (NOW_MS, 9))]))
    assert run_cli("--home", home, "mailbox", "import", body).returncode == 0
    assert run_cli("--home", home, "mailbox", "import", body).returncode == 0   # again: duplicates
    out = tmp_path / "textfile" / "ssp_agent.prom"
    out.parent.mkdir()
    p = run_cli("--home", home, "metrics", "--out", out)
    assert p.returncode == 0, p.stderr
    s = parse_prom(out.read_text())
    assert metric(s, "ssp_events_total", origin="local", outcome="applied") == 1
    assert metric(s, "ssp_events_total", origin="mailbox", outcome="applied") == 3
    assert metric(s, "ssp_events_total", origin="mailbox", outcome="duplicate") == 3
    assert metric(s, "ssp_events_total", origin="mailbox", outcome="rejected") == 2
    assert metric(s, "ssp_ignored_columns_total", table="app.readings", column="extra") == 3
    assert metric(s, "ssp_events_retained") == 4 and metric(s, "ssp_events_held") == 0
    assert metric(s, "ssp_peer_lag_events", peer=peer.site_id.hex()) == 1
    assert metric(s, "ssp_store_budget_bytes") > metric(s, "ssp_store_bytes") > 0
    assert 0 < metric(s, "ssp_store_budget_ratio") < 1
    assert [f.name for f in out.parent.iterdir()] == ["ssp_agent.prom"]   # no temporary left behind


def test_sync_once_counts_its_runs_in_the_metrics_file(broker, tmp_path):
    home = _home(tmp_path)
    out = tmp_path / "m.prom"
    p = run_cli("--home", home, "sync", "--broker", broker.url, "--once", "--timeout", "1", "--metrics-file", out)
    assert p.returncode == 0, p.stderr
    assert metric(parse_prom(out.read_text()), "ssp_sync_runs_total", outcome="ok") == 1
    p = run_cli("--home", home, "sync", "--broker", "mqtt://127.0.0.1:1", "--once", "--connect-timeout", "1",
                "--metrics-file", out)
    assert p.returncode == 1
    s = parse_prom(out.read_text())
    assert metric(s, "ssp_sync_runs_total", outcome="ok") == 1
    assert metric(s, "ssp_sync_runs_total", outcome="unreachable") == 1


def test_run_writes_the_metrics_file_and_check_works_beside_it(broker, tmp_path):
    home = _home(tmp_path)
    out = tmp_path / "m.prom"
    proc = subprocess.Popen([*agent_cmd(), "--home", str(home), "run", "--broker", broker.url, "--cadence", "0.2",
                             "--metrics-file", str(out), "--metrics-interval", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env())
    try:
        deadline = time.monotonic() + 120   # a bound on waiting, not a timing assertion
        s = {}
        while time.monotonic() < deadline:
            if out.exists():
                s = parse_prom(out.read_text())
                if (metric(s, "ssp_run_batch_cycles_total") or 0) >= 2:
                    break
            time.sleep(0.1)
        assert metric(s, "ssp_run_batch_cycles_total") >= 2
        # A write forwarded to the running agent shows in the next file.
        assert run_cli("--home", home, "write", "app.readings", "--key", '{"device":"d","seq":1}',
                       "--set", '{"temp":1.0}').returncode == 0
        while time.monotonic() < deadline:
            s = parse_prom(out.read_text())
            if metric(s, "ssp_events_total", origin="local", outcome="applied") == 1:
                break
            time.sleep(0.1)
        assert metric(s, "ssp_events_total", origin="local", outcome="applied") == 1
        # check and metrics read the home beside the running agent.
        rc, lines = check(home, "--broker", broker.url)
        assert lines["home"]["status"] == "OK" and lines["broker"]["status"] == "OK"
        assert run_cli("--home", home, "metrics", "--out", "-").returncode == 0
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_write_atomic_replaces_the_file_in_one_rename(tmp_path):
    f = tmp_path / "x.prom"
    f.write_text("old\n")
    ino = f.stat().st_ino
    write_atomic(f, "new\n")
    assert f.read_text() == "new\n" and f.stat().st_ino != ino   # a new file renamed over, never rewritten
    assert oct(f.stat().st_mode & 0o777) == "0o644"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.prom"]
