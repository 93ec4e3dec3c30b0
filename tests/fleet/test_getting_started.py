"""docs/getting-started.md as a new user follows it: its steps run as written, in order (a real
mosquitto from step 1, the gateway's `run` from step 5, the devices' wakes repeated as the page
says), until every node's `dump` shows both devices' readings; then README's five-line
application against the same broker. The checks between the steps are this test's; the commands
are the docs'."""
from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from agent.transport.broker import free_port, port_open
from tests.mqtt.helpers import wait_serving
from tests.waiting import wait_until

from .runbook import Runbook, stop_group, doc_steps

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "getting-started.md"
SECTION = "# Three nodes through one broker"
STEPS = [
    (1, "A broker, in a terminal of its own"),
    (2, "The mesh's manifest: its id and one table"),
    (3, "Three nodes: a gateway and two devices"),
    (4, "Every node trusts the other two"),
    (5, "The gateway's service, in a terminal of its own"),
    (6, "Each device writes a reading"),
    (7, "The devices wake and sync"),
    (8, "Every node holds both readings"),
]
MAX_WAKES = 6   # the page says two or three


def _dumps(out: str) -> dict[str, dict]:
    """Step 8's lines `NODE: {dump}` as {node: dump}."""
    return {m.group(1): json.loads(m.group(2)) for m in re.finditer(r"^(\w+): (\{.*\})$", out, flags=re.M)}


def test_the_page_lists_these_steps():
    assert [(n, t) for n, t, _b in doc_steps(docs=DOC, section=SECTION)] == STEPS


def test_getting_started(tmp_path):
    rb = Runbook(tmp_path, docs=DOC, section=SECTION)
    work = tmp_path / "work"
    v = {"WORK": work, "PORT": free_port()}
    broker = gateway = None
    try:
        broker = rb.start(1, **v)
        wait_until(lambda: port_open("127.0.0.1", v["PORT"]) or broker.poll() is not None, "mosquitto listening")
        assert broker.poll() is None, broker.communicate()[1]
        rb.run(2, **v)
        rb.run(3, **v)
        rb.run(4, **v)
        gateway = rb.start(5, **v)
        wait_serving(work / "gateway", gateway)
        rb.run(6, **v)
        for wakes in range(1, MAX_WAKES + 1):
            rb.run(7, **v)
            dumps = _dumps(rb.run(8, **v).stdout)
            assert set(dumps) == {"gateway", "dev1", "dev2"}, dumps
            rows = [d.get("app.readings", []) for d in dumps.values()]
            if len(rows[0]) == 2 and all(r == rows[0] for r in rows):
                break
        else:
            raise AssertionError(f"not converged after {MAX_WAKES} wakes: {dumps}")
        assert {(r["key"]["device"], r["values"]["temp"]) for r in rows[0]} == {("dev1", 20.5), ("dev2", 19.0)}
        assert rb.ran[:len(STEPS)] == [n for n, _t in STEPS]

        # README's application, run where the page's manifest is, against the page's broker
        readme = (ROOT / "README.md").read_text()
        block = readme.split("\n## An application in five lines\n", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
        assert len(block.strip().splitlines()) == 5, block
        lines = block.strip().replace("/var/lib/ssp", str(tmp_path / "app")) \
                     .replace("mqtt://gateway:1883", f"mqtt://127.0.0.1:{v['PORT']}").splitlines()
        env = rb.env({})
        for line in lines[:4]:
            p = subprocess.run(["bash", "-euo", "pipefail", "-c", line], cwd=work, env=env,
                               capture_output=True, text=True, timeout=600)
            assert p.returncode == 0, (line, p.stdout, p.stderr)
        assert {"key": {"device": "d1", "seq": 1}, "values": {"temp": 20.5}} in json.loads(p.stdout)["app.readings"]
        app = subprocess.Popen(["bash", "-euo", "pipefail", "-c", "exec " + lines[4]], cwd=work, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            wait_serving(tmp_path / "app", app)
        finally:
            err = stop_group(app)
        assert "Traceback" not in err, err[-3000:]
    finally:
        if gateway is not None:
            err = stop_group(gateway)
            assert "Traceback" not in err, err[-3000:]
        if broker is not None:
            stop_group(broker)
