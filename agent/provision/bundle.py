"""A device's provisioning bundle (docs/operations.md "Fleet workflow", 1. Bundle): what
`make_bundle` writes (manifest, profile, keystore choice, broker URL, CA and credentials, the
packaged systemd units, the offline wheelhouse and the first-boot script; no key: the identity is
made on the device) and `check_bundle`, the one check of a bundle before any step reads it."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import stat
import time
from importlib import resources
from pathlib import Path

from .. import infile
from .files import ProvisionRefused, json_doc, read_input, read_text, write_file

BUNDLE_FORMAT = 1
DEVICE_BUNDLE = "/opt/ssp-agent/bundle"      # where the bundle lives on the device's root filesystem
DEVICE_BIN = "/opt/ssp-agent/bin/ssp-agent"  # the venv firstboot.sh makes (what the shipped units name)
DEVICE_HOME = "var/lib/ssp-agent/home"        # the units' SSP_AGENT_HOME (StateDirectory=ssp-agent)
DEVICE_WITNESS = "var/lib/ssp-agent/clock-witness"
ENROL_UNIT = "ssp-agent-enrol.service"
ENROLMENT_FILE = "ssp-enrolment.json"          # on the boot partition: what the technician collects
SERVICE_UNITS = ("ssp-agent.service", "ssp-agent-sync.service", "ssp-agent-sync.timer")
SECRET_FILES = ("mqtt-password", "client.key")
# What the provisioning verbs read, each bounded (agent/infile.py), far above any real one.
BUNDLE_JSON_LIMIT = 1024 * 1024           # bundle.json (a real one is about 1 KB)
UNIT_LIMIT = 64 * 1024                    # a systemd unit
CREDENTIAL_LIMIT = 1024 * 1024            # a CA bundle, a client certificate or key
# The bundle's files a device copies to /etc/ssp-agent (device-setup), with their limits (text ones
# must be UTF-8); the mqtt section of bundle.json names the credential files by these names only.
CONF_FILES = {"manifest.toml": infile.TEXT_LIMIT, "profile.toml": infile.TEXT_LIMIT, "ca.pem": CREDENTIAL_LIMIT,
              "client.pem": CREDENTIAL_LIMIT, "client.key": CREDENTIAL_LIMIT, "mqtt-password": infile.PASSWORD_LIMIT}
TEXT_FILES = ("manifest.toml", "profile.toml", "mqtt-password")
MQTT_FILES = {"ca_file": "ca.pem", "cert_file": "client.pem", "key_file": "client.key", "password_file": "mqtt-password"}
UNIT_NAME = re.compile(r"[A-Za-z0-9_@-][A-Za-z0-9_@.-]{0,99}\.(service|timer)")
PROFILE_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")   # a built-in profile (a name with a dot is a path)

ENROL_UNIT_TEXT = f"""# ssp-agent first-boot enrolment (docs/operations.md "Fleet workflow"): creates the node's
# identity inside its keystore once the network and the clock are up, then writes the site_id and
# public key to the boot partition, then starts the service. Enabled by firstboot.sh install;
# disables itself when done.
[Unit]
Description=ssp-agent enrolment (first boot)
Wants=network-online.target
After=time-set.target network-online.target
ConditionPathExists=!/{DEVICE_HOME}/store.sqlite

[Service]
Type=oneshot
ExecStart={DEVICE_BUNDLE}/firstboot.sh enrol
# init waits for a trustworthy clock (NTP; docs/apply.md "Clocks without an RTC"): retried until it comes.
# Each attempt says on the console, and in ssp-agent-firstboot.log on the boot partition, what it
# waits for and why it failed; once enrolled it starts the service.
Restart=on-failure
RestartSec=60
TimeoutStartSec=30min
StandardOutput=journal+console
StandardError=journal+console

[Install]
WantedBy=multi-user.target
"""

# What init may wait for the clock (bundle.json wait_clock_s): the bound of every seconds argument
# of the CLI (agent/cli/args.py MAX_SECONDS; tests/provision check that the two agree).
MAX_WAIT_CLOCK_S = 10 ** 7


def make_bundle(out: Path, *, manifest: Path, profile: str, keystore: str | None, wheelhouse: Path, extras: str,
                broker: str | None, ca_file: str | None, username: str | None, password_file: str | None,
                cert_file: str | None, key_file: str | None, secure_binding: bool | None, service: str,
                clock_trusted: bool, wait_clock: float, agent_version: str) -> dict:
    """Check every input, then write the bundle into the new directory `out` (made whole under a
    temporary name, then renamed). Returns what the CLI prints."""
    from ..profile import ProfileError, load_profile
    if out.exists():
        raise ProvisionRefused(f"{out} exists; a bundle is written into a new directory")
    manifest_text = read_text(manifest, infile.TEXT_LIMIT, "manifest")
    check_manifest(manifest_text, f"manifest {manifest}")
    profile_text = None
    if Path(profile).suffix:   # a profile file (load_profile's rule: a name with a suffix is a path)
        profile_text = read_text(Path(profile), infile.TEXT_LIMIT, "profile")
        prof = check_profile(profile_text, profile)
    else:
        try:
            prof = load_profile(profile)
        except ProfileError as e:
            raise ProvisionRefused(str(e)) from None
    keystore_doc = None
    if keystore:
        keystore_doc = json_doc(keystore, "--keystore")
        if not isinstance(keystore_doc, dict) or "kind" not in keystore_doc:
            raise ProvisionRefused('--keystore must be a JSON object with a "kind"')
        check_keystore(keystore_doc, "--keystore")
    check_broker(broker, "--broker")
    check_username(username, "--username")
    if not re.fullmatch(r"[A-Za-z0-9_.,-]*", extras):   # firstboot.sh hands it to pip: ssp-agent[EXTRAS]
        raise ProvisionRefused(f'--extras must be extra names separated by commas, e.g. "pkcs11", got {extras!r}'[:300])
    if password_file and not username:
        raise ProvisionRefused("--password-file is a shared account's password: give --username too (without both, "
                               "each device makes its own password for the user name = its site_id)")
    if bool(cert_file) != bool(key_file):
        raise ProvisionRefused("--cert-file and --key-file go together")
    # The documented broker (docs/mqtt.md) gives each device its own account (user name = site_id)
    # and ACLs pinning its topics: that is what makes the binding authenticated. A shared account
    # cannot be pinned per device, so it defaults to off.
    secure = (not username) if secure_binding is None else secure_binding
    wh = wheelhouse
    wheels = sorted(wh.glob("*.whl")) if wh.is_dir() else []
    if not any(w.name.startswith("ssp_agent-") for w in wheels):
        raise ProvisionRefused(f"{wh} holds no ssp_agent wheel: build the wheelhouse with tools/wheelhouse.sh "
                               "(--arch aarch64 for Raspberry Pi OS) and give its directory")
    for w in wheels:
        if not w.is_file() or re.search(r"\s", w.name):
            raise ProvisionRefused(f"{w}: a wheelhouse holds regular files named without spaces (tools/wheelhouse.sh)")
    files = {}
    given = {"ca_file": ca_file, "password_file": password_file, "cert_file": cert_file, "key_file": key_file}
    for flag, name in (("ca_file", "ca.pem"), ("password_file", "mqtt-password"),
                       ("cert_file", "client.pem"), ("key_file", "client.key")):
        src = given[flag]
        if src:
            what = f"--{flag.replace('_', '-')}"
            if name in TEXT_FILES:
                files[name] = read_text(Path(src), CONF_FILES[name], what).encode()
            else:
                files[name] = read_input(Path(src), CONF_FILES[name], what)

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "wheelhouse").mkdir(parents=True)
    for w in wheels:
        shutil.copy2(w, tmp / "wheelhouse" / w.name)
    (tmp / "manifest.toml").write_text(manifest_text)
    for name, data in files.items():
        write_file(tmp / name, data, 0o600 if name in SECRET_FILES else 0o644)
    units = []
    (tmp / "systemd").mkdir()
    for name in SERVICE_UNITS:   # the units shipped in the package (agent/systemd/), when present
        try:
            text = resources.files("agent").joinpath("systemd", name).read_text()
        except (FileNotFoundError, OSError):
            continue
        (tmp / "systemd" / name).write_text(text)
        units.append(name)
    (tmp / "systemd" / ENROL_UNIT).write_text(ENROL_UNIT_TEXT)
    fb = tmp / "firstboot.sh"
    fb.write_bytes(resources.files("agent").joinpath("firstboot.sh").read_bytes())
    os.chmod(fb, 0o755)
    if extras:
        (tmp / "extras").write_text(f"[{extras}]")
    meta = {"format": BUNDLE_FORMAT, "created_ms": time.time_ns() // 1_000_000, "agent_version": agent_version,
            "profile": prof.name if profile in (None, prof.name) else profile,
            "keystore": keystore_doc, "service": service, "clock_trusted": bool(clock_trusted),
            "wait_clock_s": wait_clock, "units": units,
            "mqtt": {"broker": broker, "username": username,
                     "device_password": not username, "secure_binding": secure,
                     "ca_file": "ca.pem" if "ca.pem" in files else None,
                     "cert_file": "client.pem" if "client.pem" in files else None,
                     "key_file": "client.key" if "client.key" in files else None,
                     "password_file": "mqtt-password" if "mqtt-password" in files else None},
            "wheels": [w.name for w in wheels]}
    if profile_text is not None:   # a profile file travels with the bundle
        (tmp / "profile.toml").write_text(profile_text)
        meta["profile"] = "profile.toml"
    (tmp / "bundle.json").write_text(json.dumps(meta, indent=2) + "\n")
    os.chmod(tmp, 0o700)
    os.replace(tmp, out)
    return {"bundle": str(out), "wheels": len(wheels), "units": units, "service": service,
            "broker": broker, "device_password": not username, "secure_binding": secure}


# ---------------------------------------------------------------- reading and checking inputs
def check_manifest(text: str, origin: str) -> None:
    """The manifest parses (what init does with it), or a refusal naming it."""
    from ..core.schema import ManifestError, parse_manifest
    try:
        parse_manifest(text)
    except ManifestError as e:   # every wrong shape and depth (core/schema.py): anything else is a bug
        raise ProvisionRefused(f"{origin}: {e}"[:500]) from None


def check_profile(text: str, origin: str):
    from ..profile import ProfileError, parse_profile
    try:
        return parse_profile(text, origin)
    except ProfileError as e:    # every wrong shape, depth and number (profile.py): anything else is a bug
        raise ProvisionRefused(f"{e}"[:500] if origin in str(e) else f"{origin}: {e}"[:500]) from None


def check_broker(v, what: str) -> None:
    if v is None:
        return
    if not isinstance(v, str) or not re.fullmatch(r"mqtts?://[^\s\x00-\x1f\x7f]{1,1000}", v):
        raise ProvisionRefused(f"{what} must be a broker URL mqtt://HOST:PORT or mqtts://HOST:PORT, got {v!r}"[:300])


def check_username(v, what: str) -> None:
    """A broker user name: it ends up in agent.toml and in a mosquitto password_file line (`user:hash`)."""
    if v is None:
        return
    if not isinstance(v, str) or not re.fullmatch(r"[^:\s\x00-\x1f\x7f]{1,256}", v):
        raise ProvisionRefused(f"{what} must be a user name (1..256 characters, no ':', space or control character), got {v!r}"[:300])


def check_keystore(v, what: str) -> None:
    """A keystore choice: null (the profile's) or a config init takes; never a PIN (a bundle is copied around)."""
    from firmware_bridge.keystore import KeystoreConfigError, check_config
    if v is None:
        return
    if isinstance(v, dict) and "pin" in v:
        raise ProvisionRefused(f"{what} must not carry a PIN: a bundle is copied around; give pin_file, a path on the device")
    try:
        check_config(v)
    except KeystoreConfigError as e:
        raise ProvisionRefused(f"{what}: {e}"[:300]) from None


def check_bundle(path: Path, flash: bool = False) -> tuple[dict, dict[str, bytes]]:
    """The one check of a provisioning bundle, before any verb writes anything: bundle.json field by
    field (type and range; unknown fields are ignored) and the files the verbs read from it
    (regular files within their limits, text UTF-8, the manifest and a profile file parsing).
    Returns bundle.json and those files' contents (what is written is what was checked). `flash`:
    also what the image's first boot needs (firstboot.sh, an ssp_agent wheel) and nothing in the
    bundle but regular files and directories. Anything wrong is a refusal (exit 2) naming it."""
    if not path.is_dir():
        raise ProvisionRefused(f"{path} is not a provisioning bundle (no such directory; make one with `provision bundle`)")
    bj = path / "bundle.json"
    if not bj.exists() and not bj.is_symlink():
        raise ProvisionRefused(f"{path} is not a provisioning bundle (no bundle.json; make one with `provision bundle`)")
    meta = json_doc(read_text(bj, BUNDLE_JSON_LIMIT, "bundle.json"), f"{bj}")
    if not isinstance(meta, dict):
        raise ProvisionRefused(f"{bj} must hold a JSON object, not {type(meta).__name__}")

    def bad(field: str, why: str):
        raise ProvisionRefused(f"{bj}: {field} {why}, got {meta_repr(field)}"[:400])

    def meta_repr(field: str) -> str:
        v = meta
        for k in field.split("."):
            v = v.get(k) if isinstance(v, dict) else None
        return repr(v)

    fmt = meta.get("format")
    if type(fmt) is not int or fmt != BUNDLE_FORMAT:
        raise ProvisionRefused(f"{path}: bundle format {fmt!r} is not {BUNDLE_FORMAT}; make it with this version"[:300])
    if meta.get("service") not in ("run", "timer"):
        bad("service", 'must be "run" or "timer"')
    if "clock_trusted" in meta and not isinstance(meta["clock_trusted"], bool):
        bad("clock_trusted", "must be true or false")
    w = meta.get("wait_clock_s", 0)
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and 0 <= w <= MAX_WAIT_CLOCK_S):
        bad("wait_clock_s", f"must be a number of seconds 0..{MAX_WAIT_CLOCK_S}")
    profile = meta.get("profile")
    if profile is not None and not (isinstance(profile, str) and (profile == "profile.toml" or PROFILE_NAME.fullmatch(profile))):
        bad("profile", 'must be a built-in profile name or "profile.toml"')
    check_keystore(meta.get("keystore"), f"{bj}: keystore")
    units = meta.get("units", [])
    if not isinstance(units, list) or len(units) > 16 or \
            not all(isinstance(u, str) and UNIT_NAME.fullmatch(u) for u in units):
        bad("units", "must be a list of systemd unit names (NAME.service, NAME.timer)")
    wheels = meta.get("wheels", [])
    if not isinstance(wheels, list) or not all(isinstance(x, str) for x in wheels):
        bad("wheels", "must be a list of file names")
    if "agent_version" in meta and not isinstance(meta["agent_version"], (str, type(None))):
        bad("agent_version", "must be a string")
    c = meta.get("created_ms", 0)
    if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < 2 ** 63:
        bad("created_ms", "must be a time in milliseconds")
    mq = meta.get("mqtt")
    if mq is None:
        mq = {}
    elif not isinstance(mq, dict):
        bad("mqtt", "must be an object")
    check_broker(mq.get("broker"), f"{bj}: mqtt.broker")
    check_username(mq.get("username"), f"{bj}: mqtt.username")
    for k in ("device_password", "secure_binding"):
        if k in mq and not isinstance(mq[k], bool):
            bad(f"mqtt.{k}", "must be true or false")
    for k, name in MQTT_FILES.items():
        v = mq.get(k)
        if v is not None and v != name:
            bad(f"mqtt.{k}", f'must be null or "{name}" (the bundle\'s file)')
        if v is not None and not (path / name).exists():
            raise ProvisionRefused(f"{bj}: mqtt.{k} names {name}, which is not in the bundle")

    # The files: read once, bounded, checked; what the verbs write or use is these bytes.
    files: dict[str, bytes] = {}
    for name, limit in CONF_FILES.items():
        f = path / name
        if not f.exists() and not f.is_symlink():
            continue
        if name in TEXT_FILES:
            files[name] = read_text(f, limit, f"the bundle's {name}").encode()
        else:
            files[name] = read_input(f, limit, f"the bundle's {name}")
    if "manifest.toml" not in files:
        raise ProvisionRefused(f"{path}: the bundle has no manifest.toml")
    check_manifest(files["manifest.toml"].decode(), f"{path / 'manifest.toml'}")
    if profile == "profile.toml":
        if "profile.toml" not in files:
            raise ProvisionRefused(f"{bj}: profile names profile.toml, which is not in the bundle")
        check_profile(files["profile.toml"].decode(), f"{path / 'profile.toml'}")
    unit = path / "systemd" / ENROL_UNIT
    files[f"systemd/{ENROL_UNIT}"] = read_text(unit, UNIT_LIMIT, "the bundle's enrolment unit").encode()
    if flash:
        fb = path / "firstboot.sh"
        if not fb.is_file() or not os.access(fb, os.X_OK):
            raise ProvisionRefused(f"{path}: the bundle has no executable firstboot.sh (make it with `provision bundle`)")
        if not any(w.name.startswith("ssp_agent-") and w.is_file() for w in (path / "wheelhouse").glob("*.whl")):
            raise ProvisionRefused(f"{path}: the bundle's wheelhouse holds no ssp_agent wheel (make it with `provision bundle`)")
        for d, dirs, names in os.walk(path):
            for n in dirs + names:
                m = os.lstat(os.path.join(d, n)).st_mode
                if not (stat.S_ISREG(m) or stat.S_ISDIR(m)):
                    raise ProvisionRefused(f"{os.path.join(d, n)}: a bundle holds only regular files and directories")
    return meta, files

