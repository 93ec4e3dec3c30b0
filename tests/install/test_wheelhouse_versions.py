"""A device installed from tools/wheelhouse.sh runs the dependency versions this suite ran against
(docs/platform.md "Dependencies"): the aarch64 set (manylinux tags up to Raspberry Pi OS's glibc)
resolves the same version of every runtime dependency as this environment and as the host set, or
the script fails. Binary wheels only, downloaded from the package index; nothing is built but the
ssp-agent wheel."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import wheelset  # noqa: E402  (tools/ is not a package)


def _env():
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _wheelhouse(*args):
    return subprocess.run(["bash", str(ROOT / "tools" / "wheelhouse.sh"), *map(str, args)], capture_output=True,
                          text=True, env=_env(), timeout=900)


def test_aarch64_set_has_the_versions_the_suite_ran_against(tmp_path):
    suite = wheelset.pins()
    assert {"cbor2", "pynacl", "blake3", "cryptography", "paho-mqtt", "pyserial", "python-pkcs11"} <= set(suite)
    p = _wheelhouse("--out", tmp_path, "--arch", "aarch64")
    assert p.returncode == 0, p.stderr
    arm = wheelset.versions(tmp_path / "aarch64-cp311")
    arm.pop("ssp-agent")
    assert arm == suite


def test_check_compares_the_host_and_aarch64_sets(tmp_path):
    p = _wheelhouse("--out", tmp_path, "--check")
    assert p.returncode == 0, p.stderr
    host = wheelset.versions(next(d for d in tmp_path.iterdir() if d.name != "aarch64-cp311" and d.is_dir()))
    assert host == wheelset.versions(tmp_path / "aarch64-cp311") and "cbor2" in host


def test_compare_names_every_difference(tmp_path):
    a, b = tmp_path / "host", tmp_path / "arm"
    a.mkdir(), b.mkdir()
    for d, names in ((a, ["cbor2-6.3.0-cp311-cp311-manylinux_2_28_x86_64.whl", "pyserial-3.5-py2.py3-none-any.whl"]),
                     (b, ["cbor2-5.9.0-cp311-cp311-manylinux2014_aarch64.whl"])):
        for n in names:
            (d / n).write_bytes(b"")
    assert wheelset.compare(a, b) == [f"cbor2: 6.3.0 in {a}, 5.9.0 in {b}", f"pyserial: 3.5 in {a}, absent in {b}"]
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "wheelset.py"), "compare", str(a), str(b)],
                       capture_output=True, text=True)
    assert p.returncode == 1 and p.stderr.count("version mismatch") == 2
    (a / "pyserial-3.5-py2.py3-none-any.whl").unlink()
    (a / "cbor2-6.3.0-cp311-cp311-manylinux_2_28_x86_64.whl").rename(a / "cbor2-5.9.0-cp311-cp311-any.whl")
    assert wheelset.compare(a, b) == []
