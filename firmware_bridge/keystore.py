"""The abstract keystore interface (docs/keystore.md "The interface").

A keystore holds named keys that were generated inside it and never leave it.  It exports public
keys and signs — but raw signing is the private ``_sign`` method: the only public way to obtain a
signature is ``SigningBridge.release`` (SOVM §22.5 clause 1, persist-before-release).
"""
from __future__ import annotations

import os
import re
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Callable, Generator, Optional, Sequence

from .errors import KeystoreError, KeystoreUnavailable, UnsupportedAlgorithm
from .identity import Identity

ALGORITHMS = ("ed25519", "p256")
MAX_SEAL_BYTES = 1024   # seal/unseal are for keys, not data
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_key_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise KeystoreError(
            f"invalid key name {name!r}: use 1-64 characters from A-Z a-z 0-9 . _ - (not starting with . _ -)")
    return name


def check_tag(tag: bytes) -> bytes:
    if not isinstance(tag, (bytes, bytearray)) or not 1 <= len(tag) <= 32:
        raise KeystoreError("a key tag is 1 to 32 bytes")
    return tag


def check_alg(alg: str) -> str:
    if alg not in ALGORITHMS:
        raise UnsupportedAlgorithm(f"unsupported algorithm {alg!r}: use one of {', '.join(ALGORITHMS)}")
    return alg


class Keystore(ABC):
    """Named keys; Ed25519 ("ed25519") for events/records, ECDSA P-256 ("p256") for receipts."""

    kind: str = "abstract"
    # True: it refuses an identity at or below the last one it took (serial firmware keeps them
    # monotonic), so SigningBridge.open_event_gap refuses a gap below it
    upward_only: bool = False

    @abstractmethod
    def generate_key(self, name: str, alg: str, tag: Optional[bytes] = None) -> bytes:
        """Generate a key inside the keystore; return its public key (see ``public_key``).
        ``tag``: up to 32 bytes the caller chose and made durable before asking, stored with
        the key where the keystore can (``key_tag``), so a caller killed before it learnt the
        public key can still tell its own key from another's of the same name."""

    def key_tag(self, name: str) -> Optional[bytes]:
        """The ``tag`` stored with key ``name`` when it was generated, or None (generated without
        one, before tags, or on serial firmware without them). KeyNotFound if absent."""
        self.algorithm(name)
        return None

    @abstractmethod
    def public_key(self, name: str) -> bytes:
        """Ed25519: 32 raw bytes.  P-256: 33-byte compressed SEC1 (SOVM §22.5, docs/protocol.md §0
        "Sequencing receipts")."""

    @abstractmethod
    def algorithm(self, name: str) -> str:
        """"ed25519" or "p256" for an existing key; KeyNotFound otherwise."""

    @abstractmethod
    def key_names(self) -> list[str]:
        """Names of the keys held, sorted."""

    @abstractmethod
    def describe(self) -> dict[str, Any]:
        """What an operator should see (kind, path / token / port, key names). Never secrets."""

    @abstractmethod
    def _sign(self, name: str, identity: Identity, data: bytes) -> bytes:
        """Raw signature over ``data`` (Ed25519: 64 bytes; P-256: raw r||s, 64 bytes).

        Private on purpose: only ``SigningBridge`` calls it, after recording the intent (§22.5).
        ``identity`` is passed so a device can enforce its own per-identity refusal.
        """

    def _sign_many(self, requests: Sequence[tuple[str, Identity, bytes]]) -> tuple[list[bytes], Optional[BaseException]]:
        """Sign ``requests`` [(key name, identity, data)] in the order given (a device refuses
        identities at or below its last one); stop at the first failure.  Returns the signatures of
        a prefix of ``requests`` and the failure that ended it, if any.  Private like ``_sign``: only the bridge's
        group commit calls it, after the intents are durable.  Backends that can sign concurrently
        override it (software Ed25519); their prefix may be shorter than this loop's, never longer."""
        sigs: list[bytes] = []
        for name, identity, data in requests:
            try:
                sigs.append(self._sign(name, identity, data))
            except BaseException as exc:  # the caller keeps the rest as unknown outcomes
                return sigs, exc
        return sigs, None

    def _sign_chunks(self, requests: Sequence[tuple[str, Identity, bytes]]) -> Generator[list[bytes], None, None]:
        """``_sign_many`` as it goes: the signatures of ``requests`` in order, in consecutive
        chunks; a failure is raised after the chunks of the prefix before it. A backend that signs
        in another process yields one chunk while that process makes the next, so the bridge checks
        the signatures it has meanwhile (Pkcs11Keystore). Private like ``_sign``; the caller closes
        the iterator, also when it stops early."""
        sigs, failure = self._sign_many(requests)
        if sigs:
            yield sigs
        if failure is not None:
            raise failure

    def _sign_start(self, requests: Sequence[tuple[str, Identity, bytes]]) -> Callable[[], tuple[list[bytes], Optional[BaseException]]]:
        """Start signing ``requests`` (as ``_sign_many``) and return a callable that gives
        ``_sign_many``'s answer. Lets the bridge's pipelined caller (the sequencer's group commit,
        docs/sequencer.md "Pipelined group commit") persist and commit the previous chunk while a
        backend that signs in another process signs this one; by default it signs now. Private
        like ``_sign``: only the bridge calls it, after the intents are durable."""
        got = self._sign_many(requests)
        return lambda: got

    # -- sealing small secrets (at-rest protection of the agent's stored events) -----------------
    # A seal key is a symmetric key generated inside the keystore that never leaves it; it seals
    # (wraps) the agent's data keys (firmware_bridge/sealing.py). Seal keys live in their own
    # namespace: key_names() lists signing keys only.
    def generate_seal_key(self, name: str) -> None:
        """Generate a seal key inside the keystore (KeyExists if there is one of that name)."""
        raise UnsupportedAlgorithm(f"the {self.kind} keystore cannot hold a seal key")

    def has_seal_key(self, name: str) -> bool:
        raise UnsupportedAlgorithm(f"the {self.kind} keystore cannot hold a seal key")

    def seal(self, name: str, plaintext: bytes, ad: bytes) -> bytes:
        """Authenticated encryption of a small secret (at most 1024 bytes) under seal key ``name``,
        bound to ``ad``. KeyNotFound without that key."""
        raise UnsupportedAlgorithm(f"the {self.kind} keystore cannot seal")

    def unseal(self, name: str, sealed: bytes, ad: bytes) -> bytes:
        """Inverse of ``seal``; SealError when ``sealed`` does not open under ``name`` with ``ad``
        (another keystore's, damaged, or bound to other data)."""
        raise UnsupportedAlgorithm(f"the {self.kind} keystore cannot unseal")

    def delete_seal_key(self, name: str) -> bool:
        """Destroy seal key ``name`` once nothing is sealed under it any more (a re-wrap moved the
        data keys to another keystore). False where the keystore keeps it (hardware kinds: it is
        useless without the token or device, and stays there)."""
        return False

    def close(self) -> None:
        """Release resources (files, worker processes, serial ports)."""

    def __enter__(self) -> "Keystore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def with_pin(config: dict[str, Any]) -> dict[str, Any]:
    """The keystore config with its PIN resolved from `pin_file` or `pin_env` (a PIN is never
    kept in a store that gets copied and backed up). Raises KeystoreUnavailable saying what is
    missing; callers add what to do."""
    conf = dict(config)
    if "pin_file" in conf:
        try:
            conf["pin"] = Path(conf.pop("pin_file")).read_text().strip()
        except OSError as e:
            raise KeystoreUnavailable(f"cannot read the keystore PIN file: {e.strerror}") from None
    elif "pin_env" in conf:
        name = conf.pop("pin_env")
        if name not in os.environ:
            raise KeystoreUnavailable(f"the keystore PIN is expected in ${name}, which is not set")
        conf["pin"] = os.environ[name]
    return conf


class KeystoreConfigError(ValueError):
    """A keystore request that cannot be right (an unknown kind, a field missing or of the wrong
    type): the caller's input, refused before anything is made."""


# the fields each kind needs, and the type of every field a kind reads (docs/keystore.md)
_NEEDS = {"software": (), "pkcs11": ("module", "token_label"), "serial": ("port",)}
_TYPES: dict[str, Any] = {  # a type or a tuple of types: what isinstance takes
   "dir": str, "module": str, "token_label": str, "pin": str, "pin_env": str,
                                   "pin_file": str, "port": str, "env": dict, "baud": int, "timeout_s": (int, float)}


def check_config(config: object) -> dict[str, Any]:
    """The one check of a keystore config from outside (`init --keystore`, `sequencer init
    --keystore`, a profile's [keystore]): a JSON object of a known kind with the fields it needs,
    each of its type (a token needs a PIN, given or where to find it; numbers positive and in
    range). Returns a copy. Raises KeystoreConfigError."""
    if not isinstance(config, dict):
        raise KeystoreConfigError("a keystore config is an object, e.g. {\"kind\": \"software\"}")
    kind = config.get("kind")
    if kind not in _NEEDS:
        raise KeystoreConfigError(f"unknown keystore kind {kind!r}: use software, pkcs11 or serial (docs/keystore.md)")
    missing = [k for k in _NEEDS[kind] if not config.get(k)]
    if kind == "pkcs11" and not any(k in config for k in ("pin", "pin_env", "pin_file")):
        missing.append("pin, pin_env or pin_file")
    if missing:
        raise KeystoreConfigError(f"a {kind} keystore needs {', '.join(missing)} (docs/keystore.md)")
    for k, want in _TYPES.items():
        v = config.get(k)
        if v is None:
            continue
        if not isinstance(v, want) or isinstance(v, bool):
            raise KeystoreConfigError(f"keystore {k} must be {_type_name(want)}, got {v!r}"[:200])
        if k == "env" and not all(isinstance(a, str) and isinstance(b, str) for a, b in v.items()):
            raise KeystoreConfigError("keystore env maps names to strings")
        if k in ("baud", "timeout_s") and not 0 < v <= 10 ** 9:
            raise KeystoreConfigError(f"keystore {k} must be positive and at most 10^9, got {v!r}")
    return dict(config)


def _type_name(want: type | tuple) -> str:
    names = {str: "a string", dict: "an object", int: "a whole number", (int, float): "a number"}
    return names.get(want, str(want))
