"""One exception hierarchy for every keystore and bridge fault (docs/keystore.md "The interface").

Local faults have their own types, never mixed with protocol errors from peers.  Every message
says what was wrong and what to do about it, and never contains key material or a PIN.
"""
from __future__ import annotations


class KeystoreError(Exception):
    """Base class of every error raised by firmware_bridge."""


class KeystoreUnavailable(KeystoreError):
    """The keystore (directory, PKCS#11 module/token, serial device) cannot be reached."""


class WrongPin(KeystoreError):
    """The token rejected the PIN."""


class KeyNotFound(KeystoreError):
    """No key with that name exists in the keystore."""


class KeyExists(KeystoreError):
    """generate_key was asked for a name that is already taken (keys are never overwritten)."""


class UnsupportedAlgorithm(KeystoreError):
    """The algorithm is not one of "ed25519" / "p256", or the keystore cannot do it."""


class DeviceRefused(KeystoreError):
    """The serial keystore device refused the request (e.g. identity already signed)."""

    def __init__(self, message: str, code: int = 0) -> None:
        super().__init__(message)
        self.code = code


class DeviceTimeout(KeystoreError):
    """The serial keystore device, or the PKCS#11 token (its worker, then killed), did not answer in time."""


class DeviceProtocolError(KeystoreError):
    """Bytes from the device did not form a valid frame (CRC, framing, unexpected reply)."""


class JournalError(KeystoreError):
    """The persist-before-release journal cannot be written or read; the bridge stops releasing."""


class JournalBusy(JournalError):
    """Another process holds the journal (its exclusive lock): one bridge owns a journal."""


class JournalCorrupt(JournalError):
    """Damage inside the journal's durable part: a record that does not parse, with valid records
    after it.  Unlike a torn tail (truncated on open) this cannot come from an interrupted write;
    the journal refuses to open and changes nothing (docs/keystore.md)."""

    def __init__(self, message: str, offset: int, records_after: int, released_after: int) -> None:
        super().__init__(message)
        self.offset = offset
        self.records_after = records_after
        self.released_after = released_after


class OutcomeUnknown(KeystoreError):
    """An intent was durably recorded for this identity but no persisted output exists.

    SOVM §22.5 clause 2: the identity MUST be treated as already signed.  It is never re-signed.
    """

    def __init__(self, message: str, identity: object) -> None:
        super().__init__(message)
        self.identity = identity
