"""Hostile or damaged provisioning bundles and images (helper probe A: r02, r04, r05, r06, r07).

Every provisioning verb validates the whole bundle (bundle.json, field by field, and the files it
reads) and the image's boot files before it writes anything: a bad one is refused with exit 2 and
one line, and the device's root and boot directories, or the image file, are left as they were.
Before: UnicodeDecodeError, AttributeError, TypeError, KeyError, RecursionError tracebacks (some
after /etc/ssp-agent files, a node identity or the whole bundle in the image were written), a
bundle.json of `[]` flashed, and `"wait_clock_s": Infinity` waiting for ever.

The bundles here hold a stand-in wheel (no wheelhouse is built), so every test is quick."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from agent.simpeer import readings_table
from tests.cli_cmd import agent_cmd, agent_env, run_cli
from tests.provision.pi_image import install_os
from tests.waiting import HANG_S

MESH = "00112233445566778899aabbccddeeff"
IMAGE_TOOLS = ("sfdisk", "mformat", "mcopy", "mtype", "mkfs.ext4", "debugfs")
needs_image_tools = pytest.mark.skipif(any(shutil.which(t) is None for t in IMAGE_TOOLS),
                                       reason=f"needs {', '.join(IMAGE_TOOLS)}")


@pytest.fixture(scope="module")
def base_bundle(tmp_path_factory):
    d = tmp_path_factory.mktemp("base")
    (d / "wh").mkdir()
    (d / "wh" / "ssp_agent-1.0-py3-none-any.whl").write_bytes(b"stand-in")
    (d / "mesh.toml").write_text(f'mesh_id = "{MESH}"\n' + readings_table())
    p = run_cli("provision", "bundle", "--out", d / "bundle", "--manifest", d / "mesh.toml", "--wheelhouse", d / "wh",
                "--clock-trusted", "--wait-clock", "0", "--broker", "mqtts://gw.example:8883")
    assert p.returncode == 0, p.stderr
    return d / "bundle"


def bundle_with(tmp_path: Path, base: Path, meta_edit=None, raw: bytes | None = None) -> Path:
    """A copy of the base bundle, its bundle.json edited (a function of the dict) or replaced."""
    b = tmp_path / "bundle"
    shutil.copytree(base, b, symlinks=True)
    if raw is not None:
        (b / "bundle.json").write_bytes(raw)
    elif meta_edit is not None:
        meta = json.loads((b / "bundle.json").read_text())
        meta_edit(meta)
        (b / "bundle.json").write_text(json.dumps(meta))   # allow_nan: Infinity and NaN as Python writes them
    return b


def tree(p: Path) -> list[str]:
    return sorted(str(q.relative_to(p)) for q in p.rglob("*")) if p.exists() else []


def assert_refused(p: subprocess.CompletedProcess, *words: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ssp-agent: "), p.stderr[-2000:]
    for w in words:
        assert w in lines[0], (w, lines[0])


def run_on_device(verb: str, bundle: Path, tmp_path: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    root, boot = tmp_path / "root", tmp_path / "boot"
    return run_cli("provision", verb, "--bundle", bundle, "--root", root, "--boot", boot, timeout=timeout)


def _set(key, value):
    def edit(meta):
        meta[key] = value
    return edit


def _mqtt(key, value):
    def edit(meta):
        meta["mqtt"][key] = value
    return edit


def _drop(key):
    def edit(meta):
        del meta[key]
    return edit


DEEP = b"[" * 3000 + b"]" * 3000

# (bundle.json edit or raw bytes, a word the one line must hold)
BAD_JSON = [
    pytest.param(None, b"[]", "object", id="json-list"),
    pytest.param(None, b"1", "object", id="json-number"),
    pytest.param(None, DEEP, "nested", id="json-3000-deep"),
    pytest.param(None, b'{"format": 1, "service": "run", "profile": "caf\xe9"}', "UTF-8", id="json-not-utf8"),
    pytest.param(_set("format", True), None, "format", id="format-true"),
    pytest.param(_drop("service"), None, "service", id="no-service"),
    pytest.param(_set("service", "sometimes"), None, "service", id="service-unknown"),
    pytest.param(_set("mqtt", "x"), None, "mqtt", id="mqtt-string"),
    pytest.param(_mqtt("username", 5), None, "username", id="mqtt-username-int"),
    pytest.param(_mqtt("username", "a:b"), None, "username", id="mqtt-username-colon"),
    pytest.param(_mqtt("broker", ["x"]), None, "broker", id="mqtt-broker-list"),
    pytest.param(_mqtt("device_password", "yes"), None, "device_password", id="mqtt-device-password-str"),
    pytest.param(_mqtt("ca_file", "../../etc/shadow"), None, "ca_file", id="mqtt-ca-file-path"),
    pytest.param(_mqtt("ca_file", "ca.pem"), None, "ca.pem", id="mqtt-ca-file-missing"),
    pytest.param(_set("keystore", "software"), None, "keystore", id="keystore-string"),
    pytest.param(_set("keystore", {"kind": "tpm"}), None, "keystore", id="keystore-unknown-kind"),
    pytest.param(_set("wait_clock_s", "abc"), None, "wait_clock_s", id="wait-clock-str"),
    pytest.param(_set("wait_clock_s", [1]), None, "wait_clock_s", id="wait-clock-list"),
    pytest.param(_set("wait_clock_s", float("inf")), None, "wait_clock_s", id="wait-clock-inf"),
    pytest.param(_set("wait_clock_s", float("nan")), None, "wait_clock_s", id="wait-clock-nan"),
    pytest.param(_set("wait_clock_s", -1), None, "wait_clock_s", id="wait-clock-negative"),
    pytest.param(_set("wait_clock_s", 10 ** 7 + 1), None, "wait_clock_s", id="wait-clock-too-long"),
    pytest.param(_set("clock_trusted", "no"), None, "clock_trusted", id="clock-trusted-str"),
    pytest.param(_set("profile", ["x"]), None, "profile", id="profile-list"),
    pytest.param(_set("profile", "profile.toml"), None, "profile.toml", id="profile-file-missing"),
    pytest.param(_set("units", "ssp-agent.service"), None, "units", id="units-string"),
    pytest.param(_set("units", ["../../../etc/passwd"]), None, "units", id="units-path"),
]


@pytest.mark.parametrize("verb", ["device-setup", "enrol"])
@pytest.mark.parametrize("edit,raw,word", BAD_JSON)
def test_a_bad_bundle_json_is_refused_before_anything_is_written(tmp_path, base_bundle, verb, edit, raw, word):
    b = bundle_with(tmp_path, base_bundle, edit, raw)
    p = run_on_device(verb, b, tmp_path)
    assert_refused(p, word)
    assert tree(tmp_path / "root") == [] and tree(tmp_path / "boot") == []


def _latin1_manifest(b: Path) -> None:
    with open(b / "manifest.toml", "ab") as f:
        f.write(b"# caf\xe9\n")


def _manifest_dev_zero(b: Path) -> None:
    (b / "manifest.toml").unlink()
    (b / "manifest.toml").symlink_to("/dev/zero")


def _manifest_bad(b: Path) -> None:
    (b / "manifest.toml").write_text('mesh_id = "nope"\n')


def _unit_latin1(b: Path) -> None:
    (b / "systemd" / "ssp-agent-enrol.service").write_bytes(b"\xff")


def _unit_missing(b: Path) -> None:
    (b / "systemd" / "ssp-agent-enrol.service").unlink()


def _unit_dir(b: Path) -> None:
    (b / "systemd" / "ssp-agent-enrol.service").unlink()
    (b / "systemd" / "ssp-agent-enrol.service").mkdir()


def _secret_fifo(b: Path) -> None:
    os.mkfifo(b / "client.key")


BAD_FILES = [
    pytest.param(_latin1_manifest, "UTF-8", id="manifest-not-utf8"),
    pytest.param(_manifest_dev_zero, "regular file", id="manifest-dev-zero"),
    pytest.param(_manifest_bad, "manifest", id="manifest-invalid"),
    pytest.param(_unit_latin1, "UTF-8", id="enrol-unit-not-utf8"),
    pytest.param(_unit_missing, "ssp-agent-enrol.service", id="enrol-unit-missing"),
    pytest.param(_unit_dir, "directory", id="enrol-unit-directory"),
    pytest.param(_secret_fifo, "FIFO", id="client-key-fifo"),
]


@pytest.mark.parametrize("verb", ["device-setup", "enrol"])
@pytest.mark.parametrize("damage,word", BAD_FILES)
def test_a_bad_bundle_file_is_refused_before_anything_is_written(tmp_path, base_bundle, verb, damage, word):
    b = bundle_with(tmp_path, base_bundle)
    damage(b)
    p = run_on_device(verb, b, tmp_path, timeout=30)
    assert_refused(p, word)
    assert tree(tmp_path / "root") == [] and tree(tmp_path / "boot") == []


def test_enrol_refuses_a_bad_file_device_setup_left_in_etc(tmp_path, base_bundle):
    """enrol reads /etc/ssp-agent's manifest and password when device-setup put them there."""
    b = bundle_with(tmp_path, base_bundle, _mqtt("device_password", True))
    conf = tmp_path / "root" / "etc/ssp-agent"
    conf.mkdir(parents=True)
    (conf / "manifest.toml").write_bytes((b / "manifest.toml").read_bytes() + b"# caf\xe9\n")
    before = tree(tmp_path / "root")
    assert_refused(run_on_device("enrol", b, tmp_path), "UTF-8")
    assert tree(tmp_path / "root") == before
    (conf / "manifest.toml").write_bytes((b / "manifest.toml").read_bytes())
    (conf / "mqtt-password").write_bytes(b"\xff\xfe")
    before = tree(tmp_path / "root")
    assert_refused(run_on_device("enrol", b, tmp_path), "mqtt-password")
    assert tree(tmp_path / "root") == before   # no node made


def test_enrol_with_an_endless_clock_wait_is_refused_at_once(tmp_path, base_bundle):
    """r07: `"wait_clock_s": Infinity` and a clock not synchronised waited for ever."""
    b = bundle_with(tmp_path, base_bundle, lambda m: m.update(wait_clock_s=float("inf"), clock_trusted=False))
    env = agent_env({"SSP_AGENT_CLOCK_SYNC": f"timesyncd:{tmp_path / 'no-such-flag'}"})
    env.pop("SSP_AGENT_CLOCK_TRUSTED", None)
    p = subprocess.run([*agent_cmd(), "provision", "enrol", "--bundle", str(b), "--root", str(tmp_path / "root"),
                        "--boot", str(tmp_path / "boot")], capture_output=True, text=True, env=env, timeout=HANG_S)
    assert_refused(p, "wait_clock_s")
    assert tree(tmp_path / "root") == []


def test_a_bundle_waits_for_the_clock_as_long_as_the_cli_lets_it():
    """bundle.json's wait_clock_s is bounded as `provision bundle --wait-clock` is."""
    from agent.cli.args import MAX_SECONDS
    from agent.provision.bundle import MAX_WAIT_CLOCK_S
    assert MAX_WAIT_CLOCK_S == MAX_SECONDS


def test_a_good_bundle_still_sets_up_and_enrols(tmp_path, base_bundle):
    b = bundle_with(tmp_path, base_bundle)
    for verb in ("device-setup", "enrol"):
        p = run_on_device(verb, b, tmp_path)
        assert p.returncode == 0, (verb, p.stderr)
    card = json.loads((tmp_path / "boot" / "ssp-enrolment.json").read_text())
    assert card["mqtt"]["broker"] == "mqtts://gw.example:8883" and card["mqtt"]["password_file_line"]


def test_bundle_refuses_a_manifest_that_is_not_utf8(tmp_path, base_bundle):
    """r04: `provision bundle --manifest latin1.toml` was a UnicodeDecodeError traceback."""
    m = tmp_path / "latin1.toml"
    m.write_bytes(f'mesh_id = "{MESH}"\n# caf\xe9\n'.encode("latin-1"))
    p = run_cli("provision", "bundle", "--out", tmp_path / "b", "--manifest", m, "--wheelhouse", base_bundle / "wheelhouse")
    assert_refused(p, "UTF-8")
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()
    os.mkfifo(tmp_path / "fifo")
    p = run_cli("provision", "bundle", "--out", tmp_path / "b", "--manifest", tmp_path / "fifo",
                "--wheelhouse", base_bundle / "wheelhouse", timeout=HANG_S)
    assert_refused(p, "FIFO")


def test_bundle_refuses_a_credential_that_is_not_a_regular_file(tmp_path, base_bundle):
    m = tmp_path / "m.toml"
    m.write_text(f'mesh_id = "{MESH}"\n')
    os.mkfifo(tmp_path / "fifo")
    p = run_cli("provision", "bundle", "--out", tmp_path / "b", "--manifest", m, "--wheelhouse", base_bundle / "wheelhouse",
                "--ca-file", tmp_path / "fifo", timeout=HANG_S)
    assert_refused(p, "ca")
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()


# ---------------------------------------------------------------- flash
BOOT_SECTOR, ROOT_SECTOR = 2048, 18432


def make_image(path: Path, boot_files: dict[str, bytes]) -> Path:
    subprocess.run(["truncate", "-s", "40M", str(path)], check=True)
    subprocess.run(["sfdisk", "-q", str(path)], check=True, text=True,
                   input=f"label: dos\nstart={BOOT_SECTOR}, size=16384, type=c\nstart={ROOT_SECTOR}, type=83\n")
    spec = f"{path}@@{BOOT_SECTOR * 512}"
    subprocess.run(["mformat", "-i", spec, "-T", "16384", "-h", "2", "-s", "32", "::"], check=True, capture_output=True)
    root_off = ROOT_SECTOR * 512
    subprocess.run(["mkfs.ext4", "-q", "-F", "-E", f"offset={root_off}", str(path),
                    f"{(40 * 2 ** 20 - root_off) // 1024}k"], check=True, capture_output=True)
    for name, data in boot_files.items():
        src = path.with_name(name)
        src.write_bytes(data)
        subprocess.run(["mcopy", "-i", spec, str(src), f"::{name}"], check=True)
    install_os(path, root_off)   # a Python in the root: what flash checks the wheelhouse against
    return path


def digest(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def flash(image: Path, bundle: Path, *extra) -> subprocess.CompletedProcess:
    return run_cli("provision", "flash", "--image", image, "--bundle", bundle, *extra, timeout=60)


@needs_image_tools
@pytest.mark.parametrize("files,word", [
    pytest.param({"cmdline.txt": b"console=tty1 caf\xe9\n"}, "cmdline.txt", id="cmdline-not-utf8"),
    pytest.param({"cmdline.txt": b"console=tty1\n", "user-data": b"#cloud-config\n# caf\xe9\n"}, "user-data",
                 id="user-data-not-utf8"),
    pytest.param({"cmdline.txt": b"console=tty1 " + b"x" * 70000 + b"\n"}, "cmdline.txt", id="cmdline-too-large"),
])
def test_flash_refuses_bad_boot_files_before_writing_the_image(tmp_path, base_bundle, files, word):
    """r05: a cmdline.txt that is not UTF-8 failed after the whole bundle was in the root filesystem."""
    img = make_image(tmp_path / "img", files)
    before = digest(img)
    assert_refused(flash(img, base_bundle), word)
    assert digest(img) == before


@needs_image_tools
@pytest.mark.parametrize("damage", [
    pytest.param(lambda b: (b / "bundle.json").write_text("[]\n"), id="bundle-json-list"),
    pytest.param(lambda b: (b / "bundle.json").write_bytes(DEEP), id="bundle-json-deep"),
    pytest.param(lambda b: b.joinpath("manifest.toml").write_bytes(b"# \xff\n"), id="manifest-not-utf8"),
    pytest.param(lambda b: (b / "firstboot.sh").unlink(), id="no-firstboot"),
    pytest.param(lambda b: os.mkfifo(b / "extra-fifo"), id="a-fifo-in-the-bundle"),
])
def test_flash_refuses_a_bad_bundle_before_writing_the_image(tmp_path, base_bundle, damage):
    """r05: a "bundle" whose bundle.json is `[]` was flashed, first-boot hook and all (exit 0)."""
    img = make_image(tmp_path / "img", {"cmdline.txt": b"console=tty1\n"})
    b = bundle_with(tmp_path, base_bundle)
    damage(b)
    before = digest(img)
    assert_refused(flash(img, b))
    assert digest(img) == before


@needs_image_tools
def test_flash_refuses_a_directory_holding_only_bundle_json(tmp_path):
    img = make_image(tmp_path / "img", {"cmdline.txt": b"console=tty1\n"})
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "bundle.json").write_text("[]\n")
    before = digest(img)
    assert_refused(flash(img, junk))
    assert digest(img) == before


@needs_image_tools
def test_flash_of_a_good_bundle_still_works(tmp_path, base_bundle):
    img = make_image(tmp_path / "img", {"cmdline.txt": b"console=tty1 rootwait\n"})
    p = flash(img, base_bundle)
    assert p.returncode == 0, p.stderr
    out = subprocess.run(["mtype", "-i", f"{img}@@{BOOT_SECTOR * 512}", "::cmdline.txt"], capture_output=True, text=True)
    assert "rootwait systemd.run=/boot/firmware/firstrun.sh" in out.stdout


def test_flash_says_a_device_file_is_not_an_image_file(tmp_path, base_bundle):
    """A card's device file is refused (flash edits an image file's partitions with mtools and
    debugfs); it was refused as "no such image file", which sent the technician looking for a
    file that is there."""
    assert_refused(flash(Path("/dev/null"), base_bundle), "not an image file")
