"""Issue 12 item 3: systemd units shipped in the package, installed by `ssp-agent service install`;
`systemd-analyze verify` on every unit; sd_notify READY=1 / WATCHDOG=1 / STOPPING=1 from a real
`run` to a real AF_UNIX datagram socket given as NOTIFY_SOCKET; /etc/ssp-agent/agent.toml gives
`run` and `sync` their broker and credentials when no flag does (flags win)."""
from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agent.simpeer import readings_table
from agent.transport.broker import Broker, write_password_file
from tests.cli_cmd import agent_cmd, agent_env, installed, run_cli

MESH = "00112233445566778899aabbccddeeff"
UNITS = ("ssp-agent.service", "ssp-agent-sync.service", "ssp-agent-sync.timer")


def _init(tmp: Path, name="h") -> Path:
    man = tmp / "m.toml"
    man.write_text(f'mesh_id = "{MESH}"\n' + readings_table(None))
    home = tmp / name
    p = run_cli("--home", home, "init", "--manifest", man)
    assert p.returncode == 0, p.stderr
    return home


def _bin(tmp: Path) -> str:
    """An absolute command for ExecStart=: the installed ssp-agent, or a wrapper around this checkout's."""
    if installed():
        return shutil.which(agent_cmd()[0]) or agent_cmd()[0]
    w = tmp / "bin" / "ssp-agent"
    w.parent.mkdir(parents=True, exist_ok=True)
    w.write_text(f"#!/bin/sh\nexec {sys.executable} -m agent.cli \"$@\"\n")
    w.chmod(0o755)
    return str(w)


# ---------------------------------------------------------------- units
def test_service_install_writes_units_that_systemd_verifies(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here (apt-get install systemd)")
    root, exe = tmp_path / "root", _bin(tmp_path)
    p = run_cli("service", "install", "--root", root, "--bin", exe, "--broker", "mqtts://gw.example:8883",
                "--username", "dev1")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    units = [root / "etc/systemd/system" / u for u in UNITS]
    assert all(str(u) in out["written"] for u in units)
    v = subprocess.run([analyze, "verify", *map(str, units)], capture_output=True, text=True, timeout=120)
    assert v.returncode == 0 and not v.stderr.strip(), v.stderr
    run_unit, sync_unit = units[0].read_text(), units[1].read_text()
    lines = lambda t: {ln.strip() for ln in t.splitlines() if ln.strip() and not ln.startswith("#")}  # noqa: E731
    for unit in (run_unit, sync_unit):
        ls = lines(unit)
        assert "After=time-set.target network-online.target" in ls
        assert not any("time-sync.target" in ln for ln in ls)          # never blocks on NTP (no RTC)
        assert not any(ln.startswith("MemoryDenyWriteExecute") for ln in ls)   # cffi callbacks need W+X
        assert {"StateDirectory=ssp-agent", "ConfigurationDirectory=ssp-agent", "StandardOutput=journal",
                "NoNewPrivileges=yes", "ProtectSystem=strict"} <= ls
        assert not any(ln.startswith("ExecStart=/opt/") for ln in ls)   # names the installed command
    assert {"Type=notify", "WatchdogSec=120", "Restart=on-failure", "RestartPreventExitStatus=2",
            f"ExecStart={exe} run"} <= lines(run_unit)
    assert {"Type=oneshot", f"ExecStart={exe} sync --once"} <= lines(sync_unit)
    conf = (root / "etc/ssp-agent/agent.toml").read_text()
    assert 'broker = "mqtts://gw.example:8883"' in conf and 'username = "dev1"' in conf
    pw = root / "etc/ssp-agent/mqtt-password"
    assert pw.read_text() == "" and oct(pw.stat().st_mode & 0o777) == "0o600"
    # An operator's configuration is kept; flags that would change it are refused without --force.
    assert run_cli("service", "install", "--root", root, "--bin", exe).returncode == 0
    assert 'username = "dev1"' in (root / "etc/ssp-agent/agent.toml").read_text()
    p = run_cli("service", "install", "--root", root, "--bin", exe, "--broker", "mqtt://other:1883")
    assert p.returncode == 2 and "--force" in p.stderr
    # `systemd-analyze security` scores the always-on unit (printed for the record; not asserted).
    s = subprocess.run([analyze, "security", "--offline=true", str(units[0])], capture_output=True, text=True,
                       timeout=120)
    print(s.stdout.strip().splitlines()[-1] if s.stdout.strip() else s.stderr)


# ---------------------------------------------------------------- sd_notify from a real run
def _recv_until(sock: socket.socket, want: str, seen: list[str], deadline_s: float = 120.0) -> None:
    sock.settimeout(deadline_s)   # a bound on waiting, not a timing assertion
    while not any(want in m.split("\n") for m in seen):
        seen.append(sock.recv(4096).decode())


def test_run_tells_systemd_ready_pings_the_watchdog_and_says_stopping(broker, tmp_path):
    home = _init(tmp_path)
    addr = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(addr)
    env = agent_env({"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "1000000"})
    proc = subprocess.Popen([*agent_cmd(), "--home", str(home), "run", "--broker", broker.url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        seen: list[str] = []
        _recv_until(sock, "READY=1", seen)
        ready = next(m for m in seen if "READY=1" in m.split("\n"))
        assert f"MAINPID={proc.pid}" in ready.split("\n")
        # READY means serving: the control socket answers at once.
        st = run_cli("--home", home, "status")
        assert st.returncode == 0 and json.loads(st.stdout)["run"]["pid"] == proc.pid, st.stderr
        n = len(seen)
        _recv_until(sock, "WATCHDOG=1", seen)
        assert sum(m == "WATCHDOG=1" for m in seen[n:]) >= 1
        seen.append(sock.recv(4096).decode())   # the loop keeps pinging (every WATCHDOG_USEC/2)
        assert seen[-1] == "WATCHDOG=1"
        proc.send_signal(signal.SIGTERM)
        _recv_until(sock, "STOPPING=1", seen)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()


def test_no_notify_socket_no_notifications(tmp_path, monkeypatch):
    """Outside systemd nothing is sent (and a socket nobody listens on is harmless)."""
    from agent import sdnotify
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    assert sdnotify.notify("READY=1") is False


# ---------------------------------------------------------------- /etc/ssp-agent/agent.toml
@pytest.fixture
def auth_broker(tmp_path):
    pw = write_password_file(tmp_path / "passwd", {"dev1": "s3cret"})
    port_broker = Broker(workdir=tmp_path / "abroker")
    port_broker.listener_conf = (f"listener {port_broker.port} 127.0.0.1\nallow_anonymous false\n"
                                 f"password_file {pw}")
    port_broker.start()
    yield port_broker
    port_broker.close()


def test_config_file_gives_sync_its_home_broker_and_credentials(auth_broker, tmp_path):
    home = _init(tmp_path)
    run_cli("--home", home, "write", "app.readings", "--key", '{"device":"d1","seq":1}', "--set", '{"temp":1.0}')
    secret = tmp_path / "mqtt-password"
    secret.write_text("s3cret\n")
    secret.chmod(0o600)
    conf = tmp_path / "agent.toml"
    conf.write_text(f'home = "{home}"\n[mqtt]\nbroker = "{auth_broker.url}"\nusername = "dev1"\n'
                    f'password_file = "{secret}"\n')
    env = {"SSP_AGENT_CONFIG": str(conf)}
    env_clean = {k: "" for k in ("SSP_AGENT_HOME", "SSP_MQTT_BROKER", "SSP_MQTT_USERNAME", "SSP_MQTT_PASSWORD")}
    p = run_cli("sync", "--once", "--timeout", "2", env={**env_clean, **env})   # no --home, no --broker
    assert p.returncode == 0, p.stderr
    assert "pushed" in json.loads(p.stdout)
    # Without the password the broker refuses: the credentials really came from the file.
    conf.write_text(f'home = "{home}"\n[mqtt]\nbroker = "{auth_broker.url}"\nusername = "dev1"\n')
    p = run_cli("sync", "--once", "--timeout", "2", env={**env_clean, **env})
    assert p.returncode == 1 and "refused" in p.stderr, p.stderr
    # systemd's credential (LoadCredential=mqtt-password:...) is the password under the units.
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "mqtt-password").write_text("s3cret\n")
    p = run_cli("sync", "--once", "--timeout", "2", env={**env_clean, **env, "CREDENTIALS_DIRECTORY": str(creds)})
    assert p.returncode == 0, p.stderr
    # Flags win over the file, and the environment over the file.
    conf.write_text(f'home = "{home}"\n[mqtt]\nbroker = "mqtt://127.0.0.1:1"\nusername = "dev1"\n'
                    f'password_file = "{secret}"\n')
    p = run_cli("sync", "--once", "--timeout", "2", "--connect-timeout", "2", env={**env_clean, **env})
    assert p.returncode == 1 and "127.0.0.1:1" in p.stderr, p.stderr
    p = run_cli("sync", "--once", "--timeout", "2", "--broker", auth_broker.url, env={**env_clean, **env})
    assert p.returncode == 0, p.stderr
    p = run_cli("sync", "--once", "--timeout", "2", env={**env_clean, **env, "SSP_MQTT_BROKER": auth_broker.url})
    assert p.returncode == 0, p.stderr
    # A password in the configuration file, or an unknown key, is refused (exit 2) with the reason.
    conf.write_text(f'[mqtt]\nbroker = "{auth_broker.url}"\npassword = "s3cret"\n')
    p = run_cli("--home", home, "sync", "--once", env={**env_clean, **env})
    assert p.returncode == 2 and "no password in the configuration file" in p.stderr, p.stderr
    conf.write_text('[mqtt]\nbrokr = "x"\n')
    p = run_cli("--home", home, "sync", "--once", env={**env_clean, **env})
    assert p.returncode == 2 and "mqtt.brokr" in p.stderr, p.stderr
