"""A session frame's meta naming the policy gap `app.readings@².0` (`²` U+00B2: `str.isdigit()`
accepts it, `int()` refuses it) over a real serial line (a socat pty pair): the receiving
`run --secure-binding`, a real process, keeps running and takes the sender's events; the gap
entry is not a floor (docs/protocol.md §11 "Numbers from outside")."""
from __future__ import annotations

import shutil
import sqlite3
import subprocess
import time

import pytest

from ..cli_cmd import agent_cmd, agent_env, patched_cmd
from .test_pty import homes

CEILING_S = 180  # only catches a hang

# The sender is an honest ssp-agent whose frame meta carries one more gap entry.
POISON_SENDER = """
import agent.core.session as _session
_to_wire = _session.StreamMeta.to_wire
def _poisoned(self):
    d = _to_wire(self)
    d["g"] = list(d["g"]) + ["app.readings@\\u00b2.0"]
    return d
_session.StreamMeta.to_wire = _poisoned
"""


@pytest.fixture
def pty_pair(tmp_path):
    if shutil.which("socat") is None:
        pytest.fail("socat is not installed (apt-get install socat); this test needs a pty pair")
    a, b = tmp_path / "ttyA", tmp_path / "ttyB"
    proc = subprocess.Popen(["socat", f"pty,raw,echo=0,link={a}", f"pty,raw,echo=0,link={b}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + CEILING_S
    while not (a.exists() and b.exists()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert a.exists() and b.exists()
    yield str(a), str(b)
    proc.terminate()
    proc.wait(timeout=CEILING_S)


def _count(home) -> int:
    with sqlite3.connect(f"file:{home}/store.sqlite?mode=ro", uri=True, timeout=30) as c:
        return c.execute("SELECT count(*) FROM events").fetchone()[0]


@pytest.mark.parametrize("receiver", [("run",), ("sync", "--once", "--timeout", "30")])
def test_secure_serial_receiver_survives_a_floor_int_refuses(tmp_path, pty_pair, receiver):
    ha, hb = homes(tmp_path, 5, 0)
    pa, pb = pty_pair
    rb = subprocess.Popen([*agent_cmd(), "--home", str(hb), *receiver, "--serial", pb, "--secure-binding"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env())
    ra = subprocess.Popen([*patched_cmd(POISON_SENDER), "--home", str(ha), "sync", "--serial", pa, "--once",
                           "--timeout", "30", "--secure-binding"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env())
    try:
        deadline = time.monotonic() + CEILING_S
        while _count(hb) < 5 and rb.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        alive = rb.poll() is None or receiver[0] == "sync"
        ra_out = ra.communicate(timeout=CEILING_S)
    finally:
        if rb.poll() is None and receiver[0] == "run":
            rb.terminate()
        out, err = rb.communicate(timeout=CEILING_S)
    assert alive and rb.returncode == 0, err[-3000:]
    assert "Traceback" not in err and "Traceback" not in ra_out[1], (err[-2000:], ra_out[1][-2000:])
    assert _count(hb) == 5  # a's five events, applied and kept


# A bug past the boundary parsers on the receiving side, put in by the test.
FAULTY_RECEIVER = """
import agent.core.delivery as _delivery
def _faulty(entries):
    raise RuntimeError("a bug past the boundary")
_delivery.split_gaps = _faulty
"""


def test_a_frame_whose_handling_raises_is_refused_and_run_goes_on(tmp_path, pty_pair):
    """The serial loop's net: every body frame's handling raises after its events are committed;
    `run --secure-binding` refuses the frame (`unclassified`, in `ssp-agent events`), keeps the
    events, and keeps running until told to stop (exit 0)."""
    ha, hb = homes(tmp_path, 5, 0)
    pa, pb = pty_pair
    rb = subprocess.Popen([*patched_cmd(FAULTY_RECEIVER), "--home", str(hb), "run", "--serial", pb,
                           "--secure-binding"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=agent_env())
    ra = subprocess.Popen([*agent_cmd(), "--home", str(ha), "run", "--serial", pa, "--secure-binding"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env())
    try:
        deadline = time.monotonic() + CEILING_S
        refused = ""
        while rb.poll() is None and time.monotonic() < deadline:
            if _count(hb) == 5:
                ev = subprocess.run([*agent_cmd(), "--home", str(hb), "events"], capture_output=True, text=True,
                                    env=agent_env(), timeout=CEILING_S)
                if '"unclassified"' in ev.stdout:
                    refused = ev.stdout
                    break
            time.sleep(0.3)
        alive = rb.poll() is None
    finally:
        for p in (ra, rb):
            if p.poll() is None:
                p.terminate()
        outs = [p.communicate(timeout=CEILING_S) for p in (ra, rb)]
    assert alive and rb.returncode == 0, outs[1][1][-3000:]
    assert "RuntimeError" in refused and _count(hb) == 5
