"""Software keystore: one key file per key in a directory (issue 5 item 4, "software").

For development and devices without hardware.  Files are created with O_EXCL and mode 0600, the
directory with 0700; files readable by group/other are refused, as ssh does.  P-256 signs with
deterministic RFC 6979 nonces, which the substrate profile requires of software signers (§22.5).
Key material is never logged or put in an exception message.
"""
from __future__ import annotations

import json
import os
import stat
import threading
from typing import Any

import nacl.signing
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from .ec import der_to_raw, public_key_compressed
from .errors import KeyExists, KeyNotFound, KeystoreError, KeystoreUnavailable
from .fsutil import fsync_dir
from .identity import Identity
from .keystore import Keystore, check_alg, check_key_name

_SUFFIX = ".key"


class _Key:
    __slots__ = ("alg", "ed", "p256")

    def __init__(self, alg: str, secret: bytes) -> None:
        self.alg = alg
        self.ed = nacl.signing.SigningKey(secret) if alg == "ed25519" else None
        self.p256 = ec.derive_private_key(int.from_bytes(secret, "big"), ec.SECP256R1()) if alg == "p256" else None

    def public(self) -> bytes:
        if self.ed is not None:
            return bytes(self.ed.verify_key)
        assert self.p256 is not None
        return public_key_compressed(self.p256.public_key())

    def sign(self, data: bytes) -> bytes:
        if self.ed is not None:
            return self.ed.sign(data).signature
        assert self.p256 is not None
        return der_to_raw(self.p256.sign(data, ec.ECDSA(hashes.SHA256(), deterministic_signing=True)))

    def __repr__(self) -> str:  # never show the secret
        return f"<key {self.alg}>"


def new_secret(alg: str) -> bytes:
    if alg == "ed25519":
        return bytes(nacl.signing.SigningKey.generate())
    key = ec.generate_private_key(ec.SECP256R1())
    return key.private_numbers().private_value.to_bytes(32, "big")


class KeyDir:
    """The key files themselves; shared by the software keystore and the serial device emulator."""

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
        except OSError as exc:
            raise KeystoreUnavailable(f"cannot create key directory {self.path}: {exc.strerror}; "
                                      "check the path and its permissions") from None
        self._cache: dict[str, _Key] = {}
        self._lock = threading.Lock()

    def _file(self, name: str) -> str:
        return os.path.join(self.path, check_key_name(name) + _SUFFIX)

    def names(self) -> list[str]:
        try:
            return sorted(f[:-len(_SUFFIX)] for f in os.listdir(self.path) if f.endswith(_SUFFIX))
        except OSError as exc:
            raise KeystoreUnavailable(f"cannot list key directory {self.path}: {exc.strerror}") from None

    def create(self, name: str, alg: str) -> _Key:
        check_alg(alg)
        path = self._file(name)
        secret = new_secret(alg)
        body = json.dumps({"format": "ssp-key-v1", "alg": alg, "secret": secret.hex()}).encode()
        with self._lock:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            except FileExistsError:
                raise KeyExists(f"key {name!r} already exists in {self.path}; keys are never overwritten "
                                "— choose another name or remove the file deliberately") from None
            except OSError as exc:
                raise KeystoreUnavailable(f"cannot create key file in {self.path}: {exc.strerror}") from None
            try:
                os.write(fd, body)
                os.fsync(fd)
            finally:
                os.close(fd)
            fsync_dir(self.path)
            key = _Key(alg, secret)
            self._cache[name] = key
            return key

    def get(self, name: str) -> _Key:
        key = self._cache.get(name)
        if key is not None:
            return key
        path = self._file(name)
        with self._lock:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                raise KeyNotFound(f"no key {name!r} in {self.path}; generate it first "
                                  f"(known keys: {', '.join(self.names()) or 'none'})") from None
            except OSError as exc:
                raise KeystoreUnavailable(f"cannot open key file for {name!r}: {exc.strerror}") from None
            try:
                st = os.fstat(fd)
                if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
                    raise KeystoreError(f"key file {path} is accessible by group/other "
                                        f"(mode {stat.S_IMODE(st.st_mode):o}); run: chmod 600 {path}")
                raw = os.read(fd, 1 << 16)
            finally:
                os.close(fd)
            try:
                doc = json.loads(raw)
                if doc.get("format") != "ssp-key-v1":
                    raise ValueError
                key = _Key(check_alg(doc["alg"]), bytes.fromhex(doc["secret"]))
            except (ValueError, KeyError, TypeError):
                raise KeystoreError(f"key file {path} is not a valid ssp-key-v1 file; restore it from backup") from None
            self._cache[name] = key
            return key


class SoftwareKeystore(Keystore):
    kind = "software"
    # in-process keys: a returned signature is trusted (saves a verify per write on the hot path)
    verify_signatures = False

    def __init__(self, directory: str) -> None:
        self._keys = KeyDir(directory)

    def generate_key(self, name: str, alg: str) -> bytes:
        return self._keys.create(name, alg).public()

    def public_key(self, name: str) -> bytes:
        return self._keys.get(name).public()

    def algorithm(self, name: str) -> str:
        return self._keys.get(name).alg

    def key_names(self) -> list[str]:
        return self._keys.names()

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "dir": self._keys.path,
                "keys": {n: self._keys.get(n).alg for n in self._keys.names()}}

    def _sign(self, name: str, identity: Identity, data: bytes) -> bytes:
        return self._keys.get(name).sign(data)
