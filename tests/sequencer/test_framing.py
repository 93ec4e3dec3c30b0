"""RFC 9420 §6 framing read blind (agent/sequencer/framing.py): fields, strictness, one error type."""
from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from agent.sequencer.framing import (CT_APPLICATION, CT_COMMIT, CT_PROPOSAL, WIRE_PRIVATE, WIRE_PUBLIC,
                                     FramingError, encode_private_message, encode_vector, parse_mls_message)

GID = bytes(range(16))
HEAD_PUBLIC = b"\x00\x01\x00\x01"


def public_commit(group_id=GID, epoch=7, *, sender=b"\x01\x00\x00\x00\x02", path=b"\x00",
                  membership_tag=True, trailing=b"") -> bytes:
    """An MLSMessage(PublicMessage) carrying a Commit, built field by field from RFC 9420 §6/§12.4."""
    body = (encode_vector(group_id) + epoch.to_bytes(8, "big") + sender + encode_vector(b"")
            + bytes((CT_COMMIT,)) + encode_vector(b"\x00\x01" + b"P" * 40)   # proposals (opaque here)
            + path + encode_vector(b"S" * 64) + encode_vector(b"T" * 32))
    if membership_tag:
        body += encode_vector(b"M" * 32)
    return HEAD_PUBLIC + body + trailing


def leaf_node(source=b"\x03" + encode_vector(b"h" * 32), credential=b"\x00\x01" + encode_vector(b"alice")) -> bytes:
    caps = b"".join(encode_vector(b"\x00\x01") for _ in range(5))
    return (encode_vector(b"e" * 32) + encode_vector(b"s" * 32) + credential + caps + source
            + encode_vector(b"") + encode_vector(b"g" * 64))


def test_private_message_fields():
    f = parse_mls_message(encode_private_message(GID, 2**64 - 1, CT_COMMIT))
    assert (f.version, f.wire_format, f.group_id, f.epoch, f.content_type) == (1, WIRE_PRIVATE, GID, 2**64 - 1, 3)
    assert f.is_commit
    for ct in (CT_APPLICATION, CT_PROPOSAL):
        assert not parse_mls_message(encode_private_message(GID, 0, ct)).is_commit


def test_private_message_long_vectors_use_two_and_four_byte_lengths():
    msg = encode_private_message(GID, 5, ciphertext=b"c" * 20000, authenticated_data=b"a" * 100)
    assert parse_mls_message(msg).epoch == 5


def test_public_message_commit_with_and_without_path():
    assert parse_mls_message(public_commit()).wire_format == WIRE_PUBLIC
    with_path = public_commit(path=b"\x01" + leaf_node() + encode_vector(b"n" * 80))
    f = parse_mls_message(with_path)
    assert (f.group_id, f.epoch, f.content_type) == (GID, 7, CT_COMMIT)
    lifetime = public_commit(path=b"\x01" + leaf_node(source=b"\x01" + bytes(16)) + encode_vector(b""))
    assert parse_mls_message(lifetime).is_commit
    # new_member_commit sender: no index, no membership_tag
    assert parse_mls_message(public_commit(sender=b"\x04", membership_tag=False)).is_commit


def test_public_message_non_commit_is_framed_not_walked():
    msg = HEAD_PUBLIC + encode_vector(GID) + (3).to_bytes(8, "big") + b"\x01\x00\x00\x00\x00" + encode_vector(b"") + b"\x02"
    f = parse_mls_message(msg + b"any proposal body")
    assert (f.content_type, f.epoch) == (CT_PROPOSAL, 3)


@pytest.mark.parametrize("data,reason", [
    (b"", "truncated"),
    (b"\x00\x02\x00\x02", "unsupported_version"),
    (b"\x00\x01\x00\x03", "not_handshake"),
    (b"\x00\x01\x00\x05", "not_handshake"),
    (b"\x00\x01\x00\x09", "unknown_wire_format"),
    (b"\x00\x01\x00\x02" + b"\xc0" + GID, "bad_vector_length"),
    (b"\x00\x01\x00\x02" + b"\x40\x10" + GID, "non_minimal_length"),           # 16 in two bytes
    (b"\x00\x01\x00\x02" + b"\x80\x00\x00\x10" + GID, "non_minimal_length"),   # 16 in four bytes
    (b"\x00\x01\x00\x02" + b"\x00", "bad_group_id"),                           # empty group_id
    (b"\x00\x01\x00\x02" + encode_vector(b"g" * 256), "bad_group_id"),
    (encode_private_message(GID, 1)[:-1], "truncated"),
    (encode_private_message(GID, 1) + b"\x00", "trailing_bytes"),
    (encode_private_message(GID, 1, 0), "bad_content_type"),
    (encode_private_message(GID, 1, 4), "bad_content_type"),
    (public_commit(trailing=b"x"), "trailing_bytes"),
    (public_commit()[:-1], "truncated"),
    (public_commit(sender=b"\x05"), "bad_sender_type"),
    (public_commit(path=b"\x02"), "bad_optional"),
    (public_commit(path=b"\x01" + leaf_node(credential=b"\x00\x07")), "unknown_credential_type"),
    (public_commit(path=b"\x01" + leaf_node(source=b"\x04")), "bad_leaf_node_source"),
])
def test_malformed_framing_refused_with_a_reason(data, reason):
    with pytest.raises(FramingError) as e:
        parse_mls_message(data)
    assert e.value.reason == reason


def test_not_bytes_refused():
    with pytest.raises(FramingError):
        parse_mls_message("text")  # type: ignore[arg-type]


@settings(max_examples=3000, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes_only_framing_error(data):
    try:
        parse_mls_message(data)
    except FramingError:
        pass


def _mutated(seed: bytes, flips, cut: int) -> bytes:
    """`seed` with the bytes at `flips` (position, value) replaced, cut to `cut` bytes."""
    data = bytearray(seed)
    for pos, val in flips:
        if pos < len(data):
            data[pos] = val
    return bytes(data[:cut] if cut < len(data) else data)


_SEEDS = [encode_private_message(GID, 9), public_commit(), public_commit(path=b"\x01" + leaf_node() + b"\x00")]


@settings(max_examples=3000, deadline=None)
@given(st.sampled_from(_SEEDS), st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=4),
       st.integers(0, 400))
def test_fuzz_mutated_messages_only_framing_error(seed, flips, cut):
    try:
        f = parse_mls_message(_mutated(seed, flips, cut))
    except FramingError:
        return
    assert 1 <= len(f.group_id) <= 255 and 0 <= f.epoch < 2**64


def _strict(data: bytes):
    """The strict reader alone (parse_mls_message without its PrivateMessage fast path)."""
    from agent.sequencer import framing
    r = framing._Reader(bytes(data))
    try:
        if r.uint(2, "version") != framing.MLS10 or r.uint(2, "wire_format") != WIRE_PRIVATE:
            return "other"
        return framing._private_message(r, framing.MLS10)
    except FramingError as e:
        return e.reason


_PRIVATE_SEEDS = [encode_private_message(GID, 9), encode_private_message(b"g" * 200, 2**40, CT_PROPOSAL),
                  encode_private_message(b"x", 0, ciphertext=b"c" * 300, authenticated_data=b"a" * 70)]


@settings(max_examples=3000, deadline=None)
@given(st.sampled_from(_PRIVATE_SEEDS), st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), max_size=4),
       st.integers(0, 700))
def test_private_fast_path_reads_exactly_what_the_strict_reader_reads(seed, flips, cut):
    # the hot path's offset arithmetic (framing._private_fast) accepts only what the strict reader
    # accepts, with the same fields; for everything else it defers to the strict reader
    from agent.sequencer.framing import _private_fast
    data = _mutated(seed, flips, cut)
    fast, strict = _private_fast(data), _strict(data)
    if fast is not None:
        assert fast == strict
    if isinstance(strict, type(parse_mls_message(_PRIVATE_SEEDS[0]))) and data[:4] == b"\x00\x01\x00\x02":
        assert fast == strict       # every well-formed PrivateMessage takes the fast path
