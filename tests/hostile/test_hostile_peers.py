"""Hostile-peer strategies, each against a real mosquitto with real nodes:
a mesh member that misbehaves on purpose (bench/bench_strategies.py holds the strategies and
the measured comparison with an honest run, several rounds on both bindings; docs/reliability.md
has the figures). Here, small runs with the attacker only, asserting what must hold whatever the
timing: the honest receiver B (in its own process) gets every event of the honest writer A, and
A's progress shows it where A's stream reaches B directly (secure binding: B's applied watermark
for A; the default binding: A's cursor for B, moved only by B's signed acknowledgements), the
honest nodes' resources for the attacker stay within their bounds, and a liar loses only its own
data. The default binding is run for the strategies whose outcome depends on it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from agent.store.sync_links import SENT_BODIES_KEPT
from agent.transport.broker import find_mosquitto
from tests.waiting import HANG_S

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))  # bench modules import bench/_harness.py
from bench.bench_strategies import run  # noqa: E402

WINDOW = 4  # RunConfig.window


@pytest.fixture(autouse=True)
def _env(tmp_path_factory, monkeypatch):
    if find_mosquitto() is None:
        pytest.fail("mosquitto is not installed (apt-get install mosquitto)")
    monkeypatch.setenv("SSP_AGENT_WITNESS_DIR", str(tmp_path_factory.mktemp("witness")))
    monkeypatch.setenv("SSP_AGENT_CLOCK_TRUSTED", "1")


def attack(strategy, tmp_path, binding="secure", **kw):
    # The attack lasts 2 s and until its byte count (min_attack_bytes) is out; a flood is
    # written whole and held by B: counts, not rates. HANG_S only ends a run that never converges.
    r = run(strategy, True, tmp_path, events=kw.pop("events", 60), attack_s=kw.pop("attack_s", 2.0),
            timeout_s=HANG_S, binding=binding, **kw)
    assert r["b_has_all_of_a"], r
    assert r["converged_s"] is not None, r
    return r


def progressed(r) -> bool:
    """A's stream reached B and A knows it: B's watermark (secure) or A's acknowledged cursor."""
    return r["b_watermark_covers_a"] if r["binding"] == "secure" else r["acked_s"] is not None


@pytest.mark.parametrize("binding", ["secure", "signed-ack"])
def test_a_peer_that_never_answers_holds_one_window(tmp_path, binding):
    r = attack("never_answers", tmp_path, binding)
    assert progressed(r), r
    assert r["a_pending_for_m"] <= WINDOW and r["a_sent_bodies_for_m"] <= SENT_BODIES_KEPT, r


@pytest.mark.parametrize("binding", ["secure", "signed-ack"])
def test_lying_watermarks_and_have_max_cost_only_the_liar(tmp_path, binding):
    r = attack("lying_watermarks", tmp_path, binding)
    assert progressed(r), r
    # have_max_hlc 2^62 is advisory (docs/protocol.md §2): B's clock is not dragged ahead.
    assert r["b_clock_ahead_ms"] < 60_000, r
    # docs/protocol.md §3 (SSP/1 §14.2): a peer advertising a false watermark loses only its own data. On the
    # secure binding A kept the lie (and skips what it claims for M) while B converged untouched;
    # on the default binding reports are not authenticated and are ignored altogether.
    assert r["a_kept_lie"] is (binding == "secure"), r
    if binding != "secure":
        assert r["m_lost_own"] is False, r


def test_a_slow_trickle_holds_at_most_a_window(tmp_path):
    r = attack("slow_trickle", tmp_path)
    assert progressed(r), r
    assert r["a_pending_for_m"] <= WINDOW and r["a_sent_bodies_for_m"] <= SENT_BODIES_KEPT, r


def test_withheld_and_replayed_bodies_are_absorbed(tmp_path):
    r = attack("withhold_replay", tmp_path, min_attack_bytes=50_001)
    assert progressed(r), r
    assert r["attacker_bytes"] > 50_000, r  # the replays went out
    assert r["b_stats"].get("duplicate", 0) > 0, r
    # Duplicates add nothing to the store: growth per replayed byte well below one (pages, not rows).
    assert r["b_disk_growth"] <= 0.05 * r["attacker_bytes"] + 64 * 1024, r
    assert r["m_lost_own"] is True, r  # what M withheld, only M's


def test_a_relay_that_drops_a_site_does_not_stop_it_on_another_path(tmp_path):
    r = attack("dropping_relay", tmp_path)
    assert r["m_dropped"] > 0, r


def test_a_trusted_signer_flood_delays_but_does_not_stop_honest_events(tmp_path):
    r = attack("signer_flood", tmp_path, flood=600)
    assert progressed(r), r
    assert r["b_events"] >= 60 + 600, r  # the flood is valid data: stored (eviction bounds it, docs/reliability.md)


@pytest.mark.parametrize("binding", ["secure", "signed-ack"])
def test_a_member_flooding_bodies_does_not_stall_honest_bodies(tmp_path, binding):
    """M keeps 200 replayed bodies unanswered at all times (no window). B took its inbox in arrival
    order, so every body of A queued behind up to 200 of M's: A's bodies timed out, were re-offered
    behind the next 200, and A's events did not reach B for as long as the flood lasted (the harness gave up
    after 120 s). Now B serves the senders in its inbox in turn."""
    r = attack("replay_flood", tmp_path, binding, min_attack_bytes=1_000_001)
    assert progressed(r), r
    assert r["b_stats"].get("duplicate", 0) > 0, r
    # A body of A waits behind at most one body per turn of each sender (A's own window of 4
    # included): before, behind everything M had queued (about 200).
    assert r["b_max_handled_ahead_of_a"] <= 2 * WINDOW + 4, r
    # B's memory (its own process: bench/strategy_node.py) does not grow with the flood: bodies
    # are absorbed as duplicates one at a time (docs/reliability.md: about 1 MiB of RSS growth for
    # 2-5 MB of replays, as much as without the attacker; kept bodies would be 1 byte per byte).
    assert r["attacker_bytes"] > 1_000_000, r
    assert r["b_rss_growth_kb"] * 1024 <= min(0.25 * r["attacker_bytes"] + (4 << 20), 16 << 20), r
