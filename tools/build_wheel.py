"""Build the ssp-agent wheel from a clean copy of this checkout (tools/test.sh, tools/wheelhouse.sh).

A copy, because setuptools builds in the source tree and an old `build/` there can carry modules or
data an earlier layout had into the new wheel. Prints the wheel's path."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = shutil.ignore_patterns(".git", ".venv*", "build", "dist", "__pycache__", "*.egg-info", ".pytest_cache",
                              ".hypothesis", "demo-home", "wheelhouse")


def build(out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(ROOT, src, ignore=SKIP)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps",
                        "-w", str(out), str(src)], check=True, env=env)
    wheels = sorted(out.glob("ssp_agent-*.whl"), key=lambda p: p.stat().st_mtime)
    return wheels[-1]


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "dist"), help="directory for the wheel (default: dist/)")
    print(build(Path(ap.parse_args().out)))
