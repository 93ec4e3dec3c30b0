"""Reference firmware for the serial keystore device, runnable on the host as an emulator.

    python -m firmware_bridge.serial_device --port-link /tmp/ksdev --state DIR

creates a pseudo-terminal pair, links the host-side name to --port-link, prints
``READY <port>`` and serves the protocol of serial_protocol.py on it.

The device enforces SOVM §22.5 clause 2 on its own, against a buggy or compromised host: per key
it keeps a monotonic signature counter, the last event HLC signed per site_id and the last
receipt epoch signed per group_id, and refuses any identity at or below them.  Its state is made
durable *before* a signature leaves the device (persist-before-release, device side).

``DeviceCore`` is the firmware logic without I/O; ``main`` is the host-emulator shell.  What a
port to a microcontroller needs is listed in docs/keystore.md "Porting the firmware".
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import struct
import sys
import time
import tty
from typing import Optional

from . import serial_protocol as sp
from .errors import KeyExists, KeyNotFound, KeystoreError
from .fsutil import atomic_write
from .identity import DiscontinuityIdentity, EventIdentity, ReceiptIdentity, decode_identity
from .sealing import SealError
from .software import KeyDir, seal_with, unseal_with

FIRMWARE = "ssp-keystore-emulator/2"   # 2: GENERATE_TAGGED, KEY_TAG


class DeviceCore:
    """Request frame -> response frame.  State: key files + one JSON state file, both in ``state``."""

    def __init__(self, state_dir: str, *, sign_delay_s: float = 0.0, release: int = 2) -> None:
        self.state_dir = os.path.abspath(state_dir)
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        self.keys = KeyDir(os.path.join(self.state_dir, "keys"))
        self.state_path = os.path.join(self.state_dir, "device-state.json")
        self.sign_delay_s = sign_delay_s
        self.release = release   # 1: answers as the firmware before key tags did (a test option)
        self.device_id = self._device_id()
        self.state: dict = {"keys": {}}
        if os.path.exists(self.state_path):
            with open(self.state_path) as f:
                self.state = json.load(f)

    def _device_id(self) -> bytes:
        path = os.path.join(self.state_dir, "device-id")
        if not os.path.exists(path):
            atomic_write(path, os.urandom(8))
        with open(path, "rb") as f:
            return f.read()

    def handle(self, frame: sp.Frame) -> bytes:
        try:
            body = self._dispatch(frame.kind, sp.BodyReader(frame.body))
            return sp.encode_frame(frame.kind | sp.OK_BIT, frame.req_id, body)
        except _Refuse as r:
            return sp.encode_frame(sp.ERROR, frame.req_id, bytes([r.code]) + r.msg.encode()[:200])
        except sp.FrameError as exc:
            return sp.encode_frame(sp.ERROR, frame.req_id, bytes([sp.E_BAD_REQUEST]) + str(exc).encode())

    def _dispatch(self, op: int, r: sp.BodyReader) -> bytes:
        if self.release < 2 and op in (sp.GENERATE_TAGGED, sp.KEY_TAG):
            raise _Refuse(sp.E_UNKNOWN_OP, f"unknown op 0x{op:02x}")
        if op == sp.HELLO:
            r.end()
            return bytes([sp.VERSION]) + sp.put_str(FIRMWARE) + self.device_id
        if op == sp.LIST:
            r.end()
            names = self.keys.names()
            return bytes([len(names)]) + b"".join(
                bytes([sp.ALG_CODES[self.keys.get(n).alg]]) + sp.put_str(n) for n in names)
        if op in (sp.GENERATE, sp.GENERATE_TAGGED):
            alg_code, name = r.u8(), r.str()
            tag = r.blob() if op == sp.GENERATE_TAGGED else None
            r.end()
            if alg_code not in sp.ALG_NAMES:
                raise _Refuse(sp.E_BAD_ALG, f"unknown algorithm code {alg_code}")
            if tag is not None and not 1 <= len(tag) <= sp.MAX_TAG:
                raise _Refuse(sp.E_BAD_REQUEST, f"a key tag is 1 to {sp.MAX_TAG} bytes")
            try:
                key = self.keys.create(name, sp.ALG_NAMES[alg_code], tag)
            except KeyExists:
                raise _Refuse(sp.E_KEY_EXISTS, f"key {name!r} exists") from None
            except KeystoreError as exc:
                raise _Refuse(sp.E_BAD_REQUEST, str(exc)) from None
            return bytes([alg_code]) + sp.put_blob(key.public())
        if op == sp.PUBKEY:
            name = r.str()
            r.end()
            key = self._key(name)
            return bytes([sp.ALG_CODES[key.alg]]) + sp.put_blob(key.public())
        if op == sp.KEY_TAG:
            name = r.str()
            r.end()
            self._key(name)
            return sp.put_blob(self.keys.tag(name) or b"")
        if op == sp.SIGN:
            name, ident_raw, data = r.str(), r.blob(), r.blob()
            r.end()
            return self._sign(name, ident_raw, data)
        if op == sp.SEAL_GENERATE:
            name = r.str()
            r.end()
            try:
                self.keys.create_seal(name)
            except KeyExists:
                raise _Refuse(sp.E_KEY_EXISTS, f"seal key {name!r} exists") from None
            except KeystoreError as exc:
                raise _Refuse(sp.E_BAD_REQUEST, str(exc)) from None
            return b""
        if op in (sp.SEAL, sp.UNSEAL):
            name, ad, data = r.str(), r.blob(), r.blob()
            r.end()
            try:
                secret = self.keys.get_seal(name)
            except KeyNotFound:
                raise _Refuse(sp.E_KEY_NOT_FOUND, f"no seal key {name!r} on device") from None
            except KeystoreError as exc:
                raise _Refuse(sp.E_BAD_REQUEST, str(exc)) from None
            try:
                out = seal_with(secret, data, ad) if op == sp.SEAL else unseal_with(secret, data, ad)
            except SealError:
                raise _Refuse(sp.E_UNSEAL, "sealed data does not open") from None
            except KeystoreError as exc:
                raise _Refuse(sp.E_TOO_LARGE, str(exc)) from None
            return sp.put_blob(out)
        raise _Refuse(sp.E_UNKNOWN_OP, f"unknown op 0x{op:02x}")

    def _key(self, name: str):  # type: ignore[no-untyped-def]
        try:
            return self.keys.get(name)
        except KeyNotFound:
            raise _Refuse(sp.E_KEY_NOT_FOUND, f"no key {name!r} on device") from None
        except KeystoreError as exc:
            raise _Refuse(sp.E_BAD_REQUEST, str(exc)) from None

    def _sign(self, name: str, ident_raw: bytes, data: bytes) -> bytes:
        key = self._key(name)
        try:
            identity = decode_identity(ident_raw)
        except ValueError:
            raise _Refuse(sp.E_BAD_REQUEST, "malformed identity") from None
        want = "ed25519" if isinstance(identity, EventIdentity) else "p256"
        if key.alg != want:
            raise _Refuse(sp.E_WRONG_KEY_FOR_IDENTITY, f"key {name!r} is {key.alg}, identity needs {want}")
        ks = self.state["keys"].setdefault(name, {"counter": 0, "events": {}, "receipts": {}})
        # §22.5 clause 2, enforced by the device: never a second signature for one identity,
        # and never one at or below the last signed identity of its kind.
        if isinstance(identity, EventIdentity):
            last = ks["events"].get(identity.site_id.hex())
            if last is not None and tuple(last) >= identity.hlc:
                code = sp.E_ALREADY_SIGNED if tuple(last) == identity.hlc else sp.E_NOT_MONOTONIC
                raise _Refuse(code, f"{identity}: last signed HLC is {last[0]}.{last[1]}")
            ks["events"][identity.site_id.hex()] = list(identity.hlc)
        elif isinstance(identity, ReceiptIdentity):
            last_e = ks["receipts"].get(identity.group_id.hex())
            if last_e is not None and last_e >= identity.epoch:
                code = sp.E_ALREADY_SIGNED if last_e == identity.epoch else sp.E_NOT_MONOTONIC
                raise _Refuse(code, f"{identity}: last signed epoch is {last_e}")
            ks["receipts"][identity.group_id.hex()] = identity.epoch
        elif isinstance(identity, DiscontinuityIdentity):
            # a statement of absence (§22.6): its own counter per group, on (epoch, attempt)
            table = ks.setdefault("discontinuities", {})
            last_d = table.get(identity.group_id.hex())
            here = [identity.epoch, identity.attempt]
            if last_d is not None and list(last_d) >= here:
                code = sp.E_ALREADY_SIGNED if list(last_d) == here else sp.E_NOT_MONOTONIC
                raise _Refuse(code, f"{identity}: last signed statement is {last_d[0]}.{last_d[1]}")
            table[identity.group_id.hex()] = here
        ks["counter"] += 1
        try:  # durable before the signature leaves the device
            atomic_write(self.state_path, json.dumps(self.state, sort_keys=True).encode())
        except OSError as exc:
            with open(self.state_path) as f:  # roll back the in-memory state to what is durable
                self.state = json.load(f) if os.path.getsize(self.state_path) else {"keys": {}}
            raise _Refuse(sp.E_STORAGE, f"cannot persist counter: {exc.strerror}") from None
        if self.sign_delay_s:
            time.sleep(self.sign_delay_s)  # emulates a slow secure element (tests unplug here)
        sig = key.sign(data)
        return struct.pack(">Q", ks["counter"]) + sp.put_blob(sig)


class _Refuse(Exception):
    def __init__(self, code: int, msg: str) -> None:
        super().__init__(msg)
        self.code = code
        self.msg = msg


def serve(master_fd: int, core: DeviceCore, *, corrupt_ops: frozenset[int] = frozenset()) -> None:
    reader = sp.FrameReader()
    while True:
        try:
            data = os.read(master_fd, 4096)
        except OSError:  # EIO: no slave open; keep waiting for the host to reopen
            time.sleep(0.01)
            continue
        if not data:
            time.sleep(0.01)
            continue
        for frame in reader.feed(data):
            out = core.handle(frame)
            if frame.kind in corrupt_ops:  # test option: line noise on this reply
                mid = len(out) // 2
                out = out[:mid] + bytes([out[mid] ^ 0x10 or 0x01]) + out[mid + 1:]  # line noise
            os.write(master_fd, out)


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(description="Serial keystore device emulator (reference firmware)")
    ap.add_argument("--port-link", required=True, help="path of a symlink to the host-side pty")
    ap.add_argument("--state", required=True, help="directory holding the device's keys and counters")
    ap.add_argument("--sign-delay-s", type=float, default=0.0, help="test option: delay before signing")
    ap.add_argument("--release", type=int, default=2, choices=[1, 2],
                    help="test option: 1 answers as the firmware before key tags (no GENERATE_TAGGED, KEY_TAG)")
    ap.add_argument("--corrupt-op", action="append", default=[], choices=["hello", "generate", "pubkey", "sign", "list",
                                                                       "seal_generate", "seal", "unseal",
                                                                       "generate_tagged", "key_tag"],
                    help="test option: flip a bit in every reply to this op (line noise)")
    args = ap.parse_args(argv)
    core = DeviceCore(args.state, sign_delay_s=args.sign_delay_s, release=args.release)
    master, slave = os.openpty()
    tty.setraw(slave)
    name = os.ttyname(slave)
    tmp = args.port_link + ".tmp"
    if os.path.lexists(tmp):
        os.unlink(tmp)
    os.symlink(name, tmp)
    os.replace(tmp, args.port_link)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"READY {name}", flush=True)
    try:
        serve(master, core, corrupt_ops=frozenset(getattr(sp, o.upper()) for o in args.corrupt_op))  # keeps ``slave`` open: no EIO between hosts
    finally:
        try:
            os.unlink(args.port_link)
        except OSError:
            pass


if __name__ == "__main__":
    main()
