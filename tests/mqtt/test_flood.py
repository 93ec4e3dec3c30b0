"""A flood of rogue messages into a node's inbox stopped all honest progress (the
honest bodies waited behind the whole flood, each rogue message refused, logged and surfaced in a
transaction of its own, in arrival order) and grew the presence tables by one entry per fictional
site. Measured by bench/bench_flood.py; here the bounded counts, over a real mosquitto."""
from __future__ import annotations

import os
import time

from agent.core.codec import encode
from agent.core.messages import Handshake, emit_handshake
from agent.transport.mqtt import MqttLink, MqttSettings, Topics, _publish_props

from .helpers import MESH, event_ids, make_nodes, pulls_answered, runner, step_until, write
from tests.waiting import HANG_S

N_ROGUE, N_PRESENCE = 400, 120


def _wait_queued(r, n: int, timeout: float = HANG_S) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if r.link.inbound.qsize() >= n:
            return True
        time.sleep(0.02)
    return False


def test_a_flood_does_not_hold_back_honest_bodies_and_costs_bounded_rows(broker, tmp_path):
    a, b = nodes = make_nodes(tmp_path, 2)
    ra = runner(a, broker, cadence_s=3600, realtime=False)
    # A Receive Maximum of 1 000 (the default is derived from the body limit, 252 here) lets the
    # whole flood be in the queue at once, ahead of the honest body: the case the pump must order.
    rb = runner(b, broker, cadence_s=3600, realtime=False, link={"receive_maximum": 1000})
    rb.cfg.others_per_step = 32  # (unknown to the code before the fix: plain attributes)
    rb.presence_limit = rb.link.present_limit = 50
    rogue = MqttLink(MqttSettings.from_url(broker.url), MESH, os.urandom(16)).start()
    assert rogue.wait_connected(5)
    topics = Topics(MESH)
    try:
        assert step_until([ra, rb], lambda: a.site_id in rb.caps, 5)  # the honest peer is present
        # the connect-time pulls answered first: the honest message the step must serve first is
        # then the body, not a pull
        assert step_until([ra, rb], lambda: pulls_answered([ra, rb]), 30)
        shapes = [b"\xff\x00garbage", encode([1, 2, 3]), encode({"ssp_version": 2, "from_site_id": "00" * 16})]
        for i in range(N_ROGUE):  # each from a fresh fictional sender, none in b's keyring
            s = os.urandom(16)
            rogue.publish_raw(topics.requests(b.site_id, s), shapes[i % 3],
                              _publish_props({}, os.urandom(16), topics.answers(s, b.site_id)))
        for _ in range(N_PRESENCE):  # valid handshakes of fictional sites
            s = os.urandom(16)
            rogue.publish_raw(topics.presence(s), emit_handshake(Handshake(s, (0, 0), True, False, None)))
        assert _wait_queued(rb, N_ROGUE + N_PRESENCE), rb.link.inbound.qsize()
        ids = {write(a, i, "honest") for i in range(5)}
        ra.batch_cycle()
        assert _wait_queued(rb, N_ROGUE + N_PRESENCE + 1)

        # One step serves the honest body first and at most `others_per_step` of the flood.
        rb.step(0.01)
        assert ids <= event_ids(b)
        assert rb.stats["rejected_bodies"] <= 32, rb.stats

        # The rest of the flood is taken in, refused, answered and acknowledged.
        assert step_until([ra, rb], lambda: rb.stats["rejected_bodies"] == N_ROGUE and rb.link.inbound.empty()
                          and not rb._others, 30), rb.stats
        refused_rows = b.conn.execute("SELECT count(*) FROM surfaced WHERE kind='refused'").fetchone()[0]
        # surfaced per reason at most REFUSALS_SURFACED_PER_WINDOW a window; the rest counted
        assert refused_rows <= 3 * 20, refused_rows
        assert rb.stats["refusals_not_surfaced"] == N_ROGUE - refused_rows
        # presence of fictional sites: bounded, oldest evicted and counted; the honest peer stays
        assert len(rb.caps) <= 50 and a.site_id in rb.caps
        assert len(rb.link.present) <= 50 and rb.link.present_evicted >= N_PRESENCE - 50
        # (dropped while waiting to be handled, or evicted from the table once handled)
        assert rb.stats["presence_evicted"] + rb.stats["others_presence_dropped"] >= N_PRESENCE - 50

        # honest exchanges both ways keep flowing
        e2, e3 = write(a, 10, "honest"), write(b, 11, "honest")
        ra.batch_cycle(); rb.batch_cycle()
        assert step_until([ra, rb], lambda: e2 in event_ids(b) and e3 in event_ids(a), 10)
        assert a.dump() == b.dump()
        # what was not surfaced is summed up, per reason, when the window ends (here: on close)
        n_not = rb.stats["refusals_not_surfaced"]
        rb.close()
        rows = [s for s in b.surfaced() if "more refusals not surfaced" in s.get("detail", {}).get("detail", "")]
        assert sum(int(r["detail"]["detail"].split()[0]) for r in rows) == n_not, rows
    finally:
        rogue.close()
        ra.close(); rb.close()
        for n in nodes:
            n.close()
