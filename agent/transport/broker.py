"""A private mosquitto on a free loopback port, configured in a temporary directory.

Used by the tests (a real broker, never a mock), by `ssp-agent sync` when no `--broker` is
given, and by the demo. The broker is a mailbox only: it persists queued messages as
periodic snapshots and loses them on SIGKILL, so nothing durable ever depends on it
(SQLite is the outbox; cursors and re-offering guarantee delivery).
"""
from __future__ import annotations

import base64
import getpass
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

from ..timesource import SYSTEM, Clock

CANDIDATES = ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto", "/usr/bin/mosquitto")


def password_hash(password: str, salt: bytes | None = None, iterations: int = 101) -> str:
    """A mosquitto (2.x) password-file hash: `$7$` = PBKDF2-HMAC-SHA512, what `mosquitto_passwd`
    writes, so no mosquitto tool is needed to provision devices."""
    salt = salt or os.urandom(12)
    dk = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, iterations, 64)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(dk).decode()}"


def write_password_file(path: str | Path, users: dict[str, str]) -> Path:
    """username -> password, written as a mosquitto password file (mode 0600)."""
    path = Path(path)
    path.write_text("".join(f"{u}:{password_hash(pw)}\n" for u, pw in sorted(users.items())))
    os.chmod(path, 0o600)
    return path


def acl_text(mesh_ids: list[bytes], prefix: str = "ssp") -> str:
    """The per-device ACL of docs/mqtt.md (username = the device's site_id in hex, `%u`): a device
    reads only its own inbox and everyone's presence, publishes bodies and answers only under its
    own name (the last inbox segment), and presence only for itself."""
    out = ["# %u is the authenticated username (the device's site_id)"]
    for m in mesh_ids:
        b = f"{prefix}/{m.hex()}"
        out += [f"pattern read  {b}/%u/inbox/#", f"pattern write {b}/+/inbox/req/%u",
                f"pattern write {b}/+/inbox/ans/%u", f"pattern write {b}/%u/presence",
                f"pattern read  {b}/+/presence"]
    return "\n".join(out) + "\n"


class BrokerError(RuntimeError):
    """The private broker could not be started (mosquitto missing, port unusable...)."""


def find_mosquitto() -> str | None:
    found = shutil.which("mosquitto")
    if found:
        return found
    for c in CANDIDATES:
        if os.access(c, os.X_OK):
            return c
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class Broker:
    """start() / stop() / kill() / restart() a mosquitto bound to 127.0.0.1:port.

    `max_packet_size` caps one MQTT packet (mosquitto 2 disconnects a client that sends a larger
    one and announces it to MQTT 5 clients at CONNACK); `extra_conf` is appended verbatim (ACLs,
    TLS listeners...). Persistence is on (a clean stop writes the snapshot, SIGKILL loses it).
    `listener_conf` replaces the default loopback listener and `allow_anonymous true` (a TLS
    listener, `allow_anonymous false` with a password file and an ACL file...); it must keep
    the listener on `self.port`. `raw_conf` replaces every setting but logging and the user
    (a mosquitto.conf written for production, tried out on a loopback port).
    """

    def __init__(self, port: int | None = None, workdir: str | Path | None = None, *,
                 max_packet_size: int | None = None,
                 extra_conf: str = "", persistence: bool = True, verbose: bool = False,
                 listener_conf: str | None = None, raw_conf: str | None = None, clock: Clock = SYSTEM) -> None:
        self.clock = clock  # the waits for the port to open and close
        self.exe = find_mosquitto()
        if self.exe is None:
            raise BrokerError("mosquitto is not installed: `apt-get install mosquitto` (Debian/Raspberry Pi OS), "
                              "or give a broker with --broker mqtt://HOST:PORT")
        self.host = "127.0.0.1"
        self.port = port or free_port()
        self._own_dir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="ssp-mosquitto-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_packet_size = max_packet_size
        self.extra_conf = extra_conf
        self.listener_conf = listener_conf
        self.raw_conf = raw_conf
        self.persistence = persistence
        self.verbose = verbose
        self.proc: subprocess.Popen | None = None
        self.conf_path = self.dir / "mosquitto.conf"
        self.log_path = self.dir / "mosquitto.log"

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def config_text(self) -> str:
        if self.raw_conf is not None:
            lines = [self.raw_conf.strip(), f"log_dest file {self.log_path}"]
            lines += ["log_type all"] if self.verbose else ["log_type error", "log_type warning", "log_type notice"]
            if os.geteuid() == 0:
                lines.append(f"user {getpass.getuser()}")
            return "\n".join(lines) + "\n"
        lines = ["# written by ssp-agent: a private broker for one machine (loopback only)"]
        lines += ([f"listener {self.port} {self.host}", "allow_anonymous true"] if self.listener_conf is None
                  else [self.listener_conf.strip()])
        lines += [
            f"persistence {'true' if self.persistence else 'false'}",
            f"persistence_location {self.dir}/",
            "autosave_interval 1800",
            # A mailbox for devices that are offline for a while: keep their queued bodies.
            "max_queued_messages 100000",
            "max_queued_bytes 0",
            "max_inflight_messages 100",
            "persistent_client_expiration 30d",
            f"log_dest file {self.log_path}",
            "log_type error",
            "log_type warning",
            "log_type notice",
        ]
        if self.verbose:
            lines.append("log_type all")
        if self.max_packet_size:
            lines.append(f"max_packet_size {self.max_packet_size}")
        if os.geteuid() == 0:
            # mosquitto drops root to user `mosquitto`, who cannot write our temp dir.
            lines.append(f"user {getpass.getuser()}")
        return "\n".join(lines) + "\n" + self.extra_conf + ("\n" if self.extra_conf else "")

    def start(self, timeout: float = 10.0) -> "Broker":
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.conf_path.write_text(self.config_text())
        err = open(self.dir / "mosquitto.stderr", "ab")
        self.proc = subprocess.Popen([self.exe, "-c", str(self.conf_path)], stdout=err, stderr=err,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        err.close()
        deadline = self.clock.mono() + timeout
        while self.clock.mono() < deadline:
            if self.proc.poll() is not None:
                raise BrokerError(f"mosquitto exited with {self.proc.returncode} at start: {self._tail()}")
            if port_open(self.host, self.port):
                return self
            self.clock.sleep(0.02)
        self.kill()
        raise BrokerError(f"mosquitto did not listen on {self.host}:{self.port} within {timeout}s: {self._tail()}")

    def _tail(self) -> str:
        out = []
        for p in (self.dir / "mosquitto.stderr", self.log_path):
            try:
                out.append(p.read_text()[-400:].strip())
            except OSError:
                pass
        return " | ".join(o for o in out if o) or "no output"

    def stop(self, timeout: float = 5.0) -> None:
        """A clean stop (SIGTERM): mosquitto writes its persistence snapshot."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None
        self._wait_port_closed()

    def kill(self) -> None:
        """SIGKILL: the broker loses everything queued since its last snapshot."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
        self._wait_port_closed()

    def restart(self) -> "Broker":
        self.stop()
        return self.start()

    def _wait_port_closed(self, timeout: float = 3.0) -> None:
        deadline = self.clock.mono() + timeout
        while self.clock.mono() < deadline and port_open(self.host, self.port, 0.05):
            self.clock.sleep(0.02)

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "Broker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
