"""ReleasedAcks (agent/core/binding.py): a kept acknowledgement is served again only for the same
sender, the same body bytes and the same outcome, under the same signing key (docs/protocol.md §5)."""
from agent.core.binding import ReleasedAcks
from agent.core.records import AckAnswer

H1, H2 = b"\x01" * 32, b"\x02" * 32
S, T = b"s" * 16, b"t" * 16
KEY = (b"k" * 32, None)


def test_served_only_for_the_same_sender_bytes_and_outcome():
    r = ReleasedAcks()
    a = AckAnswer(H1, 1, 1, ())
    r.put(S, [a, AckAnswer(H2, 2, 2, ())], b"rec", KEY)
    assert r.get(S, a, KEY) == b"rec"
    assert r.get(S, AckAnswer(H2, 2, 2, ()), KEY) == b"rec"  # grouped: the record names both
    assert r.get(T, a, KEY) is None  # another sender: the record's subject is S
    assert r.get(S, AckAnswer(H1, 0, 1, (0,)), KEY) is None  # same bytes, now rejected: signed afresh
    assert r.get(S, AckAnswer(H1, 0, 1, ()), KEY) is None  # same bytes, now held
    assert r.get(S, AckAnswer(b"\x03" * 32, 1, 1, ()), KEY) is None


def test_a_new_signing_key_drops_every_kept_record():
    r = ReleasedAcks()
    a = AckAnswer(H1, 1, 1, ())
    r.put(S, [a], b"rec", KEY)
    assert r.get(S, a, (b"n" * 32, None)) is None
    assert r.get(S, a, KEY) is None and len(r) == 0


def test_bounded_least_recently_used_first():
    r = ReleasedAcks(per_sender=2, senders=2)
    a, b, c = (AckAnswer(bytes([i]) * 32, 1, 1, ()) for i in (1, 2, 3))
    r.put(S, [a], b"ra", KEY)
    r.put(S, [b], b"rb", KEY)
    assert r.get(S, a, KEY) == b"ra"  # a used: b is now the oldest
    r.put(S, [c], b"rc", KEY)
    assert r.get(S, b, KEY) is None and r.get(S, a, KEY) == b"ra" and r.get(S, c, KEY) == b"rc"
    r.put(T, [a], b"ta", KEY)
    r.put(b"u" * 16, [a], b"ua", KEY)  # a third sender: the least recently signed-for (S) goes
    assert r.get(S, a, KEY) is None and r.get(T, a, KEY) == b"ta" and len(r) == 2
