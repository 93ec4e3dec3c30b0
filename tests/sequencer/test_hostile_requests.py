"""Hostile requests to `sequencer run` and out-of-range numbers on the command line.

Before: a `receipt` request whose epoch was decimal text beyond SQLite's 64-bit integers (e.g.
"99999999999999999999999", 23 bytes) raised OverflowError out of the request loop: `sequencer
run` died, the request stayed unacknowledged in its persistent session, and the broker gave it
back on every restart (a crash loop from one message). Decimal text was parsed by Python's
int(): " 1_0 " registered epoch 10, "-1" was looked up. On the command line `sequencer receipt
--epoch 99999999999999999999999` and `commits status --limit` of that size printed a traceback
(exit 1), and `--keep-events`/`--attested-epoch` took it. Now every request payload goes through one
strict classifier (serve.epoch_text: ASCII digits, 0..2^63-1), every request kind answers an
error for anything else, and every numeric option is checked by argparse (exit 2)."""
from __future__ import annotations

import json
import signal
import subprocess
import types
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agent import inbox, outbox
from agent.sequencer import serve, service
from agent.sequencer.framing import encode_private_message
from tests.cli_cmd import agent_cmd, agent_env

G = bytes.fromhex("a7" * 16)
HUGE = b"99999999999999999999999"


class FakeClient:
    """paho's side of a Server: what it publishes (every PUBACK handled before ``publish``
    returns, the race agent/outbox.py must survive) and acknowledges."""

    def __init__(self) -> None:
        self.published: list = []
        self.acked: list = []
        self.on_publish = None

    def publish(self, topic, payload, qos=0, retain=False, properties=None):
        self.published.append((topic, payload))
        info = types.SimpleNamespace(rc=0, mid=len(self.published) % 65535 + 1)
        if self.on_publish is not None:       # an Outbox's (a member's client takes none)
            self.on_publish(self, None, info.mid)
        return info

    def ack(self, mid, qos):
        self.acked.append(mid)

    def is_connected(self):
        return False            # no delivery watch without a broker


def server(seq: service.Sequencer) -> tuple[serve.Server, list]:
    srv = serve.Server(seq, serve.BrokerSettings("127.0.0.1", 1))
    srv.client = FakeClient()
    srv.out = outbox.Outbox(srv.client, serve.ANSWER_BACKLOG_BYTES, serve.ANSWER_BACKLOG_ITEMS)
    answers: list = []
    srv._reply = lambda msg, body, then=None: answers.append(body)
    return srv, answers


def msg(topic: str, payload: bytes, mid: int = 1, correlation: bytes | None = None):
    """A request as paho hands it over, kept as the server's network thread keeps it."""
    props = None if correlation is None else types.SimpleNamespace(CorrelationData=correlation)
    return inbox.delivery(types.SimpleNamespace(topic=topic, payload=payload, qos=1, mid=mid, retain=False,
                                                properties=props))


def test_epoch_text_is_ascii_digits_in_range():
    assert serve.epoch_text(b"0") == 0 and serve.epoch_text(b"17") == 17
    assert serve.epoch_text(b"9223372036854775807") == 2 ** 63 - 1
    for bad in (b"", b" 1", b"1 ", b"1_0", b"+1", b"-1", b"0x10", b"1.0", "٣".encode(), b"\xff",
                b"9223372036854775808", HUGE, b"1" * 5000, b"00000000000000000000001"):
        assert serve.epoch_text(bad) is None, bad


def test_each_request_kind_answers_out_of_range_and_loose_numbers_with_an_error(seq):
    srv, answers = server(seq)
    seq.register(G, 0)
    for kind, payload in (("receipt", HUGE), ("receipt", b"-1"), ("receipt", b" 1_0 "), ("register", b" 1_0 "),
                          ("register", HUGE), ("register", b"9223372036854775807")):
        srv.handle(msg(f"sovm-seq/{(b'x' + payload[:1]).hex()}/{kind}" if kind == "register" else
                       f"sovm-seq/{G.hex()}/{kind}", payload))
        assert "error" in answers[-1], (kind, payload, answers[-1])
    assert srv.client.acked == [1] * 6                  # answered, so acknowledged: never redelivered
    srv.handle(msg(f"sovm-seq/{G.hex()}/receipt", b"0"))
    assert answers[-1] == {"receipt": None, "absent": True, "discontinuity": False}


KINDS = st.sampled_from(["submit", "register", "receipt", "evidence", "accepted", "", "lost"])
SEGMENT = st.one_of(st.just(G.hex()), st.text(max_size=12), st.binary(max_size=300).map(bytes.hex))
PAYLOAD = st.one_of(st.binary(max_size=64), st.integers().map(lambda i: str(i).encode()),
                    st.text(max_size=30).map(str.encode), st.just(HUGE))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(SEGMENT, KINDS, PAYLOAD), min_size=1, max_size=4))
def test_no_request_raises_out_of_the_loop(seq, reqs):
    """The request loop's boundary: whatever topic and payload, a request is answered (an error
    or a result) and acknowledged; nothing escapes (an escape kills `sequencer run`)."""
    srv, answers = server(seq)
    batch = [msg(f"sovm-seq/{seg}/{kind}", payload, mid=i) for i, (seg, kind, payload) in enumerate(reqs)]
    srv.handle_many(batch)
    assert sorted(srv.client.acked) == list(range(len(batch)))
    assert len(answers) == len(batch) and all(isinstance(a, dict) for a in answers)


def test_one_overflowing_receipt_request_does_not_stop_the_server(tmp_path, broker):
    """Through the installed command and a real mosquitto: the 23-byte request that killed `run`
    is answered with an error, and the next request is served by the same process."""
    from test_run_broker import Member
    home = tmp_path / "seq"
    subprocess.run([*agent_cmd(), "--home", str(home), "sequencer", "init"], check=True, capture_output=True,
                   env=agent_env())
    proc = subprocess.Popen([*agent_cmd(), "--home", str(home), "sequencer", "run", "--broker", broker.url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=agent_env())
    m = None
    try:
        json.loads(proc.stdout.readline())
        m = Member(broker.port, "mallory")
        assert "error" in m.request(f"sovm-seq/{G.hex()}/receipt", HUGE)
        assert "error" in m.request(f"sovm-seq/{G.hex()}/register", b"1_0")
        assert m.request(f"sovm-seq/{G.hex()}/register", b"4") == {"group": G.hex(), "epoch": 4}
        assert proc.poll() is None
    finally:
        if m is not None:
            m.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, proc.stderr.read()


@pytest.mark.parametrize("argv", [
    ["sequencer", "receipt", "--group", G.hex(), "--epoch", HUGE.decode()],
    ["sequencer", "receipt", "--group", G.hex(), "--epoch", "-1"],
    ["sequencer", "register", "--group", G.hex(), "--epoch", HUGE.decode()],
    ["commits", "status", "--limit", HUGE.decode()],
    ["commits", "evidence", "--group", G.hex(), "--attested-epoch", HUGE.decode()],
    ["commits", "queue", "COMMIT", "--keep-events", HUGE.decode()],
    ["commits", "send", "--broker", "mqtt://127.0.0.1:1", "--timeout", "1", "--keep-events", HUGE.decode()],
])
def test_out_of_range_numbers_on_the_command_line_are_refused(tmp_path, argv):
    home = tmp_path / "h"
    subprocess.run([*agent_cmd(), "--home", str(home), "sequencer", "init"], check=True, capture_output=True,
                   env=agent_env())
    commit = tmp_path / "c.mls"
    commit.write_bytes(encode_private_message(G, 3))
    argv = [str(commit) if a == "COMMIT" else a for a in argv]
    p = subprocess.run([*agent_cmd(), "--home", str(home), *argv], capture_output=True, text=True, env=agent_env())
    assert p.returncode == 2 and "Traceback" not in p.stderr and p.stdout == "", (argv, p.returncode, p.stderr)


def test_a_member_keeps_no_gap_for_a_negative_epoch(tmp_path):
    """A `discontinuity/E` record is retained on the broker by whoever may publish there: an epoch
    no sequencer can state (negative, or a boolean) is not kept as a gap; nor is one without the
    sequencer's signed statement (§22.6); a signed one for 7 is."""
    import cbor2

    from agent.sequencer import client, commit_queue
    from tests.sequencer.test_member import RogueSequencer
    stated = RogueSequencer().statement(7, None, G)
    q = commit_queue.open_queue(tmp_path / "m")
    try:
        q.enqueue(encode_private_message(G, 3))
        c = client.CommitClient(q, serve.BrokerSettings("127.0.0.1", 1))
        c._followed[G] = 1
        for epoch, st in ((-5, None), (True, None), (2 ** 63 - 1 + 1, None), (8, None), (7, stated)):
            try:
                body = cbor2.dumps({"epoch": epoch, "commit": None, "statement": st})
            except Exception:   # noqa: BLE001 - cbor2 may refuse to encode it at all
                continue
            c._handle(msg(f"sovm-seq/{G.hex()}/discontinuity/{epoch}", body))
        assert q.gaps() == [(G, 7)]
    finally:
        q.close()


CBORISH = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 64 + 1, 2 ** 64 - 1) | st.binary(max_size=40)
                       | st.text(max_size=8),
                       lambda c: st.lists(c, max_size=4) | st.dictionaries(
                           st.sampled_from(["epoch", "commit", "receipt", "statement", "missing"]), c, max_size=4),
                       max_leaves=16)


def test_member_fuzz_nothing_from_the_broker_raises():
    """Whatever a broker client retains on a followed group's topics, or answers on the member's
    answer topic, `commits run`'s handler classifies it; nothing escapes (an escape stops the
    member's client). Found by it: an answer whose receipt was a number, not hex text, raised
    TypeError (each example runs on a fresh queue, so an answer finds its Commit queued)."""
    import hashlib
    import tempfile

    import cbor2

    from agent.sequencer import client, commit_queue

    @settings(max_examples=300, deadline=None)
    @given(st.sampled_from(["accepted", "discontinuity/3", "lost", "answer-c", "answer-r", "answer-e"]),
           st.one_of(st.binary(max_size=80), CBORISH.map(cbor2.dumps),
                     CBORISH.map(lambda v: json.dumps(v, default=lambda b: b.hex()).encode())))
    @example("answer-r", b'{"epoch": null, "receipt": -319278}')
    @example("answer-c", b'{"accepted": true, "receipt": 7}')
    @example("answer-c", b'{"accepted": false, "reason": "stale_epoch", "head": ["00"]}')
    def one(where, payload):
        with tempfile.TemporaryDirectory() as d:
            q = commit_queue.open_queue(Path(d))
            try:
                e = q.enqueue(encode_private_message(G, 3))
                c = client.CommitClient(q, serve.BrokerSettings("127.0.0.1", 1))
                c._followed[G] = 1
                if where.startswith("answer"):
                    tag = where[-1].encode()
                    corr = tag + (e.commit_hash if tag != b"e" else hashlib.sha256(G).digest())
                    if tag == b"e":
                        c._offered[G] = (b"", ())
                    m = msg(c.reply_to, payload, correlation=corr)
                else:
                    m = msg(f"sovm-seq/{G.hex()}/{where}", payload)
                c._handle(m)
            finally:
                q.close()
    one()


def test_a_commit_beyond_64_bit_epochs_is_refused_by_the_queue(tmp_path):
    """`commits queue` of a Commit whose epoch the store cannot hold (2^63 and above; the
    sequencer refuses it as epoch_out_of_range) is refused, exit 2. Before: an OverflowError
    traceback, exit 1."""
    for epoch in (2 ** 63, 2 ** 64 - 1):
        f = tmp_path / f"c{epoch}.mls"
        f.write_bytes(encode_private_message(G, epoch))
        p = subprocess.run([*agent_cmd(), "--home", str(tmp_path / "m"), "commits", "queue", str(f)],
                           capture_output=True, text=True, env=agent_env())
        assert p.returncode == 2 and "Traceback" not in p.stderr and "epoch" in p.stderr, p.stderr[-300:]
