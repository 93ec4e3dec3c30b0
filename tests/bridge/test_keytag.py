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
