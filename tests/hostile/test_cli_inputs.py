"""Files and arguments handed to the installed command (helper 52's probe of the CLI's file
boundaries): a FIFO hung `init --manifest`, `mailbox import` and every verb reading agent.toml for
ever; /dev/zero grew them until MemoryError (15 GB seen); a 200 MB Commit took `sequencer submit`
to 241 MB before it was refused; a Latin-1 byte, deep nesting, NaN or infinity, or a section of
the wrong shape gave a traceback (exit 1) instead of a refusal; `sync` on a home holding no node
left its private mosquitto running. Every case here must end in a refusal: exit 2, one line, no
traceback, within seconds."""
from __future__ import annotations

import json
import os
import socket
import subprocess

import pytest

from ..cli_cmd import agent_cmd, agent_env
from ..mqtt.helpers import MANIFEST
from tests.waiting import HANG_S

DEEP = "a = " + "[" * 3000 + "]" * 3000 + "\n"


def run(home, *args, env=None, timeout=30):
    return subprocess.run([*agent_cmd(), "--home", str(home), *args], capture_output=True, text=True,
                          env=agent_env(env), timeout=timeout)


def refused(p) -> None:
    assert p.returncode == 2, (p.returncode, p.stdout[-500:], p.stderr[-1500:])
    assert "Traceback" not in p.stderr, p.stderr[-1500:]


@pytest.fixture
def fifo(tmp_path):
    f = tmp_path / "fifo"
    os.mkfifo(f)
    return f


@pytest.fixture
def sparse(tmp_path):
    f = tmp_path / "sparse"
    with open(f, "wb") as out:
        out.truncate(200 * 1024 * 1024)     # 200 MB that cost nothing to write
    return f


@pytest.fixture
def node_home(tmp_path):
    m = tmp_path / "m.toml"
    m.write_text(MANIFEST)
    home = tmp_path / "node"
    assert run(home, "init", "--manifest", str(m)).returncode == 0
    return home


@pytest.mark.parametrize("what", ["fifo", "/dev/zero", "latin1", "deep"])
def test_init_refuses_a_manifest_that_is_not_a_text_file_it_can_use(tmp_path, fifo, what):
    m = {"fifo": fifo, "/dev/zero": "/dev/zero"}.get(what, tmp_path / "m.toml")
    if what == "latin1":
        m.write_bytes(MANIFEST.encode() + "# caf\u00e9\n".encode("latin-1"))
    elif what == "deep":
        m.write_text(MANIFEST + DEEP)
    p = run(tmp_path / "h", "init", "--manifest", str(m))
    refused(p)
    assert not (tmp_path / "h" / "store.sqlite").exists()


@pytest.mark.parametrize("what", ["fifo", "/dev/zero", "deep", "latin1"])
def test_a_configuration_file_it_cannot_use_is_refused(tmp_path, fifo, what):
    conf = {"fifo": fifo, "/dev/zero": "/dev/zero"}.get(what, tmp_path / "agent.toml")
    if what == "deep":
        conf.write_text(DEEP)
    elif what == "latin1":
        conf.write_bytes("# caf\u00e9\n".encode("latin-1"))
    p = subprocess.run([*agent_cmd(), "status"], capture_output=True, text=True, timeout=30,
                       env=agent_env({"SSP_AGENT_CONFIG": str(conf), "SSP_AGENT_HOME": ""}))
    refused(p)


def test_mailbox_import_of_a_fifo_is_refused_without_waiting(node_home, fifo):
    refused(run(node_home, "mailbox", "import", str(fifo), timeout=HANG_S))


@pytest.mark.parametrize("text", ["[sync]\ncadence_s = nan", "[sync]\ncadence_s = inf", "[sync]\nbatch_limit = inf",
                                  "[serial]\nwindow_bytes = nan", "[store]\nrecords_limit_mb = inf", "store = 5",
                                  "sync = [1, 2]", "[eviction]\ninterval_s = inf",
                                  "[horizons]\nraw = \"99999999999999999999999w\"", DEEP])
def test_a_profile_with_values_no_setting_can_take_is_refused(tmp_path, text):
    prof = tmp_path / "p.toml"
    prof.write_text('name = "odd"\n' + text + "\n")
    m = tmp_path / "m.toml"
    m.write_text(MANIFEST)
    p = run(tmp_path / "h", "init", "--manifest", str(m), "--profile", str(prof))
    refused(p)
    assert "odd" in p.stderr or "p.toml" in p.stderr, p.stderr


def test_table_create_refuses_a_deeply_nested_spec(node_home):
    p = run(node_home, "table", "create", "--spec", "[" * 60000 + "]" * 60000)
    refused(p)
    assert "nested too deeply" in p.stderr, p.stderr


@pytest.mark.parametrize("verb", ["submit", "adopt", "recover", "queue"])
@pytest.mark.parametrize("what", ["/dev/zero", "sparse", "fifo"])
def test_sequencer_files_are_refused_without_reading_them_whole(tmp_path, fifo, sparse, verb, what):
    """The peak RSS is read in a process of its own (ru_maxrss of the children is a high-water
    mark over every child a process ever had)."""
    seq = tmp_path / "seq"
    key = json.loads(run(seq, "sequencer", "init").stdout)["sequencer_key"]
    f = {"fifo": fifo, "/dev/zero": "/dev/zero", "sparse": sparse}[what]
    args = {"submit": ("sequencer", "submit", str(f)), "adopt": ("sequencer", "adopt", str(f)),
            "recover": ("sequencer", "recover", "--group", "aa" * 16, "--binding", f"0:{key}", str(f)),
            "queue": ("commits", "queue", str(f), "--sequencer-key", key)}[verb]
    home = tmp_path / "m" if verb == "queue" else seq
    probe = ("import resource, subprocess, sys, json\n"
             "p = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=30)\n"
             "print(json.dumps({'rc': p.returncode, 'err': p.stderr[-1500:], 'out': p.stdout[-300:],\n"
             "                  'rss_kb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))\n")
    out = subprocess.run(["python3", "-c", probe, *agent_cmd(), "--home", str(home), *args], capture_output=True,
                         text=True, env=agent_env(), timeout=60)
    r = json.loads(out.stdout)
    assert r["rc"] == 2 and "Traceback" not in r["err"], r
    assert r["rss_kb"] < 120 * 1024, r       # the whole file would be 200 MB (or unbounded)


def test_sync_on_a_home_without_a_node_leaves_no_private_broker_running(tmp_path):
    p = run(tmp_path / "empty", "sync", "--once", timeout=60)
    refused(p)
    for line in p.stderr.splitlines():      # had it started one, it would say where
        if "private mosquitto at" in line:
            port = int(line.rsplit(":", 1)[1])
            with socket.socket() as s:
                assert s.connect_ex(("127.0.0.1", port)) != 0, "the private mosquitto still runs"


@pytest.mark.parametrize("what", ["fifo", "/dev/zero", "sparse", "latin1"])
def test_service_install_refuses_a_password_file_it_cannot_use(tmp_path, fifo, sparse, what):
    """`service install --password-file` read it with read_text(): a FIFO hung it, /dev/zero and a
    200 MB file were read whole, a Latin-1 byte gave a traceback. Now read_input, PASSWORD_LIMIT."""
    pw = {"fifo": fifo, "/dev/zero": "/dev/zero", "sparse": sparse}.get(what, tmp_path / "pw")
    if what == "latin1":
        pw.write_bytes("caf\u00e9\n".encode("latin-1"))
    root = tmp_path / "root"
    p = run(tmp_path / "h", "service", "install", "--root", str(root), "--bin", "/usr/bin/ssp-agent",
            "--password-file", str(pw), timeout=HANG_S)
    refused(p)
    assert len(p.stderr.strip().splitlines()) == 1 and "--password-file" in p.stderr, p.stderr
    assert not (root / "etc/ssp-agent/mqtt-password").exists()


def test_service_install_refuses_over_an_operator_password_file_that_is_not_utf8(tmp_path):
    """The password file already installed was read with read_text() to see whether it is empty:
    a Latin-1 byte in it gave a traceback (exit 1) after the units were written. Now: one line,
    exit 2, before anything is written, and the operator's file is kept byte for byte."""
    root = tmp_path / "root"
    installed = root / "etc/ssp-agent/mqtt-password"
    installed.parent.mkdir(parents=True)
    installed.write_bytes("caf\u00e9\n".encode("latin-1"))
    new = tmp_path / "pw"
    new.write_text("s3cret\n")
    p = run(tmp_path / "h", "service", "install", "--root", str(root), "--bin", "/usr/bin/ssp-agent",
            "--password-file", str(new), timeout=HANG_S)
    refused(p)
    assert len(p.stderr.strip().splitlines()) == 1 and "--force" in p.stderr, p.stderr
    assert installed.read_bytes() == "caf\u00e9\n".encode("latin-1")
    assert not (root / "etc/systemd").exists()


def _policy_rows(home) -> list[str]:
    p = run(home, "policy", "list")
    assert p.returncode == 0, p.stderr
    return p.stdout.splitlines()


@pytest.mark.parametrize("table", ["app.nosuch", "nosuch.readings", "nosuch.*"])
def test_policy_refuses_a_table_the_home_does_not_have(node_home, table):
    """A policy row for a table the home's schema lacks was stored (a typo that never matches)."""
    before = _policy_rows(node_home)
    p = run(node_home, "policy", "allow", "--peer", "*", "--table", table, "--layer", "user")
    refused(p)
    assert len(p.stderr.strip().splitlines()) == 1 and table.rstrip("*").rstrip(".") in p.stderr, p.stderr
    assert _policy_rows(node_home) == before


@pytest.mark.parametrize("role", ["r" * 100_000, "r" * 64, "field\nops"])
def test_policy_refuses_a_role_name_no_role_could_sensibly_have(node_home, role):
    """A 100 KB role name was stored (and printed back by `policy list`)."""
    before = _policy_rows(node_home)
    p = run(node_home, "policy", "deny", "--peer", "*", "--table", "app.readings", "--layer", "role", "--role", role)
    refused(p)
    assert len(p.stderr.strip().splitlines()) == 1 and len(p.stderr) < 400, p.stderr[:500]
    assert _policy_rows(node_home) == before


def test_policy_takes_a_known_table_and_a_role_of_63_characters(node_home):
    for table, role in (("app.readings", "r" * 63), ("app.*", "field-tech.eu")):
        p = run(node_home, "policy", "deny", "--peer", "*", "--table", table, "--layer", "role", "--role", role)
        assert p.returncode == 0, p.stderr
    assert any('"role": "field-tech.eu"' in r for r in _policy_rows(node_home))


def test_record_issue_role_refuses_a_role_no_policy_row_could_name(node_home, tmp_path):
    auth = tmp_path / "auth"
    card = json.loads(run(node_home, "authority", "create", "--out", str(auth)).stdout)
    assert run(node_home, "authority", "add", "--site-id", card["site_id"], "--public-key",
               card["public_key"]).returncode == 0
    subject = "ab" * 16
    p = run(node_home, "record", "issue-role", "--subject", subject, "--role", "r" * 100_000, "--authority-key", str(auth))
    refused(p)
    assert len(p.stderr.strip().splitlines()) == 1 and len(p.stderr) < 400, p.stderr[:500]
    p = run(node_home, "record", "issue-role", "--subject", subject, "--role", "field-tech", "--authority-key", str(auth))
    assert p.returncode == 0, p.stderr


def _rehydration(home) -> dict:
    p = run(home, "rehydrate", "--status")
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)["rehydrating"]


def _import(home, tmp_path, name, body: bytes) -> dict:
    f = tmp_path / name
    f.write_bytes(body)
    p = run(home, "mailbox", "import", str(f))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_rehydration_counts_only_verified_events_as_received(tmp_path):
    """A body naming the source as its sender, full of events that fail verification (signed by a
    key nobody trusts, or claiming the source's kid under another key), counted them all in
    `events_received` (and as the source's last body)."""
    from agent.simpeer import SimPeer, manifest_text, readings_table
    from ..mqtt.helpers import MESH
    src, stranger = SimPeer(MESH), SimPeer(MESH)
    forger = SimPeer(MESH, site_id=src.site_id, key=stranger.key)   # the source's kid, the wrong key
    m = tmp_path / "m.toml"
    m.write_text(manifest_text(MESH, readings_table(), [src]))
    home = tmp_path / "a"
    assert run(home, "init", "--manifest", str(m)).returncode == 0
    assert run(home, "rehydrate", "--from", src.site_id.hex()).returncode == 0
    now = int(__import__("time").time() * 1000)
    forged = [p.event("app.readings", {"device": "d", "seq": i}, {"temp": 1.0}, (now, i))
              for p in (stranger, forger) for i in range(5)]
    res = _import(home, tmp_path, "forged.cbor", src.body(forged))
    assert res["applied"] == 0, res
    s = _rehydration(home)
    assert s["events_received"] == 0 and s["events_unverified"] == 10 and s["events_applied"] == 0, s
    assert s["last_body_events"] == 0, s
    real = [src.event("app.readings", {"device": "s", "seq": i}, {"temp": 2.0}, (now, i)) for i in range(3)]
    _import(home, tmp_path, "real.cbor", src.body(real))
    s = _rehydration(home)
    assert s["events_received"] == 3 and s["events_applied"] == 3 and s["events_unverified"] == 10, s


def test_rehydration_from_a_source_not_trusted_yet_counts_no_body_as_the_source_s(tmp_path):
    """`rehydrate --from` may name a site the home does not trust yet (docs/operations.md §4: its key
    comes with a vouch in the first body), but bodies naming it as their sender counted as the
    source's, and two of them with nothing new set `caught_up`, while nobody vouched for it."""
    from agent.simpeer import SimPeer, manifest_text, readings_table
    from ..mqtt.helpers import MESH
    src = SimPeer(MESH)
    m = tmp_path / "m.toml"
    m.write_text(manifest_text(MESH, readings_table()))
    home = tmp_path / "a"
    assert run(home, "init", "--manifest", str(m)).returncode == 0
    assert run(home, "rehydrate", "--from", src.site_id.hex()).returncode == 0   # not refused: by design
    for i in range(2):
        _import(home, tmp_path, f"b{i}.cbor", src.body([]))
    s = _rehydration(home)
    assert s["bodies"] == 2 and s["bodies_from_source"] == 0 and s["caught_up"] is False, s
    assert s["source_trusted"] is False, s
    assert run(home, "peer", "add", "--site-id", src.site_id.hex(), "--public-key", src.public_key.hex()).returncode == 0
    for i in range(2, 4):
        _import(home, tmp_path, f"b{i}.cbor", src.body([]))
    s = _rehydration(home)
    assert s["bodies_from_source"] == 2 and s["caught_up"] is True and s["source_trusted"] is True, s
