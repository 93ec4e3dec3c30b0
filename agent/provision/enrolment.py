"""On the device (docs/operations.md "Fleet workflow", 3. First boot): `device_setup` writes
/etc/ssp-agent and the enrolment unit from a checked bundle; `enrol` runs `init` (the key is made
inside the keystore and never leaves it), makes the broker password (only its hash is published),
installs the service units and writes the enrolment file the technician collects from the boot
partition. Every path written is under the given root."""
from __future__ import annotations

import json
import os
import secrets
import socket
import time
from pathlib import Path
from typing import Callable, Optional

from .. import infile
from .bundle import (DEVICE_BIN, DEVICE_BUNDLE, DEVICE_HOME, DEVICE_WITNESS, ENROL_UNIT, ENROLMENT_FILE, CONF_FILES,
                     SECRET_FILES, UNIT_LIMIT, check_bundle, check_manifest, check_profile)
from .files import ProvisionFault, disable_unit, enable_unit, read_text, under, write_file

# `service install` with its arguments (the CLI's verb, handed down by the caller): 0 or the error
# it printed. None: this version has no such verb, and the bundle's copies of the units are used.
ServiceInstall = Optional[Callable[[list], "tuple[int, str]"]]


def device_setup(bundle: Path, root: Path) -> dict:
    """/etc/ssp-agent (the manifest, CA, credentials) and the enrolment unit, enabled. The whole
    bundle is checked first: a bad one is refused with nothing written."""
    meta, files = check_bundle(bundle)
    conf = root / "etc/ssp-agent"
    conf.mkdir(parents=True, exist_ok=True)
    written = []
    for name in CONF_FILES:
        if name in files:
            write_file(conf / name, files[name], 0o600 if name in SECRET_FILES else 0o644)
            written.append(str(conf / name))
    write_file(root / "etc/systemd/system" / ENROL_UNIT, files[f"systemd/{ENROL_UNIT}"], 0o644)
    enable_unit(root, ENROL_UNIT, "multi-user.target")
    return {"written": written, "enabled": ENROL_UNIT, "service": meta["service"]}


def mosquitto_password_line(username: str, password: str) -> str:
    """mosquitto_passwd's password_file line for this account ($7$: PBKDF2-HMAC-SHA512)."""
    from ..transport.broker import password_hash
    return f"{username}:{password_hash(password)}"


def enrol(bundle: Path, root: Path, boot: Path, agent_version: str, service_install: ServiceInstall) -> dict:
    """init (the key is made inside the keystore and never leaves it), the broker password (made
    here; only its hash is published), the service units, and the enrolment file on the boot partition.
    The bundle, and what device-setup put in /etc/ssp-agent, are checked before anything is made."""
    from ..node import Node
    meta, files = check_bundle(bundle)
    conf = root / "etc/ssp-agent"
    home = under(root, DEVICE_HOME)
    mq = meta.get("mqtt") or {}
    pw_path = conf / "mqtt-password"
    pw_text = read_text(pw_path, infile.PASSWORD_LIMIT, "mqtt-password") if pw_path.exists() or pw_path.is_symlink() else None
    init = None
    if not (home / Node.STORE_FILE).exists():
        mpath = conf / "manifest.toml"
        if mpath.exists() or mpath.is_symlink():   # device-setup's copy, as an operator may have edited it
            manifest = read_text(mpath, infile.TEXT_LIMIT, "manifest")
            check_manifest(manifest, str(mpath))
        else:
            manifest = files["manifest.toml"].decode()
        profile = meta.get("profile")
        if profile == "profile.toml":
            ppath = conf / "profile.toml"
            if ppath.exists() or ppath.is_symlink():
                profile = check_profile(read_text(ppath, infile.TEXT_LIMIT, "profile"), str(ppath))
            else:
                profile = check_profile(files["profile.toml"].decode(), str(bundle / "profile.toml"))
        init = (manifest, profile)
    # the units' witness directory under --root, whatever the caller's environment says: --root
    # confines every write
    os.environ["SSP_AGENT_WITNESS_DIR"] = str(under(root, DEVICE_WITNESS))
    # A device without an RTC must not take its identity's first reading of time from a clock
    # nobody vouches for: enrolment waits (retried by its unit) for a synchronised clock.
    os.environ.setdefault("SSP_AGENT_CLOCK_STRICT", "1")
    if init is not None:
        node, _pk = Node.init(home, init[0], meta.get("keystore"), init[1],
                              clock_trusted=bool(meta.get("clock_trusted")),
                              wait_clock_s=float(meta.get("wait_clock_s") or 0))
        node.close()
    with Node.open(home, read_only=True) as node:
        st = node.status()
    site = st["site_id"]
    username = mq.get("username") or site
    pw_line = None
    if mq.get("device_password"):
        if pw_text is None or not pw_text.strip():
            pw_text = secrets.token_urlsafe(24) + "\n"
            write_file(pw_path, pw_text, 0o600)
        pw_line = mosquitto_password_line(username, pw_text.strip())
    units = install_units(meta, root, conf, username, service_install)
    disable_unit(root, ENROL_UNIT, "multi-user.target")
    card = {"site_id": site, "public_key": st["public_key"], "mesh_id": st["mesh_id"],
            "hostname": socket.gethostname(), "agent_version": agent_version, "profile": st["profile"],
            "keystore": (meta.get("keystore") or {}).get("kind", "the profile's"),
            "enrolled_ms": time.time_ns() // 1_000_000,
            "mqtt": {"broker": mq.get("broker"), "username": username, "password_file_line": pw_line},
            "vouch": (f"ssp-agent --home GATEWAY_HOME record issue-vouch --subject {site} "
                      f"--public-key {st['public_key']} --authority-key AUTHORITY_DIR"),
            "peer_add": f"ssp-agent --home GATEWAY_HOME peer add --site-id {site} --public-key {st['public_key']}",
            "units": units}
    boot.mkdir(parents=True, exist_ok=True)
    (boot / ENROLMENT_FILE).write_text(json.dumps(card, indent=2) + "\n")
    return card


def install_units(meta: dict, root: Path, conf: Path, username: str, service_install: ServiceInstall) -> list[str]:
    """The service units through `service install` when the caller has it, else the bundle's
    copies; then the chosen one enabled (always-on run, or the sync timer)."""
    mq = meta.get("mqtt") or {}
    if not (conf / "mqtt-password").exists():
        write_file(conf / "mqtt-password", "", 0o600)
    units = list(meta.get("units") or [])
    if service_install is not None:
        argv = ["service", "install", "--root", str(root), "--bin", DEVICE_BIN]
        if meta.get("clock_trusted"):   # the service trusts the clock as this enrolment's init did
            argv += ["--clock-trusted"]
        if not (conf / "agent.toml").exists():   # written once; an enrolment run again keeps an edited one
            argv += ["--username", username]
            if mq.get("broker"):
                argv += ["--broker", mq["broker"]]
            for k, flag in (("ca_file", "--ca-file"), ("cert_file", "--cert-file"), ("key_file", "--key-file")):
                if mq.get(k):
                    argv += [flag, f"/etc/ssp-agent/{mq[k]}"]
            if mq.get("secure_binding"):   # absent in a bundle.json that predates it: off (fail closed)
                argv += ["--secure-binding"]
        rc, err = service_install(argv)
        if rc != 0:
            raise ProvisionFault(f"installing the service units failed: {err.strip()}")
    else:
        bundle_units = Path(DEVICE_BUNDLE) if root == Path("/") else under(root, DEVICE_BUNDLE)
        for name in units:
            src = bundle_units / "systemd" / name
            if src.is_file():
                write_file(root / "etc/systemd/system" / name, read_text(src, UNIT_LIMIT, "unit"), 0o644)
    if meta.get("service") == "timer":
        enable_unit(root, "ssp-agent-sync.timer", "timers.target")
        return ["ssp-agent-sync.timer"]
    enable_unit(root, "ssp-agent.service", "multi-user.target")
    return ["ssp-agent.service"]
