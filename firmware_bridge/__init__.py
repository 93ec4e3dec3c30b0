"""Hardware keystore bridge: keystores behind one interface, and persist-before-release.

Imports nothing from ``agent`` (tests/core/test_layout.py).  See docs/keystore.md.
"""
from .bridge import SigningBridge, Status
from .errors import (DeviceProtocolError, DeviceRefused, DeviceTimeout, JournalBusy, JournalCorrupt, JournalError,
                     KeyExists, KeyNotFound, KeystoreError, KeystoreUnavailable, OutcomeUnknown, UnsupportedAlgorithm,
                     WrongPin)
from .identity import DiscontinuityIdentity, EventIdentity, Identity, ReceiptIdentity
from .keystore import ALGORITHMS, Keystore, with_pin
from .opener import open_keystore
from .verify import verify_ed25519, verify_p256

__all__ = [
    "ALGORITHMS", "DeviceProtocolError", "DeviceRefused", "DiscontinuityIdentity", "DeviceTimeout", "EventIdentity", "Identity", "JournalBusy", "JournalCorrupt", "JournalError",
    "KeyExists", "KeyNotFound", "Keystore", "KeystoreError", "KeystoreUnavailable", "OutcomeUnknown",
    "ReceiptIdentity", "SigningBridge", "Status", "UnsupportedAlgorithm", "WrongPin", "open_keystore", "with_pin",
    "verify_ed25519", "verify_p256",
]
