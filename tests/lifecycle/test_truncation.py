"""Serving history from a log evicted below a horizon (docs/protocol.md §8, truncation records):
a peer that rehydrates a new node, or backfills it after a widening, names the rows it cannot re-send
in full in signed `sovm/ssp-truncated-v1` records; the subject surfaces exactly those rows as partial
rebuilds (naming row, table, serving peer and horizon); rows entirely above the horizon come back
identical and unflagged; forged and foreign records are dropped or only forwarded; a gateway (no
horizon) issues none."""
from __future__ import annotations

import json

from agent import rehydrate
from agent.core import records as rec
from agent.core.cose import assemble
from agent.core.scope import PolicyRow
from agent.store import db, sync_state as st
from agent.sync import SyncDriver, change_policy
from tests.lifecycle.test_eviction import DAY, R, T0, TABLES
from tests.sync.helpers import Signer, mesh, sync

H = (T0 + DAY, 0)
OLD = [{"device": "old", "seq": s} for s in range(5)]
NEW = [{"device": "new", "seq": s} for s in range(5)]
MIX, OVER, X = {"device": "mix", "seq": 0}, {"device": "over", "seq": 0}, {"device": "x", "seq": 0}
TRUNCATED = OLD + [MIX, X]  # history reaching below H
ABOVE = NEW + [OVER]  # every clock above H


def k(d):
    return json.dumps(d, sort_keys=True)


def rows(n):
    return {k(r["key"]): r["values"] for r in n.dump()[R]}


def flagged(n):
    return [e for e in n.surfaced() if e["kind"] == "partial_rebuild" and e["reason"] == "serving_peer_horizon"]


def history(tmp_path, n_new=1):
    """gw keeps everything; srv evicted below H; w wrote the history; then `n_new` fresh nodes."""
    gw, srv, w, *new = mesh(tmp_path, 3 + n_new, TABLES)
    for i, key in enumerate(OLD):
        w.write(R, key, {"temp": float(i)}, now=T0 + i)
    w.write(R, MIX, {"temp": 1.0}, now=T0 + 10)
    w.write(R, OVER, {"temp": 1.0}, now=T0 + 20)
    w.write(R, X, {"temp": 1.0}, now=T0 + 30)
    w.write(R, X, None, delete=True, now=T0 + 40)
    dg, ds, dw = SyncDriver(gw), SyncDriver(srv), SyncDriver(w)
    t = sync(dw, ds, T0 + 100)
    t = sync(dw, dg, t + 1)
    assert srv.evict_table(R, H) == 9
    late = T0 + 2 * DAY
    w.write(R, MIX, {"note": "late"}, now=late)  # one column above H, the other's owner evicted
    w.write(R, OVER, {"temp": 2.0, "note": "all"}, now=late + 1)  # every clock above H
    w.write(R, X, {"note": "back"}, now=late + 2)  # resurrects X: its tombstone lies below H
    for i, key in enumerate(NEW):
        w.write(R, key, {"temp": 100.0 + i}, now=late + 10 + i)
    t = sync(dw, ds, late + 100)
    t = sync(dw, dg, t + 1)
    assert rows(gw) == rows(w)
    return gw, srv, w, new, t


def check_subject(nw, srv, gw):
    got = flagged(nw)
    assert sorted(k(e["detail"]["row_key"]) for e in got) == sorted(map(k, TRUNCATED))  # exactly those rows
    for e in got:
        assert e["table"] == R and e["site_id"] == srv.site_id.hex()
        assert e["detail"]["serving_peer"] == srv.site_id.hex() and e["detail"]["horizon"] == f"{H[0]}.{H[1]}"
    mine, theirs, full = rows(nw), rows(srv), rows(gw)
    for key in map(k, ABOVE):  # rows entirely above the horizon: identical to the server (and the gateway)
        assert mine[key] == theirs[key] == full[key]
    assert set(mine) - set(map(k, TRUNCATED)) == set(map(k, ABOVE))
    assert mine[k(MIX)] != full[k(MIX)]  # the truncated rows really differ: that is why they are listed
    stat = rehydrate.status(nw)
    assert stat["truncations"]["received"] == [{"serving_peer": srv.site_id.hex(), "table": R,
                                                "horizon": f"{H[0]}.{H[1]}", "rows": len(TRUNCATED)}]
    return stat


def test_rehydrating_from_an_evicted_peer_over_a_session_surfaces_exactly_the_truncated_rows(tmp_path):
    gw, srv, w, (nw,), t = history(tmp_path)
    dn, ds = SyncDriver(nw), SyncDriver(srv)
    rehydrate.start(nw, srv.site_id, now=t + 1)
    t = sync(dn, ds, t + 2, cycles=3)
    stat = check_subject(nw, srv, gw)
    assert stat["rehydrating"]["partial_from_serving_peers"] == len(TRUNCATED)
    assert stat["rehydrating"]["partial_rebuilds"] >= len(TRUNCATED)
    assert rehydrate.status(srv)["truncations"]["issued"] == [{"subject": nw.site_id.hex(), "table": R,
                                                               "horizon": f"{H[0]}.{H[1]}", "rows": len(TRUNCATED)}]
    assert [e for e in srv.surfaced() if e["kind"] == "truncation_issued"]
    # more exchanges surface nothing twice
    sync(dn, ds, t + 1, cycles=2)
    assert len(flagged(nw)) == len(TRUNCATED)
    # the records go only to their subject: a third node neither receives nor surfaces them,
    # so they never swell every body of the mesh
    assert rehydrate.truncation_raws(srv.conn, nw.site_id)
    sync(ds, SyncDriver(w), t + 100_000)
    assert rehydrate.truncation_raws(w.conn, nw.site_id) == []
    assert not flagged(w)


def test_rehydrating_from_an_evicted_peer_over_mailbox_files(tmp_path):
    gw, srv, w, (nw,), t = history(tmp_path)
    dn, ds = SyncDriver(nw), SyncDriver(srv)
    rehydrate.start(nw, srv.site_id, now=t + 1)
    f1, f2 = tmp_path / "to_srv.cbor", tmp_path / "to_new.cbor"
    dn.export_mailbox(srv.site_id, f1)
    res = ds.import_mailbox(f1.read_bytes(), now=t + 2)
    assert res["records"]["rehydrate"]["reset"] == 1 and res["records"]["truncation_issued"] == 1
    ds.export_mailbox(nw.site_id, f2)
    res = dn.import_mailbox(f2.read_bytes(), now=t + 3)
    assert res["records"]["truncation"]["surfaced_rows"] == len(TRUNCATED)
    check_subject(nw, srv, gw)


def test_a_gateway_serves_with_no_truncation_records(tmp_path):
    gw, srv, w, (nw,), t = history(tmp_path)
    dn, dg = SyncDriver(nw), SyncDriver(gw)
    rehydrate.start(nw, gw.site_id, now=t + 1)
    sync(dn, dg, t + 2, cycles=3)
    assert rehydrate.truncation_raws(gw.conn, nw.site_id) == [] and rehydrate.status(gw)["truncations"]["issued"] == []
    assert not flagged(nw) and rows(nw) == rows(gw)
    assert rehydrate.status(nw)["truncations"] == {"received": [], "issued": []}


def test_widening_backfill_from_an_evicted_peer_names_the_truncated_rows(tmp_path):
    gw, srv, w, (nw,), t = history(tmp_path)
    deny = PolicyRow(nw.site_id.hex(), "app", "readings", "user", "deny", "")
    change_policy(srv, lambda c: st.put_policy_row(c, deny), now=t)
    assert rehydrate.truncation_raws(srv.conn, nw.site_id) == []
    widened = change_policy(srv, lambda c: st.delete_policy_row(c, deny), now=t + 1)
    assert widened == [(nw.site_id.hex(), R)]
    assert len(rehydrate.truncation_raws(srv.conn, nw.site_id)) == 1
    sync(SyncDriver(srv), SyncDriver(nw), t + 2, cycles=2)
    check_subject(nw, srv, gw)


def _forge(signer_key, kid, subject, rows=(MIX,), mesh_id=None, horizon=H):
    prot, payload, tbs = rec.truncation_to_be_signed(kid, mesh_id, subject, "app", "readings", horizon,
                                                     list(rows), T0)
    return assemble(prot, payload, signer_key.sign(tbs))


def test_forged_or_foreign_truncation_records(tmp_path):
    gw, srv, w, (nw,), t = history(tmp_path)
    dn = SyncDriver(nw)
    mesh_id = nw.mesh_id
    stranger = Signer()
    forged = [
        _forge(stranger, stranger.site_id, nw.site_id, mesh_id=mesh_id),  # issuer not in the keyring
        _forge(stranger, srv.site_id, nw.site_id, mesh_id=mesh_id),  # claims to be srv: bad signature
        _forge(stranger, srv.site_id, nw.site_id, mesh_id=bytes(16)),  # another mesh
    ]
    trusted = Signer()
    nw.add_peer(trusted.site_id, trusted.public_key, None)
    forged.append(_forge(trusted, trusted.site_id, trusted.site_id, mesh_id=mesh_id))  # addressed to itself
    forged.append(_forge(trusted, trusted.site_id, nw.site_id, mesh_id=mesh_id, horizon=(0, 0)))
    out = dn.apply_records(forged, t)
    assert out["truncation"]["dropped"] == len(forged) and out["truncation"]["stored"] == 0
    reasons = [e["reason"] for e in nw.surfaced() if e["kind"] == "record_dropped"]
    assert reasons == ["unknown_kid", "bad_signature", "bad_signature", "self_addressed", "bad_horizon"]
    assert not flagged(nw)
    # a retired issuer's statements are not taken either
    retired = Signer()
    nw.add_peer(retired.site_id, retired.public_key, (T0, 0))
    out = dn.apply_records([_forge(retired, retired.site_id, nw.site_id, mesh_id=mesh_id)], t)
    assert out["truncation"]["dropped"] == 1 and not flagged(nw)
    # a genuine record for another subject: stored and forwarded, never surfaced here
    foreign = rehydrate.issue_truncations(srv, w.site_id, now=t)
    assert len(foreign) == 1
    out = dn.apply_records(foreign, t)
    assert out["truncation"]["stored"] == 1 and not flagged(nw)
    assert foreign[0] in dn._record_raws(w.site_id)  # kept, and sent on only to its subject
    assert foreign[0] not in dn._record_raws(srv.site_id)
    assert dn.apply_records(foreign, t)["truncation"]["known"] == 1
    # the same genuine record reaches its subject: surfaced there
    res = SyncDriver(w).apply_records(foreign, t)
    assert res["truncation"]["surfaced_rows"] == len(TRUNCATED)
    assert sorted(k(e["detail"]["row_key"]) for e in flagged(w)) == sorted(map(k, TRUNCATED))
    assert bytes(db.get_meta(srv.conn, "public_key")) == nw.keyring[srv.site_id][0]


def test_records_signed_through_the_bridge_are_not_replayed_as_events_on_open(tmp_path):
    from tests.sync.helpers import reopen
    gw, srv, w, (nw,), t = history(tmp_path)
    assert rehydrate.issue_truncations(srv, nw.site_id, now=t)
    rehydrate.start(nw, srv.site_id, now=t + 1)
    for n in (reopen(srv), reopen(nw)):
        assert not [e for e in n.surfaced() if e["reason"] == "not_an_event"]
        # the journal no longer holds them once the store does and it is compacted (on open only
        # past JOURNAL_OPEN_COMPACT_BYTES or after a recovery: docs/keystore.md)
        n.compact_journal()
        assert not [r for _i, r in n.bridge.iter_released()]
        n.close()
