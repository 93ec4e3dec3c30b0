"""Event ids (SSP/1 §12: the BLAKE3-256 digest of the event's exact bytes) and record hashes against the
BLAKE3 team's published vectors (tests/vectors/blake3): for every input length, our own functions give
the first 32 bytes of the vector's `hash`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent.core import events, records

VECTORS = json.loads((Path(__file__).resolve().parents[1] / "vectors" / "blake3" / "test_vectors.json").read_text())


def _input(n: int) -> bytes:
    return bytes(i % 251 for i in range(n))


@pytest.mark.parametrize("case", VECTORS["cases"], ids=lambda c: f"len{c['input_len']}")
def test_event_id_and_record_hash(case):
    expected = bytes.fromhex(case["hash"])[:32]
    data = _input(case["input_len"])
    assert events.event_id(data) == expected
    assert records.record_hash(data) == expected


def test_every_length_class_is_covered():
    lengths = {c["input_len"] for c in VECTORS["cases"]}
    # empty, one byte, a block edge (64), a chunk edge (1024), many chunks (the tree)
    assert {0, 1, 64, 1024, 1025, 102400} <= lengths
