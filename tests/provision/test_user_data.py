"""The cloud-init hook of `provision flash` (docs/operations.md "Fleet workflow", 2. Flash).

A Trixie-based Raspberry Pi OS image is configured by cloud-init from the boot partition's
`user-data`, which Raspberry Pi Imager writes (fixtures/imager-user-data*: `#cloud-config`, its
header comment, hostname, users, ssh, apt, rpi interfaces, and a runcmd list whose items are not
indented; one with a comment after `runcmd:`). `flash` parses it as YAML and writes it back with
our entry first in runcmd: the result parses, every setting of the image's is kept, and the
image's own runcmd entries follow ours. A user-data that is not valid YAML or not a cloud-config
is refused (exit 2) with the image unchanged."""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

from agent.provision.bundle import DEVICE_BUNDLE  # noqa: E402
from agent.provision.image import add_runcmd  # noqa: E402
from agent.simpeer import readings_table  # noqa: E402
from tests.cli_cmd import run_cli  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
OURS = ["bash", f"{DEVICE_BUNDLE}/firstboot.sh", "install", "--start"]
IMAGER = sorted(FIXTURES.glob("imager-user-data*"))
MESH = "00112233445566778899aabbccddeeff"


@pytest.mark.parametrize("fixture", IMAGER, ids=lambda p: p.name)
def test_imager_user_data_keeps_every_setting_and_runs_ours_first(fixture):
    text = fixture.read_text()
    before = yaml.safe_load(text)
    out = add_runcmd(text)
    after = yaml.safe_load(out)                       # valid YAML (cloud-init would reject the whole file else)
    assert out.splitlines()[:2] == text.splitlines()[:2]    # "#cloud-config" and Imager's header comment
    assert after["runcmd"] == [OURS] + before["runcmd"]     # ours first, then the image's own, all of them
    assert {k: v for k, v in after.items() if k != "runcmd"} == {k: v for k, v in before.items() if k != "runcmd"}
    assert list(after) == list(before)                # and in the same order
    assert add_runcmd(out) == out                     # flashing the image again adds nothing


def test_user_data_shapes():
    assert yaml.safe_load(add_runcmd(None)) == {"runcmd": [OURS]}
    assert add_runcmd(None).startswith("#cloud-config\n")
    # no runcmd yet; an empty `runcmd:`; a comment on its line
    assert yaml.safe_load(add_runcmd("#cloud-config\nhostname: x\n")) == {"hostname": "x", "runcmd": [OURS]}
    assert yaml.safe_load(add_runcmd("#cloud-config\nruncmd:\nhostname: x\n")) == {"runcmd": [OURS], "hostname": "x"}
    assert yaml.safe_load(add_runcmd("#cloud-config\nruncmd: # later\n  - [echo, a]\n"))["runcmd"] == [OURS, ["echo", "a"]]
    # a block scalar stays a block scalar
    ud = add_runcmd("#cloud-config\nwrite_files:\n- path: /etc/x\n  content: |\n    line 1\n    line 2\n")
    assert "content: |" in ud and yaml.safe_load(ud)["write_files"][0]["content"] == "line 1\nline 2\n"


@pytest.mark.parametrize("text, why", [
    ("#cloud-config\nruncmd:\n  - [echo, a]\n- [echo, b]\n", "not valid YAML"),
    ("#cloud-config\n- just\n- a list\n", "mapping"),
    ("#cloud-config\nruncmd: echo hello\n", "runcmd"),
    ("#!/bin/sh\necho a user-data script\n", "#cloud-config"),
])
def test_user_data_that_cannot_be_edited_is_refused(text, why):
    from agent.provision.files import ProvisionRefused
    with pytest.raises(ProvisionRefused, match=why):
        add_runcmd(text)


IMAGE_TOOLS = ("sfdisk", "mkfs.vfat", "mkfs.ext4", "mcopy", "mtype", "debugfs")


@pytest.mark.skipif(any(shutil.which(t) is None for t in IMAGE_TOOLS), reason=f"needs {', '.join(IMAGE_TOOLS)}")
def test_flash_an_imager_made_trixie_image(tmp_path):
    from tests.provision.test_flash import fat, make_image
    (tmp_path / "wh").mkdir()
    (tmp_path / "wh" / "ssp_agent-1.0-py3-none-any.whl").write_bytes(b"stand-in")
    (tmp_path / "mesh.toml").write_text(f'mesh_id = "{MESH}"\n' + readings_table())
    b = tmp_path / "bundle"
    p = run_cli("provision", "bundle", "--out", b, "--manifest", tmp_path / "mesh.toml", "--wheelhouse", tmp_path / "wh")
    assert p.returncode == 0, p.stderr
    imager = (FIXTURES / "imager-user-data").read_text()
    img = make_image(tmp_path / "trixie.img", {"cmdline.txt": "console=serial0,115200 root=PARTUUID=1 rootwait\n",
                                               "user-data": imager, "meta-data": "instance-id: rpi-imager-1\n"})
    p = run_cli("provision", "flash", "--image", img, "--bundle", b)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["hook"] == "cloud-init"
    after = yaml.safe_load(fat(img, "user-data"))
    before = yaml.safe_load(imager)
    assert after["runcmd"] == [OURS] + before["runcmd"] and after["users"] == before["users"]
    # broken user-data: refused, the image file as it was
    bad = make_image(tmp_path / "bad.img", {"cmdline.txt": "root=PARTUUID=1 rootwait\n",
                                            "user-data": "#cloud-config\nruncmd:\n  - [a]\n- [b]\n"})
    digest = hashlib.sha256(bad.read_bytes()).hexdigest()
    p = run_cli("provision", "flash", "--image", bad, "--bundle", b)
    assert p.returncode == 2 and "user-data" in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert hashlib.sha256(bad.read_bytes()).hexdigest() == digest
