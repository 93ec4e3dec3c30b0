"""Devices that are never online at the same time converge through the broker.

Each device wakes, runs `ssp-agent sync --once` as a real process against a real mosquitto, and
sleeps; no two are ever online together. Everything between them travels through their
persistent broker sessions (QoS 1): bodies wait in the sleeping peer's session, and the peer's
answers wait in the sender's. The answers must be taken on the sender's next wake and move its
durable cursor, so that wake sends the next window; before, they were ignored (their correlation
data belonged to the previous process), cursors never moved and each wake re-sent the first
window, so a peer never got more than one window of a device's events."""
from __future__ import annotations

import json
import random
import sqlite3
import subprocess
import time

from agent.node import Node

from .helpers import MANIFEST, event_ids, write
from tests.cli_cmd import agent_cmd, agent_env

N_DEVICES = 3
EVENTS_EACH = 12
BATCH_LIMIT = 2  # events per body; with the window of 4 bodies, 8 events per peer per wake
PROFILE = """name = "sleeper"
description = "a wake-sync-sleep device with small bodies"
[store]
disk_budget_mb = 64
[horizons]
telemetry = "7d"
records = "60d"
[sync]
cadence_s = 30
batch_limit = %d
body_limit_bytes = 65536
session_expiry_s = 86400
[keystore]
kind = "software"
""" % BATCH_LIMIT


def _sync_once(home, url: str) -> dict:
    p = subprocess.run([*agent_cmd(), "--home", str(home), "sync", "--broker", url, "--once", "--timeout", "2"],
                       capture_output=True, text=True, timeout=60, env=agent_env())
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


def _durable(home) -> tuple[int, dict[bytes, int], set[bytes]]:
    """(highest seq of the log, the durable `mqtt` cursor per peer, event ids), read from the store."""
    with sqlite3.connect(f"file:{home}/store.sqlite?mode=ro", uri=True, timeout=5) as c:
        top = c.execute("SELECT coalesce(max(seq), 0) FROM events").fetchone()[0]
        names = {n for (n,) in c.execute("SELECT name FROM sqlite_master")}
        cur = {bytes(p): live for p, live in c.execute("SELECT peer, live FROM sync_cursors WHERE path='mqtt'")} \
            if "sync_cursors" in names else {}
        ids = {bytes(r[0]) for r in c.execute("SELECT event_id FROM events")}
    return top, cur, ids


def test_devices_never_online_together_converge_with_every_cursor_advancing(broker, tmp_path):
    prof = tmp_path / "sleeper.toml"
    prof.write_text(PROFILE)
    nodes = [Node.init(tmp_path / f"d{i}", MANIFEST, profile=str(prof))[0] for i in range(N_DEVICES)]
    for a in nodes:
        for b in nodes:
            if a is not b:
                a.add_peer(b.site_id, b.keyring[b.site_id][0], None)
    for k, n in enumerate(nodes):
        for i in range(EVENTS_EACH):
            write(n, i, f"dev{k}")
    want = set().union(*(event_ids(n) for n in nodes))
    homes = [n.home for n in nodes]
    sites = [n.site_id for n in nodes]
    for n in nodes:
        n.close()
    assert len(want) == N_DEVICES * EVENTS_EACH

    rng = random.Random(10)
    wakes = 0
    t0 = time.monotonic()
    converged = False
    for _round in range(14):
        # One round: every device wakes once, in a random order, for as long as one `sync --once`
        # takes; the next wakes only after it has gone (disconnected, its presence cleared).
        for k in rng.sample(range(N_DEVICES), N_DEVICES):
            time.sleep(rng.uniform(0, 0.2))
            out = _sync_once(homes[k], broker.url)
            wakes += 1
            assert not any(p["present"] for p in out["peers"].values())  # never online together
            state = [_durable(h) for h in homes]
            if all(ids == want for _top, _cur, ids in state) and all(
                    cur.get(sites[j], 0) == top for i, (top, cur, _ids) in enumerate(state)
                    for j in range(N_DEVICES) if j != i):
                converged = True
                break
        if converged:
            break
    elapsed = time.monotonic() - t0
    state = [_durable(h) for h in homes]
    assert converged, {"wakes": wakes, "have": [len(ids) for _t, _c, ids in state],
                       "cursors": [[c.get(s, 0) for s in sites] for _t, c, _i in state],
                       "tops": [t for t, _c, _i in state]}
    # Every durable cursor advanced past the first window, to the end of its holder's log: every
    # event there was answered for by that peer (each node's log holds all 36 events).
    for i, (top, cur, ids) in enumerate(state):
        assert top >= len(want) > 4 * BATCH_LIMIT
        for j in range(N_DEVICES):
            if j != i:
                assert cur[sites[j]] == top
    dumps = []
    for h in homes:
        n = Node.open(h)
        dumps.append(n.dump())
        n.close()
    assert dumps[0] == dumps[1] == dumps[2]
    print(f"{N_DEVICES} sleepers converged after {wakes} wakes in {elapsed:.1f}s")
