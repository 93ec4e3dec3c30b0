"""Fuzzing in CI: generated and mutated bodies, handshakes, presence payloads, frame
metas, session frames, events, records, mailbox files and serial frames through each boundary's
classify function, numbers written as text in every Unicode digit class through every reader of
one, a serial session's frame meta on a real node, and whole MQTT messages (user properties,
correlation data, response topics, retained presence) through a real node's MQTT loop on both
bindings (tests/hostile/targets.py), asserting only designated outcomes, a CPU-time
bound per input (targets.TIME_BOUND_S) and a memory bound (tracemalloc per input for the pure
parsers; the process's peak RSS for the targets on a real node).

Bounded in time: about a minute in all at the default scale. `SSP_FUZZ_SCALE=N` multiplies the
examples (tools/fuzz.sh runs it long when atheris is not available). Figures (executions per
target) are printed at the end of the run."""
from __future__ import annotations

import os
import resource

import pytest
from hypothesis import HealthCheck, given, settings

from . import strategies as S
from . import targets as T

SCALE = float(os.environ.get("SSP_FUZZ_SCALE", "1"))
# the poison seeds are large: Hypothesis warns that their repr is long (only shown for a failure)
pytestmark = pytest.mark.filterwarnings("ignore::hypothesis.errors.HypothesisWarning")


def fuzz(n: int):
    return settings(max_examples=max(1, int(n * SCALE)), deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


@fuzz(500)
@given(S.hostile(S.cbor_bytes()))
def test_codec(data):
    T.bounded("codec", T.codec, data)


@fuzz(500)
@given(S.hostile(S.body_bytes()))
def test_message(data):
    T.bounded("message", T.message, data)


@fuzz(150)
@given(S.hostile(S.body_bytes()))
def test_presence(data):
    T.bounded("presence", T.presence, data)


@fuzz(400)
@given(S.hostile(S.meta_text()))
def test_meta(data):
    T.bounded("meta", T.meta, data)


@fuzz(400)
@given(S.hostile(S.number_text().map(lambda t: t.encode("utf-8", "surrogatepass"))))
def test_number(data):
    T.bounded("number", T.number, data)


@fuzz(250)
@given(S.hostile(S.session_frame_bytes()))
def test_session_frame(data):
    T.bounded("frame", T.frame, data)


@fuzz(400)
@given(S.hostile(S.events()))
def test_envelope(data):
    T.bounded("envelope", T.envelope, data)


@fuzz(400)
@given(S.hostile(S.event_payload_bytes()))
def test_event_payload(data):
    T.bounded("event_payload", T.event_payload, data)


@fuzz(250)
@given(S.hostile(S.record_payload_bytes()))
def test_record_payload(data):
    T.bounded("record_payload", T.record_payload, data)


@fuzz(400)
@given(S.hostile(S.serial_line()))
def test_serial_reply(data):
    T.bounded("serial", T.serial, data)


@fuzz(400)
@given(S.hostile(S.mls_bytes()))
def test_mls_framing(data):
    T.bounded("mls_framing", T.mls_framing, data)


@fuzz(150)
@given(S.hostile(S.receipt_bytes()))
def test_receipt(data):
    T.bounded("receipt", T.receipt, data)


@fuzz(300)
@given(S.hostile(S.evidence_bytes()))
def test_evidence(data):
    T.bounded("evidence", T.evidence, data)


@fuzz(300)
@given(S.hostile(S.lost_bytes()))
def test_lost(data):
    T.bounded("lost", T.lost, data)


# ---------------------------------------------------------------- through a real node (SQLite)
@pytest.fixture(scope="module")
def fuzz_node(tmp_path_factory):
    n = T.FuzzNode(tmp_path_factory.mktemp("fuzz") / "n")
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    yield n
    n.close()
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024
    assert grown_mb < 256, f"peak RSS grew {grown_mb:.0f} MB while fuzzing the node"


@fuzz(150)
@given(data=S.hostile(S.event_payload_bytes()))
def test_apply_path(fuzz_node, data):
    T.bounded("apply", fuzz_node.event_payload, data, memory=False)


@fuzz(120)
@given(data=S.hostile(S.record_payload_bytes()))
def test_records_on_a_node(fuzz_node, data):
    T.bounded("records", fuzz_node.records, data, memory=False)


@fuzz(150)
@given(data=S.hostile(S.body_bytes()))
def test_mailbox_import(fuzz_node, data):
    T.bounded("mailbox", fuzz_node.mailbox, data, memory=False)


@fuzz(150)
@given(data=S.hostile(S.session_meta_bytes()))
def test_serial_session_meta(fuzz_node, data):
    T.bounded("session_meta", fuzz_node.session_meta, data, memory=False)


@pytest.fixture(scope="module")
def fuzz_runner():
    r = T.FuzzRunner()
    yield r
    r.close()


@fuzz(250)
@given(data=S.hostile(S.mqtt_message()))
def test_mqtt_message_on_both_bindings(fuzz_runner, data):
    T.bounded("mqtt", fuzz_runner.message, data, memory=False)
