"""The poison inputs (messages that crashed, hung or bloated a node), built byte by byte: the regression tests
feed them to the
boundaries, and tools/fuzz.sh seeds its corpus with them (`python3 -m tests.hostile.poison DIR`)."""
from __future__ import annotations

import sys
from pathlib import Path

import cbor2

from agent.core.codec import encode


def head(major: int, n: int) -> bytes:
    """A CBOR item head in its shortest form."""
    if n < 24:
        return bytes([major << 5 | n])
    for ai, w in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * w):
            return bytes([major << 5 | ai]) + n.to_bytes(w, "big")
    raise ValueError(n)


def shareable(item: bytes) -> bytes:
    return b"\xd8\x1c" + item  # tag 28: "this value may be referenced"


def shared_ref(index: int) -> bytes:
    return b"\xd8\x1d" + head(0, index)  # tag 29: "the index-th shareable value"


def sharing_bomb(depth: int = 8, fanout: int = 8) -> bytes:
    """Value sharing (tags 28/29): level k is an array of `fanout` references to level k-1.
    A few hundred bytes decode into a graph that a tree walk (the old strict decoder, then
    every re-encode) visits fanout**depth times: 196 bytes at 8/8 take seconds, 244 at 10/8
    hours. Shareable indices are assigned in pre-order, so the outermost level is index 0."""
    def level(k: int) -> bytes:
        if k == 0:
            return shareable(head(4, 1) + b"\x00")
        return shareable(head(4, fanout) + level(k - 1) + shared_ref(depth - k + 1) * (fanout - 1))
    return level(depth)


def shared_events_body(n_refs: int = 40_000, event_bytes: int = 64 * 1024) -> bytes:
    """A sync body whose `events` array holds one large byte string and `n_refs` references to
    it: ~185 KB on the wire (at the defaults), 40 001 events of 64 KiB (2.6 GB) once decoded."""
    members = {"ssp_version": 1, "from_site_id": "00" * 16, "have_max_hlc": {"physical_ms": 0, "logical": 0},
               "records": [], "applied_watermarks": []}
    out = head(5, len(members) + 1)
    for k in sorted(list(members) + ["events"], key=lambda k: (len(k), k)):
        out += head(3, len(k)) + k.encode()
        if k == "events":
            out += head(4, n_refs + 1) + shareable(head(2, event_bytes) + bytes(event_bytes)) + shared_ref(0) * n_refs
        else:
            out += cbor2.dumps(members[k], canonical=True)
    return out


# A body whose map has a non-text key (27 bytes) -> TypeError in messages.py
MIXED_KEY_BODY = cbor2.dumps({"ssp_version": 1, "events": [], "x": 0, 7: 0})
# An `ssp-meta` user property of 5 000 `[` -> RecursionError in runner.py
DEEP_META = "[" * 5000


def watermark_body(sender: bytes, hlc_physical_ms: int = 2**63) -> bytes:
    """A well-formed body whose applied watermark HLC SQLite cannot store."""
    return cbor2.dumps({"ssp_version": 1, "from_site_id": sender.hex(),
                        "have_max_hlc": {"physical_ms": 0, "logical": 0}, "events": [], "records": [],
                        "applied_watermarks": [{"site_id": sender.hex(), "table_schema": "app",
                                                "table_name": "readings", "hlc_physical_ms": hlc_physical_ms,
                                                "hlc_logical": 0}]}, canonical=True)


def corpus() -> dict[str, bytes]:
    """Named seeds for the long fuzzing runs (tools/fuzz.sh)."""
    return {"sharing_bomb": sharing_bomb(), "shared_events_body": shared_events_body(2000, 1024),
            "mixed_key_body": MIXED_KEY_BODY, "deep_meta": DEEP_META.encode(),
            "watermark_2p63": watermark_body(bytes(16)),
            "empty_body": encode({"ssp_version": 1, "from_site_id": "00" * 16,
                                  "have_max_hlc": {"physical_ms": 0, "logical": 0}, "events": [], "records": [],
                                  "applied_watermarks": []})}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, data in corpus().items():
        (out / name).write_bytes(data)
