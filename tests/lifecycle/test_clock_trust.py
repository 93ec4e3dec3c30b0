"""Clocks on devices without an RTC (docs/apply.md "Clocks without an RTC"), through
the real CLI as subprocesses and libfaketime for a bad boot.

The sync source is systemd-timesyncd's flag file, redirected to a file of the test
(SSP_AGENT_CLOCK_SYNC=timesyncd:PATH): present = synchronised, absent = not. This machine's kernel
reports STA_UNSYNC, so the kernel source is left out to make "synchronised" reachable here.

The rule under test: eviction, horizon changes and `init` refuse (exit 2, clock_untrusted) without a
trustworthy clock or --clock-trusted; while the clock is untrusted a write is stamped no later than
the evidence (the last trustworthy reading) plus the 300 s skew bound, so after a bad boot a year
ahead nothing is evicted, no horizon moves, and a fresh peer with a right clock accepts every write."""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from agent.simpeer import readings_table
from tests.cli_cmd import agent_cmd, agent_env

pytestmark = pytest.mark.skipif(shutil.which("faketime") is None, reason="libfaketime (Debian faketime) not installed")

MESH = "00112233445566778899aabbccddeeff"
YEAR_MS = 365 * 86_400_000
SKEW_MS = 300_000


class Cli:
    def __init__(self, tmp: Path) -> None:
        self.flag = tmp / "timesync" / "synchronized"
        self.flag.parent.mkdir()
        self.env = agent_env({"SSP_AGENT_WITNESS_DIR": str(tmp / "witness"),
                              "SSP_AGENT_CLOCK_SYNC": f"timesyncd:{self.flag}"})
        self.env.pop("SSP_AGENT_CLOCK_TRUSTED", None)

    def synced(self, yes: bool) -> None:
        if yes:
            self.flag.write_text("")
        else:
            self.flag.unlink(missing_ok=True)

    def __call__(self, home, *args, ok=True, fake: str | None = None):
        pre = ["faketime", "-f", fake] if fake else []
        p = subprocess.run([*pre, *agent_cmd(), "--home", str(home), *map(str, args)], capture_output=True,
                           text=True, env=self.env, timeout=120)
        if ok:
            assert p.returncode == 0, f"{args}: {p.stderr}"
        return p

    def j(self, home, *args, **kw):
        return json.loads(self(home, *args, **kw).stdout)

    def log(self, home):
        return [json.loads(x) for x in self(home, "log").stdout.splitlines() if x.strip()]


def _manifest(tmp: Path, name: str, peers: list[dict]) -> Path:
    text = f'mesh_id = "{MESH}"\n' + "".join(
        f'[[peers]]\nsite_id = "{p["site_id"]}"\npublic_key = "{p["public_key"]}"\n' for p in peers)
    text += readings_table("telemetry")
    f = tmp / f"{name}.toml"
    f.write_text(text)
    return f


def _p(hlc: str) -> int:
    return int(hlc.split(".")[0])


def test_init_waits_for_a_trustworthy_clock(tmp_path):
    cli = Cli(tmp_path)
    m = _manifest(tmp_path, "m", [])
    cli.synced(False)
    # A clock nobody vouches for and nothing contradicts: accepted with a warning (the CLI contract
    # holds on machines that cannot say), and the reading is not taken as evidence.
    p = cli(tmp_path / "c", "init", "--manifest", m)
    assert "not known to be synchronised" in p.stderr, p.stderr
    assert cli.j(tmp_path / "c", "status")["clock"]["evidence_ms"] is None
    # Strict mode (first-boot enrolment, SSP_AGENT_CLOCK_STRICT=1, or --wait-clock) refuses it.
    cli.env["SSP_AGENT_CLOCK_STRICT"] = "1"
    p = cli(tmp_path / "a", "init", "--manifest", m, ok=False)
    assert p.returncode == 2 and "clock_untrusted" in p.stderr, p.stderr
    assert not (tmp_path / "a" / "store.sqlite").exists()          # nothing made
    t0 = time.time()
    p = cli(tmp_path / "a", "init", "--manifest", m, "--wait-clock", "1.5", ok=False)
    assert p.returncode == 2 and time.time() - t0 >= 1.5            # it waited, then refused
    # The override, or a clock that becomes synchronised while it waits:
    cli(tmp_path / "b", "init", "--manifest", m, "--clock-trusted")
    cli.synced(True)
    cli(tmp_path / "a", "init", "--manifest", m, "--wait-clock", "5")
    del cli.env["SSP_AGENT_CLOCK_STRICT"]
    st = cli.j(tmp_path / "a", "status")["clock"]
    assert st["trusted"] and st["source"] == "timesyncd" and st["state"] == "ok"
    assert abs(st["evidence_ms"] - time.time() * 1000) < 60_000


def test_a_bad_boot_a_year_ahead_neither_evicts_nor_poisons_the_mesh(tmp_path):
    cli = Cli(tmp_path)
    cli.synced(True)
    b = cli.j(tmp_path / "b", "init", "--manifest", _manifest(tmp_path, "mb", []))
    a = cli.j(tmp_path / "a", "init", "--manifest", _manifest(tmp_path, "ma", [b]))
    A, B = tmp_path / "a", tmp_path / "b"
    cli(B, "peer", "add", "--site-id", a["site_id"], "--public-key", a["public_key"])
    key = lambda n: json.dumps({"device": "d", "seq": n})  # noqa: E731
    cli(A, "write", "app.readings", "--key", key(1), "--set", '{"temp": 20.5}')
    evidence = cli.j(A, "status")["clock"]["evidence_ms"]

    # A bad boot: the wall clock a year ahead, no time sync yet.
    cli.synced(False)
    bad = "+365d"
    st = cli.j(A, "status", fake=bad)["clock"]
    assert not st["trusted"] and st["state"] == "ahead" and st["ahead_ms"] > YEAR_MS - 86_400_000
    p = cli(A, "evict", "--auto", fake=bad, ok=False)
    assert p.returncode == 2 and "clock_untrusted" in p.stderr, p.stderr
    ahead = f"{int(time.time() * 1000) + YEAR_MS}.0"
    p = cli(A, "evict", "app.readings", "--horizon", ahead, fake=bad, ok=False)
    assert p.returncode == 2 and "clock_untrusted" in p.stderr, p.stderr
    # The sensor keeps writing through the bad boot: stamped no later than evidence + skew bound.
    cli(A, "write", "app.readings", "--key", key(2), "--set", '{"temp": 21.5}', fake=bad)
    cli(A, "write", "app.readings", "--key", key(3), "--set", '{"temp": 22.5}', fake=bad)
    # The clock corrected by hand but not yet synchronised: still bounded, still monotonic.
    cli(A, "write", "app.readings", "--key", key(4), "--set", '{"temp": 23.5}')
    # Synchronised: stamped by the real clock again.
    cli.synced(True)
    cli(A, "write", "app.readings", "--key", key(5), "--set", '{"temp": 24.5}')

    log = cli.log(A)
    assert [e["row_key"]["seq"] for e in log] == [1, 2, 3, 4, 5]    # no history evicted
    stamps = [tuple(map(int, e["hlc"].split("."))) for e in log]
    assert stamps == sorted(stamps) and len(set(stamps)) == 5       # never reissued, monotonic
    now = int(time.time() * 1000)
    assert all(p <= evidence + SKEW_MS for p, _ in stamps[1:4]), (evidence, stamps)
    assert all(p <= now + SKEW_MS for p, _ in stamps)               # nothing stamped in the future
    st = cli.j(A, "status")
    assert all(t["horizon"] == "0.0" for t in st["tables"].values())  # no horizon raised a year ahead
    # The HLC may sit up to the skew bound above the corrected clock (the bounded writes): within
    # what every peer accepts, and not "behind" (far from the wall clock) for `check`.
    assert st["clock"]["trusted"] and st["clock"]["behind_ms"] <= SKEW_MS and st["clock"]["state"] == "ok"

    # A fresh peer with a right clock takes every write: none rejected for clock skew.
    body = tmp_path / "a-to-b.body"
    cli(A, "mailbox", "export", "--peer", b["site_id"], "--out", body)
    res = cli.j(B, "mailbox", "import", body)
    assert res["applied"] == 5 and res["rejected"] == 0, res
    assert len(cli.j(B, "dump")["app.readings"]) == 5

    # With a trustworthy clock the eviction job runs (and its horizon is in the past).
    rep = cli.j(A, "evict", "--auto")
    h = _p(rep["tables"]["app.readings"]["horizon"])
    assert h < int(time.time() * 1000)


def test_runs_eviction_job_is_deferred_without_a_trustworthy_clock(tmp_path, monkeypatch):
    """`run`'s eviction job (Runner.evict) on a real node: deferred (not failed, nothing deleted,
    surfaced once) while no sync source says the clock is synchronised; run once it is."""
    from agent.node import Node
    from agent.runner import RunConfig, Runner
    from agent.transport.mqtt import MqttSettings
    flag = tmp_path / "synchronized"
    flag.write_text("")
    monkeypatch.delenv("SSP_AGENT_CLOCK_TRUSTED", raising=False)
    monkeypatch.setenv("SSP_AGENT_CLOCK_SYNC", f"timesyncd:{flag}")
    node, _ = Node.init(tmp_path / "a", (_manifest(tmp_path, "m", [])).read_text())
    try:
        old = int(time.time() * 1000) - 10 * 86_400_000          # older than the profile's 7 days
        node.write("app.readings", {"device": "d", "seq": 1}, {"temp": 1.5}, now=old)
        runner = Runner(node, MqttSettings(), RunConfig(eviction_interval_s=60))
        flag.unlink()
        assert runner.evict() is None and runner.evict() is None
        assert runner.stats["evictions_deferred"] == 2 and runner.stats["eviction_failures"] == 0
        assert node.conn.execute("SELECT count(*) FROM events").fetchone()[0] == 1
        assert [e["reason"] for e in node.surfaced(100) if e["kind"] == "clock"] == ["clock_untrusted"]
        assert node.status()["tables"]["app.readings"]["horizon"] == "0.0"
        flag.write_text("")
        rep = runner.evict()      # it runs; the node's own write, which no peer acknowledged, stays
        assert rep is not None and runner.stats["evictions"] == 1
        assert rep["tables"]["app.readings"]["events_deleted"] == 0
    finally:
        node.close()


def test_a_synchronised_clock_ten_years_ahead_evicts_nothing_undelivered(tmp_path):
    """A time source that claims synchronisation while the clock reads ten years ahead: `evict
    --auto` deleted the node's own writes no peer had received, and set a horizon ten years up, so
    the peer's later writes landed "below horizon" and were never stored. Eviction now keeps own
    events no peer acknowledged, and no horizon passes the newest time the peers vouch for. Across
    restarts (each command a process; the bad clock in one of them), then a corrected clock."""
    cli = Cli(tmp_path)
    cli.synced(True)
    b = cli.j(tmp_path / "b", "init", "--manifest", _manifest(tmp_path, "mb", []))
    a = cli.j(tmp_path / "a", "init", "--manifest", _manifest(tmp_path, "ma", [b]))
    A, B = tmp_path / "a", tmp_path / "b"
    cli(B, "peer", "add", "--site-id", a["site_id"], "--public-key", a["public_key"])
    key = lambda d, n: json.dumps({"device": d, "seq": n})  # noqa: E731

    def deliver(src, dst, peer_site):
        f = tmp_path / "x.body"
        cli(src, "mailbox", "export", "--peer", peer_site, "--out", f)
        return cli.j(dst, "mailbox", "import", f)

    cli(B, "write", "app.readings", "--key", key("b", 1), "--set", '{"temp": 1.5}')
    assert deliver(B, A, a["site_id"])["applied"] == 1
    mine = [cli(A, "write", "app.readings", "--key", key("a", i), "--set", '{"temp": 2.5}').stdout.strip()
            for i in range(3)]                               # never delivered to anyone yet

    ten_years = "+3650d"                                     # the source still says "synchronised"
    rep = cli.j(A, "evict", "--auto", fake=ten_years)
    assert {e["event_id"] for e in cli.log(A)} >= set(mine)  # nothing of its own lost
    h = _p(rep["tables"]["app.readings"]["horizon"])
    assert h <= int(time.time() * 1000) + SKEW_MS, rep       # not ten years up

    # The clock is right again: the peer's later write is stored, and the own writes reach the peer.
    time.sleep(0.01)
    cli(B, "write", "app.readings", "--key", key("b", 2), "--set", '{"temp": 3.5}')
    res = deliver(B, A, a["site_id"])
    assert res["applied"] == 1 and res["dropped"] == 0, res
    rows = {(r["key"]["device"], r["key"]["seq"]) for r in cli.j(A, "dump")["app.readings"]}
    assert ("b", 2) in rows
    res = deliver(A, B, b["site_id"])
    assert res["rejected"] == 0, res
    rows = {(r["key"]["device"], r["key"]["seq"]) for r in cli.j(B, "dump")["app.readings"]}
    assert {("a", 0), ("a", 1), ("a", 2)} <= rows


def test_a_node_that_never_synchronised_and_boots_ten_years_ahead_stays_deliverable(tmp_path):
    """A device that never had a synchronised clock (no evidence of its own) booted ten years
    ahead stamped its writes ten years ahead and went on doing so after the clock was corrected
    (its HLC never goes back): its peers rejected them (`clock_skew`) and they reached no one. The
    time its peers vouch for (events it holds from them) now caps its signing time as evidence does."""
    cli = Cli(tmp_path)
    cli.synced(True)
    b = cli.j(tmp_path / "b", "init", "--manifest", _manifest(tmp_path, "mb", []))
    cli.synced(False)                                        # A's clock never synchronised
    a = cli.j(tmp_path / "a", "init", "--manifest", _manifest(tmp_path, "ma", [b]))
    A, B = tmp_path / "a", tmp_path / "b"
    assert cli.j(A, "status")["clock"]["evidence_ms"] is None
    cli.synced(True)
    cli(B, "peer", "add", "--site-id", a["site_id"], "--public-key", a["public_key"])
    cli(B, "write", "app.readings", "--key", json.dumps({"device": "b", "seq": 1}), "--set", '{"temp": 1.5}')
    f = tmp_path / "b-to-a.body"
    cli(B, "mailbox", "export", "--peer", a["site_id"], "--out", f)
    assert cli.j(A, "mailbox", "import", f)["applied"] == 1
    cli.synced(False)
    for i in range(3):                                       # a boot ten years ahead, then corrected
        cli(A, "write", "app.readings", "--key", json.dumps({"device": "a", "seq": i}), "--set", '{"temp": 2.5}',
            fake="+3650d" if i < 2 else None)
    stamps = [_p(e["hlc"]) for e in cli.log(A) if e["site_id"] == a["site_id"]]
    assert len(stamps) == 3 and max(stamps) <= int(time.time() * 1000) + SKEW_MS, stamps
    f = tmp_path / "a-to-b.body"
    cli(A, "mailbox", "export", "--peer", b["site_id"], "--out", f)
    res = cli.j(B, "mailbox", "import", f)
    assert res["applied"] == 3 and res["rejected"] == 0, res


def test_writes_stamped_by_a_first_boot_ten_years_ahead_reach_the_peers(tmp_path):
    """A device that never had a synchronised clock and holds nothing from its peers boots ten
    years ahead: nothing bounds its signing time, so its writes are stamped ten years ahead, and
    every peer with a right clock would reject them (`clock_skew`). Once the clock is corrected and
    synchronised, the writes no peer acknowledged are withdrawn and re-issued inside the range the
    jump left unissued, where later writes are stamped too (`clock_reissued`): the peer takes them
    all, the later write winning as it does here. Each command is its own process."""
    cli = Cli(tmp_path)
    cli.synced(True)
    b = cli.j(tmp_path / "b", "init", "--manifest", _manifest(tmp_path, "mb", []))
    cli.synced(False)                                        # A's clock never synchronised
    a = cli.j(tmp_path / "a", "init", "--manifest", _manifest(tmp_path, "ma", [b]), fake="+3650d")
    A, B = tmp_path / "a", tmp_path / "b"
    cli(B, "peer", "add", "--site-id", a["site_id"], "--public-key", a["public_key"])
    for i in range(3):                                       # the bad boot: stamped 2036
        cli(A, "write", "app.readings", "--key", json.dumps({"device": "a", "seq": i}), "--set",
            json.dumps({"temp": 2.5 + i}), fake="+3650d")
    assert min(_p(e["hlc"]) for e in cli.log(A)) > int(time.time() * 1000) + YEAR_MS
    cli.synced(True)                                         # the clock corrected and synchronised
    cli(A, "write", "app.readings", "--key", json.dumps({"device": "a", "seq": 3}), "--set", '{"temp": 9.5}')
    cli(A, "write", "app.readings", "--key", json.dumps({"device": "a", "seq": 0}), "--set", '{"temp": 7.5}')
    f = tmp_path / "a-to-b.body"
    cli(A, "mailbox", "export", "--peer", b["site_id"], "--out", f)
    res = cli.j(B, "mailbox", "import", f)
    assert res["rejected"] == 0, res
    rows = {r["key"]["seq"]: r["values"]["temp"] for r in cli.j(B, "dump")["app.readings"]}
    assert rows == {0: 7.5, 1: 3.5, 2: 4.5, 3: 9.5}, rows   # every write, the later one winning
    assert rows == {r["key"]["seq"]: r["values"]["temp"] for r in cli.j(A, "dump")["app.readings"]}
    now = int(time.time() * 1000)
    assert all(_p(e["hlc"]) <= now for e in cli.log(A)), cli.log(A)   # nothing left stamped ahead
    surfaced = [json.loads(x) for x in cli(A, "events").stdout.splitlines() if x.strip()]
    done = [e["detail"] for e in surfaced if e["kind"] == "clock" and e["reason"] == "clock_reissued"]
    assert len(done) == 1 and done[0]["withdrawn"] == 3, surfaced


def test_evidence_recorded_under_a_lying_clock_is_dropped_once_the_mesh_contradicts_it(tmp_path):
    """A time source that claimed synchronisation while reading ten years ahead left that reading
    as the node's evidence; once the clock is right, every assessment found it "behind" the
    evidence, so eviction was refused (`clock_untrusted`) for ten years. A synchronised clock that
    the newest time its peers vouch for agrees with (within the skew bound) outweighs it: the
    evidence is lowered to the reading and surfaced (`clock_evidence_reset`). Across restarts."""
    cli = Cli(tmp_path)
    cli.synced(True)
    b = cli.j(tmp_path / "b", "init", "--manifest", _manifest(tmp_path, "mb", []))
    a = cli.j(tmp_path / "a", "init", "--manifest", _manifest(tmp_path, "ma", [b]))
    A, B = tmp_path / "a", tmp_path / "b"
    cli.j(A, "evict", "--auto", fake="+3650d")               # the lying source: "synchronised"
    assert cli.j(A, "status")["clock"]["evidence_ms"] > int(time.time() * 1000) + YEAR_MS
    p = cli(A, "evict", "--auto", ok=False)                  # the clock is right again
    assert p.returncode == 2 and "clock_untrusted" in p.stderr, p.stderr   # stuck, until the mesh speaks
    cli(B, "write", "app.readings", "--key", json.dumps({"device": "b", "seq": 1}), "--set", '{"temp": 1.5}')
    f = tmp_path / "b-to-a.body"
    cli(B, "mailbox", "export", "--peer", a["site_id"], "--out", f)
    assert cli.j(A, "mailbox", "import", f)["applied"] == 1
    cli.j(A, "evict", "--auto")
    st = cli.j(A, "status")["clock"]
    assert st["trusted"] and st["state"] == "ok" and st["evidence_ms"] <= int(time.time() * 1000), st
    surfaced = [json.loads(x) for x in cli(A, "events").stdout.splitlines() if x.strip()]
    assert "clock_evidence_reset" in [e["reason"] for e in surfaced if e["kind"] == "clock"], surfaced
    # A clock set back while synchronised, which the peers' newer time contradicts, is still refused.
    p = cli(A, "evict", "--auto", fake="-30d", ok=False)
    assert p.returncode == 2 and "clock_untrusted" in p.stderr, p.stderr
