"""One fuzz target per boundary: each takes bytes from outside, feeds them through the
boundary's one classify function, and checks that the outcome is a designated one: a parsed
value, or the boundary's refusal with a stable reason code (never `unclassified`, which would
mean the parser's own net caught a bug). Anything else raised is a finding.

The Hypothesis tests (test_fuzz.py, in CI) and the atheris harness (tools/fuzz_atheris.py, long
runs by tools/fuzz.sh) call the same targets. `bounded` adds the per-input wall-time and memory
bounds around a call."""
from __future__ import annotations

import os
import re
import tempfile
import time
import tracemalloc
import zlib
from pathlib import Path
from typing import Any, Callable

import cbor2
import nacl.signing

from agent.core import cose, numbers
from agent.core.binding import decode_indices, encode_indices
from agent.core.delivery import split_gaps
from agent.core.exchange import answered_progress
from agent.core.ids import IdFormatError, parse_hlc
from agent.core import seqrecords as sr
from agent.core.classify import UNCLASSIFIED
from agent.core.codec import DecodeError, decode_strict
from agent.core.events import EVENT_CONTENT_TYPE, event_from_verified
from agent.core.messages import Handshake, ProtocolError, SyncBody, parse_message, parse_presence
from agent.core.records import ACK, TRUNCATED, CONTENT_TYPES, RecordError, verify_ack, verify_record, verify_truncation
from agent.core.session import StreamMeta, decode_frame, parse_meta_text
from agent.outcomes import STATUSES
from agent.sequencer import receipts as rc
from agent.sequencer import recovery
from agent.sequencer.client import parse_lost
from agent.sequencer.core import EPOCH_LIMIT
from agent.sequencer.framing import FramingError, parse_mls_message
from agent.transport.mqtt import parse_body_limit
from firmware_bridge import serial_protocol as sp

MESH = bytes.fromhex("f0220000000000000000000000000011")
SITE = bytes.fromhex("0123456789abcdef0123456789abcdef")
# A fixed trusted key (the authority and peer of the fuzzed node): hostile but validly signed
# payloads get past the signature to the payload checks.
KEY = nacl.signing.SigningKey(bytes(range(32)))
KID = bytes.fromhex("a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5a5")

TIME_BOUND_S = 2.0  # CPU s per input: a superlinear parse (value sharing took seconds to hours) exceeds it
NODE_TIME_BOUND_S = 10.0  # CPU s per input through a real node (its SQLite commits)
MEM_BASE = 4 * 1024 * 1024  # per input: 4 MiB plus
MEM_PER_BYTE = 256  # ... this many bytes per input byte (Python objects for one-byte CBOR items)
_REASON = re.compile(r"^[a-z][a-z0-9_]*$")

COUNTS: dict[str, int] = {}  # executions per target (the fuzzing figures)


class Finding(AssertionError):
    """An outcome that is not designated, or a bound exceeded."""


def designated(e: BaseException) -> None:
    reason = getattr(e, "reason", None)
    if not isinstance(reason, str) or not _REASON.match(reason):
        raise Finding(f"refusal without a stable reason code: {e!r}")
    if reason == UNCLASSIFIED:
        raise Finding(f"the classify net caught a parser bug: {e!r}")


def bounded(name: str, fn: Callable[[bytes], Any], data: bytes, memory: bool = True) -> Any:
    """Run one target on one input within the time bound and (pure targets) the memory bound,
    traced by tracemalloc during the call only (generating the input is not the target's)."""
    COUNTS[name] = COUNTS.get(name, 0) + 1
    if memory:
        tracemalloc.start()
    try:
        # CPU, not wall time: a busy or slow machine stretches the wall time of any input, and a
        # superlinear parse is CPU spent (waiting on an fsync or the scheduler is not)
        t0 = time.process_time()
        out = fn(data)
        dt = time.process_time() - t0
        peak = tracemalloc.get_traced_memory()[1] if memory else 0
    finally:
        if memory:
            tracemalloc.stop()
    if dt > (TIME_BOUND_S if memory else NODE_TIME_BOUND_S):
        raise Finding(f"{name}: {dt:.2f} s of CPU for {len(data)} bytes")
    if peak > MEM_BASE + MEM_PER_BYTE * len(data):
        raise Finding(f"{name}: {peak} bytes allocated for {len(data)} bytes")
    return out


def sign(payload: bytes, content_type: str = EVENT_CONTENT_TYPE, kid: bytes = KID) -> bytes:
    protected = cose.protected_header(cose.ALG_EDDSA, content_type, kid)
    return cose.assemble(protected, payload, KEY.sign(cose.sig_structure(protected, MESH, payload)).signature)


# ---------------------------------------------------------------- pure boundaries
def codec(data: bytes) -> None:
    for kw in ({}, {"deterministic": False, "allowed_tags": frozenset({18})}):
        try:
            decode_strict(data, **kw)
        except DecodeError as e:
            designated(e)


def message(data: bytes) -> None:
    try:
        m = parse_message(data)
    except ProtocolError as e:
        designated(e)
        return
    assert isinstance(m, (Handshake, SyncBody))
    if isinstance(m, SyncBody):  # what a parsed body holds is what its consumers expect
        assert all(type(e) is bytes for e in m.events) and all(type(r) is bytes for r in m.records)
        assert all(0 <= w.hlc[0] < 2**63 and 0 <= w.hlc[1] < 2**32 for w in m.applied_watermarks)


def presence(data: bytes) -> None:
    try:
        parse_presence(data, SITE)
    except ProtocolError as e:
        designated(e)


def meta(data: bytes) -> None:
    text = data.decode("utf-8", "replace")
    try:
        m = parse_meta_text(text)
    except ProtocolError as e:
        designated(e)
        return
    d = m["d"]
    for n in (0, 1, len(d) if isinstance(d, list) else 2, 1000):
        try:
            sm = StreamMeta.from_wire(m, n)
        except ProtocolError as e:
            designated(e)
            continue
        assert 0 <= sm.start and all(s < 2**63 for s in sm.seqs) and sm.end < 2**63
        policy, floors = split_gaps(sm.gaps)   # the gap list, read on the secure binding
        assert all(0 <= p < 2**63 and 0 <= lo < 2**32 for p, lo in floors.values())
        assert set(sm.gaps) == policy | {g for g in sm.gaps if g.rpartition("@")[0] in floors}


def number(data: bytes) -> None:
    """A number written as text by someone else, through every reader of one (docs/protocol.md
    §11 "Numbers from outside"): the body limit, the processed count, the rejected indices, an
    own-history floor, an HLC. Never an exception; a number only when it is one in ASCII."""
    text = data.decode("utf-8", "replace")
    for t in (text, text.split("\x00")[0]):
        n = numbers.uint(t)
        assert n is None or (t.isascii() and str(n) == t)
        assert parse_body_limit(t) in (None, n)
        got = decode_indices(t, 8)
        assert got is None or (all(0 <= i < 8 for i in got) and encode_indices(got) == t)
        assert 0 <= answered_progress(5, None, t, None)[0] <= 5
        split_gaps([t, f"app.readings@{t}"])
        h = numbers.hlc(t)
        try:
            assert parse_hlc(t) == h
        except IdFormatError:
            assert h is None


def frame(data: bytes) -> None:
    try:
        decode_frame(data)
    except ProtocolError as e:
        designated(e)


def envelope(data: bytes) -> None:
    """An event or record envelope, then (as if its signature verified) the event payload."""
    try:
        s1 = cose.parse_sign1(data)
    except DecodeError as e:
        designated(e)
        return
    try:
        event_from_verified(data, s1)
    except DecodeError as e:
        designated(e)


def event_payload(data: bytes) -> None:
    """Payload bytes signed validly under the trusted key: the EventPayload boundary."""
    raw = sign(data)
    try:
        event_from_verified(raw, cose.parse_sign1(raw))
    except DecodeError as e:
        designated(e)


def record_payload(data: bytes) -> None:
    """Payload bytes signed validly by a mesh authority, as every record kind (authority records,
    truncation, MQTT acknowledgement, the sequencing records with the sequencer's receipt or
    statement inside, as agent/sequencing.py reads them): the record boundaries."""
    entry = lambda kid: (bytes(KEY.verify_key), None) if kid == KID else None    # noqa: E731
    for ctype in list(CONTENT_TYPES.values()) + [TRUNCATED, ACK, sr.RECEIPT_HEAD, sr.DISCONTINUITY, sr.BINDING]:
        raw = sign(data, ctype)
        try:
            if ctype == sr.RECEIPT_HEAD:
                rc.verify_receipt(sr.verify_receipt_head(raw, MESH, entry).receipt)
            elif ctype == sr.DISCONTINUITY:
                rc.verify_statement(sr.verify_discontinuity(raw, MESH, entry).statement)
            elif ctype == sr.BINDING:
                sr.verify_binding(raw, MESH, {KID}, lambda kid: bytes(KEY.verify_key) if kid == KID else None)
            elif ctype == TRUNCATED:
                verify_truncation(raw, MESH, lambda kid: (bytes(KEY.verify_key), None) if kid == KID else None)
            elif ctype == ACK:
                verify_ack(raw, MESH, lambda kid: (bytes(KEY.verify_key), None) if kid == KID else None)
            else:
                verify_record(raw, MESH, {KID}, lambda kid: bytes(KEY.verify_key) if kid == KID else None)
        except (RecordError, rc.ReceiptError) as e:
            designated(e)


def serial(data: bytes) -> None:
    """Bytes on the serial line from the keystore device: the frame reader, then the reply
    boundary for every request op. The same bytes also go out as one well-framed reply (valid
    COBS and CRC), so the body parser is reached whatever the CRC."""
    reader = sp.FrameReader()
    frames = list(reader.feed(data))
    payload = bytes([sp.VERSION]) + data[:sp.MAX_PAYLOAD]
    if len(payload) >= 4:
        raw = sp.cobs_encode(payload + zlib.crc32(payload).to_bytes(4, "big"))
        frames += list(sp.FrameReader().feed(raw + b"\x00"))
    for f in frames:
        for op in (sp.HELLO, sp.GENERATE, sp.PUBKEY, sp.SIGN, sp.LIST, sp.SEAL_GENERATE, sp.SEAL, sp.UNSEAL,
                   sp.GENERATE_TAGGED, sp.KEY_TAG):
            try:
                sp.parse_reply(op, f)
            except sp.ReplyError as e:
                designated(e)


# ---------------------------------------------------------------- the sequencer's boundaries
# A fixed P-256 key standing for the bound sequencer: hostile but validly signed receipt and
# statement payloads get past the signature to the payload checks.
_SEQ_KEY = None


def _seq_key():
    global _SEQ_KEY
    if _SEQ_KEY is None:
        from cryptography.hazmat.primitives.asymmetric import ec
        from firmware_bridge.ec import public_key_compressed
        k = ec.derive_private_key(0x5EC, ec.SECP256R1())     # strategies.py's sequencer key
        _SEQ_KEY = (k, public_key_compressed(k.public_key()))
    return _SEQ_KEY


def _es256(payload: bytes, protected: bytes) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from firmware_bridge.ec import der_to_raw
    k, _kid = _seq_key()
    return rc.assemble(protected, payload, der_to_raw(k.sign(rc.sig_structure(protected, payload), ec.ECDSA(hashes.SHA256()))))


def mls_framing(data: bytes) -> None:
    """A Commit from a broker client or `sequencer submit`/`commits queue`: the MLSMessage framing."""
    try:
        f = parse_mls_message(data)
    except FramingError as e:
        designated(e)
        return
    assert type(f.group_id) is bytes and 1 <= len(f.group_id) <= 255 and 0 <= f.epoch < 2**64


def receipt(data: bytes) -> None:
    """A receipt or a statement of absence from outside (a member's evidence, a retained copy on
    the broker, a sequencer's answer): the bytes as they come, and as the payload of a receipt and
    of a statement validly signed by the sequencer, through the verification entry points."""
    _k, kid = _seq_key()
    for raw in (data, _es256(data, rc.protected_header(kid)), _es256(data, rc.statement_protected(kid))):
        for verify in (rc.verify_receipt, rc.verify_statement):
            try:
                got = verify(raw, kid)
            except rc.ReceiptError as e:
                designated(e)
                continue
            assert 0 <= got.epoch < 2**64 and type(got.group_id) is bytes


def evidence(data: bytes) -> None:
    """A member's evidence (`sequencer recover` file, `evidence` request on the broker)."""
    for gid, most in ((None, None), (b"\xa7" * 16, recovery.MAX_OFFERED)):
        try:
            recovery.parse_evidence(data, gid, most)
        except recovery.EvidenceError as e:
            designated(e)


def lost(data: bytes) -> None:
    """A `lost` record retained on the broker (what a restored sequencer still misses)."""
    out = parse_lost(data)
    assert out is None or all(0 <= a <= b < EPOCH_LIMIT for a, b in out)


PURE = {"codec": codec, "message": message, "presence": presence, "meta": meta, "frame": frame, "number": number,
        "envelope": envelope, "event_payload": event_payload, "record_payload": record_payload, "serial": serial,
        "mls_framing": mls_framing, "receipt": receipt, "evidence": evidence, "lost": lost}


# ---------------------------------------------------------------- boundaries with a real node
class FuzzNode:
    """One node on a real SQLite store trusting KEY (as a peer and as the mesh authority), for the
    targets that go through the apply path, the records and the mailbox import."""

    def __init__(self, home: Path | None = None) -> None:
        from agent.node import Node
        from agent.simpeer import NOTES_TABLE, readings_table
        home = home or Path(tempfile.mkdtemp(prefix="ssp-fuzz-")) / "n"
        os.environ.setdefault("SSP_AGENT_WITNESS_DIR", str(home.parent / "witness"))
        os.environ.setdefault("SSP_AGENT_CLOCK_TRUSTED", "1")  # as tests/conftest.py (atheris runs outside pytest)
        man = (f'mesh_id = "{MESH.hex()}"\nauthorities = ["{KID.hex()}"]\n[[peers]]\nsite_id = "{KID.hex()}"\n'
               f'public_key = "{bytes(KEY.verify_key).hex()}"\n' + readings_table() + NOTES_TABLE)
        self.node, _ = Node.init(home, man)
        from agent.sync import SyncDriver
        self.driver = SyncDriver(self.node)
        self.now = int(time.time() * 1000)
        self._session = None
        self._corr = 0
        self.empty_body = cbor2.dumps({"ssp_version": 1, "from_site_id": KID.hex(),
                                       "have_max_hlc": {"physical_ms": 0, "logical": 0}, "events": [], "records": [],
                                       "applied_watermarks": []}, canonical=True)

    def close(self) -> None:
        self.node.close()

    def events(self, raws: list[bytes]) -> None:
        outs = self.node.apply_batch(raws, self.now)
        assert len(outs) == len(raws) and all(o.status in STATUSES and _REASON.match(o.reason) for o in outs)

    def event_payload(self, data: bytes) -> None:
        self.events([sign(data), data])

    def records(self, data: bytes) -> None:
        from agent.rehydrate import CONTENT_TYPE as REHYDRATE
        raws = [sign(data, c) for c in list(CONTENT_TYPES.values()) + [TRUNCATED, REHYDRATE, *SEQUENCING]] + [data]
        out = self.driver.apply_records(raws, self.now)
        assert isinstance(out, dict)

    def session_meta(self, data: bytes) -> None:
        """A body frame from the trusted peer on a secure serial session (its handshake done)
        whose meta `m` is `data` (CBOR; anything else as it is): the session and the sync layer
        refuse it with a designated reason or take the body; the gap list's floors are read
        (SSP/1 §14.2) and nothing raises out of `Session.receive`."""
        import cbor2
        from agent.core.messages import emit_handshake
        from agent.core.session import encode_frame
        s = self._session
        if s is None:
            s = self._session = self.driver.session("serial", None, secure=True, binding_unsolicited=True)
            s.start(self.now)
            s.receive(encode_frame("hello", b=emit_handshake(Handshake(KID, (0, 0), False, True, None)), r=False),
                      self.now)
            assert s.state == "ready", s.events
        try:
            m = cbor2.loads(data)
        except Exception:  # noqa: BLE001 - not CBOR: the bytes themselves are the meta
            m = data
        self._corr += 1
        try:
            frame = cbor2.dumps({"t": "body", "c": self._corr, "b": self.empty_body, "m": m})
        except Exception:  # noqa: BLE001 - a decoded value cbor2 cannot encode again
            return
        s.receive(frame, self.now)
        _designated_events(s)
        s.data_to_send()

    def mailbox(self, data: bytes) -> None:
        try:
            out = self.driver.import_mailbox(data, self.now)
        except ProtocolError as e:
            designated(e)
            return
        assert {"applied", "duplicate", "dropped", "rejected", "held"} <= set(out)


def _designated_events(s) -> None:
    for ev in s.events:
        if ev.kind == "protocol_error" and not _REASON.match(ev.detail or ""):
            raise Finding(f"a session refusal without a stable reason code: {ev.detail!r}")
        if ev.kind == "protocol_error" and ev.detail == UNCLASSIFIED:
            raise Finding("a frame's handling raised past its boundary (the net caught it)")
    s.events.clear()


class FuzzRunner:
    """The MQTT loop of a real node (agent/runner.py, SQLite store, no broker: what it publishes
    waits in paho's queue) on the default binding and on the secure one: each input is one
    PUBLISH a rogue client could make it take (strategies.mqtt_message), handed over as the
    link's network thread does and handled by `Runner.pump`. Designated outcomes only: what the
    loop's net catches (`unhandled_messages`) is a finding, as is anything raised."""

    STRANGER = bytes.fromhex("5a" * 16)

    def __init__(self) -> None:
        from agent.runner import RunConfig, Runner
        from agent.simpeer import readings_table  # noqa: F401 - the table FuzzNode declares
        from agent.transport.mqtt import MqttSettings
        self.nodes, self.runners = [], {}
        for secure in (False, True):
            fn = FuzzNode()
            self.nodes.append(fn)
            for i in range(4):   # bodies in flight to the trusted peer: answers have something to answer
                fn.node.write("app.readings", {"device": "fuzz", "seq": i}, {"temp": float(i)})
            r = Runner(fn.node, MqttSettings.from_url("mqtt://127.0.0.1:1"), RunConfig(secure=secure, window=2))
            r.batch_cycle()
            self.runners[secure] = r

    def close(self) -> None:
        for fn in self.nodes:
            fn.close()

    def message(self, data: bytes) -> None:
        import cbor2
        from agent.transport.mqtt import Inbound, Topics
        try:
            d = cbor2.loads(data)
        except Exception:  # noqa: BLE001 - not CBOR: a request whose payload is the bytes
            d = None
        if not isinstance(d, dict):
            d = {"k": "req", "b": data}
        r = self.runners[bool(d.get("secure"))]
        node = r.node
        s = d.get("s")
        sender = [KID, node.site_id, self.STRANGER][s % 3 if isinstance(s, int) else 0]
        props: dict[str, str] = {}
        for pair in d.get("p") if isinstance(d.get("p"), list) else ():
            if isinstance(pair, list) and len(pair) == 2:
                props.setdefault(str(pair[0])[:64], str(pair[1])[:70_000])   # MQTT: text, u16 lengths
        corr = d.get("c")
        if corr == b"@":
            corr = next(iter(r.ex.pending), None)   # the answer to a body in flight
        corr = bytes(corr) if isinstance(corr, (bytes, bytearray)) else None
        rt = d.get("r")
        rt = Topics(MESH).answers(sender, node.site_id) if rt == "@answers" else rt if isinstance(rt, str) else None
        payload = d.get("b") if isinstance(d.get("b"), bytes) else b""
        kind = d.get("k") if d.get("k") in ("req", "ans", "presence") else "req"
        oversize = len(payload) if len(payload) > r.settings.body_limit_bytes else 0
        m = Inbound(kind, sender if kind == "presence" else node.site_id, b"" if oversize else payload, props, corr,
                    rt, 1, 1, bool(d.get("d")), bool(d.get("q")), r.link.generation,
                    None if kind == "presence" else sender, oversize=oversize)
        before = r.stats["unhandled_messages"]
        r.link.inbound.put(m)
        r.pump(0)
        if r.stats["unhandled_messages"] != before:
            raise Finding(f"the runtime loop's net caught a {kind}: {r.rejections[-1] if r.rejections else ''}")


NODE_TARGETS = ("event_payload", "records", "mailbox", "session_meta", "mqtt")
SEQUENCING = (sr.RECEIPT_HEAD, sr.DISCONTINUITY, sr.BINDING)
