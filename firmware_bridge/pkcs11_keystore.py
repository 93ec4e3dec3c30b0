"""PKCS#11 keystore (python-pkcs11), e.g. SoftHSM2 or a hardware token (issue 5 item 4).

Keys are generated on the token (CKA_SENSITIVE, not CKA_EXTRACTABLE) and never leave it.  Ed25519
via CKM_EC_EDWARDS_KEY_PAIR_GEN / CKM_EDDSA; P-256 via CKM_ECDSA_SHA256 or CKM_ECDSA over a
SHA-256 digest.  The token chooses its own ECDSA nonces, which is why §22.5 forbids re-signing.
All token calls run in a worker process (pkcs11_worker.py; reasons there).
"""
from __future__ import annotations

import os
import struct
import subprocess
import sys
import threading
from typing import Any, Iterator, Optional, Sequence

import cbor2

from . import errors
from .errors import KeystoreError, KeystoreUnavailable
from .identity import Identity
from .keystore import MAX_SEAL_BYTES, Keystore, check_alg, check_key_name


SIGN_MANY_CHUNK = 64


def _worker_error(reply: dict[str, Any]) -> KeystoreError:
    """The worker names an errors.py class; anything else becomes a plain KeystoreError."""
    if reply["err"] == "SealError":
        from .sealing import SealError
        return SealError(reply["msg"])
    cls = getattr(errors, reply["err"], KeystoreError)
    if not (isinstance(cls, type) and issubclass(cls, KeystoreError)):
        cls = KeystoreError
    return cls(reply["msg"])


class Pkcs11Keystore(Keystore):
    kind = "pkcs11"
    verify_signatures = True

    def __init__(self, module: str, token_label: str, pin: str, env: Optional[dict[str, str]] = None) -> None:
        self.module = module
        self.token_label = token_label
        self._lock = threading.Lock()
        self._algs: dict[str, str] = {}
        if not os.path.exists(module):
            raise KeystoreUnavailable(f"PKCS#11 module {module} does not exist; install it (Debian: apt-get "
                                      "install softhsm2) or fix keystore.module in the profile")
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        penv = dict(os.environ, **(env or {}))
        penv["PYTHONPATH"] = pkg_root + os.pathsep + penv.get("PYTHONPATH", "")
        self._proc = subprocess.Popen([sys.executable, "-m", "firmware_bridge.pkcs11_worker"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=penv)
        try:
            self.info = self._call("open", module=module, token_label=token_label, pin=pin)
        except BaseException:
            self.close()
            raise

    def _call(self, op: str, **kw: Any) -> Any:
        with self._lock:
            self._send(op, kw)
            reply = self._recv(op)
        if "err" in reply:
            raise _worker_error(reply)
        return reply["ok"]

    def _send(self, op: str, kw: dict) -> None:
        """One request to the worker (the caller holds ``_lock`` until it has read every reply)."""
        proc = self._proc
        if proc is None or proc.poll() is not None:
            raise KeystoreUnavailable("the PKCS#11 worker process is not running; restart the agent")
        try:
            data = cbor2.dumps({"op": op, **kw})
            assert proc.stdin is not None
            proc.stdin.write(struct.pack(">I", len(data)) + data)
            proc.stdin.flush()
        except (OSError, ValueError):
            raise KeystoreUnavailable(f"the PKCS#11 worker for {self.module} died during {op}; "
                                      "check the token and restart the agent") from None

    def _recv(self, op: str) -> dict:
        proc = self._proc
        if proc is None:
            raise KeystoreUnavailable("the PKCS#11 worker process is not running; restart the agent")
        try:
            assert proc.stdout is not None
            head = proc.stdout.read(4)
            if len(head) < 4:
                raise EOFError
            return cbor2.loads(proc.stdout.read(struct.unpack(">I", head)[0]))
        except (OSError, EOFError, ValueError):
            raise KeystoreUnavailable(f"the PKCS#11 worker for {self.module} died during {op}; "
                                      "check the token and restart the agent") from None

    def generate_key(self, name: str, alg: str) -> bytes:
        pub = self._call("generate", name=check_key_name(name), alg=check_alg(alg))
        self._algs[name] = alg
        return bytes(pub)

    def _pub(self, name: str) -> tuple[str, bytes]:
        alg, pub = self._call("public", name=check_key_name(name))
        self._algs[name] = alg
        return alg, bytes(pub)

    def public_key(self, name: str) -> bytes:
        return self._pub(name)[1]

    def algorithm(self, name: str) -> str:
        return self._algs.get(name) or self._pub(name)[0]

    def key_names(self) -> list[str]:
        got = self._call("list")
        self._algs.update(got)
        return sorted(got)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "module": self.module, "token_label": self.token_label,
                "token_serial": self.info.get("token_serial"), "ecdsa": self.info.get("ecdsa_mechanism"),
                "keys": self._call("list")}

    def _sign(self, name: str, identity: Identity, data: bytes) -> bytes:
        return bytes(self._call("sign", name=name, alg=self.algorithm(name), data=data))

    def _sign_many(self, requests: Sequence[tuple[str, Identity, bytes]]) -> tuple[list[bytes], Optional[BaseException]]:
        sigs: list[bytes] = []
        chunks = self._sign_chunks(requests)
        try:
            for part in chunks:
                sigs.extend(part)
        except BaseException as exc:
            return sigs, exc
        finally:
            chunks.close()
        return sigs, None

    def _sign_chunks(self, requests: Sequence[tuple[str, Identity, bytes]]) -> Iterator[list[bytes]]:
        """A group commit's signatures in round trips of up to SIGN_MANY_CHUNK to the worker (the
        pipe round trip costs about as much as a SoftHSM2 signature); the token signs in order.
        The next chunk is sent before this one is yielded, so the token signs it while the bridge
        checks this one (an ES256 verification costs about as much as a SoftHSM2 signature: on
        two cores the two overlap). Nothing is signed that has no durable intent: every request
        here has one (the bridge's order, docs/keystore.md); after a failure or an early close the
        chunk in flight is read and dropped (its signatures stay unknown outcomes). The keystore's
        lock is held until the stream ends: the caller makes no other call on this keystore meanwhile."""
        try:
            reqs = [[name, self.algorithm(name), bytes(data)] for name, _, data in requests]
        except KeystoreError:   # reported at its position by the one-at-a-time loop
            sigs, failure = super()._sign_many(requests)
            if sigs:
                yield sigs
            if failure is not None:
                raise failure
            return
        parts = [reqs[i:i + SIGN_MANY_CHUNK] for i in range(0, len(reqs), SIGN_MANY_CHUNK)]
        if not parts:
            return
        with self._lock:
            self._send("sign_many", {"requests": parts[0]})
            in_flight = 1
            try:
                for k in range(len(parts)):
                    if k + 1 < len(parts):
                        self._send("sign_many", {"requests": parts[k + 1]})
                        in_flight += 1
                    got = self._recv("sign_many")
                    in_flight -= 1
                    if "ok" not in got:
                        raise _worker_error(got)
                    got = got["ok"]
                    sigs = [bytes(x) for x in got["sigs"]]
                    if sigs:
                        yield sigs
                    if "err" in got:
                        raise _worker_error(got)
            finally:
                self._drain(in_flight)

    def _drain(self, n: int) -> None:
        """Read and drop ``n`` replies in flight (a stopped stream); a worker that does not answer
        is stopped, so the next call reports it unavailable instead of reading a stale reply."""
        try:
            for _ in range(n):
                self._recv("sign_many")
        except KeystoreUnavailable:
            proc, self._proc = self._proc, None
            if proc is not None:
                proc.kill()
                proc.wait()

    # Seal keys: a non-extractable AES-256 key on the token, CKM_AES_GCM (pkcs11_worker.py).
    def generate_seal_key(self, name: str) -> None:
        self._call("seal_generate", name=check_key_name(name))

    def has_seal_key(self, name: str) -> bool:
        return bool(self._call("seal_has", name=check_key_name(name)))

    def seal(self, name: str, plaintext: bytes, ad: bytes) -> bytes:
        if len(plaintext) > MAX_SEAL_BYTES:
            raise KeystoreError(f"seal takes at most {MAX_SEAL_BYTES} bytes (keys, not data)")
        return bytes(self._call("seal", name=check_key_name(name), plaintext=bytes(plaintext), ad=bytes(ad)))

    def unseal(self, name: str, sealed: bytes, ad: bytes) -> bytes:
        return bytes(self._call("unseal", name=check_key_name(name), sealed=bytes(sealed), ad=bytes(ad)))

    def close(self) -> None:
        proc, self._proc = getattr(self, "_proc", None), None
        if proc is not None:
            try:
                if proc.stdin:
                    proc.stdin.close()
                proc.wait(timeout=5)
            except Exception:  # noqa: BLE001
                proc.kill()
                proc.wait()
