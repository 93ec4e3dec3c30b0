"""The Ed25519 accept set, pinned against C2SP/CCTV's 914 edge-case vectors (SSP/1 §12 step 1: every
node of a mesh must reach the same verdict on the same signature, or histories diverge).

Verifiers disagree on these inputs (libsodium accepts 43, other libraries up to 208), so the vectors
carry no verdict: `tests/vectors/cctv/accept_set.json` records ours, and any change of a verdict, by a
dependency update or a code change, fails here. Every Ed25519 entry point is checked to be one of the
two pinned functions."""
from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

import firmware_bridge
from agent.core import binding, cose, prepare, records, seqrecords
from firmware_bridge import bridge, pkcs11_keystore
from firmware_bridge import verify as bridge_verify

HERE = Path(__file__).resolve().parents[1] / "vectors" / "cctv"
VECTORS = HERE / "ed25519vectors.json"
ACCEPT_SET = HERE / "accept_set.json"

# What the two verifiers are: the agent's (events, records, acks) and the bridge's (what a keystore signed).
VERIFIERS = {"agent.core.cose": cose.verify_ed25519, "firmware_bridge.verify": bridge_verify.verify_ed25519}


def _vectors() -> list[dict]:
    return json.loads(VECTORS.read_text())


def _accepted(verify) -> list[int]:
    return [v["number"] for v in _vectors()
            if verify(bytes.fromhex(v["key"]), v["msg"].encode(), bytes.fromhex(v["sig"]))]


def _classes(accepted: list[int]) -> dict:
    """Per CCTV flag: how many vectors carry it and how many of those are accepted."""
    acc, total = Counter(), Counter()
    for v in _vectors():
        for f in v["flags"] or ["none"]:
            total[f] += 1
            acc[f] += v["number"] in set(accepted)
    return {f: {"accepted": acc[f], "of": total[f]} for f in sorted(total)}


@pytest.mark.parametrize("name", sorted(VERIFIERS))
def test_accept_set_is_pinned(name):
    pinned = json.loads(ACCEPT_SET.read_text())
    got = _accepted(VERIFIERS[name])
    assert len(_vectors()) == pinned["vectors"] == 914
    moved = sorted(set(got) ^ set(pinned["accepted"]))
    assert not moved, f"{name}: verdicts moved for CCTV vectors {moved} (accepted now: {len(got)}, pinned: {len(pinned['accepted'])})"
    assert _classes(got) == pinned["classes"]


def test_refused_classes_are_refused_whole():
    """What docs/protocol.md promises: small-order R or A, a small-order residue, non-canonical R or
    A, and a reencoded k are refused in every vector that carries the flag."""
    classes = json.loads(ACCEPT_SET.read_text())["classes"]
    for flag in ("low_order_R", "low_order_A", "low_order_residue", "non_canonical_R", "non_canonical_A",
                 "reencoded_k"):
        assert classes[flag]["accepted"] == 0, flag
        assert classes[flag]["of"] > 0, flag


def test_every_entry_point_uses_a_pinned_verifier():
    """The event path, records, acks and the keystore bridge verify through one of the pinned functions
    (looked up where they call it), so the accept set above is the one every path has."""
    assert records.verify_ed25519 is cose.verify_ed25519          # vouches, retirements, acks, truncation
    assert binding.verify_ack is records.verify_ack                # acks on the MQTT binding
    assert seqrecords.verify_signed_by_site is records.verify_signed_by_site
    assert "cose.verify_ed25519" in Path(prepare.__file__).read_text()   # the event path's worker batch
    assert bridge.verify_ed25519 is bridge_verify.verify_ed25519
    assert pkcs11_keystore.verify_ed25519 is bridge_verify.verify_ed25519
    assert firmware_bridge.verify_ed25519 is bridge_verify.verify_ed25519


def write() -> None:
    accepted = _accepted(cose.verify_ed25519)
    assert accepted == _accepted(bridge_verify.verify_ed25519), "the two verifiers disagree"
    ACCEPT_SET.write_text(json.dumps({
        "source": "C2SP/CCTV 1e3d2860d46e ed25519/ed25519vectors.json",
        "verifier": "libsodium crypto_sign_verify_detached (PyNaCl)",
        "vectors": len(_vectors()), "accepted": accepted, "classes": _classes(accepted)}, indent=1) + "\n")


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    write()
