"""A two-node ejabberd cluster (Debian `ejabberd`, MQTT v5 through mod_mqtt, mnesia clustering) on
loopback, started from this file for the tests that run the agent on a clustered broker.

Each node is an Erlang VM with its own configuration, spool and MQTT port in the test's directory;
node 2 joins node 1 (`ejabberd_admin:join_cluster`, what `ejabberdctl join_cluster` calls) and the
MQTT accounts are registered once, in the cluster's shared mnesia. Nothing is left running: `close`
stops both VMs."""
from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

from agent.transport.broker import free_port, port_open

ERL = "/usr/bin/erl"

CONFIG = """\
loglevel: warning
hosts:
  - localhost
auth_method: [internal]
auth_password_format: plain
listen:
  -
    port: {port}
    ip: "127.0.0.1"
    module: mod_mqtt
    backlog: 1000
    max_payload_size: 16777216
acl:
  local:
    user_regexp: ""
access_rules:
  local:
    allow: local
modules:
  mod_mqtt:
    max_queue: 100000
    session_expiry: 3600
    access_publish:
      "#":
        - allow: all
    access_subscribe:
      "#":
        - allow: all
"""


def ejabberd_lib() -> Path | None:
    """The directory holding ejabberd's Erlang applications (ERL_LIBS), or None if not installed."""
    for root in (Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib/aarch64-linux-gnu"), Path("/usr/lib")):
        if any(root.glob("ejabberd-*/ebin/ejabberd.app")):
            return root
    return None


class ClusterError(RuntimeError):
    pass


class EjabberdCluster:
    def __init__(self, workdir: Path, users: dict[str, str], nodes: int = 2) -> None:
        self.workdir = Path(workdir)
        self.users = users
        self.tag = secrets.token_hex(4)
        self.cookie = secrets.token_hex(16)
        self.names = [f"ssp{self.tag}n{i + 1}@localhost" for i in range(nodes)]
        self.ports = [free_port() for _ in range(nodes)]
        self.procs: list[subprocess.Popen] = []

    def url(self, i: int) -> str:
        return f"mqtt://127.0.0.1:{self.ports[i]}"

    def _env(self, i: int) -> dict:
        d = self.workdir / f"n{i + 1}"
        return {**os.environ, "EJABBERD_CONFIG_PATH": str(d / "ejabberd.yml"),
                "EJABBERD_LOG_PATH": str(d / "ejabberd.log"), "ERL_LIBS": str(ejabberd_lib()),
                "ERL_CRASH_DUMP_BYTES": "0", "HOME": str(d)}

    def _start_node(self, i: int) -> None:
        d = self.workdir / f"n{i + 1}"
        (d / "spool").mkdir(parents=True, exist_ok=True)
        (d / "ejabberd.yml").write_text(CONFIG.format(port=self.ports[i]))
        out = open(d / "erl.out", "wb")
        self.procs.append(subprocess.Popen(
            [ERL, "-sname", self.names[i], "-setcookie", self.cookie, "-noinput",
             "-mnesia", "dir", f'"{d / "spool"}"', "-s", "ejabberd"],
            cwd=d, env=self._env(i), stdout=out, stderr=subprocess.STDOUT, start_new_session=True))

    def _wait_port(self, i: int, ceiling: float) -> None:
        deadline = time.monotonic() + ceiling
        while not port_open("127.0.0.1", self.ports[i]):
            if self.procs[i].poll() is not None or time.monotonic() > deadline:
                log = (self.workdir / f"n{i + 1}" / "erl.out").read_text(errors="replace")[-2000:]
                raise ClusterError(f"ejabberd node {i + 1} did not listen on {self.ports[i]}:\n{log}")
            time.sleep(0.2)

    def ctl(self, expr: str, ceiling: float = 300) -> str:
        """Evaluate Erlang `expr` (which must print its result and may use N1, N2 for the node
        names) on a control node connected to the cluster; returns what it printed."""
        bind = "".join(f"N{i + 1} = '{n}', " for i, n in enumerate(self.names))
        p = subprocess.run([ERL, "-sname", f"ssp{self.tag}ctl{secrets.token_hex(2)}@localhost",
                            "-setcookie", self.cookie, "-noinput", "-eval", f"{bind}{expr}, halt()."],
                           capture_output=True, text=True, timeout=ceiling, env={**os.environ, "HOME": str(self.workdir)})
        if p.returncode != 0:
            raise ClusterError(f"ejabberd control call failed: {p.stdout}{p.stderr}")
        return p.stdout

    def start(self, ceiling: float = 600) -> "EjabberdCluster":
        if ejabberd_lib() is None or not os.access(ERL, os.X_OK):
            raise ClusterError("ejabberd is not installed (apt-get install ejabberd)")
        for i in range(len(self.names)):
            self._start_node(i)
        for i in range(len(self.names)):
            self._wait_port(i, ceiling)
        joins = "".join(f"io:format(\"~p~n\", [rpc:call(N{i + 1}, ejabberd_admin, join_cluster, [atom_to_binary(N1)])]), "
                        for i in range(1, len(self.names)))
        regs = "".join(f"io:format(\"~p~n\", [rpc:call(N1, ejabberd_admin, register, [<<\"{u}\">>, <<\"localhost\">>, <<\"{pw}\">>])]), "
                       for u, pw in self.users.items())
        out = self.ctl(joins + regs + "io:format(\"nodes ~p~n\", [rpc:call(N1, mnesia, system_info, [running_db_nodes])])",
                       ceiling)
        if any(n not in out for n in self.names):
            raise ClusterError(f"the ejabberd nodes did not form one cluster: {out}")
        for i in range(len(self.names)):   # join_cluster restarts the joining node's applications
            self._wait_port(i, ceiling)
        return self

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        shutil.rmtree(self.workdir / "n1" / "spool", ignore_errors=True)
