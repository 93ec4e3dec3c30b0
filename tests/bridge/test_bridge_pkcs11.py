"""PKCS#11 keystore against SoftHSM2 in a temporary token directory.

Needs the Debian package softhsm2 and the pip package python-pkcs11 (docs/keystore.md "Test
set-up"); a missing one fails these tests with the command to run, it does not skip them."""
import os
import shutil
import subprocess

import pytest

from firmware_bridge import (EventIdentity, KeyExists, KeystoreUnavailable, ReceiptIdentity, SigningBridge, Status,
                             WrongPin, open_keystore, verify_ed25519, verify_p256)

from bridge_helpers import (assembler, cose_parts, event_payload, event_protected, receipt_payload,
                            receipt_protected, sig_structure, softhsm_module)

SO_PIN, PIN, LABEL = "87654321", "123456", "ssp-test"


@pytest.fixture(scope="module")
def token(tmp_path_factory):
    module = softhsm_module()
    util = shutil.which("softhsm2-util")
    if module is None or util is None:
        pytest.fail("SoftHSM2 is not installed: run `apt-get install -y softhsm2` (docs/keystore.md, Test set-up)")
    d = tmp_path_factory.mktemp("softhsm")
    (d / "tokens").mkdir()
    conf = d / "softhsm2.conf"
    conf.write_text(f"directories.tokendir = {d / 'tokens'}\nobjectstore.backend = file\nlog.level = ERROR\n")
    env = dict(os.environ, SOFTHSM2_CONF=str(conf))
    subprocess.run([util, "--init-token", "--free", "--label", LABEL, "--so-pin", SO_PIN, "--pin", PIN],
                   check=True, env=env, capture_output=True)
    return {"kind": "pkcs11", "module": module, "token_label": LABEL, "pin": PIN,
            "env": {"SOFTHSM2_CONF": str(conf)}}


@pytest.fixture(scope="module")
def keystore(token):
    ks = open_keystore(token)
    ks.generate_key("site", "ed25519")
    ks.generate_key("seq", "p256")
    yield ks
    ks.close()


def test_keys_generated_on_token_sensitive_and_non_extractable(keystore, token):
    assert len(keystore.public_key("site")) == 32
    p = keystore.public_key("seq")
    assert len(p) == 33 and p[0] in (2, 3)
    for name in ("site", "seq"):
        attrs = keystore._call("key_attributes", name=name)
        assert attrs == {"sensitive": True, "extractable": False, "never_extractable": True, "local": True}
    d = keystore.describe()
    assert d["kind"] == "pkcs11" and d["token_label"] == LABEL and d["keys"] == {"site": "ed25519", "seq": "p256"}
    assert PIN not in repr(d)
    with pytest.raises(KeyExists):
        keystore.generate_key("site", "ed25519")
    # keys persist on the token across a new worker / session
    ks2 = open_keystore(token)
    assert ks2.public_key("seq") == p
    ks2.close()


def test_sign_verify_round_trips_through_the_bridge(keystore, tmp_path):
    site, kid = b"\x01" * 16, keystore.public_key("seq")
    with SigningBridge(keystore, str(tmp_path / "j")) as bridge:
        prot, pay = event_protected(site), event_payload(5, 0, 1)
        out = bridge.release(EventIdentity(site, 5, 0), "site", sig_structure(prot, pay), assembler(prot, pay))
        p2, y2, sig = cose_parts(out)
        assert verify_ed25519(keystore.public_key("site"), sig_structure(p2, y2), sig)  # PyNaCl
        prot, pay = receipt_protected(kid), receipt_payload(b"g", 1, bytes(32), None)
        r = bridge.release(ReceiptIdentity(b"g", 1), "seq", sig_structure(prot, pay), assembler(prot, pay))
        p2, y2, sig = cose_parts(r)
        assert verify_p256(kid, sig_structure(p2, y2), sig)  # cryptography
        assert bridge.release(ReceiptIdentity(b"g", 1), "seq", b"anything", assembler(prot, pay)) == r


def test_token_nonces_are_random_which_is_why_resigning_is_forbidden(keystore):
    a = keystore._sign("seq", ReceiptIdentity(b"g", 9), b"same payload")
    b = keystore._sign("seq", ReceiptIdentity(b"g", 9), b"same payload")
    kid = keystore.public_key("seq")
    assert a != b and verify_p256(kid, b"same payload", a) and verify_p256(kid, b"same payload", b)


def test_wrong_pin(token):
    with pytest.raises(WrongPin, match="rejected the PIN"):
        open_keystore(dict(token, pin="000000"))


def test_token_missing(token):
    with pytest.raises(KeystoreUnavailable, match="no token labelled 'absent'"):
        open_keystore(dict(token, token_label="absent"))
    with pytest.raises(KeystoreUnavailable, match="does not exist"):
        open_keystore(dict(token, module="/nonexistent/libpkcs11.so"))


def test_token_gone_mid_use_no_partial_release(token, tmp_path):
    ks = open_keystore(token)
    bridge = SigningBridge(ks, str(tmp_path / "j"))
    site = b"\x02" * 16
    prot, pay = event_protected(site), event_payload(1, 0, 1)
    item = (EventIdentity(site, 1, 0), "site", sig_structure(prot, pay), assembler(prot, pay))
    bridge.release(*item)
    ks._proc.kill()  # the token library / worker dies
    ks._proc.wait()
    prot, pay = event_protected(site), event_payload(2, 0, 1)
    item2 = (EventIdentity(site, 2, 0), "site", sig_structure(prot, pay), assembler(prot, pay))
    with pytest.raises(KeystoreUnavailable, match="not running|died"):
        bridge.release(*item2)
    assert bridge.released(item2[0]) is None and bridge.status(item2[0]) is Status.OUTCOME_UNKNOWN
    bridge.close()
    ks.close()


def test_group_commit_signs_in_worker_batches(keystore, tmp_path):
    """release_many sends the token's signatures in batches (sign_many): every output verifies, both
    algorithms, across a chunk boundary; a failure inside a batch keeps the signed prefix only."""
    site, kid = b"\x03" * 16, keystore.public_key("seq")
    with SigningBridge(keystore, str(tmp_path / "j")) as bridge:
        items = []
        for k in range(150):
            prot, pay = event_protected(site), event_payload(7, k, k)
            items.append((EventIdentity(site, 7, k), "site", sig_structure(prot, pay), assembler(prot, pay)))
        for o in bridge.release_many(items):
            p2, y2, sig = cose_parts(o)
            assert verify_ed25519(keystore.public_key("site"), sig_structure(p2, y2), sig)
        rc = []
        for e in range(1, 70):
            prot, pay = receipt_protected(kid), receipt_payload(b"g2", e, bytes(32), None)
            rc.append((ReceiptIdentity(b"g2", e), "seq", sig_structure(prot, pay), assembler(prot, pay)))
        for o in bridge.release_many(rc):
            p2, y2, sig = cose_parts(o)
            assert verify_p256(kid, sig_structure(p2, y2), sig)
    got = keystore._call("sign_many", requests=[["site", "ed25519", b"a"], ["nope", "ed25519", b"b"],
                                                ["site", "ed25519", b"c"]])
    assert len(got["sigs"]) == 1 and got["err"] == "KeyNotFound"
    assert verify_ed25519(keystore.public_key("site"), b"a", bytes(got["sigs"][0]))


def test_streamed_signatures_in_order_and_an_early_stop_leaves_the_worker_in_step(keystore):
    # _sign_chunks keeps one chunk in flight ahead of the one it yields (the token signs it while
    # the bridge checks); a caller that stops early leaves that reply in the pipe unless it is read
    from firmware_bridge.pkcs11_keystore import SIGN_MANY_CHUNK
    from firmware_bridge.verify import verify_p256
    kid = keystore.public_key("seq")
    reqs = [("seq", ReceiptIdentity(b"s", i), b"m%d" % i) for i in range(2 * SIGN_MANY_CHUNK + 5)]
    parts = list(keystore._sign_chunks(reqs))
    assert [len(p) for p in parts] == [SIGN_MANY_CHUNK, SIGN_MANY_CHUNK, 5]
    assert all(verify_p256(kid, data, sig) for (_n, _i, data), sig in zip(reqs, [s for p in parts for s in p]))
    stream = keystore._sign_chunks(reqs)
    assert len(next(stream)) == SIGN_MANY_CHUNK
    stream.close()                     # the second chunk was in flight
    assert keystore.public_key("site") != kid and keystore._call("key_attributes", name="seq")["sensitive"]
    sig = keystore._sign("seq", ReceiptIdentity(b"s", 10**6), b"after")
    assert verify_p256(kid, b"after", sig)
    sigs, failure = keystore._sign_many(reqs[:3] + [("nokey", ReceiptIdentity(b"s", 7), b"x")])
    assert len(sigs) == 3 and failure is not None
    assert verify_p256(kid, b"after", keystore._sign("seq", ReceiptIdentity(b"s", 10**6 + 1), b"after"))
