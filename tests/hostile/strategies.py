"""Hypothesis strategies for hostile bytes: generated (structured, near-valid values at every
integer, type and nesting edge) and mutated (valid or poison seeds with flipped bytes, inserted
CBOR heads such as value-sharing tags, indefinite markers and huge lengths, truncations)."""
from __future__ import annotations

import json
import zlib

import cbor2
from hypothesis import strategies as st

from agent.core.events import PAYLOAD_MEMBERS
from firmware_bridge import serial_protocol as sp

from . import poison
from .targets import KID, MESH, SITE, _es256, _seq_key, sign

def _sequencer_outputs():
    """Real receipts and discontinuity statements of a fixed P-256 key (test-only signing outside
    any bridge, as tests/sequencer/test_member.py's RogueSequencer): targets.py's sequencer key."""
    from agent.sequencer import receipts
    _sk, kid = _seq_key()

    def signed(protected, payload):
        return _es256(payload, protected)
    rx, prev = [], None
    for e in range(3):
        payload = receipts.payload_bytes(SEQ_GROUP if e < 2 else b"\x01", e, receipts.commit_hash(b"c%d" % e), prev)
        rx.append(signed(receipts.protected_header(kid), payload))
        prev = receipts.receipt_hash(rx[-1])
    st_ = [signed(receipts.statement_protected(kid), receipts.statement_payload(SEQ_GROUP, e, None, prev))
           for e in (3, 2 ** 63 - 2)]
    return kid, rx, st_


SEQ_GROUP = bytes.fromhex("5e" * 16)
SEQ_KEY, SEQ_RECEIPTS, SEQ_STATEMENTS = _sequencer_outputs()

EDGE_INTS = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**31, 2**32 - 1, 2**32, 2**53, 2**63 - 1, 2**63, 2**64 - 1,
             2**64, -1, -24, -25, -(2**63), -(2**63) - 1, -(2**64)]
INTS = st.one_of(st.sampled_from(EDGE_INTS), st.integers(-(2**65), 2**65), st.integers(0, 2**41))
FLOATS = st.one_of(st.floats(width=16), st.floats(width=32), st.floats())  # NaN and infinities included
TAGS = st.sampled_from([0, 1, 2, 3, 18, 24, 25, 28, 29, 55799, 256, 258, 2**32, 2**63])
TEXT = st.text(max_size=24)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT, st.binary(max_size=48))


def _tag(t: int, v):
    return cbor2.CBORTag(t, v)


CBOR_VALUES = st.recursive(
    SCALARS,
    lambda kids: st.one_of(
        st.lists(kids, max_size=6),
        st.dictionaries(st.one_of(TEXT, st.integers(-5, 30), st.binary(max_size=4)), kids, max_size=6),
        st.builds(_tag, TAGS, kids)),
    max_leaves=40)


def dumps(v, canonical: bool = False) -> bytes:
    try:
        return cbor2.dumps(v, canonical=canonical)
    except Exception:  # noqa: BLE001 - some generated values have no encoding: null instead
        return b"\xf6"


@st.composite
def cbor_bytes(draw, values=CBOR_VALUES) -> bytes:
    return dumps(draw(values), draw(st.booleans()))


def _maybe(draw, good, bad=CBOR_VALUES, p_bad: float = 0.15):
    """Mostly a right-typed value, sometimes anything."""
    return draw(bad) if draw(st.integers(0, 99)) < p_bad * 100 else draw(good)


HEX16 = st.one_of(st.just(SITE.hex()), st.just(KID.hex()), st.binary(min_size=16, max_size=16).map(bytes.hex))
HLC_P = st.one_of(st.sampled_from([0, 1_790_000_000_000, 2**63 - 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
HLC_L = st.one_of(st.sampled_from([0, 1, 2**32 - 1, 2**32]), st.integers(0, 2**33))


@st.composite
def event_payload_obj(draw) -> dict:
    key = {"device": _maybe(draw, TEXT), "seq": _maybe(draw, INTS)}
    if draw(st.booleans()):
        key = draw(st.dictionaries(TEXT, SCALARS, max_size=3))
    op = draw(st.sampled_from(["upsert", "delete", "purge", ""]))
    payload = None if op == "delete" and draw(st.booleans()) else draw(
        st.dictionaries(st.sampled_from(["temp", "note", "device", "x", ""]), SCALARS, max_size=4))
    obj = {"table_schema": _maybe(draw, st.sampled_from(["app", "sec", ""])),
           "table_name": _maybe(draw, st.sampled_from(["readings", "notes", "nope"])),
           "row_key": key, "operation": op, "payload": payload,
           "hlc_physical_ms": _maybe(draw, HLC_P), "hlc_logical": _maybe(draw, HLC_L)}
    if draw(st.integers(0, 9)) == 0:
        obj.pop(draw(st.sampled_from(sorted(PAYLOAD_MEMBERS))))
    return obj


@st.composite
def event_payload_bytes(draw) -> bytes:
    return dumps(draw(event_payload_obj()), canonical=draw(st.integers(0, 9)) > 0)


@st.composite
def events(draw) -> bytes:
    """COSE_Sign1 events: validly signed payloads (generated), or envelopes with generated parts."""
    if draw(st.booleans()):
        return sign(draw(event_payload_bytes()))
    return dumps(cbor2.CBORTag(draw(st.sampled_from([18, 18, 17])),
                               [_maybe(draw, st.binary(max_size=40)), _maybe(draw, st.just({})),
                                _maybe(draw, event_payload_bytes()), _maybe(draw, st.binary(min_size=64, max_size=64))]))


@st.composite
def record_payload_bytes(draw) -> bytes:
    gen = _maybe(draw, st.one_of(st.sampled_from([0, 1, 2**63 - 1, 2**63, 2**64 - 1]), INTS))
    p = {"subject_site_id": _maybe(draw, st.binary(min_size=16, max_size=16)), "generation": gen,
         "previous_record_hash": _maybe(draw, st.one_of(st.none(), st.binary(min_size=32, max_size=32)))}
    kind = draw(st.sampled_from(["role", "vouch", "retire", "truncated", "rehydrate", "ack",
                                 "receipt_head", "discontinuity", "binding"]))
    if kind in ("receipt_head", "discontinuity", "binding"):
        # sequencing records (agent/core/seqrecords.py): the inner receipt or statement is a real
        # ES256 one, one of another group, or bytes near one (the sequencer's boundary, inside)
        p = {"group_id": _maybe(draw, st.one_of(st.just(SEQ_GROUP), st.binary(min_size=1, max_size=255)))}
        if kind == "binding":
            p.update(sequencer_key=_maybe(draw, st.sampled_from([SEQ_KEY, b"\x02" * 33, b"\x04" * 65])),
                     generation=gen, previous_record_hash=_maybe(draw, st.one_of(st.none(),
                                                                                 st.binary(min_size=32, max_size=32))))
        else:
            inner = SEQ_RECEIPTS if kind == "receipt_head" else SEQ_STATEMENTS
            p["receipt" if kind == "receipt_head" else "statement"] = _maybe(draw, st.one_of(
                st.sampled_from(inner), st.sampled_from(inner).map(lambda b: b[:-1]),
                st.binary(max_size=300)))
        return dumps(p, canonical=draw(st.integers(0, 9)) > 0)
    if kind == "role":
        p["role"] = _maybe(draw, TEXT)
    elif kind == "vouch":
        p["public_key"] = _maybe(draw, st.binary(min_size=32, max_size=32))
    elif kind == "retire":
        p["retired_after"] = _maybe(draw, st.lists(HLC_P, min_size=2, max_size=2))
        p["successor_site_id"] = _maybe(draw, st.one_of(st.none(), st.binary(min_size=16, max_size=16)))
    elif kind == "truncated":
        p = {"subject_site_id": p["subject_site_id"], "table_schema": _maybe(draw, st.just("app")),
             "table_name": _maybe(draw, st.just("readings")),
             "horizon": _maybe(draw, st.lists(st.one_of(HLC_P, HLC_L), min_size=2, max_size=2)),
             "row_keys": _maybe(draw, st.lists(st.dictionaries(TEXT, SCALARS, max_size=3), max_size=4)),
             "issued_at": _maybe(draw, HLC_P)}
    elif kind == "ack":  # sovm/ssp-ack-v1: [body_hash, processed, count, rejected indices]
        n = st.one_of(st.integers(0, 40), INTS)
        p = {"subject_site_id": p["subject_site_id"],
             "answers": _maybe(draw, st.lists(st.lists(st.one_of(st.binary(min_size=32, max_size=32), n,
                                                                 st.lists(n, max_size=5)), min_size=4, max_size=4)
                                              | st.tuples(st.binary(min_size=32, max_size=32), n, n,
                                                          st.lists(n, max_size=5)).map(list), max_size=20))}
    else:
        p["requested_at"] = _maybe(draw, HLC_P)
    return dumps(p, canonical=draw(st.integers(0, 9)) > 0)


@st.composite
def watermark_obj(draw) -> dict:
    return {"site_id": _maybe(draw, HEX16), "table_schema": _maybe(draw, st.just("app")),
            "table_name": _maybe(draw, st.just("readings")), "hlc_physical_ms": _maybe(draw, HLC_P),
            "hlc_logical": _maybe(draw, HLC_L)}


@st.composite
def body_bytes(draw) -> bytes:
    """A sync body (§32) or handshake (§31), near-valid."""
    hmax = {"physical_ms": _maybe(draw, HLC_P), "logical": _maybe(draw, HLC_L)}
    if draw(st.integers(0, 4)) == 0:
        obj = {"ssp_version": _maybe(draw, st.just(1)), "site_id": _maybe(draw, HEX16), "have_max_hlc": hmax,
               "supports_realtime": _maybe(draw, st.booleans()), "secure_channel": _maybe(draw, st.booleans()),
               "rtt_ms": _maybe(draw, st.one_of(st.none(), INTS))}
    else:
        obj = {"ssp_version": _maybe(draw, st.just(1)), "from_site_id": _maybe(draw, HEX16), "have_max_hlc": hmax,
               "events": _maybe(draw, st.lists(events(), max_size=3)),
               "records": _maybe(draw, st.lists(record_payload_bytes().map(lambda p: sign(p, "sovm/ssp-vouch-v1")),
                                                max_size=2)),
               "applied_watermarks": _maybe(draw, st.lists(watermark_obj(), max_size=3))}
    if draw(st.integers(0, 9)) == 0:
        obj[draw(st.one_of(TEXT, st.integers(0, 9)))] = draw(SCALARS)
    return dumps(obj, canonical=draw(st.booleans()))


# ---------------------------------------------------------------- numbers written as text
# Every character besides ASCII 0-9 that str.isdigit() accepts: superscripts (`²`, category No),
# circled digits (No), fullwidth, Arabic-Indic, Devanagari, mathematical digits (Nd) ... int()
# takes the Nd ones and refuses the others: neither is a number from outside (core.numbers).
UNICODE_DIGITS = sorted(chr(c) for c in range(0x80, 0x20000) if chr(c).isdigit())
NAMED_DIGITS = ["\u00b2", "\u00b3", "\u00b9", "\u2070", "\u2074", "\u2089", "\u2460", "\u2473", "\u24ea",
                "\uff10", "\uff13", "\u0660", "\u0663", "\u06f3", "\u0966", "\u09e9", "\u0e53", "\U0001d7ce",
                "\U0001f101", "\u1369"]
DIGITS = st.one_of(st.sampled_from(NAMED_DIGITS), st.sampled_from(UNICODE_DIGITS))


# Digits only, of any class: what `str.isdigit()` says yes to (the check the readers relied on)
DIGIT_RUN = st.lists(st.one_of(st.sampled_from("0123456789"), DIGITS), min_size=1, max_size=6).map("".join)


@st.composite
def number_text(draw) -> str:
    """Text where a decimal number is read: runs of digits of every class, ASCII numbers at the
    edges, what int() also takes (signs, spaces, underscores), leading zeros, very long runs."""
    piece = st.one_of(st.sampled_from("0123456789"), DIGITS,
                      st.sampled_from(["+", "-", " ", "_", ".", ",", "\n", "\t", "0" * 30, "9" * 25, "1" * 5000,
                                       "0x1", "1e3", "\u00a0"]))
    how = draw(st.integers(0, 5))
    if how <= 2:
        return draw(DIGIT_RUN)
    if how == 3:
        return str(draw(st.sampled_from(EDGE_INTS)))
    return "".join(draw(st.lists(piece, min_size=0, max_size=10)))


TABLES = st.sampled_from(["app.readings", "app.notes", "*", "", "@", "app.readings@1"])


@st.composite
def gap_entry(draw) -> str:
    """An entry of a frame meta's gap list: a table name, or an own-history floor `TABLE@P.L`
    whose numbers may be anything (`app.readings@².0`)."""
    if draw(st.integers(0, 3)) == 0:
        return draw(st.one_of(TABLES, TEXT))
    sep = draw(st.sampled_from([".", ".", "\uff0e", ".."]))
    return f"{draw(TABLES)}@{draw(number_text())}{sep}{draw(number_text())}"


def _meta(draw, gaps) -> dict:
    return {"s": _maybe(draw, st.integers(0, 2**64)),
            "e": _maybe(draw, st.integers(0, 2**65)),
            "d": _maybe(draw, st.lists(st.one_of(st.integers(-2, 2**64), st.sampled_from([1, 2**63])), max_size=6)),
            "g": _maybe(draw, st.lists(gaps, max_size=4)), "x": _maybe(draw, st.integers(0, 2**64))}


@st.composite
def meta_text(draw) -> bytes:
    if draw(st.integers(0, 4)) == 0:
        return draw(st.text(max_size=80)).encode()
    m = _meta(draw, st.one_of(TEXT, gap_entry()))
    if draw(st.integers(0, 9)) == 0:
        m = draw(st.recursive(st.one_of(st.none(), st.integers(), TEXT), lambda k: st.lists(k) | st.dictionaries(TEXT, k)))
    try:
        return json.dumps(m).encode()
    except (TypeError, ValueError):
        return b"{}"


@st.composite
def session_frame_bytes(draw) -> bytes:
    f = {"t": _maybe(draw, st.sampled_from(["hello", "body", "answer", "ack", "push", "push_ack", "refused", "error"])),
         "c": _maybe(draw, INTS), "b": _maybe(draw, body_bytes()), "m": _maybe(draw, st.just({"s": 0})),
         "k": _maybe(draw, INTS), "r": _maybe(draw, st.one_of(st.booleans(), st.text(max_size=8))),
         "f": _maybe(draw, st.sampled_from(["body", "answer", "push", "ack", ""])), "l": _maybe(draw, INTS),
         "j": _maybe(draw, st.lists(INTS, max_size=3))}
    for k in draw(st.lists(st.sampled_from("cbmkrflj"), max_size=6)):
        f.pop(k, None)
    return dumps(f, canonical=draw(st.booleans()))


@st.composite
def session_meta_bytes(draw) -> bytes:
    """The meta `m` of a serial session's body frame (CBOR), its gap list full of numbers that
    are not (the receiving session on a real node: targets.FuzzNode.session_meta). Mostly
    positions that describe an empty body (so the floors are read), sometimes anything."""
    m = _meta(draw, gap_entry())
    if draw(st.integers(0, 2)):
        m.update(s=0, e=draw(st.integers(0, 3)), d=[], x=0)
    return dumps(m)


NUMERIC_PROPERTIES = ["ssp-body-limit", "ssp-processed", "ssp-rejected-at", "ssp-meta"]
# A well-formed empty body from the trusted peer: a meta describing it gets to the gap list.
EMPTY_BODY = cbor2.dumps({"ssp_version": 1, "from_site_id": KID.hex(), "have_max_hlc": {"physical_ms": 0, "logical": 0},
                          "events": [], "records": [], "applied_watermarks": []}, canonical=True)
PROPERTY_NAMES = st.one_of(st.sampled_from(NUMERIC_PROPERTIES), st.sampled_from(
    ["ssp-status", "ssp-reason", "ssp-kind", "ssp-ack", "ssp-count", "ssp-start", "ssp-end", "ssp-part", "ssp-from",
     "x-other"]))


@st.composite
def property_value(draw) -> str:
    return draw(st.one_of(
        number_text(),
        st.builds(lambda gaps: json.dumps({"s": 0, "e": 0, "d": [], "g": gaps, "x": 0}, ensure_ascii=False),
                  st.lists(gap_entry(), min_size=1, max_size=3)),
        st.lists(number_text(), max_size=4).map(",".join),
        st.sampled_from(["ok", "rejected", "too_large", "batch", "rt", "1", "0", "", "1/1"]),
        meta_text().map(lambda b: b.decode("utf-8", "replace")),
        TEXT))


@st.composite
def mqtt_message(draw) -> bytes:
    """One PUBLISH a rogue client can make a node take (targets.FuzzRunner): a request, an answer
    (to a body in flight, `c` = b"@", or not) or a presence (retained or not), under a member's
    name, the node's own or a stranger's; user properties with numbers in every digit class,
    correlation data and response topics of any shape. CBOR, so atheris mutates it too."""
    kind = draw(st.sampled_from(["req", "ans", "presence"]))
    who = draw(st.sampled_from([0, 0, 1, 2]))    # mostly the trusted peer: its messages go furthest
    props = draw(st.lists(st.tuples(PROPERTY_NAMES, property_value()), max_size=6))
    if kind == "ans" and draw(st.booleans()):
        props.insert(0, ("ssp-status", "ok"))
    corr = draw(st.one_of(st.just(b"@"), st.none(), st.binary(max_size=80)))
    rt = draw(st.one_of(st.none(), st.just("@answers"), st.text(max_size=40),
                        st.sampled_from(["#", "+", "ssp//x", "sovm-seq/00/accepted"])))
    body = draw(st.one_of(st.just(EMPTY_BODY), body_bytes(), st.binary(max_size=64), st.just(b"")))
    return dumps({"k": kind, "s": who, "p": [list(p) for p in props], "c": corr, "r": rt,
                  "b": body, "q": draw(st.booleans()), "d": draw(st.booleans()),
                  "secure": draw(st.booleans())})


@st.composite
def serial_line(draw) -> bytes:
    """What the line carries from the device: well-framed replies with generated bodies, noise."""
    out = b""
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from([sp.HELLO, sp.GENERATE, sp.PUBKEY, sp.SIGN, sp.LIST, sp.ERROR])) | (
            sp.OK_BIT if draw(st.integers(0, 4)) else 0)
        body = draw(st.one_of(st.binary(max_size=80), st.builds(
            lambda a, n, b: bytes([a]) + bytes([n]) + b, st.integers(0, 255), st.integers(0, 255), st.binary(max_size=70))))
        payload = bytes([sp.VERSION, kind & 0xFF]) + draw(st.integers(0, 0xFFFF)).to_bytes(2, "big") + body
        out += sp.cobs_encode(payload + zlib.crc32(payload).to_bytes(4, "big")) + b"\x00"
    return out + draw(st.binary(max_size=30))


@st.composite
def mls_bytes(draw) -> bytes:
    """An MLSMessage as a member sends it to the sequencer: PrivateMessage framings at the edges of
    every field (group_id 0..256 bytes, epoch up to 2^64-1, each content type, long vectors)."""
    from agent.sequencer.framing import encode_private_message
    gid = draw(st.one_of(st.just(SEQ_GROUP), st.binary(max_size=256)))
    epoch = draw(st.one_of(st.sampled_from([0, 1, 2**63 - 2, 2**63 - 1, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1)))
    try:
        return encode_private_message(gid, epoch, draw(st.integers(0, 4)),
                                      authenticated_data=draw(st.binary(max_size=70)),
                                      encrypted_sender_data=draw(st.binary(max_size=20)),
                                      ciphertext=draw(st.one_of(st.binary(max_size=40), st.just(b"\x00" * 20000))))
    except ValueError:                  # a group_id the encoder refuses: the bytes near one
        return b"\x00\x01\x00\x02" + gid[:255] + epoch.to_bytes(8, "big")


@st.composite
def receipt_bytes(draw) -> bytes:
    """Receipt and statement payloads (deterministic CBOR maps at every field's edges), or a real
    signed receipt or statement, whole or cut (a receipt from outside, or its payload)."""
    if draw(st.integers(0, 3)) == 0:
        raw = draw(st.sampled_from(SEQ_RECEIPTS + SEQ_STATEMENTS))
        return raw[:draw(st.integers(0, len(raw)))] if draw(st.booleans()) else raw
    p = {"group_id": _maybe(draw, st.one_of(st.just(SEQ_GROUP), st.binary(max_size=256))),
         "epoch": _maybe(draw, INTS),
         "commit_hash": _maybe(draw, st.one_of(st.none(), st.binary(min_size=32, max_size=32))),
         "previous_receipt_hash": _maybe(draw, st.one_of(st.none(), st.binary(min_size=32, max_size=32)))}
    for k in draw(st.lists(st.sampled_from(sorted(p)), max_size=2)):
        p.pop(k, None)
    return dumps(p, canonical=draw(st.integers(0, 9)) > 0)


@st.composite
def evidence_bytes(draw) -> bytes:
    """A member's evidence document (JSON) with every field's edges: real receipts and statements
    in hex, epochs past 64 bits, floats, deep nesting."""
    hexes = st.lists(st.one_of(st.sampled_from(SEQ_RECEIPTS + SEQ_STATEMENTS).map(bytes.hex),
                               st.text(max_size=8)), max_size=4)
    j = st.recursive(st.one_of(st.none(), st.booleans(), INTS, st.floats(), TEXT),
                     lambda c: st.lists(c, max_size=3) | st.dictionaries(TEXT, c, max_size=3), max_leaves=8)
    doc = {"member": draw(st.one_of(st.text(max_size=300), j)), "attested_epoch": draw(st.one_of(INTS, j)),
           "receipts": draw(st.one_of(hexes, j)), "statements": draw(st.one_of(hexes, j)),
           "discontinuities": draw(st.one_of(st.lists(INTS, max_size=4), j)),
           "group": draw(st.one_of(st.just(SEQ_GROUP.hex()), st.text(max_size=10), j))}
    for k in draw(st.lists(st.sampled_from(sorted(doc)), max_size=3)):
        doc.pop(k, None)
    text = json.dumps(doc, allow_nan=True)
    return (("[" * 100_000 + text) if draw(st.integers(0, 40)) == 0 else text).encode()   # past the parser's depth


@st.composite
def lost_bytes(draw) -> bytes:
    """A `lost` record: CBOR {"missing": [[first, last], ...]} at the edges (runs past 64 bits,
    reversed, too many)."""
    runs = draw(st.lists(st.lists(INTS, min_size=0, max_size=3), max_size=6))
    if draw(st.integers(0, 20)) == 0:
        runs = [[0, 1]] * 5000
    return dumps({"missing": _maybe(draw, st.just(runs))} if draw(st.integers(0, 9)) else runs,
                 canonical=draw(st.booleans()))


HEADS = [b"\xd8\x1c", b"\xd8\x1d\x00", b"\x9f", b"\xbf", b"\x7f", b"\xff", b"\x5b\xff\xff\xff\xff\xff\xff\xff\xff",
         b"\x9b\x00\x00\x00\x01\x00\x00\x00\x00", b"\x1b\x80\x00\x00\x00\x00\x00\x00\x00", b"\x3b\xff" + b"\xff" * 7,
         b"\xfb\x7f\xf8\x00\x00\x00\x00\x00\x00", b"\xf9\x7c\x00", b"\xc2", b"\xf7", b"\xd2", b"\x81" * 20, b"\xa1\x80",
         b"\x1c", b"\x00"]


@st.composite
def mutated(draw, seeds) -> bytes:
    """A seed with a few mutations: byte flips, inserted CBOR heads, deletions, truncation,
    duplicated slices."""
    data = bytearray(draw(seeds))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "head", "delete", "truncate", "dup", "byte"]))
        at = draw(st.integers(0, len(data))) if data else 0
        if op == "flip" and data:
            i = min(at, len(data) - 1)
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "byte" and data:
            data[min(at, len(data) - 1)] = draw(st.integers(0, 255))
        elif op == "head":
            data[at:at] = draw(st.sampled_from(HEADS))
        elif op == "delete":
            del data[at:at + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[at:]
        elif op == "dup" and data:
            n = draw(st.integers(1, 16))
            data[at:at] = data[at:at + n] * draw(st.integers(1, 4))
    return bytes(data)


POISON = st.sampled_from(sorted(poison.corpus().values()) + [poison.MIXED_KEY_BODY, poison.sharing_bomb(3, 3)])


def hostile(generated) -> st.SearchStrategy[bytes]:
    """Generated inputs, mutated generated inputs, mutated poison, random bytes."""
    return st.one_of(generated, mutated(generated), mutated(POISON), st.binary(max_size=200))


__all__ = ["hostile", "cbor_bytes", "body_bytes", "events", "event_payload_bytes", "record_payload_bytes",
           "meta_text", "session_frame_bytes", "serial_line", "mls_bytes", "receipt_bytes", "evidence_bytes",
           "lost_bytes", "number_text", "gap_entry", "session_meta_bytes", "mqtt_message", "UNICODE_DIGITS", "MESH"]
