"""Provisioning and flashing (docs/operations.md "Fleet workflow").

An image file with Raspberry Pi OS's layout is made here (MBR: a FAT32 boot partition type c with
cmdline.txt, an ext4 root partition; sfdisk, mkfs.vfat, mkfs.ext4), the bundle is written onto it by
`provision flash` (mtools, debugfs; no loop device), and both partitions are read back. Then the root
filesystem's bundle is unpacked into a temporary root and the first-boot script itself runs there
(paths redirected by SSP_ROOT/SSP_BOOT): it installs offline from the bundle's wheelhouse into a venv
(no index reachable), enables the enrolment unit, and the enrolment creates the identity inside the
keystore and writes site_id, public key and the broker password's hash to the boot partition; a real
mosquitto given that hash line accepts the device's account (user name = site_id)."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from agent.simpeer import readings_table
from tests.cli_cmd import run_cli
from tests.provision.pi_image import install_os

ROOT = Path(__file__).resolve().parents[2]
MESH = "00112233445566778899aabbccddeeff"
TOOLS = ("sfdisk", "mkfs.vfat", "mkfs.ext4", "mcopy", "mtype", "debugfs")
pytestmark = pytest.mark.skipif(any(shutil.which(t) is None for t in TOOLS),
                                reason=f"needs {', '.join(TOOLS)} (apt-get install fdisk dosfstools mtools e2fsprogs)")
BOOT_START, BOOT_SECTORS = 8192, 131072   # 64 MiB FAT32 (Raspberry Pi OS: 512 MiB), then ext4 to the end


def make_image(path: Path, files: dict[str, str], **os_kw) -> Path:
    """The image, its root holding a Python (pi_image.install_os: this machine's by default)."""
    subprocess.run(["truncate", "-s", "160M", str(path)], check=True)
    subprocess.run(["sfdisk", "-q", str(path)], check=True, text=True,
                   input=f"label: dos\nstart={BOOT_START}, size={BOOT_SECTORS}, type=c\n"
                         f"start={BOOT_START + BOOT_SECTORS}, type=83\n")
    subprocess.run(["mkfs.vfat", "-F", "32", "-s", "1", "-n", "bootfs", "--offset", str(BOOT_START), str(path),
                    str(BOOT_SECTORS // 2)], check=True, capture_output=True)
    root_off = (BOOT_START + BOOT_SECTORS) * 512
    subprocess.run(["mkfs.ext4", "-q", "-F", "-L", "rootfs", "-E", f"offset={root_off}", str(path),
                    f"{(160 * 2**20 - root_off) // 1024}k"], check=True, capture_output=True)
    for name, text in files.items():
        src = path.with_name(name)
        src.write_text(text)
        subprocess.run(["mcopy", "-i", f"{path}@@{BOOT_START * 512}", str(src), f"::{name}"], check=True)
    install_os(path, root_off, **os_kw)
    return path


def fat(image: Path, name: str) -> str | None:
    p = subprocess.run(["mtype", "-i", f"{image}@@{BOOT_START * 512}", f"::{name}"], capture_output=True, text=True)
    return p.stdout if p.returncode == 0 else None


def ext4(image: Path, cmd: str) -> str:
    return subprocess.run(["debugfs", "-R", cmd, f"{image}?offset={(BOOT_START + BOOT_SECTORS) * 512}"],
                          capture_output=True, text=True).stdout


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    out = tmp_path_factory.mktemp("wh")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([str(ROOT / "tools" / "wheelhouse.sh"), "--arch", "host", "--no-pkcs11", "--out", str(out)],
                   check=True, env=env, capture_output=True, timeout=600)
    return next(d for d in out.iterdir() if d.is_dir() and not d.name.startswith("."))


@pytest.fixture
def bundle(tmp_path, wheelhouse):
    m = tmp_path / "mesh.toml"
    m.write_text(f'mesh_id = "{MESH}"\n' + readings_table("telemetry"))
    (tmp_path / "ca.pem").write_text("-----BEGIN CERTIFICATE-----\nfleet CA\n-----END CERTIFICATE-----\n")
    out = tmp_path / "bundle"
    p = run_cli("provision", "bundle", "--out", out, "--manifest", m, "--wheelhouse", wheelhouse,
                "--profile", "pi-zero-2w", "--broker", "mqtts://gateway.example:8883", "--ca-file", tmp_path / "ca.pem",
                "--wait-clock", "5")
    assert p.returncode == 0, p.stderr
    return out


def test_bundle_contents_and_refusals(tmp_path, bundle, wheelhouse):
    meta = json.loads((bundle / "bundle.json").read_text())
    assert meta["profile"] == "pi-zero-2w" and meta["mqtt"]["broker"] == "mqtts://gateway.example:8883"
    assert meta["mqtt"]["device_password"] and meta["mqtt"]["ca_file"] == "ca.pem"
    assert any(w.startswith("ssp_agent-") for w in meta["wheels"]) and any(w.startswith("cbor2") for w in meta["wheels"])
    # the units shipped in the package travel with it, and the enrolment unit
    assert {"ssp-agent.service", "ssp-agent-sync.timer"} <= set(meta["units"])
    assert (bundle / "systemd" / "ssp-agent-enrol.service").is_file()
    assert os.access(bundle / "firstboot.sh", os.X_OK) and (bundle / "manifest.toml").is_file()
    assert not any(p.name.endswith(".key") or "keystore" in p.name for p in bundle.rglob("*"))  # no identity in it
    m = tmp_path / "mesh.toml"
    for args, why in [(["--out", bundle], "exists"), (["--out", tmp_path / "b2", "--wheelhouse", tmp_path], "no ssp_agent wheel"),
                      (["--out", tmp_path / "b3", "--password-file", m], "--username"),
                      (["--out", tmp_path / "b4", "--keystore", '{"kind":"pkcs11","pin":"1234"}'], "PIN")]:
        base = {"--manifest": m, "--wheelhouse": wheelhouse}
        full = [*args] + [x for k, v in base.items() if k not in args for x in (k, v)]
        p = run_cli("provision", "bundle", *full)
        assert p.returncode == 2 and why in p.stderr, (args, p.stderr)


def test_flash_cloud_init_image_keeps_its_user_data(tmp_path, bundle):
    img = make_image(tmp_path / "trixie.img", {"cmdline.txt": "console=serial0,115200 root=PARTUUID=1 rootwait\n",
                                               "user-data": "#cloud-config\nhostname: sensor\nruncmd:\n  - [echo, hello]\n",
                                               "meta-data": "instance-id: x\n"})
    p = run_cli("provision", "flash", "--image", img, "--bundle", bundle)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["hook"] == "cloud-init"
    ud = fat(img, "user-data")
    assert "hostname: sensor" in ud and "[echo, hello]" in ud
    assert "- [bash, /opt/ssp-agent/bundle/firstboot.sh, install, --start]" in ud
    assert ud.index("firstboot.sh") < ud.index("echo, hello")
    assert fat(img, "firstrun.sh") is None and "systemd.run" not in fat(img, "cmdline.txt")
    assert '"format": 1' in ext4(img, "cat /opt/ssp-agent/bundle/bundle.json")


def test_flash_then_first_boot_installs_offline_and_enrols(tmp_path, bundle):
    img = make_image(tmp_path / "bookworm.img", {"cmdline.txt": "console=serial0,115200 root=PARTUUID=1 rootwait\n",
                                                 "config.txt": "arm_64bit=1\n"})
    p = run_cli("provision", "flash", "--image", img, "--bundle", bundle)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["hook"] == "firstrun"
    # boot partition: the Bookworm hook, named on the kernel command line
    cmdline = fat(img, "cmdline.txt")
    assert cmdline.count("\n") == 1 and "rootwait systemd.run=/boot/firmware/firstrun.sh" in cmdline
    assert "systemd.unit=kernel-command-line.target" in cmdline
    assert "FIRSTBOOT=${SSP_ROOT:-}/opt/ssp-agent/bundle/firstboot.sh" in fat(img, "firstrun.sh")
    # root filesystem: the bundle, root-owned, 0700, its script executable
    st = ext4(img, "stat /opt/ssp-agent/bundle")
    assert "Mode:  0700" in st and "User:     0" in st
    assert "Mode:  0755" in ext4(img, "stat /opt/ssp-agent/bundle/firstboot.sh")
    assert "ssp_agent-" in ext4(img, "ls -l /opt/ssp-agent/bundle/wheelhouse")
    assert "fleet CA" in ext4(img, "cat /opt/ssp-agent/bundle/ca.pem")

    # First boot, from what the image holds: unpack its root filesystem's bundle and boot files.
    root, boot = tmp_path / "root", tmp_path / "root" / "boot" / "firmware"
    (root / "opt" / "ssp-agent").mkdir(parents=True)
    boot.mkdir(parents=True)
    ext4(img, f"rdump /opt/ssp-agent/bundle {root / 'opt' / 'ssp-agent'}")
    for name in ("cmdline.txt", "firstrun.sh"):
        (boot / name).write_text(fat(img, name))
    flag = tmp_path / "synchronized"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SSP_AGENT_CLOCK_TRUSTED",
                                                            "SSP_AGENT_WITNESS_DIR", "PIP_FIND_LINKS")}
    # offline: no index is reachable (and none is asked: --no-index); the clock's sync source is a
    # timesyncd flag file of this test (the kernel here is not synchronised)
    env.update(SSP_ROOT=str(root), SSP_PYTHON=sys.executable, PIP_INDEX_URL="http://127.0.0.1:9/simple",
               http_proxy="http://127.0.0.1:9", https_proxy="http://127.0.0.1:9",
               SSP_AGENT_CLOCK_SYNC=f"timesyncd:{flag}")
    # No systemd runs here: the device's "systemd is running" is ROOT/run/systemd/system, and a
    # systemctl on PATH records what firstboot.sh asks of it (the one stand-in of this test).
    (root / "run/systemd/system").mkdir(parents=True)
    calls = tmp_path / "systemctl.calls"
    fake = tmp_path / "bin" / "systemctl"
    fake.parent.mkdir()
    fake.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    fake.chmod(0o755)
    env["PATH"] = f"{fake.parent}:{env['PATH']}"
    script = root / "opt" / "ssp-agent" / "bundle" / "firstboot.sh"
    p = subprocess.run(["bash", str(script), "install"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    venv_cmd = root / "opt" / "ssp-agent" / "bin" / "ssp-agent"
    v = subprocess.run([str(root / "opt/ssp-agent/bin/python"), "-c", "import agent; print(agent.__file__)"],
                       capture_output=True, text=True, env=env, cwd="/")
    assert str(root / "opt" / "ssp-agent" / "lib") in v.stdout, v.stdout   # the venv's own copy, not the checkout
    assert (root / "etc/ssp-agent/manifest.toml").is_file() and (root / "etc/ssp-agent/ca.pem").is_file()
    enrol_link = root / "etc/systemd/system/multi-user.target.wants/ssp-agent-enrol.service"
    assert enrol_link.is_symlink()

    # The enrolment: the clock is not synchronised yet, so init waits (5 s in this bundle) and refuses;
    # nothing is made, the unit stays enabled to retry. Then NTP syncs and it enrols.
    p = subprocess.run(["bash", str(script), "enrol"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "clock_untrusted" in p.stderr, p.stderr
    assert not (root / "var/lib/ssp-agent/home/store.sqlite").exists() and enrol_link.is_symlink()
    # what enrolment waits for, on the console (stderr: the unit sends it to journal+console) and
    # on the boot partition, with the attempt's number and its cause
    log = (boot / "ssp-agent-firstboot.log").read_text()
    for said in (p.stderr, log):
        assert "enrolment attempt 1" in said and "synchronised clock" in said and "--clock-trusted" in said, said
    assert "clock_untrusted" in log and "retries" in log, log
    assert "start" not in (calls.read_text() if calls.exists() else "")      # no service before an identity
    flag.write_text("")
    p = subprocess.run(["bash", str(script), "enrol"], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    # enrolled: the service starts now, not at the next boot
    assert "start --no-block ssp-agent.service" in calls.read_text().splitlines()
    assert "enrolment attempt 2" in (boot / "ssp-agent-firstboot.log").read_text()
    enrol_unit = (root / "etc/systemd/system/ssp-agent-enrol.service").read_text()
    assert "StandardError=journal+console" in enrol_unit
    card = json.loads((boot / "ssp-enrolment.json").read_text())
    home = root / "var/lib/ssp-agent/home"
    status = json.loads(subprocess.run([str(venv_cmd), "--home", str(home), "status"], env=env, capture_output=True,
                                       text=True, check=True).stdout)
    assert card["site_id"] == status["site_id"] and card["public_key"] == status["public_key"]
    assert status["profile"] == "pi-zero-2w" and status["clock"]["trusted"]
    assert (home / "keystore").is_dir()                       # the key was made in the device's keystore
    assert (root / "var/lib/ssp-agent/clock-witness").is_dir()  # the units' witness directory
    assert card["mqtt"]["username"] == card["site_id"]
    # service units installed for the venv's command and enabled; the enrolment unit disabled
    unit = (root / "etc/systemd/system/ssp-agent.service").read_text()
    assert "ExecStart=/opt/ssp-agent/bin/ssp-agent run" in unit
    assert (root / "etc/systemd/system/multi-user.target.wants/ssp-agent.service").is_symlink()
    assert not enrol_link.exists()
    assert 'broker = "mqtts://gateway.example:8883"' in (root / "etc/ssp-agent/agent.toml").read_text()
    pw = root / "etc/ssp-agent/mqtt-password"
    assert stat.S_IMODE(pw.stat().st_mode) == 0o600 and len(pw.read_text().strip()) >= 24
    assert pw.read_text().strip() not in json.dumps(card)      # only the hash leaves the device

    # Issued after enrolment, image untouched: the broker takes the card's password_file line.
    from agent.transport.broker import Broker, find_mosquitto, free_port
    if find_mosquitto() is None:
        pytest.skip("mosquitto not installed")
    import paho.mqtt.client as mqtt
    pwfile = tmp_path / "broker-passwords"
    pwfile.write_text(card["mqtt"]["password_file_line"] + "\n")
    os.chmod(pwfile, 0o600)
    port = free_port()
    b = Broker(port=port, workdir=tmp_path / "broker",
               listener_conf=f"listener {port} 127.0.0.1\nallow_anonymous false\npassword_file {pwfile}").start()
    try:
        def connects(user, password):
            """The broker's CONNACK: True accepted, False refused (waits for the answer, not a time)."""
            import threading
            got, answer = threading.Event(), {}
            c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
            c.username_pw_set(user, password)
            c.on_connect = lambda cl, ud, fl, rc, pr: (answer.update(ok=not rc.is_failure), got.set())
            c.connect("127.0.0.1", port)
            c.loop_start()
            try:
                assert got.wait(60), "no CONNACK"
                return answer["ok"]
            finally:
                c.loop_stop()
                c.disconnect()
        assert connects(card["site_id"], pw.read_text().strip())
        assert not connects(card["site_id"], "wrong")
    finally:
        b.close()


def test_shared_account_timer_bundle_enrols(tmp_path, wheelhouse):
    """A bundle with one shared broker account, a client certificate and the wake-sync-sleep timer:
    the device keeps the given credentials (secrets 0600), publishes no password hash, and enables
    the timer instead of the always-on service. (device-setup and enrol as firstboot.sh runs them.)"""
    m = tmp_path / "mesh.toml"
    m.write_text(f'mesh_id = "{MESH}"\n' + readings_table("telemetry"))
    for name, text in (("pw", "s3cret\n"), ("c.pem", "CERT\n"), ("c.key", "KEY\n")):
        (tmp_path / name).write_text(text)
    b = tmp_path / "bundle"
    p = run_cli("provision", "bundle", "--out", b, "--manifest", m, "--wheelhouse", wheelhouse, "--service", "timer",
                "--broker", "mqtt://gw:1883", "--username", "fleet", "--password-file", tmp_path / "pw",
                "--cert-file", tmp_path / "c.pem", "--key-file", tmp_path / "c.key")
    assert p.returncode == 0, p.stderr
    assert stat.S_IMODE((b / "client.key").stat().st_mode) == 0o600
    root, boot = tmp_path / "root", tmp_path / "root" / "boot" / "firmware"
    for verb in ("device-setup", "enrol"):
        p = run_cli("provision", verb, "--bundle", b, "--root", root, "--boot", boot)
        assert p.returncode == 0, (verb, p.stderr)
    card = json.loads((boot / "ssp-enrolment.json").read_text())
    assert card["mqtt"] == {"broker": "mqtt://gw:1883", "username": "fleet", "password_file_line": None}
    conf = root / "etc/ssp-agent"
    assert (conf / "mqtt-password").read_text() == "s3cret\n" and stat.S_IMODE((conf / "mqtt-password").stat().st_mode) == 0o600
    assert stat.S_IMODE((conf / "client.key").stat().st_mode) == 0o600
    toml = (conf / "agent.toml").read_text()
    assert 'username = "fleet"' in toml and 'key_file = "/etc/ssp-agent/client.key"' in toml
    assert (root / "etc/systemd/system/timers.target.wants/ssp-agent-sync.timer").is_symlink()
    assert not (root / "etc/systemd/system/multi-user.target.wants/ssp-agent.service").exists()
    assert not (root / "etc/systemd/system/multi-user.target.wants/ssp-agent-enrol.service").exists()
    # enrolling again is harmless: the same identity, the card rewritten
    p = run_cli("provision", "enrol", "--bundle", b, "--root", root, "--boot", boot)
    assert p.returncode == 0 and json.loads(p.stdout)["site_id"] == card["site_id"]


@pytest.mark.parametrize("python, arch", [("3.13", "aarch64"), ("3.13", None), ("3.11", "aarch64")])
def test_flash_refuses_a_wheelhouse_the_image_cannot_install(tmp_path, bundle, python, arch):
    """This machine's wheelhouse (binary wheels for its architecture and Python) onto an image whose
    Python or architecture differ: refused before anything is written, saying which wheelhouse to build."""
    img = make_image(tmp_path / "other.img", {"cmdline.txt": "console=serial0,115200 root=PARTUUID=1 rootwait\n"},
                     python=python, arch=arch)
    before = hashlib.sha256(img.read_bytes()).hexdigest()
    p = run_cli("provision", "flash", "--image", img, "--bundle", bundle)
    assert p.returncode == 2, (p.returncode, p.stderr)
    line = p.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in line, line
    assert f"Python {python}" in line and "do not install on this image" in line and "cbor2" in line, line
    if arch == "aarch64":
        assert f"tools/wheelhouse.sh --arch aarch64 --python-version {python}" in line, line
    assert hashlib.sha256(img.read_bytes()).hexdigest() == before


# ---------------------------------------------------------------- first boot: failures, retries, the service
def _unpack(img: Path, tmp: Path) -> tuple[Path, Path]:
    """The image's root bundle and boot files, as the device sees them."""
    root, boot = tmp / "root", tmp / "root" / "boot" / "firmware"
    (root / "opt" / "ssp-agent").mkdir(parents=True)
    boot.mkdir(parents=True)
    ext4(img, f"rdump /opt/ssp-agent/bundle {root / 'opt' / 'ssp-agent'}")
    for name in ("cmdline.txt", "firstrun.sh", "ssp-firstrun-previous.sh", "user-data"):
        if fat(img, name) is not None:
            (boot / name).write_text(fat(img, name))
    return root, boot


def _device_env(root: Path, boot: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SSP_AGENT_CLOCK_TRUSTED",
                                                            "SSP_AGENT_WITNESS_DIR", "PIP_FIND_LINKS")}
    env.update({"SSP_ROOT": str(root), "SSP_BOOT": str(boot), "SSP_PYTHON": sys.executable,
                "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "http_proxy": "http://127.0.0.1:9",
                "https_proxy": "http://127.0.0.1:9", **extra})
    return env


def _boot_once(boot: Path, env: dict) -> subprocess.CompletedProcess:
    """One first boot: systemd.run= runs the boot partition's firstrun.sh (it always exits 0, then reboots)."""
    p = subprocess.run(["bash", str(boot / "firstrun.sh")], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    return p


IMAGER_FIRSTRUN = """#!/bin/bash
set +e
echo ran >> "$SSP_BOOT/imager-ran"
rm -f "$SSP_BOOT/firstrun.sh"
sed -i 's| systemd.run.*||g' "$SSP_BOOT/cmdline.txt"
exit 0
"""


def test_first_boot_failure_is_logged_with_its_cause_and_retried_at_the_next_boot(tmp_path, bundle):
    img = make_image(tmp_path / "bookworm.img", {"cmdline.txt": "console=serial0,115200 root=PARTUUID=1 rootwait\n",
                                                 "firstrun.sh": IMAGER_FIRSTRUN})
    assert run_cli("provision", "flash", "--image", img, "--bundle", bundle).returncode == 0
    root, boot = _unpack(img, tmp_path)
    wheels = root / "opt/ssp-agent/bundle/wheelhouse"
    cbor = next(wheels.glob("cbor2-*.whl"))
    aside = cbor.rename(tmp_path / cbor.name)        # a wheelhouse that cannot satisfy the install
    env = _device_env(root, boot)
    log = boot / "ssp-agent-firstboot.log"

    _boot_once(boot, env)
    text = log.read_text()
    assert "attempt 1 of 3" in text and "cbor2" in text, text          # the cause, from pip, on the boot partition
    assert "next boot" in text, text
    # Imager's own settings ran once and removed the hook; ours put it back to run again
    assert (boot / "imager-ran").read_text() == "ran\n"
    assert (boot / "firstrun.sh").is_file() and "systemd.run=/boot/firmware/firstrun.sh" in (boot / "cmdline.txt").read_text()
    assert not (root / "opt/ssp-agent/bin/ssp-agent").exists()

    aside.rename(cbor)                                 # (a wheelhouse the next boot can use)
    _boot_once(boot, env)
    text = log.read_text()
    assert "attempt 2 of 3" in text and "installed" in text, text
    assert (boot / "imager-ran").read_text() == "ran\n"                 # Imager's script ran once only
    assert not (boot / "firstrun.sh").exists() and "systemd.run" not in (boot / "cmdline.txt").read_text()
    assert (root / "etc/systemd/system/multi-user.target.wants/ssp-agent-enrol.service").is_symlink()


def test_first_boot_gives_up_after_a_bounded_number_of_boots(tmp_path, bundle):
    img = make_image(tmp_path / "bookworm.img", {"cmdline.txt": "console=serial0,115200 root=PARTUUID=1 rootwait\n"})
    assert run_cli("provision", "flash", "--image", img, "--bundle", bundle).returncode == 0
    root, boot = _unpack(img, tmp_path)
    env = _device_env(root, boot, SSP_PYTHON=str(tmp_path / "no-such-python3"))
    for n in (1, 2, 3):
        assert (boot / "firstrun.sh").is_file(), n
        _boot_once(boot, env)
    text = (boot / "ssp-agent-firstboot.log").read_text()
    assert [f"attempt {n} of 3" in text for n in (1, 2, 3)] == [True] * 3, text
    assert "no-such-python3" in text and "giving up after 3 attempts" in text, text
    # the card then boots normally (no boot loop), with the reason on its boot partition
    assert not (boot / "firstrun.sh").exists() and "systemd.run" not in (boot / "cmdline.txt").read_text()


def test_cloud_init_first_boot_failure_is_retried_at_the_next_boot(tmp_path, bundle):
    """cloud-init runs runcmd once per instance: a failed install leaves a unit that runs it again at
    every boot (bounded as the Bookworm hook), removed once the install succeeds."""
    root, boot = tmp_path / "root", tmp_path / "root" / "boot" / "firmware"
    (root / "opt" / "ssp-agent").mkdir(parents=True)
    boot.mkdir(parents=True)
    shutil.copytree(bundle, root / "opt/ssp-agent/bundle")
    script = root / "opt/ssp-agent/bundle/firstboot.sh"
    retry = root / "etc/systemd/system/ssp-agent-install.service"
    retry_link = root / "etc/systemd/system/multi-user.target.wants/ssp-agent-install.service"
    p = subprocess.run(["bash", str(script), "install", "--start"], capture_output=True, text=True, timeout=600,
                       env=_device_env(root, boot, SSP_PYTHON=str(tmp_path / "no-such-python3")))
    assert p.returncode != 0
    assert "ExecStart=/opt/ssp-agent/bundle/firstboot.sh install --start" in retry.read_text()
    assert retry_link.is_symlink()
    analyze = shutil.which("systemd-analyze")
    if analyze:   # a unit systemd takes (its command pointed at one that exists on this machine)
        check = tmp_path / "check" / retry.name
        check.parent.mkdir()
        check.write_text(retry.read_text().replace("/opt/ssp-agent/bundle/firstboot.sh", shutil.which("true")))
        v = subprocess.run([analyze, "verify", str(check)], capture_output=True, text=True, timeout=120)
        assert v.returncode == 0 and not v.stderr.strip(), v.stderr
    assert "attempt 1 of 3" in (boot / "ssp-agent-firstboot.log").read_text()
    p = subprocess.run(["bash", str(script), "install", "--start"], capture_output=True, text=True, timeout=600,
                       env=_device_env(root, boot))
    assert p.returncode == 0, p.stderr
    assert not retry.exists() and not retry_link.exists()
    assert "attempt 2 of 3" in (boot / "ssp-agent-firstboot.log").read_text()
