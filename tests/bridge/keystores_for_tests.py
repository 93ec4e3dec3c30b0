"""Test-only keystore: software keys, but P-256 with *random* nonces, like a protected keystore
(SOVM §22.5: a token chooses its own nonce, so two signings of one payload differ).  This makes
a re-signed receipt visible as a second, byte-distinct output to the checker."""
from __future__ import annotations

from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec

from firmware_bridge.ec import der_to_raw
from firmware_bridge.software import SoftwareKeystore


class RandomNonceSoftwareKeystore(SoftwareKeystore):
    def _sign(self, name, identity, data):
        key = self._keys.get(name)
        if key.p256 is not None:
            return der_to_raw(key.p256.sign(data, ec.ECDSA(hashes.SHA256())))
        return key.sign(data)
