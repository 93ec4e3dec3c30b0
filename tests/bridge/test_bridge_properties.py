"""Property tests (Hypothesis): encodings round-trip, and the journal recovers from any torn tail."""
import ast
import os

from hypothesis import given, settings, strategies as st

import firmware_bridge
from firmware_bridge import EventIdentity, ReceiptIdentity, SigningBridge, open_keystore
from firmware_bridge import serial_protocol as sp
from firmware_bridge.identity import decode_identity

events = st.builds(EventIdentity, st.binary(min_size=16, max_size=16), st.integers(0, 2**64 - 1),
                   st.integers(0, 2**32 - 1))
receipts = st.builds(ReceiptIdentity, st.binary(min_size=1, max_size=255), st.integers(0, 2**64 - 1))


@given(st.one_of(events, receipts))
def test_identity_round_trip(identity):
    assert decode_identity(identity.encode()) == identity


@given(events, events)
def test_event_identity_bytes_order_is_hlc_order_within_a_site(a, b):
    b = EventIdentity(a.site_id, b.physical_ms, b.logical)
    assert (a.encode() < b.encode()) == (a.hlc < b.hlc)


@given(st.binary(max_size=3000))
def test_cobs_round_trip(data):
    enc = sp.cobs_encode(data)
    assert 0 not in enc and sp.cobs_decode(enc) == data


@given(st.integers(0, 0xFFFF), st.binary(max_size=600), st.binary(max_size=64))
def test_frame_reader_finds_frames_in_any_chunking(req_id, body, noise):
    stream = noise.replace(b"\x00", b"") + b"\x00" + sp.encode_frame(sp.SIGN, req_id, body)
    reader = sp.FrameReader()
    frames = []
    for i in range(0, len(stream), 7):
        frames += list(reader.feed(stream[i:i + 7]))
    assert [(f.req_id, f.body) for f in frames] == [(req_id, body)]


@settings(max_examples=40, deadline=None)
@given(cut=st.integers(0, 10_000), n=st.integers(1, 12))
def test_journal_recovers_from_any_truncation(tmp_path_factory, cut, n):
    d = tmp_path_factory.mktemp("j")
    ks = open_keystore({"kind": "software", "dir": str(d / "k")})
    ks.generate_key("site", "ed25519")
    site = b"\x01" * 16
    b = SigningBridge(ks, str(d / "j"))
    outs = []
    for k in range(n):
        outs.append(b.release(EventIdentity(site, 1, k), "site", b"tbs%d" % k, lambda s: b"C" + s))
    b.close()
    data = (d / "j").read_bytes()
    cut = min(cut, len(data))
    (d / "j").write_bytes(data[:cut])
    b = SigningBridge(ks, str(d / "j"))  # never raises on a torn tail
    for k in range(n):
        got = b.released(EventIdentity(site, 1, k))
        assert got is None or got == outs[k]  # a prefix: old outputs intact, nothing invented
    b.close()


@settings(max_examples=60, deadline=None)
@given(at=st.integers(0, 10_000), xor=st.integers(1, 255), n=st.integers(2, 8))
def test_journal_damage_is_refused_or_only_in_the_last_record(tmp_path_factory, at, xor, n):
    """One damaged byte anywhere after the header either makes the journal refuse
    to open (JournalCorrupt, file unchanged), or lies in the last record, which is then truncated
    as a torn tail; never is a record before the damage lost, nor one after it silently dropped."""
    from firmware_bridge import JournalCorrupt
    d = tmp_path_factory.mktemp("j")
    ks = open_keystore({"kind": "software", "dir": str(d / "k")})
    ks.generate_key("site", "ed25519")
    site = b"\x01" * 16
    b = SigningBridge(ks, str(d / "j"))
    outs = [b.release(EventIdentity(site, 1, k), "site", b"tbs%d" % k, lambda s: b"C" + s) for k in range(n)]
    b.close()
    data = bytearray((d / "j").read_bytes())
    at = 8 + at % (len(data) - 8)
    data[at] ^= xor
    (d / "j").write_bytes(bytes(data))
    try:
        b = SigningBridge(ks, str(d / "j"))
    except JournalCorrupt as e:
        assert (d / "j").read_bytes() == bytes(data) and e.records_after > 0
        return
    got = [b.released(EventIdentity(site, 1, k)) for k in range(n)]
    b.close()
    assert got[:n - 1] == outs[:n - 1]           # only the last record (its output) may be gone
    assert got[n - 1] in (None, outs[n - 1])


def test_firmware_bridge_imports_nothing_from_agent():
    pkg = os.path.dirname(firmware_bridge.__file__)
    for name in os.listdir(pkg):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(pkg, name)).read())
            for node in ast.walk(tree):
                mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                        else [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
                assert not any(m == "agent" or m.startswith("agent.") for m in mods), (name, mods)
