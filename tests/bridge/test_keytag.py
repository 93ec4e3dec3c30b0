"""firmware_bridge/keytag.py: which existing key an unfinished init may take up as its own."""
from firmware_bridge import keytag

PK, OTHER = b"\x02" + b"\x11" * 32, b"\x03" + b"\x22" * 32


def test_a_key_is_ours_by_its_recorded_public_key_or_tag_only():
    rec = keytag.new_record("pkcs11", existed_before=False)
    tag = keytag.tag_of(rec)
    assert len(tag) == keytag.TAG_BYTES
    assert keytag.is_ours(rec, "pkcs11", OTHER, tag)              # killed before the public key was known
    assert not keytag.is_ours(rec, "pkcs11", OTHER, b"events")     # a key with another CKA_ID (another home's)
    assert not keytag.is_ours(rec, "pkcs11", OTHER, None)          # a keystore that keeps no tag
    assert not keytag.is_ours(rec, "serial", OTHER, tag)           # another kind of keystore
    rec["public_key"] = PK.hex()
    assert keytag.is_ours(rec, "pkcs11", PK, None)
    assert not keytag.is_ours(None, "pkcs11", PK, tag) and not keytag.is_ours({}, "pkcs11", PK, tag)


def test_a_software_key_is_ours_only_in_the_homes_own_directory_and_only_if_it_was_not_there():
    rec = keytag.new_record("software", existed_before=False)
    assert keytag.is_ours(rec, "software", OTHER, None, own_directory=True)
    assert not keytag.is_ours(rec, "software", OTHER, None, own_directory=False)
    before = keytag.new_record("software", existed_before=True)
    assert not keytag.is_ours(before, "software", OTHER, None, own_directory=True)


def test_two_records_never_share_a_tag():
    assert len({keytag.new_record("pkcs11", False)["tag"] for _ in range(64)}) == 64


def test_generate_or_take_up_with_a_real_keystore(tmp_path):
    """The record is written before the key, holds its public key after; a second call (an init
    run again) takes the same key up; a refusal by the keystore leaves no record behind."""
    import json

    import pytest

    from firmware_bridge import KeyExists, KeystoreError, open_keystore
    ks = open_keystore({"kind": "software", "dir": str(tmp_path / "keystore")})
    try:
        rec = tmp_path / "init.incomplete"
        pk, taken = keytag.generate_or_take_up(ks, "k", "p256", rec, "software", own_directory=True)
        assert not taken and json.loads(rec.read_text())["public_key"] == pk.hex()
        assert keytag.generate_or_take_up(ks, "k", "p256", rec, "software", own_directory=True) == (pk, True)
        other = tmp_path / "other.incomplete"   # another init's record: that key is not its own
        with pytest.raises(KeyExists):
            keytag.generate_or_take_up(ks, "k", "p256", other, "software", own_directory=True)
        assert not other.exists()     # a refused init leaves no record saying it was cut short
        refused = tmp_path / "refused.incomplete"
        with pytest.raises(KeystoreError):
            keytag.generate_or_take_up(ks, "r", "rsa", refused, "software")
        assert not refused.exists()
    finally:
        ks.close()


def test_the_software_keystore_keeps_a_keys_tag_in_its_file(tmp_path):
    from firmware_bridge import open_keystore
    ks = open_keystore({"kind": "software", "dir": str(tmp_path / "keystore")})
    try:
        ks.generate_key("tagged", "p256", tag=b"\x01" * 16)
        ks.generate_key("plain", "ed25519")
        assert ks.key_tag("tagged") == b"\x01" * 16 and ks.key_tag("plain") is None
    finally:
        ks.close()
    reopened = open_keystore({"kind": "software", "dir": str(tmp_path / "keystore")})
    try:
        assert reopened.key_tag("tagged") == b"\x01" * 16     # durable, and signing still works
        assert len(reopened.public_key("tagged")) == 33
    finally:
        reopened.close()


def test_a_key_file_is_whole_or_absent_after_a_kill(tmp_path):
    """The software keystore creates a key file complete or not at all: a kill between creating
    the file and writing it left an empty file that every later use refused ("not a valid
    ssp-key-v1 file") and that no init could replace (KeyExists). SIGKILL right after the file's
    creation (os.open), in a real subprocess."""
    import subprocess
    import sys
    from pathlib import Path

    import firmware_bridge
    from firmware_bridge import open_keystore
    root = str(Path(firmware_bridge.__file__).resolve().parents[1])
    code = f"""
import os, signal, sys
sys.path.insert(0, {root!r})
from firmware_bridge import open_keystore
real_open = os.open
def open_then_die(path, flags, *a, **k):
    fd = real_open(path, flags, *a, **k)
    if flags & os.O_CREAT and str(path).startswith({str(tmp_path / 'keystore')!r}):
        os.kill(os.getpid(), signal.SIGKILL)
    return fd
os.open = open_then_die
open_keystore({{"kind": "software", "dir": {str(tmp_path / 'keystore')!r}}}).generate_key("k", "p256")
"""
    (tmp_path / "keystore").mkdir(mode=0o700)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == -9, p.stderr
    ks = open_keystore({"kind": "software", "dir": str(tmp_path / "keystore")})
    try:
        assert ks.key_names() == []                 # no key file cut short in its name
        assert len(ks.generate_key("k", "p256")) == 33
    finally:
        ks.close()


def test_a_key_file_on_a_filesystem_without_hard_links_is_created_in_place(tmp_path, monkeypatch):
    """FAT and exFAT (an authority directory on a USB stick) refuse link(2): the key file is then
    created in place as before, and an existing one is still never replaced."""
    import errno
    import os

    import pytest

    from firmware_bridge import KeyExists, open_keystore

    def no_links(src, dst, *a, **k):
        raise OSError(errno.EPERM, "Operation not permitted")
    monkeypatch.setattr(os, "link", no_links)
    ks = open_keystore({"kind": "software", "dir": str(tmp_path / "keystore")})
    try:
        pk = ks.generate_key("k", "p256", tag=b"\x02" * 16)
        assert ks.key_tag("k") == b"\x02" * 16 and len(pk) == 33
        with pytest.raises(KeyExists):
            ks.generate_key("k", "p256")
        assert sorted(os.listdir(tmp_path / "keystore")) == ["k.key"]     # no temporary file left
    finally:
        ks.close()
