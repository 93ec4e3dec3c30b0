"""Store-and-forward demo: three nodes that never talk to each other directly exchange mailbox
files (a USB stick carried between sites) through the real `ssp-agent` CLI, and converge.

    python3 tools/demo_mailbox.py [WORKDIR]
"""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

from agent.simpeer import manifest_text, readings_table

MANIFEST = manifest_text(bytes.fromhex("5e55a9e7000000000000000000000002"), readings_table())


def sh(home: Path, *args: str, quiet: bool = False) -> str:
    cmd = [sys.executable, "-m", "agent.cli", "--home", str(home), *args]
    if not quiet:
        print("  $ ssp-agent --home", home.name, " ".join(shlex.quote(a) for a in args))
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"demo: command failed ({p.returncode}): {p.stderr.strip()}")
    return p.stdout


def main() -> int:
    # docs/apply.md "Clocks without an RTC": a demo on a machine that may run no time sync (a container); declare the wall clock trustworthy
    os.environ.setdefault("SSP_AGENT_CLOCK_TRUSTED", "1")
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="ssp-mailbox-demo-"))
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("SSP_AGENT_WITNESS_DIR", str(root / "witness"))
    (root / "manifest.toml").write_text(MANIFEST)
    names = ["north", "south", "east"]
    homes = {n: root / n for n in names}
    ids = {}
    print("[1/5] three field nodes")
    for n in names:
        ids[n] = json.loads(sh(homes[n], "init", "--manifest", str(root / "manifest.toml")))
    print("[2/5] each trusts the others' keys (a mesh authority's vouch records do this in-band)")
    for n in names:
        for m in names:
            if m != n:
                sh(homes[n], "peer", "add", "--site-id", ids[m]["site_id"], "--public-key", ids[m]["public_key"],
                   quiet=True)
    print("[3/5] each writes while disconnected (north and south edit the same row)")
    sh(homes["north"], "write", "app.readings", "--key", '{"device":"pump","seq":1}', "--set", '{"temp":4.5}')
    sh(homes["south"], "write", "app.readings", "--key", '{"device":"pump","seq":1}', "--set", '{"note":"serviced"}')
    sh(homes["east"], "write", "app.readings", "--key", '{"device":"tank","seq":7}', "--set", '{"temp":11.0}')
    sh(homes["east"], "write", "app.readings", "--key", '{"device":"tank","seq":8}', "--set", '{"temp":12.0}')
    sh(homes["east"], "write", "app.readings", "--key", '{"device":"tank","seq":8}', "--delete")
    print("[4/5] a courier carries files round the ring north -> south -> east -> north, twice")
    mail = root / "usb-stick"
    mail.mkdir(exist_ok=True)
    ring = [("north", "south"), ("south", "east"), ("east", "north")]
    for rnd in range(2):
        for src, dst in ring:
            f = mail / f"{src}-to-{dst}-{rnd}.cbor"
            sh(homes[src], "mailbox", "export", "--peer", ids[dst]["site_id"], "--out", str(f))
            res = json.loads(sh(homes[dst], "mailbox", "import", str(f)))
            print(f"      {dst} took {f.name}: " + ", ".join(f"{k} {res[k]}" for k in
                                                           ("applied", "duplicate", "dropped", "rejected", "held")))
    print("[5/5] the tables on every node")
    dumps = {n: json.loads(sh(homes[n], "dump", quiet=True)) for n in names}
    print(json.dumps(dumps["north"], indent=2))
    same = all(dumps[n] == dumps["north"] for n in names)
    print("converged: all three dumps identical" if same else "NOT converged: dumps differ")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
