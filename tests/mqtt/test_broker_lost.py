"""A lost broker connection shows in `ssp-agent events` ("every reason code reached
through every transport shows in events"), as a serial link loss does: kind `link_lost`, reason
`broker_lost` from agent/core/reasons.py, source `link:mqtt`, paho's reason in the detail; and
sync resumes once the broker is back. A real mosquitto is stopped under running runners."""
from __future__ import annotations

import json
import subprocess

from agent.core import reasons as R

from ..cli_cmd import agent_cmd, agent_env
from .helpers import event_ids, make_nodes, pump_for, runner, step_until, write


def _link_lost(home) -> list[dict]:
    p = subprocess.run([*agent_cmd(), "--home", str(home), "events"], capture_output=True, text=True,
                       env=agent_env(), timeout=120)
    assert p.returncode == 0, p.stderr
    return [e for e in map(json.loads, p.stdout.splitlines()) if e["kind"] == "link_lost"]


def test_a_lost_broker_shows_in_events_and_sync_resumes(broker, tmp_path):
    a, b = nodes = make_nodes(tmp_path, 2)
    ra, rb = rs = [runner(a, broker), runner(b, broker)]
    try:
        first = write(a, 1)
        assert step_until(rs, lambda: first in event_ids(b), 20)
        broker.stop()
        assert step_until(rs, lambda: not (ra.link.connected.is_set() or rb.link.connected.is_set()), 20)
        pump_for(rs, 0.3)  # a reconnect attempt or two fails meanwhile
        broker.start()
        assert step_until(rs, lambda: ra.link.connected.is_set() and rb.link.connected.is_set(), 20)
        second = write(a, 2)
        assert step_until(rs, lambda: second in event_ids(b), 20)  # sync resumes
    finally:
        for r in rs:
            r.close()
        for n in nodes:
            n.close()
    for n in nodes:
        lost = _link_lost(n.home)
        assert lost, "the broker's loss is not in events"
        assert {e["reason"] for e in lost} == {R.BROKER_LOST}
        assert {e["detail"]["source"] for e in lost} == {"link:mqtt"}
        # paho's reason for the loss, then (once) why the reconnects failed; our own close is no loss
        details = [e["detail"]["detail"] for e in lost]
        assert details[0].startswith("disconnected: ") or details[0].startswith("connection lost ("), details
        assert [d for d in details if "cannot reach broker" in d] == [details[-1]], details
        assert not any("Normal disconnection" in d or "before accepting" in d for d in details), details


def test_broker_losses_are_bounded_in_events(broker, tmp_path):
    """A link that loses its broker again and again (a flapping network) surfaces at most
    LOSSES_SURFACED_PER_WINDOW rows per window (each an fsync), with the same pure budget as a
    serial link's losses; the rest are told in one row (here when the runner closes)."""
    from agent.runner import LOSSES_SURFACED_PER_WINDOW
    a, b = nodes = make_nodes(tmp_path, 2)
    r = runner(a, broker)
    extra = 5
    try:
        for i in range(LOSSES_SURFACED_PER_WINDOW + extra):  # what the link's network thread notes per loss
            r.link.losses.append((1_000 + i, f"disconnected: loss {i}"))
        r.step(0)
        assert r.stats["broker_lost"] == LOSSES_SURFACED_PER_WINDOW + extra
    finally:
        r.close()
        for n in nodes:
            n.close()
    details = [e["detail"]["detail"] for e in _link_lost(a.home)]
    assert details[:-1] == [f"disconnected: loss {i}" for i in range(LOSSES_SURFACED_PER_WINDOW)]
    assert details[-1].startswith(f"{extra} more not surfaced"), details
