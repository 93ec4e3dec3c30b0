"""The fleet rehearsal (docs/operations.md "Fleet rehearsal"): the fleet workflow and the replacement
runbook executed as written, step by step, in the deployment's shape. Real processes: mosquitto
started here with docs/mqtt.md's configuration (one account per device, the per-device ACLs, TLS),
an authority, a gateway under `run --secure-binding` for the whole test, three `pi-zero-2w` devices
enrolled while it runs and waking with `sync --once` one at a time (never two online together),
then one device destroyed and replaced while the gateway keeps running. The checks between the
steps are this test's; the commands are the doc's."""
from __future__ import annotations

import json
import shutil
import subprocess

from tests.cli_cmd import run_cli
from tests.mqtt.test_broker_security import docs_broker, make_pki
from tests.mqtt.test_metrics_labels import documented_labels
from tests.mqtt.helpers import wait_serving
from tests.waiting import wait_until

from .runbook import Runbook, stop_group

T = "app.readings"
DEVICES = 3
WRITE_ROUNDS = 2      # rounds in which every device writes a reading before its wake
MAX_ROUNDS = 6        # wakes per device after the last write by which the fleet has converged
MAX_REHYDRATE_WAKES = 6


def _json(p: subprocess.CompletedProcess) -> dict:
    return json.loads(p.stdout)


def _rows(home, p: subprocess.CompletedProcess | None = None) -> set[str]:
    """The readings a node holds: its `dump` (forwarded on the live gateway), or `p`'s output."""
    p = p or run_cli("--home", home, "dump")
    assert p.returncode == 0, p.stderr
    return {json.dumps(r, sort_keys=True) for r in json.loads(p.stdout).get(T, [])}


def test_fleet_rehearsal(tmp_path):
    rb = Runbook(tmp_path)
    pki = make_pki(tmp_path / "pki", [])
    (tmp_path / "mosquitto").mkdir()
    broker = docs_broker(tmp_path / "mosquitto", pki, {})   # no account yet: each is issued by the runbook
    v = {"AUTH": tmp_path / "authority", "MESH": tmp_path / "mesh.toml", "DEVICE_MESH": tmp_path / "device-mesh.toml", "BROKER": f"mqtts://127.0.0.1:{broker.port}",
         "CA": pki["ca"], "PASSWD": tmp_path / "mosquitto" / "ssp.passwd", "MOSQUITTO_PID": broker.proc.pid,
         "GW": tmp_path / "gw", "GW_PW": tmp_path / "gw.mqtt-password"}
    gw_proc = None
    try:
        out = _json(rb.run(1, **v))
        v.update(AUTH_SITE=out["site_id"], AUTH_PK=out["public_key"])
        rb.run(2, **v)
        out = _json(rb.run(3, **v))
        v.update(GW_SITE=out["site_id"], GW_PK=out["public_key"])
        rb.run(4, **v)
        rb.run(5, **v)
        rb.run(6, **v)
        gw_proc = rb.start(7, **v)
        wait_serving(v["GW"], gw_proc)

        # three devices enrolled while the gateway runs
        devices = []
        for i in range(DEVICES):
            d = {"DEVICE": tmp_path / f"dev{i}", "DEVICE_PW": tmp_path / f"dev{i}.mqtt-password"}
            out = _json(rb.run(8, **v, **d))
            d.update(SITE=out["site_id"], PK=out["public_key"])
            rb.run(9, **v, **d)
            rb.run(10, **v, **d)
            rb.run(11, **v, **d)
            devices.append(d)

        # wakes one at a time, a reading written before each wake in the first rounds
        seq = 0
        for _ in range(WRITE_ROUNDS):
            seq += 1
            for d in devices:
                rb.run(12, **v, **d, N=seq)
                rb.run(13, **v, **d)
        written = DEVICES * WRITE_ROUNDS
        rounds = 0
        while True:
            gw_rows = _rows(v["GW"])
            behind = [d["SITE"][:8] for d in devices if _rows(d["DEVICE"]) != gw_rows]
            if len(gw_rows) == written and not behind:
                break
            assert rounds < MAX_ROUNDS, f"after {rounds} more rounds of wakes: gateway {len(gw_rows)}/{written} " \
                                        f"rows, devices behind it: {behind}"
            rounds += 1
            for d in devices:
                rb.run(13, **v, **d)
        print(f"fleet converged {rounds} round(s) of wakes after the last write")

        # every node of the healthy fleet: check exits 0 (once every node's peers have reported
        # their watermarks: a sleeper's report to another sleeper waits in its broker session)
        quiet = _until_healthy(rb, v, devices, absent=v["AUTH_SITE"])
        print(f"check exits 0 on every node after {quiet} more round(s) of wakes")

        # the gateway's metrics file (`run --metrics-file`): Prometheus' own parser reads it, every label documented
        # written every --metrics-interval (15 s) by the running gateway: the first write after its
        # events arrived is waited for (a hang ceiling), then every label of it is checked
        def counted():
            got = documented_labels((v["GW"] / "metrics.prom").read_text())
            return got if ("ssp_events_total", "origin", "mqtt") in got else None
        seen = wait_until(counted, "the gateway's metrics file counting events received over MQTT", poll=0.5)
        assert {("ssp_peer_lag_events", "peer", d["SITE"]) for d in devices} <= seen, seen
        assert not any(lab == "peer" and val == v["AUTH_SITE"] for _n, lab, val in seen)

        # one device destroyed: its card is gone (its home deleted), the gateway keeps running
        old = devices[1]
        had = {r for r in _rows(v["GW"]) if json.loads(r)["key"]["device"] == old["SITE"]}
        assert len(had) == WRITE_ROUNDS
        shutil.rmtree(old["DEVICE"])
        cutoff = rb.run(15, **v, OLD=old["SITE"]).stdout.strip()
        assert cutoff and "." in cutoff, cutoff
        new = {"DEVICE": tmp_path / "dev1-new", "DEVICE_PW": tmp_path / "dev1-new.mqtt-password"}
        out = _json(rb.run(8, **v, **new))
        new.update(SITE=out["site_id"], PK=out["public_key"])
        assert new["SITE"] != old["SITE"]
        rb.run(9, **v, **new)
        p = rb.run(16, **v, NEW=new["SITE"], NEW_PK=new["PK"], OLD=old["SITE"], CUTOFF=cutoff)
        # the two issued records, then `record list`: one line per record with its `head`
        recs = [r for r in map(json.loads, p.stdout.splitlines()) if "head" in r]
        assert any(r["kind"] == "vouch" and r["subject"] == new["SITE"] and r["head"] for r in recs), recs
        assert any(r["kind"] == "retire" and r["subject"] == old["SITE"] and r["head"] for r in recs), recs
        rb.run(11, **v, **new)
        rb.run(17, **v, **new)
        # caught up: the source has nothing left to send to NEW (the new device cannot know that
        # from a quiet source: its `remaining` says to ask the source, docs/operations.md §4)
        outs, serving = [], None
        for wakes in range(1, MAX_REHYDRATE_WAKES + 1):
            outs.append(_json(rb.run(13, **v, **new)))
            st = _json(rb.run(18, **v, NODE=new["DEVICE"]))["rehydrating"]
            gw_st = _json(rb.run(18, **v, NODE=v["GW"]))
            serving = [s for s in gw_st["serving"] if s["subject"] == new["SITE"]]
            if (st["source_trusted"] and serving and serving[0]["remaining_events"] == 0
                    and had <= _rows(new["DEVICE"])):
                break
        else:
            raise AssertionError(f"the new device did not catch up in {MAX_REHYDRATE_WAKES} wakes: {st}; "
                                 f"the gateway serving it: {serving}; wakes: {outs}")
        print(f"replacement caught up after {wakes} wake(s): bodies received {[o['bodies_received'] for o in outs]}")
        assert st["from"] == v["GW_SITE"] and st["rows_received"] == len(_rows(v["GW"])), st
        # every row the old device had synced is back, and the new device holds what the gateway holds
        new_rows = _rows(None, rb.run(19, NODE=new["DEVICE"]))
        assert had <= new_rows
        assert new_rows == _rows(None, rb.run(19, NODE=v["GW"]))
        # the fleet is healthy again, every device writing its readings (the new one too): the
        # retired device is no peer anywhere any more
        devices[1] = new
        seq += 1
        for d in devices:
            rb.run(12, **v, **d, N=seq)
            rb.run(13, **v, **d)
        quiet = _until_healthy(rb, v, devices, absent=old["SITE"])
        print(f"after the replacement, check exits 0 on every node after {quiet} round(s) of wakes")
        assert gw_proc.poll() is None, "the gateway's service stopped during the rehearsal"
        # every step of the doc ran, first in the doc's order (tests/fleet/test_runbook_steps.py)
        assert set(rb.ran) == set(rb.steps), sorted(set(rb.ran) ^ set(rb.steps))
        first = sorted(set(rb.ran), key=rb.ran.index)
        assert first == sorted(first), first
    finally:
        if gw_proc is not None:
            err = stop_group(gw_proc)
            assert "Traceback" not in err, err[-3000:]
        broker.close()


def _until_healthy(rb: Runbook, v: dict, devices: list[dict], absent: str) -> int:
    """Rounds of wakes (each device once, in turn) until `check` exits 0 on the gateway and every
    device and none has a line for `absent` (a key that is no sync peer, or a retired device, once
    its retirement reached every node). Returns the rounds needed."""
    nodes = [(v["GW"], v["GW_SITE"], v["GW_PW"])] + [(d["DEVICE"], d["SITE"], d["DEVICE_PW"]) for d in devices]
    for rounds in range(MAX_ROUNDS + 1):
        not_ok = {}
        for home, site, pw in nodes:
            p = rb.run(14, check=False, **v, NODE=home, NODE_SITE=site, NODE_PW=pw)
            assert p.returncode in (0, 3), (home.name, p.returncode, p.stdout, p.stderr)
            if p.returncode or absent[:8] in p.stdout:
                not_ok[home.name] = [ln for ln in p.stdout.splitlines() if not ln.startswith("OK ")]
        if not not_ok:
            return rounds
        for d in devices:
            rb.run(13, **v, **d)
    raise AssertionError(f"after {MAX_ROUNDS} rounds of wakes, check is not 0 on: {not_ok}")
