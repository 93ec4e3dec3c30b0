"""Wycheproof vectors through the verification entry points (docs/protocol.md §13, §0 "Sequencing receipts")."""
import json
import os

import pytest

from firmware_bridge import verify_ed25519, verify_p256
from firmware_bridge.ec import compress_point

# a copy of ../shared/vectors/wycheproof (tests/vectors/wycheproof/SOURCE.md), so a clone anywhere runs them
VEC = os.path.join(os.path.dirname(__file__), "..", "vectors", "wycheproof")


def _load(name):
    path = os.path.normpath(os.path.join(VEC, name))
    with open(path) as f:
        return json.load(f)


def test_wycheproof_p256_p1363_uncompressed_and_compressed_keys():
    doc = _load("ecdsa_secp256r1_sha256_p1363_test.json")
    counts = {"valid": 0, "invalid": 0, "acceptable": 0}
    for group in doc["testGroups"]:
        pub = bytes.fromhex(group["publicKey"]["uncompressed"])
        keys = [pub, compress_point(pub)]
        for t in group["tests"]:
            msg, sig = bytes.fromhex(t["msg"]), bytes.fromhex(t["sig"])
            for key in keys:
                got = verify_p256(key, msg, sig)
                if t["result"] == "valid":
                    assert got, (t["tcId"], t["comment"])
                elif t["result"] == "invalid":
                    assert not got, (t["tcId"], t["comment"])
            counts[t["result"]] += 1
    assert counts["valid"] > 50 and counts["invalid"] > 50
    assert sum(counts.values()) == doc["numberOfTests"]


def test_p256_rejects_bad_lengths_and_points():
    assert not verify_p256(b"\x02" + b"\x00" * 32, b"m", b"\x01" * 64)
    assert not verify_p256(b"\x04" * 65, b"m", b"\x01" * 64)
    assert not verify_p256(b"\x02" * 33, b"m", b"\x01" * 63)


def test_wycheproof_ed25519():
    doc = _load("ed25519_test.json")
    n = 0
    for group in doc["testGroups"]:
        pub = bytes.fromhex(group["publicKey"]["pk"])
        for t in group["tests"]:
            got = verify_ed25519(pub, bytes.fromhex(t["msg"]), bytes.fromhex(t["sig"]))
            if t["result"] == "valid":
                assert got, t["tcId"]
            elif t["result"] == "invalid":
                assert not got, t["tcId"]
            n += 1
    assert n == doc["numberOfTests"]


@pytest.mark.parametrize("bad", [b"", b"\x00" * 31, b"\x00" * 33])
def test_ed25519_bad_key_lengths(bad):
    assert verify_ed25519(bad, b"m", b"\x00" * 64) is False
