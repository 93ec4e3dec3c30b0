"""systemd and metrics over a serial line: `run --serial` under systemd tells it READY=1 and
pings the watchdog (a real datagram socket as NOTIFY_SOCKET), and writes its metrics file;
`sync --serial --once --metrics-file` counts its run."""
from __future__ import annotations

import signal
import socket
import subprocess

from ..cli_cmd import agent_cmd, agent_env
from ..mqtt.test_health import metric, parse_prom
from ..mqtt.test_systemd import _recv_until
from .test_pty import cli, homes, relay_factory  # noqa: F401  (the fixture)


def test_run_serial_notifies_systemd_and_writes_metrics(tmp_path, relay_factory):  # noqa: F811
    ha, _hb = homes(tmp_path, 1, 0)
    relay = relay_factory()
    addr = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(addr)
    out = tmp_path / "a.prom"
    proc = subprocess.Popen([*agent_cmd(), "--home", str(ha), "run", "--serial", relay.ports[0],
                             "--metrics-file", str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=agent_env({"NOTIFY_SOCKET": addr, "WATCHDOG_USEC": "1000000"}))
    try:
        seen: list[str] = []
        _recv_until(sock, "READY=1", seen)
        _recv_until(sock, "WATCHDOG=1", seen)
        proc.send_signal(signal.SIGTERM)
        _recv_until(sock, "STOPPING=1", seen)
        assert proc.wait(timeout=60) == 0
        s = parse_prom(out.read_text())
        assert metric(s, "ssp_events_total", origin="local", outcome="applied") == 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        sock.close()


def test_sync_serial_once_counts_its_run(tmp_path, relay_factory):  # noqa: F811
    ha, _hb = homes(tmp_path, 1, 0)
    relay = relay_factory()
    out = tmp_path / "a.prom"
    p = cli(ha, "sync", "--serial", relay.ports[0], "--once", "--timeout", "1.5", "--metrics-file", str(out))
    assert p.returncode == 1   # nobody at the other end
    assert metric(parse_prom(out.read_text()), "ssp_sync_runs_total", outcome="failed") == 1
