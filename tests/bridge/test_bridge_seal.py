"""Seal keys in every keystore kind (docs/keystore.md "Seal keys"): generated
inside the keystore (PKCS#11: sensitive, never extractable), a sealed secret opens only under
the same keystore and the same associated data; and the journal keeps released outputs sealed
when given a sealer (no output in clear in the file, the same bytes read back)."""
from __future__ import annotations

import os

import pytest

from bridge_helpers import MESH_ID, assembler, event_payload, event_protected, serial_keystore, sig_structure, \
    softhsm_token
from firmware_bridge import EventIdentity, JournalError, KeyExists, KeyNotFound, SigningBridge, open_keystore
from firmware_bridge.journal import Journal
from firmware_bridge.sealing import SEAL_KEY, SealError, Sealer, new_data_key


@pytest.fixture(params=["software", "pkcs11", "serial"])
def two_keystores(request, tmp_path):
    """Two keystores of one kind (the second stands for a replaced one)."""
    if request.param == "software":
        yield [{"kind": "software", "dir": str(tmp_path / n)} for n in ("k1", "k2")]
    elif request.param == "pkcs11":
        yield [softhsm_token(tmp_path / n, "seal") for n in ("t1", "t2")]
    else:
        g1, g2 = serial_keystore(tmp_path / "d1"), serial_keystore(tmp_path / "d2")
        yield [next(g1), next(g2)]
        for g in (g1, g2):
            next(g, None)


def test_seal_opens_only_under_the_same_keystore_and_associated_data(two_keystores):
    ks1, ks2 = (open_keystore(c) for c in two_keystores)
    try:
        assert not ks1.has_seal_key(SEAL_KEY)
        with pytest.raises(KeyNotFound):
            ks1.seal(SEAL_KEY, b"x", b"ad")
        ks1.generate_seal_key(SEAL_KEY)
        ks2.generate_seal_key(SEAL_KEY)
        assert ks1.has_seal_key(SEAL_KEY)
        with pytest.raises(KeyExists):
            ks1.generate_seal_key(SEAL_KEY)
        assert SEAL_KEY not in ks1.key_names()          # not a signing key
        dk = new_data_key()
        sealed = ks1.seal(SEAL_KEY, dk, b"site|1")
        assert dk not in sealed
        assert ks1.unseal(SEAL_KEY, sealed, b"site|1") == dk
        with pytest.raises(SealError):
            ks1.unseal(SEAL_KEY, sealed, b"site|2")     # bound to what it wraps
        with pytest.raises(SealError):
            ks2.unseal(SEAL_KEY, sealed, b"site|1")     # another keystore's seal key
    finally:
        ks1.close()
        ks2.close()


def test_pkcs11_seal_key_is_sensitive_and_never_extractable(tmp_path):
    ks = open_keystore(softhsm_token(tmp_path, "seal"))
    try:
        ks.generate_seal_key(SEAL_KEY)
        assert ks._call("seal_attributes", name=SEAL_KEY) == {"sensitive": True, "extractable": False,
                                                                "never_extractable": True}
    finally:
        ks.close()


def test_journal_keeps_outputs_sealed_and_reads_them_back(tmp_path):
    site = os.urandom(16)
    sealer = Sealer({1: new_data_key()}, 1)
    path = str(tmp_path / "journal")
    ks = open_keystore({"kind": "software", "dir": str(tmp_path / "k")})
    ks.generate_key("events", "ed25519")
    outs = []
    with SigningBridge(ks, path, sealer=sealer) as bridge:
        for i in range(5):
            prot, pay = event_protected(site), event_payload(1000 + i, 0, i)
            outs.append(bridge.release(EventIdentity(site, 1000 + i, 0), "events", sig_structure(prot, pay),
                                       assembler(prot, pay)))
        assert [bridge.released(EventIdentity(site, 1000 + i, 0)) for i in range(5)] == outs
    data = open(path, "rb").read()
    assert not any(o in data or o[-64:] in data for o in outs)    # neither the event nor its signature
    j = Journal(path, sealer=sealer)
    try:
        assert [j.read_released(i) for i, _ in j.released_items()] == outs
    finally:
        j.close()
    j = Journal(path)                     # without the data key: the state is known, the bytes are not
    try:
        assert j.state(EventIdentity(site, 1000, 0).encode()) == "released"
        with pytest.raises(JournalError):
            j.read_released(EventIdentity(site, 1000, 0).encode())
    finally:
        j.close()
    j = Journal(path, sealer=Sealer({1: new_data_key()}, 1))     # another data key
    try:
        with pytest.raises(JournalError):
            j.read_released(EventIdentity(site, 1000, 0).encode())
    finally:
        j.close()


def test_a_batch_seals_like_one_at_a_time():
    """`Sealer.seal_many` (the journal's group commit seals its outputs in one call): each blob
    opens under its own associated data only, and no two share a nonce."""
    s = Sealer({3: new_data_key()}, 3)
    ads = [b"ad-%d" % i for i in range(40)]
    pts = [os.urandom(i * 9) for i in range(40)]
    blobs = s.seal_many(ads, pts)
    assert [s.open(a, b) for a, b in zip(ads, blobs)] == pts
    assert len({b[3:27] for b in blobs}) == 40
    assert all(b[:3] == s.seal(b"x", b"")[:3] for b in blobs)   # format byte and key id
    with pytest.raises(SealError):
        s.open(ads[1], blobs[0])
