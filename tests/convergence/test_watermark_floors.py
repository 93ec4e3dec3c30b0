"""A watermark never claims history its holder did not get (§14.2 "MUST NOT
infer progress it cannot demonstrate"), when the sender evicted or lost (restore) its own old
events. Three nodes: an evicting device D, a gateway G that synced D's history earlier, and a
new or long-offline receiver R that must still get that history from G."""
from __future__ import annotations

import shutil
import time

from agent.node import Node
from agent.simpeer import NOTES_TABLE, readings_table
from agent.sync import SyncDriver

from ..sync.helpers import NOW, T, mesh, sync, sync_until_quiet

TABLES = readings_table("telemetry") + NOTES_TABLE


def _events_of(node, site):
    return {e["event_id"] for e in node.log_entries() if e["site_id"] == site.hex()}


def assert_no_overclaim(nodes, everything):
    """Every watermark (s, t) <= W of every node covers only events that node holds (or that
    lie below its own horizon): `everything` maps event_id -> (site, table, hlc)."""
    for n in nodes:
        held = {e["event_id"] for e in n.log_entries()}
        for (s, q, p, l) in n.conn.execute("SELECT site_id, qualified, hlc_p, hlc_l FROM watermarks"):
            h = n.tables[q].horizon if q in n.tables else None
            for eid, (es, eq, eh) in everything.items():
                if es == bytes(s) and eq == q and eh <= (p, l) and not (h and eh < h):
                    assert eid in held, f"{n.site_id.hex()[:6]} claims {q} of {bytes(s).hex()[:6]} up to {p}.{l} " \
                                        f"but lacks {eid[:8]} at {eh}"


def _catalogue(nodes):
    out = {}
    for n in nodes:
        for e in n.log_entries():
            out[e["event_id"]] = (bytes.fromhex(e["site_id"]), e["table"], tuple(map(int, e["hlc"].split("."))))
    return out


def test_new_receiver_gets_evicted_history_from_the_gateway(tmp_path):
    d, g, r = mesh(tmp_path, 3, TABLES)
    dd, dg, dr = SyncDriver(d), SyncDriver(g), SyncDriver(r)
    for i in range(10):
        d.write(T, {"device": "d", "seq": i}, {"temp": float(i)}, now=NOW + i)
    sync(dd, dg, NOW + 20, cycles=2)
    history = _events_of(d, d.site_id)
    assert _events_of(g, d.site_id) == history
    everything = _catalogue([d, g])
    d.evict_table(T, (NOW + 6, 0), now=NOW + 30)
    sync(dd, dr, NOW + 40, cycles=2)   # R meets D first: only 6..9 come from D itself
    assert_no_overclaim([r], everything)
    sync_until_quiet([dd, dg, dr], NOW + 50)
    assert_no_overclaim([d, g, r], everything)
    assert _events_of(r, d.site_id) == history
    for n in (d, g, r):
        n.close()


def test_receiver_part_way_through_the_stream_when_the_sender_evicts(tmp_path):
    d, g, r = mesh(tmp_path, 3, TABLES)
    dd, dg, dr = SyncDriver(d), SyncDriver(g), SyncDriver(r)
    for i in range(3):
        d.write(T, {"device": "d", "seq": i}, {"temp": float(i)}, now=NOW + i)
    sync(dd, dr, NOW + 5, cycles=2)   # R holds 0..2 and a watermark at 2
    for i in range(3, 10):
        d.write(T, {"device": "d", "seq": i}, {"temp": float(i)}, now=NOW + i)
    sync(dd, dg, NOW + 20, cycles=2)
    history = _events_of(d, d.site_id)
    everything = _catalogue([d, g])
    d.evict_table(T, (NOW + 6, 0), now=NOW + 30)   # 3..5 gone from D, never reached R
    sync(dd, dr, NOW + 40, cycles=2)
    assert_no_overclaim([r], everything)
    sync_until_quiet([dd, dg, dr], NOW + 50)
    assert _events_of(r, d.site_id) == history
    assert_no_overclaim([d, g, r], everything)
    for n in (d, g, r):
        n.close()


def test_sender_restored_from_an_older_copy(tmp_path):
    # Real time: the restored node asks its peers for its history again, signing that request
    # under the wall clock (agent/node.py `_redeliver_if_restored`).
    NOW = int(time.time() * 1000)
    d, g, r = mesh(tmp_path, 3, TABLES)
    for i in range(5):
        d.write(T, {"device": "d", "seq": i}, {"temp": float(i)}, now=NOW + i)
    home = d.home
    d.close()
    shutil.copytree(home, tmp_path / "copy")
    d = Node.open(home)
    for i in range(5, 8):
        d.write(T, {"device": "d", "seq": i}, {"temp": float(i)}, now=NOW + i)
    sync(SyncDriver(d), SyncDriver(g), NOW + 20, cycles=2)   # G holds 0..7
    history = _events_of(d, d.site_id)
    d.close()
    shutil.rmtree(home)
    shutil.copytree(tmp_path / "copy", home)     # D restored: 5..7 are gone from its log
    d = Node.open(home)
    for i in range(8, 10):
        d.write(T, {"device": "d", "seq": i}, {"temp": float(i)}, now=NOW + 100 + i)
    history |= _events_of(d, d.site_id)
    everything = _catalogue([d, g])
    dd, dg, dr = SyncDriver(d), SyncDriver(g), SyncDriver(r)
    sync(dd, dr, NOW + 200, cycles=2)
    assert_no_overclaim([r], everything)
    sync_until_quiet([dd, dg, dr], NOW + 300)
    assert _events_of(r, d.site_id) == history
    assert_no_overclaim([g, r], everything)
    for n in (d, g, r):
        n.close()
