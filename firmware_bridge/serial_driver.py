"""Host driver for the serial keystore device (pyserial), protocol in serial_protocol.py.

One request at a time (a lock), each with a fresh request id; replies with another id (stale
replies to an earlier, timed-out request) and corrupted frames are discarded.  Nothing is ever
retried automatically: a SIGN whose reply was lost may have been signed by the device, and the
bridge's journal already treats that identity as OutcomeUnknown (SOVM §22.5 clause 2).
"""
from __future__ import annotations

import threading
import time
from typing import Any, Optional

import serial

from . import serial_protocol as sp
from .errors import (DeviceProtocolError, DeviceRefused, DeviceTimeout, KeyExists, KeyNotFound, KeystoreError,
                     KeystoreUnavailable, UnsupportedAlgorithm)
from .identity import Identity
from .keystore import MAX_SEAL_BYTES, Keystore, check_alg, check_key_name, check_tag

_REFUSAL_HINT = {
    sp.E_ALREADY_SIGNED: "the device has already signed this identity and will never sign it again "
                         "(events: tick the HLC; receipts: §22.6 discontinuity path)",
    sp.E_NOT_MONOTONIC: "the device only signs identities above the last one it signed for this key; "
                        "the host's clock or epoch state is behind the device's",
    sp.E_WRONG_KEY_FOR_IDENTITY: "use an ed25519 key for events and a p256 key for receipts",
    sp.E_STORAGE: "the device could not persist its counter; check its storage",
}


class SerialKeystore(Keystore):
    kind = "serial"
    upward_only = True  # the firmware refuses identities at or below its last one (E_NOT_MONOTONIC)
    verify_signatures = True  # the line and the device are outside our process: check before persisting

    def __init__(self, port: str, baud: int = 115200, timeout_s: float = 2.0) -> None:
        self.port = port
        self.baud = baud
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._req = 0
        self._reader = sp.FrameReader()
        self._algs: dict[str, str] = {}
        try:
            self._ser = serial.Serial(port, baudrate=baud, timeout=0.05, write_timeout=timeout_s)
        except (serial.SerialException, OSError) as exc:
            raise KeystoreUnavailable(f"cannot open serial keystore at {port}: {exc}; check that the device "
                                      "is plugged in and the port name is right (ls -l /dev/serial/by-id/)") from None
        self._ser.reset_input_buffer()
        hello = self._request(sp.HELLO, b"")
        self.protocol = hello.protocol
        self.firmware = hello.firmware
        self.device_id = hello.device_id.hex()

    # -- request / reply ----------------------------------------------------------------------
    def _request(self, op: int, body: bytes) -> Any:
        """Send one request and return its reply, parsed by the reply boundary
        (`serial_protocol.parse_reply`: a DeviceProtocolError for anything malformed); Any: the
        reply class `parse_reply` gives is the one of `op`."""
        with self._lock:
            self._req = (self._req + 1) & 0xFFFF or 1
            req_id = self._req
            try:
                self._ser.write(sp.encode_frame(op, req_id, body))
                self._ser.flush()
            except (serial.SerialException, OSError) as exc:
                raise KeystoreUnavailable(f"serial keystore at {self.port} disconnected while sending ({exc}); "
                                          "reconnect the device and restart the agent") from None
            rejected_before = self._reader.rejected
            deadline = time.monotonic() + self.timeout_s
            while time.monotonic() < deadline:
                try:
                    data = self._ser.read(self._ser.in_waiting or 1)
                except (serial.SerialException, OSError) as exc:
                    raise KeystoreUnavailable(f"serial keystore at {self.port} disconnected mid-request ({exc}); "
                                              "nothing was released; reconnect the device and restart the agent") from None
                for frame in self._reader.feed(data):
                    if frame.req_id != req_id:
                        continue  # a stale reply to an earlier request
                    reply = sp.parse_reply(op, frame)
                    if isinstance(reply, sp.DeviceError):
                        raise self._refusal(reply.code, reply.message)
                    return reply
            if self._reader.rejected > rejected_before:
                raise DeviceProtocolError(f"serial keystore at {self.port}: reply rejected ({self._reader.last_error}); "
                                    "line noise or a wrong baud rate — check the cable and the baud setting")
            raise DeviceTimeout(f"serial keystore at {self.port} did not answer within {self.timeout_s} s; "
                                "check that the device is powered and running the keystore firmware")

    def _refusal(self, code: int, msg: str) -> Exception:
        if code == sp.E_KEY_NOT_FOUND:
            return KeyNotFound(f"{msg}; generate it on the device first")
        if code == sp.E_KEY_EXISTS:
            return KeyExists(f"{msg}; keys are never overwritten on the device")
        if code == sp.E_BAD_ALG:
            return UnsupportedAlgorithm(msg)
        if code == sp.E_UNKNOWN_OP and "0x0" in msg and any(f"0x{o:02x}" in msg for o in (sp.SEAL_GENERATE, sp.SEAL, sp.UNSEAL)):
            return UnsupportedAlgorithm(f"the serial keystore at {self.port} ({self.firmware if hasattr(self, 'firmware') else '?'}) "
                                        "has no SEAL/UNSEAL commands: update its firmware (docs/keystore.md)")
        hint = _REFUSAL_HINT.get(code, "")
        name = sp.ERROR_NAMES.get(code, f"error {code}")
        return DeviceRefused(f"serial keystore refused ({name}): {msg}" + (f"; {hint}" if hint else ""), code)

    # -- Keystore -------------------------------------------------------------------------------
    def generate_key(self, name: str, alg: str, tag: Optional[bytes] = None) -> bytes:
        check_key_name(name)
        body = bytes([sp.ALG_CODES[check_alg(alg)]]) + sp.put_str(name)
        r = None
        if tag is not None:
            try:
                r = self._request(sp.GENERATE_TAGGED, body + sp.put_blob(check_tag(tag)))
            except DeviceRefused as exc:
                if exc.code != sp.E_UNKNOWN_OP:
                    raise
                # firmware from before tags refused the op before making anything: untagged then
                # (``key_tag`` says None; an init cut short there is told by its public key only)
        if r is None:
            r = self._request(sp.GENERATE, body)
        self._algs[name] = r.alg
        return r.public_key

    def key_tag(self, name: str) -> Optional[bytes]:
        try:
            return self._request(sp.KEY_TAG, sp.put_str(check_key_name(name))).data or None
        except DeviceRefused as exc:
            if exc.code != sp.E_UNKNOWN_OP:
                raise
            self.algorithm(name)   # firmware without tags: KeyNotFound still says so
            return None

    def _pub(self, name: str) -> tuple[str, bytes]:
        r = self._request(sp.PUBKEY, sp.put_str(check_key_name(name)))
        self._algs[name] = r.alg
        return r.alg, r.public_key

    def public_key(self, name: str) -> bytes:
        return self._pub(name)[1]

    def algorithm(self, name: str) -> str:
        return self._algs.get(name) or self._pub(name)[0]

    def key_names(self) -> list[str]:
        names = []
        for name, alg in self._request(sp.LIST, b"").keys:
            self._algs[name] = alg
            names.append(name)
        return sorted(names)

    def describe(self) -> dict[str, Any]:
        names = self.key_names()
        return {"kind": self.kind, "port": self.port, "baud": self.baud, "firmware": self.firmware,
                "device_id": self.device_id, "keys": {n: self._algs[n] for n in names}}

    def _sign(self, name: str, identity: Identity, data: bytes) -> bytes:
        body = sp.put_str(name) + sp.put_blob(identity.encode()) + sp.put_blob(data)
        r = self._request(sp.SIGN, body)
        self.last_counter = r.counter
        return r.signature

    # Seal keys live on the device (SEAL_GENERATE / SEAL / UNSEAL, docs/keystore.md): the agent's
    # data key is sealed there and only the device opens it.
    def generate_seal_key(self, name: str) -> None:
        self._request(sp.SEAL_GENERATE, sp.put_str(check_key_name(name)))

    def has_seal_key(self, name: str) -> bool:
        try:
            self._request(sp.UNSEAL, sp.put_str(check_key_name(name)) + sp.put_blob(b"") + sp.put_blob(b""))
        except KeyNotFound:
            return False
        except DeviceRefused as exc:
            if exc.code == sp.E_UNSEAL:
                return True
            raise
        return True

    def seal(self, name: str, plaintext: bytes, ad: bytes) -> bytes:
        if len(plaintext) > MAX_SEAL_BYTES:
            raise KeystoreError(f"seal takes at most {MAX_SEAL_BYTES} bytes (keys, not data)")
        return self._request(sp.SEAL, sp.put_str(check_key_name(name)) + sp.put_blob(ad) + sp.put_blob(plaintext)).data

    def unseal(self, name: str, sealed: bytes, ad: bytes) -> bytes:
        try:
            return self._request(sp.UNSEAL, sp.put_str(check_key_name(name)) + sp.put_blob(ad) + sp.put_blob(sealed)).data
        except DeviceRefused as exc:
            if exc.code == sp.E_UNSEAL:
                from .sealing import SealError
                raise SealError(f"the serial keystore at {self.port} cannot open this home's sealed data key "
                                "(another device's, or damaged)") from None
            raise

    def close(self) -> None:
        try:
            self._ser.close()
        except Exception:
            pass
