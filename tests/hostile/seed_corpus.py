"""Seed the long fuzzing runs' corpora from the tests: the poison inputs of the regression tests
and examples drawn from the Hypothesis strategies of test_fuzz.py, one directory per target.

    python3 -m tests.hostile.seed_corpus DIR [N_PER_TARGET]"""
from __future__ import annotations

import hashlib
import sys
import warnings
from pathlib import Path

from hypothesis import HealthCheck, given, settings

from . import poison, strategies as S

SOURCES = {"codec": S.cbor_bytes(), "message": S.body_bytes(), "presence": S.body_bytes(), "meta": S.meta_text(),
           "frame": S.session_frame_bytes(), "envelope": S.events(), "event_payload": S.event_payload_bytes(),
           "record_payload": S.record_payload_bytes(), "serial": S.serial_line(), "apply": S.event_payload_bytes(),
           "records": S.record_payload_bytes(), "mailbox": S.body_bytes(), "mls_framing": S.mls_bytes(),
           "receipt": S.receipt_bytes(), "evidence": S.evidence_bytes(), "lost": S.lost_bytes(),
           "number": S.number_text().map(lambda t: t.encode("utf-8", "surrogatepass")),
           "session_meta": S.session_meta_bytes(), "mqtt": S.mqtt_message()}


def draw(strategy, n: int) -> list[bytes]:
    out: list[bytes] = []

    @settings(max_examples=n, database=None, deadline=None, suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(x):
        out.append(x)
    collect()
    return out


def main() -> None:
    root = Path(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    warnings.simplefilter("ignore")
    for name, strategy in SOURCES.items():
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        seeds = draw(strategy, n) + list(poison.corpus().values())
        for data in seeds:
            (d / hashlib.sha1(data).hexdigest()[:16]).write_bytes(data)
        print(f"{name}: {len(list(d.iterdir()))} seeds in {d}")


if __name__ == "__main__":
    main()
