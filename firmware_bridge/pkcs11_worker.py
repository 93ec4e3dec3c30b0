"""PKCS#11 worker process: owns the module, the token session and the login.

Run by Pkcs11Keystore as ``python -m firmware_bridge.pkcs11_worker``; it speaks length-prefixed
CBOR over stdin/stdout.  A separate process because python-pkcs11 loads one module per process and
C_Initialize reads its configuration (e.g. SOFTHSM2_CONF) once, and so a hung or crashed token
library cannot take the agent down with it.  The PIN arrives on the pipe, never on argv.

``--copies FD``: a pipe to the keystore's verifier process (verify_worker.py). A ``sign_many``
request with ``copy`` set sends, besides its reply, a copy of each P-256 item's (key name, SHA-256
digest, signature) there, so the signatures are verified while the keystore's process does other
work (docs/keystore.md "Verified in a verifier process"). The copy is written without blocking:
when the verifier does not keep up (or died) the worker stops copying for good and says so in
its replies (``copied`` false); the keystore then verifies in its own process. Signing never
waits for the verifier.

``--cancel FD``: batch numbers (u64) written by the verifier or the keystore's process when a
signature of that batch failed verification; read without blocking before each chunk, whose batch
is then answered unsigned, like the rest of a batch that failed at the token.
"""
from __future__ import annotations

import collections
import hashlib
import os
import struct
import sys
from typing import Any, BinaryIO, Optional

import cbor2

ED25519_OID = "1.3.101.112"


def _unwrap_point(data: bytes) -> bytes:
    """EC_POINT is usually a DER OCTET STRING around the point; accept both forms."""
    if len(data) >= 2 and data[0] == 0x04 and data[1] == len(data) - 2 and len(data) in (34, 67):
        return bytes(data[2:])
    return bytes(data)


class Worker:
    def __init__(self, copies: Optional[int] = None, cancel: Optional[int] = None) -> None:
        self.copies = copies   # the verifier's pipe (non-blocking), None when there is none or it failed
        self.cancel = cancel   # batch numbers whose signature failed verification (non-blocking)
        self.cancel_buf = b""
        # batches that failed (at the token, or a signature did not verify): their later chunks are
        # not signed. Batches are numbered upwards and queue in order: the last few suffice.
        self.failed: collections.deque = collections.deque(maxlen=16)
        self.session: Any = None
        self.info: dict[str, Any] = {}
        self._keys: dict[str, Any] = {}  # private key handles by label (find once)

    def op_open(self, module: str, token_label: str, pin: str) -> dict[str, Any]:
        import pkcs11
        try:
            lib = pkcs11.lib(module)
        except Exception as exc:  # noqa: BLE001 - the binding raises several types here
            raise _Err("KeystoreUnavailable", f"cannot load PKCS#11 module {module}: {exc}; check the path "
                       "(Debian: apt-get install softhsm2 puts it in /usr/lib/softhsm/libsofthsm2.so)")
        try:
            token = lib.get_token(token_label=token_label)
        except pkcs11.NoSuchToken:
            labels = []
            try:
                labels = [t for t in (s.get_token().label for s in lib.get_slots(token_present=True)) if t]
            except Exception:  # noqa: BLE001
                pass
            raise _Err("KeystoreUnavailable", f"no token labelled {token_label!r} in {module} (present: "
                       f"{', '.join(labels) or 'none'}); insert the token or initialise it "
                       "(softhsm2-util --init-token --free --label ...)")
        try:
            self.session = token.open(user_pin=pin, rw=True)
        except pkcs11.PinIncorrect:
            raise _Err("WrongPin", f"token {token_label!r} rejected the PIN; check the keystore PIN in the "
                       "profile (repeated failures may lock the token)")
        except pkcs11.PinLocked:
            raise _Err("KeystoreUnavailable", f"token {token_label!r} has its user PIN locked; unlock it with the SO PIN")
        mechs = set(token.slot.get_mechanisms())
        self.ecdsa_sha256 = pkcs11.Mechanism.ECDSA_SHA256 in mechs
        self.info = {"token_label": token.label, "token_serial": token.serial.decode(errors="replace").strip()
                     if isinstance(token.serial, bytes) else str(token.serial),
                     "manufacturer": str(token.manufacturer_id).strip(),
                     "eddsa": pkcs11.Mechanism.EDDSA in mechs or not mechs,
                     "ecdsa_mechanism": "CKM_ECDSA_SHA256" if self.ecdsa_sha256 else "CKM_ECDSA over SHA-256"}
        return self.info

    def _private(self, name: str) -> Any:
        import pkcs11
        from pkcs11 import ObjectClass
        if name in self._keys:
            return self._keys[name]
        try:
            key = self._keys[name] = self.session.get_key(object_class=ObjectClass.PRIVATE_KEY, label=name)
            return key
        except pkcs11.NoSuchKey:
            raise _Err("KeyNotFound", f"no private key labelled {name!r} on the token; generate it first")
        except pkcs11.MultipleObjectsReturned:
            raise _Err("KeystoreError", f"several private keys labelled {name!r} on the token; remove the duplicates")

    def _public(self, name: str) -> tuple[str, bytes]:
        import pkcs11
        from pkcs11 import Attribute, KeyType, ObjectClass
        try:
            pub = self.session.get_key(object_class=ObjectClass.PUBLIC_KEY, label=name)
        except pkcs11.NoSuchKey:
            raise _Err("KeyNotFound", f"no key labelled {name!r} on the token; generate it first")
        point = _unwrap_point(pub[Attribute.EC_POINT])
        if pub.key_type == KeyType.EC_EDWARDS:
            return "ed25519", point
        from .ec import compress_point
        return "p256", compress_point(point)

    def op_key_attributes(self, name: str) -> dict[str, bool]:
        from pkcs11 import Attribute
        key = self._private(name)
        return {"sensitive": bool(key[Attribute.SENSITIVE]), "extractable": bool(key[Attribute.EXTRACTABLE]),
                "never_extractable": bool(key[Attribute.NEVER_EXTRACTABLE]), "local": bool(key[Attribute.LOCAL])}

    def op_public(self, name: str) -> list[Any]:
        alg, pub = self._public(name)
        return [alg, pub]

    def op_list(self) -> dict[str, str]:
        from pkcs11 import Attribute, KeyType, ObjectClass
        out = {}
        for obj in self.session.get_objects({Attribute.CLASS: ObjectClass.PRIVATE_KEY}):
            out[obj.label] = "ed25519" if obj.key_type == KeyType.EC_EDWARDS else "p256"
        return out

    def op_key_tag(self, name: str) -> bytes:
        from pkcs11 import Attribute
        return bytes(self._private(name)[Attribute.ID])

    def op_generate(self, name: str, alg: str, tag: Optional[bytes] = None) -> bytes:
        import pkcs11
        from pkcs11 import Attribute, KeyType, Mechanism
        from pkcs11.util.ec import encode_named_curve_parameters
        try:
            self._private(name)
            raise _Err("KeyExists", f"a key labelled {name!r} already exists on the token; keys are never overwritten")
        except _Err as e:
            if e.cls != "KeyNotFound":
                raise
        # CKA_ID: the caller's tag, durable on its side before this (Keystore.generate_key), by
        # which an init killed before it learnt the public key knows the key for its own
        key_id = bytes(tag) if tag else name.encode()
        priv_t = {Attribute.SENSITIVE: True, Attribute.EXTRACTABLE: False, Attribute.SIGN: True,
                  Attribute.TOKEN: True, Attribute.PRIVATE: True, Attribute.ID: key_id}
        pub_t = {Attribute.VERIFY: True, Attribute.TOKEN: True, Attribute.ID: key_id}
        try:
            if alg == "ed25519":
                pub_t[Attribute.EC_PARAMS] = encode_named_curve_parameters(ED25519_OID)
                self.session.generate_keypair(KeyType.EC_EDWARDS, mechanism=Mechanism.EC_EDWARDS_KEY_PAIR_GEN,
                                              store=True, label=name, public_template=pub_t, private_template=priv_t)
            else:
                params = self.session.create_domain_parameters(
                    KeyType.EC, {Attribute.EC_PARAMS: encode_named_curve_parameters("secp256r1")}, local=True)
                params.generate_keypair(store=True, label=name, public_template=pub_t, private_template=priv_t)
        except (pkcs11.MechanismInvalid, pkcs11.DomainParamsInvalid, pkcs11.FunctionNotSupported) as exc:
            raise _Err("UnsupportedAlgorithm", f"the token cannot generate {alg} keys ({type(exc).__name__}); "
                       "EdDSA needs SoftHSM >= 2.6 built with OpenSSL >= 1.1.1, or a token with CKM_EDDSA")
        return self._public(name)[1]

    def op_sign(self, name: str, alg: str, data: bytes, digest: Optional[bytes] = None) -> bytes:
        from pkcs11 import Mechanism
        key = self._private(name)
        if alg == "ed25519":
            return bytes(key.sign(data, mechanism=Mechanism.EDDSA))
        if self.ecdsa_sha256:
            return bytes(key.sign(data, mechanism=Mechanism.ECDSA_SHA256))
        # CKM_ECDSA over the SHA-256 digest; PKCS#11 returns raw r||s, as COSE ES256 wants
        return bytes(key.sign(digest or hashlib.sha256(data).digest(), mechanism=Mechanism.ECDSA))

    def op_sign_many(self, requests: list[list[Any]], copy: bool = False, seq: int = 0,
                     batch: Any = None) -> dict[str, Any]:
        """[[name, alg, data], ...] in one round trip (the bridge's group commit); signs in order and
        stops at the first failure: {"sigs": [...]} plus "err"/"msg" when one failed. With ``copy``
        (P-256 items only) the (name, digest, signature) of each signed item also go to the
        verifier, numbered ``seq``; "copied" says whether they did. ``batch``: the keystore's batch
        the chunk belongs to; once one of its chunks failed, its later chunks (already queued
        here) are answered unsigned: the batch ends at its first failure, and each signature
        would only burn an identity as an unknown outcome."""
        if batch is not None and batch in self._failed():
            return {"sigs": [], "err": "KeystoreError", "skipped": True,
                    "msg": "not signed: an earlier chunk of this batch failed"}
        copy = copy and self.copies is not None and all(alg == "p256" for _, alg, _ in requests)
        sigs: list[bytes] = []
        items: list[tuple[bytes, bytes, bytes]] = []
        out: dict[str, Any] = {"sigs": sigs}
        for name, alg, data in requests:
            try:
                if copy:
                    digest = hashlib.sha256(data).digest()
                    sig = self.op_sign(name, alg, data, digest)
                    items.append((name.encode(), digest, sig))
                else:
                    sig = self.op_sign(name, alg, data)
                sigs.append(sig)
            except _Err as e:
                out.update(err=e.cls, msg=e.msg)
                self.failed.append(batch)
                break
            except Exception as e:  # noqa: BLE001 - same report as a single sign
                out.update(err="KeystoreError", msg=f"PKCS#11 sign failed: {type(e).__name__}: {e}")
                self.failed.append(batch)
                break
        if copy and items:
            out["copied"] = self._copy(seq, batch or 0, items)
        return out

    def _failed(self) -> collections.deque:
        """The failed batches, with the cancellations that arrived (read without blocking)."""
        if self.cancel is not None:
            try:
                while True:
                    got = os.read(self.cancel, 4096)
                    if not got:   # every writer gone: no more cancellations
                        os.close(self.cancel)
                        self.cancel = None
                        break
                    buf = self.cancel_buf + got
                    n = len(buf) // 8 * 8
                    self.failed.extend(struct.unpack(f">{n // 8}Q", buf[:n]))
                    self.cancel_buf = buf[n:]
            except BlockingIOError:
                pass
        return self.failed

    def _copy(self, seq: int, batch: int, items: list[tuple[bytes, bytes, bytes]]) -> bool:
        """One copy to the verifier, written without blocking. A full pipe (the verifier is far
        behind or stopped) or a broken one (it died) ends copying for good: the verifier sees the
        end of its input (after a partial copy, if any) and exits."""
        from .verify_worker import encode_items
        body = encode_items(items)
        data = memoryview(struct.pack(">IQQ", len(body) + 16, seq, batch) + body)
        copies = self.copies
        assert copies is not None  # a copy is made only with the pipe
        try:
            while data:
                data = data[os.write(copies, data):]
            return True
        except OSError:   # BlockingIOError, BrokenPipeError
            os.close(copies)
            self.copies = None
            return False


    # -- seal keys (firmware_bridge/sealing.py): an AES-256 key generated on the token, sensitive and
    # never extractable; sealing is CKM_AES_GCM with a random 96-bit IV and the caller's associated
    # data (one seal per data key: IV collisions are not a concern at that rate).
    def _seal_key(self, name: str) -> Any:
        import pkcs11
        from pkcs11 import ObjectClass
        key = self._keys.get("seal:" + name)
        if key is not None:
            return key
        try:
            key = self._keys["seal:" + name] = self.session.get_key(object_class=ObjectClass.SECRET_KEY, label=name)
            return key
        except pkcs11.NoSuchKey:
            raise _Err("KeyNotFound", f"no seal key labelled {name!r} on the token (this home's data key was "
                       "sealed by another token, or the key was deleted)")
        except pkcs11.MultipleObjectsReturned:
            raise _Err("KeystoreError", f"several secret keys labelled {name!r} on the token; remove the duplicates")

    def op_seal_has(self, name: str) -> bool:
        try:
            self._seal_key(name)
            return True
        except _Err as e:
            if e.cls == "KeyNotFound":
                return False
            raise

    def op_seal_generate(self, name: str) -> bool:
        from pkcs11 import Attribute, KeyType
        if self.op_seal_has(name):
            raise _Err("KeyExists", f"a seal key labelled {name!r} already exists on the token; keys are never overwritten")
        self._keys["seal:" + name] = self.session.generate_key(
            KeyType.AES, 256, label=name, store=True,
            template={Attribute.SENSITIVE: True, Attribute.EXTRACTABLE: False, Attribute.ENCRYPT: True,
                      Attribute.DECRYPT: True, Attribute.TOKEN: True, Attribute.PRIVATE: True,
                      Attribute.ID: name.encode()})
        return True

    def op_seal_attributes(self, name: str) -> dict[str, bool]:
        from pkcs11 import Attribute
        key = self._seal_key(name)
        return {"sensitive": bool(key[Attribute.SENSITIVE]), "extractable": bool(key[Attribute.EXTRACTABLE]),
                "never_extractable": bool(key[Attribute.NEVER_EXTRACTABLE])}

    @staticmethod
    def _gcm(iv: bytes, ad: bytes) -> Any:
        try:
            from pkcs11.mechanisms import GCMParams   # python-pkcs11 >= 0.9
            return GCMParams(iv, ad, 128)
        except ImportError:
            return (iv, ad, 128)

    def op_seal(self, name: str, plaintext: bytes, ad: bytes) -> bytes:
        import os
        from pkcs11 import Mechanism
        iv = os.urandom(12)
        return iv + bytes(self._seal_key(name).encrypt(bytes(plaintext), mechanism=Mechanism.AES_GCM,
                                                       mechanism_param=self._gcm(iv, bytes(ad))))

    def op_unseal(self, name: str, sealed: bytes, ad: bytes) -> bytes:
        from pkcs11 import Mechanism
        key = self._seal_key(name)
        if len(sealed) < 12 + 16:
            raise _Err("SealError", "sealed data too short")
        try:
            return bytes(key.decrypt(bytes(sealed[12:]), mechanism=Mechanism.AES_GCM,
                                     mechanism_param=self._gcm(bytes(sealed[:12]), bytes(ad))))
        except Exception:  # noqa: BLE001 - a failed GCM tag check surfaces as several binding errors
            raise _Err("SealError", "sealed data does not open under this token's seal key (another token's, "
                       "or damaged)")


class _Err(Exception):
    def __init__(self, cls: str, msg: str) -> None:
        super().__init__(msg)
        self.cls = cls
        self.msg = msg


def read_msg(f: BinaryIO) -> Any:
    head = f.read(4)
    if len(head) < 4:
        return None
    (n,) = struct.unpack(">I", head)
    return cbor2.loads(f.read(n))


def write_msg(f: BinaryIO, obj: Any) -> None:
    data = cbor2.dumps(obj)
    f.write(struct.pack(">I", len(data)) + data)
    f.flush()


def main(argv: list[str], worker_cls: type = Worker) -> None:
    """``worker_cls``: a test seam (tests/bridge/faulty_pkcs11_worker.py, a token returning a bad
    signature); ``python -m firmware_bridge.pkcs11_worker`` always runs ``Worker``."""
    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing else may write to the message pipe
    fds: dict[str, Optional[int]] = {"--copies": None, "--cancel": None}
    for opt, fd in zip(argv[::2], argv[1::2]):
        fds[opt] = int(fd)
        os.set_blocking(int(fd), False)
    worker = worker_cls(fds["--copies"], fds["--cancel"])
    while True:
        msg = read_msg(inp)
        if msg is None:
            return
        op = msg.pop("op")
        try:
            write_msg(out, {"ok": getattr(worker, "op_" + op)(**msg)})
        except _Err as e:
            write_msg(out, {"err": e.cls, "msg": e.msg})
        except Exception as e:  # noqa: BLE001 - reported to the host, never silently dropped
            write_msg(out, {"err": "KeystoreError", "msg": f"PKCS#11 {op} failed: {type(e).__name__}: {e}"})


if __name__ == "__main__":
    main(sys.argv[1:])
