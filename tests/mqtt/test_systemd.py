"""The systemd units shipped in the package, installed by `ssp-agent service install`;
`systemd-analyze verify` on every unit; sd_notify READY=1 / WATCHDOG=1 / STOPPING=1 from a real
`run` to a real AF_UNIX datagram socket given as NOTIFY_SOCKET; /etc/ssp-agent/agent.toml gives
`run` and `sync` their broker and credentials when no flag does (flags win)."""
from __future__ import annotations

import json
import re
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


# ---------------------------------------------------------------- the clock check inside the units' sandbox
# `kernel_synced()` (agent/clockstate.py) reads the kernel's NTP state with adjtimex(); glibc makes
# that a clock_adjtime system call. The units' SystemCallFilter= must allow what the call really
# makes, or inside the service the kernel source reads None and chrony/ntpd are never believed.
CLOCK_CHECK = "from agent.clockstate import kernel_synced; print(kernel_synced())"


def _unit_filter(unit_text: str) -> list[str]:
    tokens = [t for ln in unit_text.splitlines() if ln.startswith("SystemCallFilter=")
              for t in ln.split("=", 1)[1].split()]
    assert tokens and not any(t.startswith("~") for t in tokens), tokens   # an allow list
    return tokens


def _expand(tokens: list[str], analyze: str) -> set[str]:
    """The system calls an allow list names: its @groups expanded as this systemd defines them."""
    text = subprocess.run([analyze, "syscall-filter"], capture_output=True, text=True, timeout=120).stdout
    groups: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        s = line.strip()
        if not s or s.startswith("#"):
            continue
        if line.startswith("@"):
            current = groups.setdefault(s, [])
        elif current is not None:
            current.append(s)

    def names(t: str) -> set[str]:
        return set().union(*(names(m) for m in groups[t])) if t.startswith("@") else {t}
    return set().union(*(names(t) for t in tokens))


def _python() -> str:
    from tests.cli_cmd import installed_python
    return installed_python() or sys.executable


def _clock_syscalls(tmp: Path) -> set[str]:
    """What the clock check really calls, seen by strace."""
    trace = tmp / "clock.strace"
    p = subprocess.run(["strace", "-f", "-qq", "-o", str(trace), "-e", "trace=adjtimex,clock_adjtime",
                        _python(), "-c", CLOCK_CHECK], capture_output=True, text=True, env=agent_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    return {m.group(1) for m in re.finditer(r"^(?:\d+\s+)?(\w+)\(", trace.read_text(), re.M)}


# The unit's seccomp filter, loaded for real with libseccomp in a child process: every named system
# call allowed, anything else EPERM (SystemCallErrorNumber=EPERM), then the clock check.
SECCOMP_CHILD = r"""
import ctypes, json, sys
from agent.clockstate import kernel_synced
kernel_synced()                                   # libc loaded first, as a running service has it
allowed = json.load(open(sys.argv[1]))
lib = ctypes.CDLL("libseccomp.so.2")
lib.seccomp_init.restype = ctypes.c_void_p
lib.seccomp_init.argtypes = [ctypes.c_uint32]
lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
lib.seccomp_rule_add.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint]
lib.seccomp_load.argtypes = [ctypes.c_void_p]
ctx = lib.seccomp_init(0x00050000 | 1)            # SCMP_ACT_ERRNO(EPERM)
for name in allowed:
    nr = lib.seccomp_syscall_resolve_name(name.encode())
    if nr >= 0:                                   # names this architecture lacks are skipped, as systemd does
        assert lib.seccomp_rule_add(ctx, 0x7FFF0000, nr, 0) == 0, name   # SCMP_ACT_ALLOW
assert lib.seccomp_load(ctx) == 0
print(kernel_synced(), flush=True)
"""


def _in_filter(tmp: Path, allowed: set[str]) -> str:
    spec = tmp / "allowed.json"
    spec.write_text(json.dumps(sorted(allowed)))
    p = subprocess.run([_python(), "-c", SECCOMP_CHILD, str(spec)], capture_output=True, text=True,
                       env=agent_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


@pytest.mark.parametrize("unit", ["ssp-agent.service", "ssp-agent-sync.service"])
def test_units_let_the_clock_check_read_the_kernel(tmp_path, unit):
    analyze = shutil.which("systemd-analyze")
    if analyze is None or shutil.which("strace") is None:
        pytest.skip("needs systemd-analyze and strace (apt-get install systemd strace)")
    from importlib import resources
    allowed = _expand(_unit_filter(resources.files("agent").joinpath("systemd", unit).read_text()), analyze)
    called = _clock_syscalls(tmp_path)
    assert called, "strace saw no clock call: the check did not read the kernel"
    assert called <= allowed, f"{unit} denies {sorted(called - allowed)}, which the clock check calls"
    # The same filter, loaded with libseccomp: the check reads what it reads outside the sandbox.
    import ctypes.util
    if ctypes.util.find_library("seccomp") is None:
        pytest.skip("libseccomp is not installed (apt-get install libseccomp2)")
    outside = subprocess.run([_python(), "-c", CLOCK_CHECK], capture_output=True, text=True, env=agent_env(),
                             timeout=120).stdout.strip()
    assert outside in ("True", "False"), outside
    assert _in_filter(tmp_path, allowed) == outside
    # control: without what the check calls the filter really denies it (the child's filter is live)
    assert _in_filter(tmp_path, allowed - called) == "None"


def test_clock_check_under_systemd_run_with_the_units_properties(tmp_path):
    """Where systemd runs (not in a container without it): the unit's [Service] sandbox, for real."""
    state = subprocess.run(["systemctl", "is-system-running"], capture_output=True, text=True).stdout.strip() \
        if shutil.which("systemctl") else ""
    if state not in ("running", "degraded"):
        pytest.skip(f"no running systemd here (systemctl is-system-running: {state or 'absent'})")
    from importlib import resources
    text = resources.files("agent").joinpath("systemd", "ssp-agent.service").read_text()
    sandbox = ("DynamicUser", "SupplementaryGroups", "UMask", "NoNewPrivileges", "ProtectSystem", "ProtectHome",
               "PrivateTmp", "ProtectKernel", "ProtectControlGroups", "ProtectHostname", "ProtectProc", "Restrict",
               "LockPersonality", "CapabilityBoundingSet", "AmbientCapabilities", "SystemCall")
    props = [x for ln in text.splitlines() if ln.startswith(sandbox) for x in ("-p", ln)]
    outside = subprocess.run([_python(), "-c", CLOCK_CHECK], capture_output=True, text=True,
                             env=agent_env(), timeout=120).stdout.strip()
    checkout = [] if installed() else [f"--setenv=PYTHONPATH={Path(__file__).resolve().parents[2]}"]
    p = subprocess.run(["systemd-run", "--wait", "--pipe", "--quiet", *props, *checkout, _python(), "-c", CLOCK_CHECK],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == outside
