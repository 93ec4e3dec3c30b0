"""`ssp-agent service install [--root DIR]`: the systemd units shipped inside the package
(agent/systemd/, package data) and /etc/ssp-agent/ configuration, written for this installed
command (docs/systemd.md). It only writes files; enabling a unit is the
operator's `systemctl` step (printed). Units are ours and rewritten; the configuration and the
password file are the operator's and kept unless --force."""
from __future__ import annotations

import json
import os
import shutil
import stat
import sys
from importlib import resources
from pathlib import Path

UNITS = ("ssp-agent.service", "ssp-agent-sync.service", "ssp-agent-sync.timer")
SHIPPED_BIN = "/opt/ssp-agent/bin/ssp-agent"   # what the shipped units name; replaced at install
_CONF_FLAGS = ("broker", "username", "ca_file", "cert_file", "key_file")


def register(sub, mailbox_sub) -> None:
    s = sub.add_parser("service", help="systemd units and /etc/ssp-agent configuration (docs/systemd.md)")
    ss = s.add_subparsers(dest="service_verb", metavar="ACTION")
    ss.required = True
    a = ss.add_parser("install", help="write the units (always-on run; sync --once timer) and /etc/ssp-agent/")
    a.add_argument("--root", default="/", help="install under this directory instead of / (an image, a test)")
    a.add_argument("--bin", help="the ssp-agent command the units start (default: this installed command)")
    a.add_argument("--broker", help="broker URL written to agent.toml, e.g. mqtts://gateway:8883")
    a.add_argument("--username", help="broker user name written to agent.toml")
    a.add_argument("--password-file", help="copied to /etc/ssp-agent/mqtt-password (0600), the units' credential")
    a.add_argument("--ca-file", help="CA bundle path written to agent.toml")
    a.add_argument("--cert-file", help="client certificate path written to agent.toml")
    a.add_argument("--key-file", help="client key path written to agent.toml")
    a.add_argument("--secure-binding", action="store_true",
                   help="write secure_binding = true to agent.toml: only when the broker enforces per-device "
                        "accounts and ACLs (docs/mqtt.md \"Authenticated or not\")")
    a.add_argument("--force", action="store_true", help="replace an existing agent.toml / mqtt-password")
    a.add_argument("--clock-trusted", action="store_true",
                   help="the device has a real-time clock: write SSP_AGENT_CLOCK_TRUSTED=1 to /etc/ssp-agent/environment, "
                        "which the units read (docs/apply.md \"Clocks without an RTC\")")
    a.set_defaults(fn=cmd_install, home_optional=True)


def unit_text(name: str, bin_path: str) -> str:
    text = resources.files("agent").joinpath("systemd", name).read_text()
    return text.replace(SHIPPED_BIN, bin_path)


def default_bin() -> str:
    """The command this process was started as, when it is an installed `ssp-agent`."""
    here = Path(sys.executable).parent / "ssp-agent"
    if here.exists():
        return str(here)
    return shutil.which("ssp-agent") or SHIPPED_BIN


def config_text(args) -> str:
    template = resources.files("agent").joinpath("systemd", "agent.toml").read_text()
    lines = []
    for line in template.splitlines():
        for k in _CONF_FLAGS:
            v = getattr(args, k, None)
            if v and line.startswith(f"# {k} = "):
                line = f"{k} = {json.dumps(v)}"
        if getattr(args, "secure_binding", False) and line.startswith("# secure_binding = "):
            line = "secure_binding = true    # the broker enforces per-device accounts and ACLs (docs/mqtt.md)"
        lines.append(line)
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _holds_text(path: Path) -> bool:
    """Whether ``path`` is a regular file holding more than white space (its first 64 KiB read)."""
    try:
        with open(path, "rb", opener=lambda p, f: os.open(p, f | os.O_NONBLOCK)) as f:
            return stat.S_ISREG(os.fstat(f.fileno()).st_mode) and bool(f.read(65536).strip())
    except FileNotFoundError:
        return False
    except OSError as e:
        from .common import Refused
        raise Refused(f"cannot read {path}: {e.strerror}") from None


def cmd_install(args) -> int:
    from .common import EXIT_OK, PASSWORD_LIMIT, Refused, emit, read_input
    root = Path(args.root)
    bin_path = args.bin or default_bin()
    if not Path(bin_path).is_absolute():
        raise Refused(f"--bin must be an absolute path (systemd needs one), got {bin_path}")
    # Read like every verb's password file (docs/protocol.md "Files handed to the CLI"), and before
    # anything is written: a FIFO, a device, a file over 64 KiB or not UTF-8 is refused, exit 2.
    secret = (read_input(args.password_file, PASSWORD_LIMIT, "--password-file", text=True).strip()
              if args.password_file else None)
    conf_dir = root / "etc/ssp-agent"
    pw = conf_dir / "mqtt-password"
    # the operator's password file is theirs: only whether it holds anything is read (as bytes: any
    # encoding), and a refusal comes before anything is written
    if secret is not None and not args.force and _holds_text(pw):
        raise Refused(f"{pw} exists and is not empty; pass --force to replace it")
    written, kept = [], []
    for name in UNITS:
        p = root / "etc/systemd/system" / name
        _write(p, unit_text(name, bin_path), 0o644)
        written.append(str(p))
    conf_dir.mkdir(parents=True, exist_ok=True)
    conf = conf_dir / "agent.toml"
    wants_conf = any(getattr(args, k, None) for k in _CONF_FLAGS) or args.secure_binding
    if conf.exists() and not args.force:
        if wants_conf:
            raise Refused(f"{conf} exists; edit it, or pass --force to replace it (nothing was written to it)")
        kept.append(str(conf))
    else:
        _write(conf, config_text(args), 0o644)   # no secret in it: the password has its own file
        written.append(str(conf))
    if args.clock_trusted:
        # the units' EnvironmentFile: the service trusts the clock as the enrolment's init did
        env_file = conf_dir / "environment"
        _write(env_file, "SSP_AGENT_CLOCK_TRUSTED=1\n", 0o644)
        written.append(str(env_file))
    if secret is not None:
        _write(pw, secret + "\n", 0o600)
        written.append(str(pw))
    elif pw.exists():
        kept.append(str(pw))
    else:   # LoadCredential= needs the file; empty means "no password"
        _write(pw, "", 0o600)
        written.append(str(pw))
    emit({"written": written, "kept": kept, "bin": bin_path,
          "next": ["systemctl daemon-reload",
                   "SSP_AGENT_WITNESS_DIR=/var/lib/ssp-agent/clock-witness "
                   f"{bin_path} --home /var/lib/ssp-agent/home init --manifest MANIFEST [--profile P]",
                   "systemctl enable --now ssp-agent.service      # always-on",
                   "systemctl enable --now ssp-agent-sync.timer   # or: wake, sync --once, sleep"]})
    return EXIT_OK
