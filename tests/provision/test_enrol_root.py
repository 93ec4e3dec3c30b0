"""The on-device provisioning verbs against a root directory (docs/operations.md "Fleet workflow").

`--root DIR` confines everything `device-setup` and `enrol` write: the boot partition defaults to
DIR/boot/firmware, the clock witness to DIR/var/lib/ssp-agent/clock-witness. Checked with strace:
every path the command opens for writing, creates, renames or removes is under DIR.

The secure binding (docs/mqtt.md "Authenticated or not"): a bundle with per-device broker accounts
(the documented broker: per-device passwords and ACLs) enrols devices whose agent.toml turns it on;
a shared account turns it off; `--secure-binding` / `--no-secure-binding` say so explicitly.

The bundles hold a stand-in wheel (nothing is installed here), and say --clock-trusted."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from agent.config import load as load_config
from agent.simpeer import readings_table
from tests.cli_cmd import agent_cmd, agent_env, run_cli

MESH = "00112233445566778899aabbccddeeff"


def make_bundle(tmp: Path, *extra) -> Path:
    (tmp / "wh").mkdir(exist_ok=True)
    (tmp / "wh" / "ssp_agent-1.0-py3-none-any.whl").write_bytes(b"stand-in")
    (tmp / "mesh.toml").write_text(f'mesh_id = "{MESH}"\n' + readings_table())
    out = tmp / f"bundle{len(list(tmp.glob('bundle*')))}"
    p = run_cli("provision", "bundle", "--out", out, "--manifest", tmp / "mesh.toml", "--wheelhouse", tmp / "wh",
                "--clock-trusted", "--wait-clock", "0", "--broker", "mqtts://gw.example:8883", *extra)
    assert p.returncode == 0, p.stderr
    return out


# openat(AT_FDCWD, "/x", O_WRONLY|O_CREAT|..., 0644), mkdir("/x", 0700), rename("/a", "/b"), unlink("/x")...
_WRITE_CALL = re.compile(r'^(?:\d+\s+)?(\w+)\((.*)\)\s+=\s+(-?\d+)')
_MUTATING = {"mkdir", "mkdirat", "rename", "renameat", "renameat2", "unlink", "unlinkat", "rmdir", "link", "linkat", "chmod", "fchmodat", "chown", "fchownat", "lchown", "truncate",
             "utimensat", "mknod", "mknodat"}


def written_paths(trace: Path) -> list[str]:
    """Every path a traced process tree opened for writing or changed (successful calls only)."""
    out = []
    for line in trace.read_text().splitlines():
        m = _WRITE_CALL.match(line)
        if not m or int(m.group(3)) < 0:
            continue
        call, args = m.group(1), m.group(2)
        paths = re.findall(r'"((?:[^"\\]|\\.)*)"', args)
        if call in ("open", "openat", "creat", "openat2"):
            if call == "creat" or re.search(r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC", args):
                out += paths[:1]
        elif call in ("symlink", "symlinkat"):
            out += paths[-1:]   # the link made; its target is only text
        elif call in _MUTATING:
            out += paths
    return out


def under(path: str, root: Path, cwd: Path) -> bool:
    p = Path(os.path.normpath(path if path.startswith("/") else cwd / path))
    return p == root or root in p.parents


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace (apt-get install strace)")
def test_root_confines_every_write(tmp_path):
    b = make_bundle(tmp_path)
    root = tmp_path / "root"
    root.mkdir()
    env = agent_env({"PYTHONDONTWRITEBYTECODE": "1"})
    env.pop("SSP_AGENT_WITNESS_DIR", None)
    for verb in ("device-setup", "enrol"):
        trace = tmp_path / f"{verb}.strace"
        p = subprocess.run(["strace", "-f", "-qq", "-o", str(trace), "-e", "trace=%file", *agent_cmd(),
                            "provision", verb, "--bundle", str(b), "--root", str(root)],
                           capture_output=True, text=True, env=env, cwd=root, timeout=300)
        assert p.returncode == 0, (verb, p.stderr)
        outside = [w for w in written_paths(trace) if not under(w, root, root) and not w.startswith("/dev/")]
        assert not outside, (verb, outside)
        assert written_paths(trace), "strace saw no write at all: the trace is not what this test reads"
    card = json.loads((root / "boot/firmware/ssp-enrolment.json").read_text())
    assert card["site_id"] and (root / "var/lib/ssp-agent/clock-witness").is_dir()


def _enrol(tmp: Path, bundle: Path) -> dict:
    root = tmp / f"root-{bundle.name}"
    for verb in ("device-setup", "enrol"):
        p = run_cli("provision", verb, "--bundle", bundle, "--root", root)
        assert p.returncode == 0, (verb, p.stderr)
    return load_config(root / "etc/ssp-agent/agent.toml")["mqtt"]


def test_per_device_accounts_enrol_with_the_secure_binding(tmp_path):
    b = make_bundle(tmp_path)   # per-device accounts (user name = site_id): the documented broker
    assert json.loads((b / "bundle.json").read_text())["mqtt"]["secure_binding"] is True
    assert _enrol(tmp_path, b).get("secure_binding") is True
    (tmp_path / "pw").write_text("s3cret\n")
    shared = make_bundle(tmp_path, "--username", "fleet", "--password-file", tmp_path / "pw")
    assert _enrol(tmp_path, shared).get("secure_binding", False) is False   # one account: no per-device ACLs
    off = make_bundle(tmp_path, "--no-secure-binding")
    assert _enrol(tmp_path, off).get("secure_binding", False) is False
    on = make_bundle(tmp_path, "--username", "fleet", "--password-file", tmp_path / "pw", "--secure-binding")
    assert _enrol(tmp_path, on).get("secure_binding") is True


def test_bundle_secure_binding_field_is_checked(tmp_path):
    b = make_bundle(tmp_path)
    meta = json.loads((b / "bundle.json").read_text())
    meta["mqtt"]["secure_binding"] = "yes"
    (b / "bundle.json").write_text(json.dumps(meta))
    p = run_cli("provision", "device-setup", "--bundle", b, "--root", tmp_path / "r")
    assert p.returncode == 2 and "mqtt.secure_binding" in p.stderr, p.stderr
    assert not (tmp_path / "r").exists()


def _enrolled_root(tmp_path: Path, bundle: Path) -> Path:
    root = tmp_path / f"root-{bundle.name}"
    for verb in ("device-setup", "enrol"):
        p = run_cli("provision", verb, "--bundle", bundle, "--root", root, env={"PYTHONDONTWRITEBYTECODE": "1"})
        assert p.returncode == 0, (verb, p.stderr)
    return root


def _service_env(root: Path, unit: str) -> dict:
    """What systemd gives the unit: its Environment= lines, then each EnvironmentFile= read."""
    env = {}
    for line in (root / "etc/systemd/system" / unit).read_text().splitlines():
        if line.startswith("Environment="):
            k, _, v = line[len("Environment="):].partition("=")
            env[k] = v
        elif line.startswith("EnvironmentFile="):
            path = line[len("EnvironmentFile="):].lstrip("-").replace("%E", "/etc")
            f = root / path.lstrip("/")
            if f.exists():
                for kv in f.read_text().splitlines():
                    if kv and not kv.startswith("#"):
                        k, _, v = kv.partition("=")
                        env[k] = v
    return env


def test_a_clock_trusted_bundle_reaches_the_service(tmp_path):
    """A bundle made with --clock-trusted (a device with an RTC and no network) is trusted by the
    running service too, not only by the enrolment's init: the units read the environment file
    enrolment writes, so eviction does not wait for a sync source that never comes."""
    trusted = _enrolled_root(tmp_path, make_bundle(tmp_path))
    for unit in ("ssp-agent.service", "ssp-agent-sync.service"):
        assert _service_env(trusted, unit).get("SSP_AGENT_CLOCK_TRUSTED") == "1", unit
    plain = make_bundle(tmp_path)
    meta = json.loads((plain / "bundle.json").read_text())
    meta["clock_trusted"] = False    # a bundle made without --clock-trusted
    (plain / "bundle.json").write_text(json.dumps(meta))
    untrusted = _enrolled_root(tmp_path, plain)
    for unit in ("ssp-agent.service", "ssp-agent-sync.service"):
        assert "SSP_AGENT_CLOCK_TRUSTED" not in _service_env(untrusted, unit), unit
