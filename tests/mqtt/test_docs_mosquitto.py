"""docs/mqtt.md's mosquitto set-up as a broker administrator follows it: the configuration names
nothing mosquitto 2 deprecates and lets the largest body a profile sends through, and the password
and ACL files, owned and moded as the docs say, are readable by mosquitto after it drops root for
its own user (files only root can read stop it at start)."""
from __future__ import annotations

import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from agent.transport.broker import acl_text, find_mosquitto, free_port, port_open, write_password_file
from agent.transport.mqtt import max_packet_size

from .test_broker_security import DOCS, docs_broker, docs_conf_blocks, make_pki

ROOT = Path(__file__).resolve().parents[2]
MESH = bytes.fromhex("5e5e0000000000000000000000000042")


def test_docs_conf_has_nothing_deprecated_and_fits_every_profile(tmp_path):
    conf, _ = docs_conf_blocks()
    settings = dict(ln.split(" ", 1) for ln in conf.splitlines() if ln and not ln.startswith("#"))
    largest = max(_body_limit(p) for p in (ROOT / "agent" / "profiles").glob("*.toml"))
    assert int(settings["max_packet_size"]) >= max_packet_size(largest), (settings.get("max_packet_size"), largest)
    pki = make_pki(tmp_path / "pki", [])
    br = docs_broker(tmp_path, pki, {"dev": "pw"})
    try:
        log = br.log_path.read_text()   # written at start, before the listener opened
    finally:
        br.close()
    assert not re.search(r"deprecated|recommended to replace", log, re.I), log


def _body_limit(profile: Path) -> int:
    m = re.search(r"^body_limit_bytes\s*=\s*(\d+)", profile.read_text(), re.M)
    assert m, profile
    return int(m.group(1))


def _docs_commands() -> list[list[str]]:
    """The chown/chmod lines of docs/mqtt.md's ```sh block about the password and ACL files."""
    blocks = re.findall(r"```sh\n(.*?)```", DOCS.read_text(), re.S)
    cmds = [ln.split() for b in blocks for ln in b.splitlines() if "ssp.passwd" in ln and "ssp.acl" in ln]
    assert {c[0] for c in cmds} == {"chown", "chmod"}, cmds
    return cmds


def _mosquitto_as_its_user(d: Path, port: int) -> subprocess.Popen:
    conf = d / "m.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous false\npassword_file {d / 'ssp.passwd'}\n"
                    f"acl_file {d / 'ssp.acl'}\nuser mosquitto\nlog_dest stderr\nlog_type all\n")
    return subprocess.Popen([find_mosquitto(), "-c", str(conf)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _started(proc: subprocess.Popen, port: int) -> bool:
    deadline = time.monotonic() + 60   # a bound on waiting for a start or an exit, not a timing claim
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        if port_open("127.0.0.1", port):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.skipif(os.geteuid() != 0, reason="mosquitto drops root only when started as root")
def test_mosquitto_reads_the_files_the_docs_way_after_dropping_root():
    try:
        pwd.getpwnam("mosquitto")
    except KeyError:
        pytest.fail("no `mosquitto` user: Debian's mosquitto package makes it (apt-get install mosquitto)")
    # a directory the mosquitto user can enter (pytest's temporary directories are root's only)
    d = Path(tempfile.mkdtemp(prefix="ssp-docs-mosq-"))
    os.chmod(d, 0o755)
    procs = []
    try:
        write_password_file(d / "ssp.passwd", {"dev": "pw"})   # 0600 root, as mosquitto_passwd -c makes it
        (d / "ssp.acl").write_text(acl_text([MESH]))
        os.chmod(d / "ssp.acl", 0o600)
        port = free_port()
        procs.append(_mosquitto_as_its_user(d, port))
        assert not _started(procs[-1], port)   # root's files: mosquitto stops at start
        out = procs[-1].communicate(timeout=60)[0]
        assert "pwfile" in out or "password" in out.lower(), out
        for cmd in _docs_commands():
            subprocess.run([*cmd[:-2], str(d / "ssp.passwd"), str(d / "ssp.acl")], check=True)
        port = free_port()
        procs.append(_mosquitto_as_its_user(d, port))
        assert _started(procs[-1], port), procs[-1].communicate(timeout=60)[0]
        ok = []
        c = paho.Client(CallbackAPIVersion.VERSION2, client_id="dev", protocol=paho.MQTTv5)
        c.username_pw_set("dev", "pw")
        c.on_connect = lambda _c, _u, _f, rc, _p: ok.append(not rc.is_failure)
        c.connect("127.0.0.1", port)
        c.loop_start()
        deadline = time.monotonic() + 60
        while not ok and time.monotonic() < deadline:
            time.sleep(0.05)
        c.loop_stop()
        c.disconnect()
        assert ok == [True]   # the password file was read: the device's password is accepted
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(30)
        shutil.rmtree(d)
