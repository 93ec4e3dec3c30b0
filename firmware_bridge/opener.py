"""Opening a keystore by its configuration: the one module that knows every kind (software, PKCS#11,
serial), so that the interface (keystore.py) imports none of its implementations."""
from __future__ import annotations

from typing import Any

from .errors import KeystoreError
from .keystore import Keystore


def open_keystore(config: dict[str, Any]) -> Keystore:
    """Open the keystore a profile names.

    ``{"kind": "software", "dir": PATH}``
    ``{"kind": "pkcs11", "module": SO_PATH, "token_label": STR, "pin": STR[, "env": {..}][, "timeout_s": 60.0]}``
    ``{"kind": "serial", "port": DEV, "baud": 115200, "timeout_s": 2.0}``
    """
    kind = config.get("kind") if isinstance(config, dict) else None
    if kind == "software":
        from .software import SoftwareKeystore
        return SoftwareKeystore(_req(config, "dir"))
    if kind == "pkcs11":
        from .pkcs11_keystore import DEFAULT_TIMEOUT_S, Pkcs11Keystore
        return Pkcs11Keystore(module=_req(config, "module"), token_label=_req(config, "token_label"),
                              pin=_req(config, "pin"), env=config.get("env"),
                              timeout_s=config.get("timeout_s", DEFAULT_TIMEOUT_S))
    if kind == "serial":
        from .serial_driver import SerialKeystore
        return SerialKeystore(port=_req(config, "port"), baud=int(config.get("baud", 115200)),
                              timeout_s=float(config.get("timeout_s", 2.0)))
    raise KeystoreError(f"unknown keystore kind {kind!r}: set keystore.kind to software, pkcs11 or serial")


def _req(config: dict[str, Any], key: str) -> Any:
    if key not in config:
        raise KeystoreError(f"keystore config of kind {config.get('kind')!r} lacks {key!r}")
    return config[key]
