"""The real components the suite starts are installed (tools/setup.sh installs them before every
run of tools/test.sh and CI): a missing one turned its tests into skips, so they could not fail
(libfaketime and the image tools of `flash` were missing in CI until setup.sh installed them)."""
from __future__ import annotations

import os
import shutil

import pytest

# command -> the Debian package that provides it
COMPONENTS = {"mosquitto": "mosquitto", "softhsm2-util": "softhsm2", "socat": "socat", "faketime": "faketime",
              "sfdisk": "fdisk", "mkfs.vfat": "dosfstools", "mcopy": "mtools", "mtype": "mtools",
              "mkfs.ext4": "e2fsprogs", "debugfs": "e2fsprogs", "ejabberdctl": "ejabberd", "erl": "ejabberd",
              "node": "nodejs", "npm": "npm"}


@pytest.mark.parametrize("command", sorted(COMPONENTS))
def test_the_component_the_suite_starts_is_installed(command):
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin" + os.pathsep + "/sbin"
    assert shutil.which(command, path=path), (
        f"{command} is missing: run tools/setup.sh (apt-get install {COMPONENTS[command]}); "
        "the tests that need it would only be skipped")


def test_ts_mls_is_installed():
    """The ts-mls members of the sequencer tests (tools/setup.sh runs `npm ci` for them)."""
    from pathlib import Path
    here = Path(__file__).resolve().parent / "sequencer" / "ts_mls" / "node_modules" / "ts-mls"
    assert here.is_dir(), "ts-mls is missing: run tools/setup.sh (npm ci --prefix tests/sequencer/ts_mls)"
