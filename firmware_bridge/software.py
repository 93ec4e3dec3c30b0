"""Software keystore: one key file per key in a directory ("software").

For development and devices without hardware.  Key files are written whole under a temporary
name and linked into place (never over an existing one, never seen half-written), mode 0600, the
directory with 0700; files readable by group/other are refused, as ssh does.  P-256 signs with
deterministic RFC 6979 nonces, which the substrate profile requires of software signers (§22.5).
Key material is never logged or put in an exception message.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import nacl.bindings
import nacl.exceptions
import nacl.signing

from .errors import KeyExists, KeyNotFound, KeystoreError, KeystoreUnavailable
from .fsutil import fsync_dir
from .identity import Identity
from .keystore import MAX_SEAL_BYTES, Keystore, check_alg, check_key_name, check_tag

if TYPE_CHECKING:   # imported where first used: an Ed25519-only node never loads them
    from concurrent.futures import ThreadPoolExecutor

    from cryptography.hazmat.primitives.asymmetric import ec

_SUFFIX = ".key"
# link(2) refused by a filesystem without hard links (FAT, exFAT: an authority on a USB stick)
_NO_HARD_LINKS = frozenset(getattr(errno, n) for n in ("EPERM", "EOPNOTSUPP", "ENOTSUP", "EMLINK") if hasattr(errno, n))
_SEAL_SUFFIX = ".seal"   # seal keys (firmware_bridge/sealing.py): their own namespace, never signing keys


# A group commit of at least this many Ed25519 signatures is split across worker threads:
# libsodium releases the GIL, so on a multi-core Pi the signatures of one batch run in parallel.
PARALLEL_MIN = 64
# A pipelined P-256 batch of at least this many goes to the key's signing process (sign_worker.py):
# cryptography's P-256 sign holds the GIL, so only a second process signs beside this one.
PROCESS_MIN = 16


class _Key:
    __slots__ = ("alg", "ed", "ed_sk", "p256")

    def __init__(self, alg: str, secret: bytes) -> None:
        self.alg = alg
        self.ed = nacl.signing.SigningKey(secret) if alg == "ed25519" else None
        # libsodium's 64-byte secret (seed || public key) for crypto_sign, built once per key
        self.ed_sk = nacl.bindings.crypto_sign_seed_keypair(secret)[1] if alg == "ed25519" else None
        self.p256 = _p256_private(secret) if alg == "p256" else None

    def public(self) -> bytes:
        if self.ed is not None:
            return bytes(self.ed.verify_key)
        assert self.p256 is not None
        from .ec import public_key_compressed
        return public_key_compressed(self.p256.public_key())

    def sign(self, data: bytes) -> bytes:
        if self.ed_sk is not None:
            return nacl.bindings.crypto_sign(data, self.ed_sk)[:64]
        assert self.p256 is not None
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec

        from .ec import der_to_raw
        return der_to_raw(self.p256.sign(data, ec.ECDSA(hashes.SHA256(), deterministic_signing=True)))

    def __repr__(self) -> str:  # never show the secret
        return f"<key {self.alg}>"


def _p256_private(secret: bytes) -> ec.EllipticCurvePrivateKey:
    # cryptography only where P-256 is used (an Ed25519-only node never loads it)
    from cryptography.hazmat.primitives.asymmetric import ec
    return ec.derive_private_key(int.from_bytes(secret, "big"), ec.SECP256R1())


def new_secret(alg: str) -> bytes:
    if alg == "ed25519":
        return bytes(nacl.signing.SigningKey.generate())
    from cryptography.hazmat.primitives.asymmetric import ec
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

    def create(self, name: str, alg: str, tag: Optional[bytes] = None) -> _Key:
        check_alg(alg)
        path = self._file(name)
        secret = new_secret(alg)
        doc = {"format": "ssp-key-v1", "alg": alg, "secret": secret.hex()}
        if tag:   # Keystore.generate_key's tag, kept beside the key (readers before it ignore the field)
            doc["tag"] = bytes(tag).hex()
        body = json.dumps(doc).encode()
        with self._lock:
            self._write_new(path, body, "key file",
                            f"key {name!r} already exists in {self.path}; keys are never overwritten "
                            "— choose another name or remove the file deliberately")
            key = _Key(alg, secret)
            self._cache[name] = key
            return key

    def get(self, name: str) -> _Key:
        key = self._cache.get(name)
        if key is not None:
            return key
        path = self._file(name)
        with self._lock:
            raw = _read_private(path, "key file", name, 1 << 16,
                                lambda: f"no key {name!r} in {self.path}; generate it first "
                                        f"(known keys: {', '.join(self.names()) or 'none'})")
            try:
                doc = json.loads(raw)
                if doc.get("format") != "ssp-key-v1":
                    raise ValueError
                key = _Key(check_alg(doc["alg"]), bytes.fromhex(doc["secret"]))
            except (ValueError, KeyError, TypeError):
                raise KeystoreError(f"key file {path} is not a valid ssp-key-v1 file; restore it from backup") from None
            self._cache[name] = key
            return key

    def tag(self, name: str) -> Optional[bytes]:
        """The tag key ``name`` was created with, or None (none given, or a file from before tags)."""
        self.get(name)      # KeyNotFound, or a damaged file, as for any use of the key
        raw = _read_private(self._file(name), "key file", name, 1 << 16, lambda: f"no key {name!r} in {self.path}")
        tag = json.loads(raw).get("tag")
        try:
            return bytes.fromhex(tag) if isinstance(tag, str) and tag else None
        except ValueError:
            return None

    # -- seal keys: 32 random bytes, XChaCha20-Poly1305 (sealing.py); same file rules as signing keys
    def _seal_file(self, name: str) -> str:
        return os.path.join(self.path, check_key_name(name) + _SEAL_SUFFIX)

    def create_seal(self, name: str) -> bytes:
        path = self._seal_file(name)
        secret = os.urandom(32)
        body = json.dumps({"format": "ssp-seal-key-v1", "secret": secret.hex()}).encode()
        with self._lock:
            self._write_new(path, body, "seal key file",
                            f"seal key {name!r} already exists in {self.path}; keys are never overwritten")
        return secret

    def _write_new(self, path: str, body: bytes, what: str, exists: str) -> None:
        """Create a key file (0600, never over an existing one) and make it and its name durable.
        It is written whole under a temporary name first and then linked into place (a link never
        replaces a file): a kill before the link leaves no key file, where creating the file in
        place left an empty one after a kill between its creation and its write, a key no later
        use could read and no later init could replace."""
        if os.path.lexists(path):
            raise KeyExists(exists)
        tmp = f"{path}.new-{os.getpid()}-{os.urandom(4).hex()}"   # not a key name: names() skips it
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, body)
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise KeyExists(exists) from None
            except OSError as exc:
                if exc.errno not in _NO_HARD_LINKS:
                    raise
                self._create_in_place(path, body, exists)   # FAT (a USB stick): no hard links
        except OSError as exc:
            raise KeystoreUnavailable(f"cannot create {what} in {self.path}: {exc.strerror}") from None
        finally:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        fsync_dir(self.path)

    @staticmethod
    def _create_in_place(path: str, body: bytes, exists: str) -> None:
        """Where the filesystem has no hard links: the file created in place (O_EXCL) and then
        written, so a kill between the two can leave it empty there (docs/keystore.md)."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            raise KeyExists(exists) from None
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)

    def has_seal(self, name: str) -> bool:
        return os.path.exists(self._seal_file(name))

    def delete_seal(self, name: str) -> bool:
        """Overwrite the seal key file with zeros (durably), then remove it and make that durable:
        the key is in no file afterwards (a flash card's wear levelling may still keep old blocks).
        False when there is no such file."""
        path = self._seal_file(name)
        with self._lock:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)
            except FileNotFoundError:
                return False
            try:
                os.write(fd, bytes(os.fstat(fd).st_size))
                os.fsync(fd)
            finally:
                os.close(fd)
            os.unlink(path)
            fsync_dir(self.path)
        return True

    def get_seal(self, name: str) -> bytes:
        path = self._seal_file(name)
        raw = _read_private(path, "seal key file", name, 1 << 12,
                            lambda: f"no seal key {name!r} in {self.path} (the key file {os.path.basename(path)} "
                                    "is missing: the keystore of this home is not this one)")
        try:
            doc = json.loads(raw)
            if doc.get("format") != "ssp-seal-key-v1":
                raise ValueError
            secret = bytes.fromhex(doc["secret"])
            if len(secret) != 32:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise KeystoreError(f"seal key file {path} is not a valid ssp-seal-key-v1 file; restore it from backup") from None
        return secret


def _read_private(path: str, what: str, name: str, limit: int, missing: Callable[[], str]) -> bytes:
    """A key file's bytes: never through a symlink, refused when group or others can reach it
    (the file is the key); `missing()` says what to do when it is absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise KeyNotFound(missing()) from None
    except OSError as exc:
        raise KeystoreUnavailable(f"cannot open {what} for {name!r}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise KeystoreError(f"{what} {path} is accessible by group/other "
                                f"(mode {stat.S_IMODE(st.st_mode):o}); run: chmod 600 {path}")
        return os.read(fd, limit)
    finally:
        os.close(fd)


def seal_with(secret: bytes, plaintext: bytes, ad: bytes) -> bytes:
    """nonce (24) | XChaCha20-Poly1305(plaintext, ad): the software keystore's and the serial
    device emulator's seal (a microcontroller port may use any AEAD: only the device opens it)."""
    if len(plaintext) > MAX_SEAL_BYTES:
        raise KeystoreError(f"seal takes at most {MAX_SEAL_BYTES} bytes (keys, not data)")
    nonce = os.urandom(24)
    return nonce + nacl.bindings.crypto_aead_xchacha20poly1305_ietf_encrypt(plaintext, ad, nonce, secret)


def unseal_with(secret: bytes, sealed: bytes, ad: bytes) -> bytes:
    from .sealing import SealError
    if len(sealed) < 24 + 16:
        raise SealError("sealed data too short")
    try:
        return nacl.bindings.crypto_aead_xchacha20poly1305_ietf_decrypt(sealed[24:], ad, sealed[:24], secret)
    except nacl.exceptions.CryptoError:
        raise SealError("sealed data does not open under this keystore's seal key (another keystore's, "
                        "or damaged)") from None


class SoftwareKeystore(Keystore):
    kind = "software"
    # in-process keys: a returned signature is trusted (saves a verify per write on the hot path)
    verify_signatures = False

    def __init__(self, directory: str, *, sign_threads: Optional[int] = None) -> None:
        self._keys = KeyDir(directory)
        self._threads = max(1, min(4, os.cpu_count() or 1) if sign_threads is None else sign_threads)
        self._pool: Optional[ThreadPoolExecutor] = None   # made for the first large batch
        self._pool_lock = threading.Lock()
        self._workers: dict[str, "_SignProcess"] = {}   # P-256 signing processes, per key name

    def generate_key(self, name: str, alg: str, tag: Optional[bytes] = None) -> bytes:
        return self._keys.create(name, alg, None if tag is None else check_tag(tag)).public()

    def key_tag(self, name: str) -> Optional[bytes]:
        return self._keys.tag(name)

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

    # A seal key file beside the signing key: whoever holds the card holds both, so this seals
    # nothing against a stolen card (docs/reliability.md "At rest"); only the hardware kinds do.
    def generate_seal_key(self, name: str) -> None:
        self._keys.create_seal(name)

    def has_seal_key(self, name: str) -> bool:
        return self._keys.has_seal(name)

    def seal(self, name: str, plaintext: bytes, ad: bytes) -> bytes:
        return seal_with(self._keys.get_seal(name), plaintext, ad)

    def unseal(self, name: str, sealed: bytes, ad: bytes) -> bytes:
        return unseal_with(self._keys.get_seal(name), sealed, ad)

    def delete_seal_key(self, name: str) -> bool:
        return self._keys.delete_seal(name)

    def _sign_many(self, requests: Sequence[tuple[str, Identity, bytes]]) -> tuple[list[bytes], Optional[BaseException]]:
        """Deterministic Ed25519 gives the same bytes in any order, so a large batch of Ed25519
        requests is signed in contiguous chunks on worker threads; anything else, sequentially."""
        if self._threads < 2 or len(requests) < PARALLEL_MIN or type(self)._sign is not SoftwareKeystore._sign:
            return super()._sign_many(requests)   # a subclass that changes one signature governs batches too
        try:
            sks = [self._keys.get(name).ed_sk for name, _, _ in requests]
        except KeystoreError:   # the sequential loop reports it at the right position
            return super()._sign_many(requests)
        if any(sk is None for sk in sks):
            return super()._sign_many(requests)
        pool = self._worker_pool()
        step = -(-len(requests) // self._threads)
        chunks = [(sks[i:i + step], [data for _, _, data in requests[i:i + step]])
                  for i in range(0, len(requests), step)]
        futures = [pool.submit(_sign_chunk, keys, datas) for keys, datas in chunks[1:]]
        sigs: list[bytes] = []
        failure: Optional[BaseException] = None
        try:
            sigs.extend(_sign_chunk(*chunks[0]))   # this thread signs the first chunk itself
        except BaseException as exc:
            failure = exc
        for fut in futures:
            try:
                part = fut.result()
            except BaseException as exc:
                failure = failure or exc
                continue
            if failure is None:
                sigs.extend(part)
        return sigs, failure

    def _sign_start(self, requests: Sequence[tuple[str, Identity, bytes]]) -> Callable[[], tuple[list[bytes], Optional[BaseException]]]:
        """A pipelined batch of P-256 requests for one key goes to that key's signing process
        (sign_worker.py), so the bridge's caller persists and commits the previous batch meanwhile
        (docs/keystore.md "Pipelined release and pipelined P-256 signing"); anything else is signed
        now. RFC 6979: a batch the process could not sign is signed here with the same bytes."""
        names = {name for name, _, _ in requests}
        if (len(names) != 1 or len(requests) < PROCESS_MIN or self._threads < 2
                or type(self)._sign is not SoftwareKeystore._sign):
            return super()._sign_start(requests)
        (name,) = names
        try:
            if self._keys.get(name).p256 is None:
                return super()._sign_start(requests)
        except KeystoreError:
            return super()._sign_start(requests)   # _sign_many reports it at its position
        worker = self._workers.get(name)
        if worker is None or worker.dead:
            worker = self._workers[name] = _SignProcess(self._keys.path, name)
        ticket = worker.send([data for _, _, data in requests])
        if ticket is None:   # the process is gone: sign here (RFC 6979: the same bytes)
            return super()._sign_start(requests)

        def wait() -> tuple[list[bytes], Optional[BaseException]]:
            sigs = worker.wait(ticket)
            if sigs is None:
                return Keystore._sign_many(self, requests)
            return sigs, None
        return wait

    def _worker_pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor
                self._pool = ThreadPoolExecutor(self._threads - 1, thread_name_prefix="ssp-sign")
            return self._pool

    def close(self) -> None:
        workers, self._workers = self._workers, {}
        for w in workers.values():
            w.close()
        with self._pool_lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _sign_chunk(keys: list, datas: list[bytes]) -> list[bytes]:
    sign = nacl.bindings.crypto_sign
    return [sign(data, sk)[:64] for sk, data in zip(keys, datas)]


class _SignProcess:
    """One sign_worker.py child for one P-256 key (docs/keystore.md "Pipelined release and pipelined P-256 signing").
    Batches may be queued behind each other; answers come back in request order. ``wait``
    returns None when the process failed or died, and the keystore then signs that batch itself
    (deterministic: the same bytes). A request is written without blocking while answers are
    read meanwhile, so neither side ever waits on a full pipe the other is not draining."""

    def __init__(self, directory: str, name: str) -> None:
        import subprocess
        import sys
        self.dead = False
        self._sent = 0
        self._got = 0
        self._answers: dict[int, Optional[list[bytes]]] = {}
        self._counts: dict[int, int] = {}   # ticket -> signatures asked for
        self._inbuf = bytearray()           # answer bytes read while a request was being written
        self._lock = threading.Lock()
        self._proc = None
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)   # the package this module came from, installed or a checkout
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        try:
            self._proc = subprocess.Popen([sys.executable, "-m", "firmware_bridge.sign_worker", directory, name],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=root,
                                          close_fds=True)
            assert self._proc.stdin is not None and self._proc.stdout is not None  # pipes
            self._wfd = self._proc.stdin.fileno()
            self._rfd = self._proc.stdout.fileno()
            if os.read(self._rfd, 1) != b"R":
                raise OSError("the signing process did not start")
            os.set_blocking(self._wfd, False)
        except (OSError, ValueError):
            self._fail()

    def send(self, datas: list[bytes]) -> Optional[int]:
        from .pipes import encode_request, write_draining
        with self._lock:
            if self.dead:
                return None
            try:
                write_draining(self._wfd, self._rfd, encode_request(datas), self._inbuf, timeout_ms=30_000)
            except (OSError, EOFError):
                self._fail()
                return None
            self._sent += 1
            self._counts[self._sent] = len(datas)
            return self._sent

    def _read(self, n: int) -> bytes:
        from .pipes import read_buffered
        return read_buffered(self._rfd, self._inbuf, n)

    def wait(self, ticket: int) -> Optional[list[bytes]]:
        import struct
        with self._lock:
            while ticket not in self._answers:
                if self.dead or ticket <= self._got:
                    return None
                try:
                    nxt = self._got + 1
                    count = self._counts.pop(nxt)
                    status = self._read(1)
                    if status == b"\x00":
                        raw = self._read(64 * count)
                        self._answers[nxt] = [raw[i:i + 64] for i in range(0, len(raw), 64)]
                    else:   # the process could not sign: the keystore signs (and reports) it here
                        (n,) = struct.unpack(">I", self._read(4))
                        self._read(n)
                        self._answers[nxt] = None
                    self._got = nxt
                except (EOFError, OSError, KeyError, struct.error):
                    self._fail()
                    return None
            return self._answers.pop(ticket)

    def _fail(self) -> None:
        self.dead = True
        self.close()

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for f in (proc.stdin, proc.stdout):
            assert f is not None  # pipes
            try:
                f.close()
            except OSError:
                pass
        try:
            proc.wait(5)
        except Exception:
            proc.kill()
            proc.wait()
