"""PKCS#11 keystore (python-pkcs11), e.g. SoftHSM2 or a hardware token.

Keys are generated on the token (CKA_SENSITIVE, not CKA_EXTRACTABLE) and never leave it.  Ed25519
via CKM_EC_EDWARDS_KEY_PAIR_GEN / CKM_EDDSA; P-256 via CKM_ECDSA_SHA256 or CKM_ECDSA over a
SHA-256 digest.  The token chooses its own ECDSA nonces, which is why §22.5 forbids re-signing.
All token calls run in a worker process (pkcs11_worker.py; reasons there). The pipes to it are
used at the file-descriptor level: requests are written without blocking while replies are read
meanwhile (docs/keystore.md "Pipelined signing"), so batches can be outstanding at the worker.
Every reply has a deadline (``timeout_s``, docs/keystore.md "Reply deadline"): a token that stops
answering gets its worker killed instead of hanging the caller for ever.
Every signature returned is verified under the key's public key first: by the verifier process
(verify_worker.py), which gets the worker's copies while this process does other work, or here
(docs/keystore.md "Verified in a verifier process"); the bridge need not check them again.
"""
from __future__ import annotations

import collections
import fcntl
import hashlib
import math
import os
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Generator, Optional, Sequence

import cbor2

from . import errors
from .errors import DeviceTimeout, KeystoreError, KeystoreUnavailable
from .identity import Identity
from .keystore import MAX_SEAL_BYTES, Keystore, check_alg, check_key_name, check_tag
from .pipes import read_before, write_draining
from .verify import verify_ed25519, verify_p256
from .verify_worker import ANSWER, encode_items, encode_key


SIGN_MANY_CHUNK = 64
# The reply deadline's default: generous, since a token may be slow (a USB HSM generating a key, a
# SoftHSM2 on a loaded Pi); it only has to turn "hangs for ever" into "fails, clearly".
DEFAULT_TIMEOUT_S = 60.0


def _python_m(module: str) -> list[str]:
    """``python -m module`` without the working directory on sys.path (``-P``, Python >= 3.11): a
    directory holding another ``firmware_bridge`` would otherwise be imported instead of this one
    (the PYTHONPATH given to the child puts this package's root first)."""
    return [sys.executable, *(["-P"] if sys.version_info >= (3, 11) else []), "-m", module]


def _worker_error(reply: dict[str, Any]) -> KeystoreError:
    """The worker names an errors.py class; anything else becomes a plain KeystoreError."""
    if reply["err"] == "SealError":
        from .sealing import SealError
        return SealError(reply["msg"])
    cls = getattr(errors, reply["err"], KeystoreError)
    if not (isinstance(cls, type) and issubclass(cls, KeystoreError)):
        cls = KeystoreError
    return cls(reply["msg"])


class _Chunk:
    """One ``sign_many`` request sent: its [name, alg, data] items, its sequence number, its batch
    and whether the worker was asked to copy it to the verifier."""
    __slots__ = ("reqs", "seq", "batch", "copy")

    def __init__(self, reqs: list, seq: int, batch: int, copy: bool) -> None:
        self.reqs = reqs
        self.seq = seq
        self.batch = batch
        self.copy = copy


class _Batch:
    """One ``_sign_start`` batch: its chunk requests sent to the worker, their replies read (in
    order, by whoever reads the pipe next) and verified into ``results`` (verified signatures,
    failure); ``failure`` when the worker died before all of them came."""
    __slots__ = ("unread", "chunks", "results", "failure", "result")

    def __init__(self) -> None:
        self.unread = 0
        self.chunks: list[_Chunk] = []
        self.results: list[tuple[list[bytes], Optional[BaseException]]] = []
        self.failure: Optional[BaseException] = None
        self.result: Optional[tuple[list[bytes], Optional[BaseException]]] = None


def _bad_signature(name: str) -> KeystoreError:
    return KeystoreError(f"the PKCS#11 token returned a signature that does not verify under key {name!r}; "
                         "nothing was released. Check the token (wrong key, fault or tampering).")


class Pkcs11Keystore(Keystore):
    kind = "pkcs11"
    # every signature this keystore returns was verified under the key's public key (by the
    # verifier process or here): the bridge checks only its form
    verify_signatures = False
    _WORKER_MODULE = "firmware_bridge.pkcs11_worker"   # a test seam (a faulty token); see pkcs11_worker.main

    def __init__(self, module: str, token_label: str, pin: str, env: Optional[dict[str, str]] = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                or not math.isfinite(timeout_s) or timeout_s <= 0):
            raise KeystoreError(f"keystore.timeout_s (the PKCS#11 reply deadline) must be a positive number of "
                                f"seconds, not {timeout_s!r}; fix it in the profile (default {DEFAULT_TIMEOUT_S:g})")
        self.module = module
        self.token_label = token_label
        self.timeout_s = float(timeout_s)
        # why the worker was stopped for good (a missed deadline): the failure of every later call
        self._gone: Optional[KeystoreError] = None
        self._lock = threading.Lock()
        self._algs: dict[str, str] = {}
        self._keys: dict[str, tuple[str, bytes]] = {}   # (alg, public key) by name: what signatures are verified under
        self._proc: Optional[subprocess.Popen] = None
        # the verifier process (verify_worker.py), started by the first pipelined batch; the read
        # end of the worker's copy pipe is kept for it until then. _vgone: never again (it died,
        # missed the deadline, or could not start): verification is done in this process.
        self._verifier: Optional[subprocess.Popen] = None
        self._copies_r: Optional[int] = None
        self._cancel_w: Optional[int] = None   # batch numbers to the worker: a signature of it failed verification
        self._vgone = False
        self._vkeys: set[str] = set()
        self._vbuf = bytearray()
        self._seq = 0
        self._batch_id = 0   # numbers each _sign_start batch and _sign_chunks stream (the worker skips a failed one's rest)
        # _sign_start batches whose replies are not all read yet, in the order sent (the worker
        # answers in that order); reply bytes read while a request was being written wait in _inbuf
        self._outstanding: collections.deque[_Batch] = collections.deque()
        self._inbuf = bytearray()
        self._stdout: Any = None   # the worker's stdout, open until EOF: replies written before a death are read
        if not os.path.exists(module):
            raise KeystoreUnavailable(f"PKCS#11 module {module} does not exist; install it (Debian: apt-get "
                                      "install softhsm2) or fix keystore.module in the profile")
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        penv = dict(os.environ, **(env or {}))
        penv["PYTHONPATH"] = pkg_root + os.pathsep + penv.get("PYTHONPATH", "")
        self._env = penv
        # the worker's copies to the verifier: a large pipe, so a verifier a few batches behind
        # never makes the worker stop copying (it never waits for it: pkcs11_worker._copy)
        self._copies_r, copies_w = os.pipe()
        cancel_r, self._cancel_w = os.pipe()
        os.set_blocking(self._cancel_w, False)
        try:   # Linux; elsewhere (or above /proc/sys/fs/pipe-max-size) the default pipe
            fcntl.fcntl(copies_w, fcntl.F_SETPIPE_SZ, 1 << 20)
        except (OSError, AttributeError):
            pass
        try:
            self._proc = subprocess.Popen([*_python_m(self._WORKER_MODULE), "--copies", str(copies_w),
                                           "--cancel", str(cancel_r)],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=penv, bufsize=0,
                                          pass_fds=(copies_w, cancel_r))
        finally:
            os.close(copies_w)
            os.close(cancel_r)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._stdout = self._proc.stdout
        self._wfd, self._rfd = self._proc.stdin.fileno(), self._proc.stdout.fileno()
        os.set_blocking(self._wfd, False)   # _write: never blocked on a full pipe (see there)
        self._poller = select.poll()        # _recv waits for a reply at most timeout_s
        self._poller.register(self._rfd, select.POLLIN)
        try:
            self.info = self._call("open", module=module, token_label=token_label, pin=pin)
        except BaseException:
            self.close()
            raise

    def _call(self, op: str, **kw: Any) -> Any:
        with self._lock:
            self._collect()
            self._send(op, kw)
            reply = self._recv(op)
        if "err" in reply:
            raise _worker_error(reply)
        return reply["ok"]

    def _send(self, op: str, kw: dict) -> None:
        """One request to the worker (the caller holds ``_lock`` until it has read every reply,
        or has registered the replies to come in ``_outstanding``)."""
        if self._proc is None or self._proc.poll() is not None:
            self._broken()
            if self._gone is not None:
                raise KeystoreUnavailable(f"the PKCS#11 worker was killed: {self._gone}") from None
            raise KeystoreUnavailable("the PKCS#11 worker process is not running; restart the agent")
        data = cbor2.dumps({"op": op, **kw})
        self._write(struct.pack(">I", len(data)) + data, op)

    def _write(self, data: bytes, op: str) -> None:
        """Write all of ``data`` without ever blocking on a full pipe (pipes.write_draining: the
        replies read meanwhile wait in ``_inbuf``); a worker that neither reads nor answers for
        ``timeout_s`` has missed the deadline."""
        try:
            write_draining(self._wfd, self._rfd, data, self._inbuf, timeout_ms=math.ceil(self.timeout_s * 1000))
        except TimeoutError:
            raise self._timed_out(op) from None
        except (OSError, EOFError, ValueError):
            self._broken()
            raise KeystoreUnavailable(f"the PKCS#11 worker for {self.module} died during {op}; "
                                      "check the token and restart the agent") from None

    def _recv(self, op: str) -> dict:
        """The next reply: from ``_inbuf`` when it holds one, else read (blocking) from the pipe,
        for at most ``timeout_s`` (then ``_timed_out``). After a death the replies the worker wrote
        before it are still read, up to EOF."""
        buf = self._inbuf
        deadline = None
        try:
            while True:
                if len(buf) >= 4:
                    (n,) = struct.unpack_from(">I", buf)
                    if len(buf) >= 4 + n:
                        reply = cbor2.loads(bytes(buf[4:4 + n]))
                        del buf[:4 + n]
                        return reply
                if self._stdout is None:
                    raise EOFError
                if deadline is None:
                    deadline = time.monotonic() + self.timeout_s
                buf += read_before(self._rfd, self._poller, deadline)
        except TimeoutError:
            raise self._timed_out(op) from None
        except (OSError, EOFError, ValueError):
            self._broken()
            self._close_stdout()
            if self._gone is not None:   # killed by us earlier: say why
                raise KeystoreUnavailable(f"the PKCS#11 worker was killed: {self._gone}") from None
            raise KeystoreUnavailable(f"the PKCS#11 worker for {self.module} died during {op}; "
                                      "check the token and restart the agent") from None

    def _timed_out(self, op: str) -> DeviceTimeout:
        """The worker missed the reply deadline: kill it (a token that answers later must not
        sign, or answer, anything more) and say so. Every request in flight is an unknown
        outcome: the token may have signed it, and it is never sent again (§22.5)."""
        self._gone = DeviceTimeout(
            f"the PKCS#11 token {self.token_label!r} ({self.module}) did not answer within {self.timeout_s:g} s "
            f"(during {op}); its worker process was killed. The signatures in flight are unknown outcomes and "
            "are never signed again (§22.5); this keystore is unusable until the agent restarts. Check the "
            "token (unplugged, locked up, overloaded); a token that is just slow needs a larger keystore "
            "timeout_s in the profile")
        self._broken()
        self._close_stdout()
        return self._gone

    def _broken(self) -> None:
        """The worker died, stopped reading or spoke garbage: stop it for good. It is never
        restarted here, so nothing is ever sent (or signed) again (§22.5: SoftHSM2's ECDSA nonces
        are random, a second signature is a second output); later calls report it unavailable."""
        proc, self._proc = self._proc, None
        if proc is not None:
            proc.kill()
            proc.wait()
            assert proc.stdin is not None  # a pipe
            try:
                proc.stdin.close()
            except OSError:
                pass

    def _close_stdout(self) -> None:
        out, self._stdout = self._stdout, None
        self._inbuf.clear()
        if out is not None:
            out.close()

    def generate_key(self, name: str, alg: str, tag: Optional[bytes] = None) -> bytes:
        kw: dict[str, Any] = {"name": check_key_name(name), "alg": check_alg(alg)}
        if tag is not None:
            kw["tag"] = bytes(check_tag(tag))
        pub = self._call("generate", **kw)
        self._algs[name] = alg
        self._keys[name] = (alg, bytes(pub))
        return bytes(pub)

    def _pub(self, name: str) -> tuple[str, bytes]:
        alg, pub = self._call("public", name=check_key_name(name))
        self._algs[name] = alg
        self._keys[name] = (alg, bytes(pub))
        return alg, bytes(pub)

    def _key(self, name: str) -> tuple[str, bytes]:
        """(algorithm, public key) of ``name``, fetched once: the key its signatures are verified
        under (the bridge's ``public_key``, also fetched once)."""
        return self._keys.get(name) or self._pub(name)

    def public_key(self, name: str) -> bytes:
        return self._pub(name)[1]

    def key_tag(self, name: str) -> Optional[bytes]:
        """The key's CKA_ID: the ``tag`` it was generated with (keys generated before tags, or
        without one, carry their name there)."""
        return bytes(self._call("key_tag", name=check_key_name(name)))

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
        alg = self._key(name)[0]
        sig = bytes(self._call("sign", name=name, alg=alg, data=data))
        if self._verify_here([[name, alg, data]], [sig]) != 1:
            raise _bad_signature(name)
        return sig

    def _requests(self, requests: Sequence[tuple[str, Identity, bytes]]) -> list[list[Any]]:
        """[[name, alg, data], ...] for the worker; every key's public key is fetched here (before
        the lock is taken), for the verification. KeystoreError for a key that is not there."""
        return [[name, self._key(name)[0], bytes(data)] for name, _, data in requests]

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

    def _sign_chunks(self, requests: Sequence[tuple[str, Identity, bytes]]) -> Generator[list[bytes], None, None]:
        """A group commit's signatures in round trips of up to SIGN_MANY_CHUNK to the worker (the
        pipe round trip costs about as much as a SoftHSM2 signature); the token signs in order.
        The next chunk is sent before this one is verified and yielded, so the token signs it
        meanwhile (an ES256 verification costs about as much as a SoftHSM2 signature: the two
        overlap; with the verifier running, the verification too runs beside the caller). Nothing is signed that has no durable intent: every request
        here has one (the bridge's order, docs/keystore.md); after a failure or an early close the
        chunk in flight is read and dropped (its signatures stay unknown outcomes; the worker does
        not sign it when the failure was the token's, op_sign_many's ``batch``). The keystore's
        lock is held until the stream ends: the caller makes no other call on this keystore meanwhile."""
        try:
            reqs = self._requests(requests)
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
            self._collect()
            self._batch_id += 1
            bid = self._batch_id
            in_flight = collections.deque([self._send_chunk(parts[0], bid)])
            try:
                for k in range(len(parts)):
                    if k + 1 < len(parts):
                        in_flight.append(self._send_chunk(parts[k + 1], bid))
                    got = self._recv("sign_many")
                    sigs, failure = self._resolve(in_flight.popleft(), got)
                    if sigs:
                        yield sigs
                    if failure is not None:
                        raise failure
            finally:
                self._drain(len(in_flight))

    def _sign_start(self, requests: Sequence[tuple[str, Identity, bytes]]) -> Callable[[], tuple[list[bytes], Optional[BaseException]]]:
        """Send the batch's sign_many chunks to the worker now and return; ``wait`` reads their
        replies later (docs/keystore.md "Pipelined signing"), so the token signs this batch while
        the bridge's caller commits the one before. Batches queue at the worker in the order
        started; any other call first reads every outstanding reply into its batch (``_collect``).
        The lock is held only while sending and while reading, never in between. Nothing is
        signed that was not given here (each request has a durable intent, the bridge's order),
        and nothing is sent twice: a dead worker is the failure of every batch still outstanding
        (its identities become unknown outcomes, §22.5)."""
        try:
            reqs = self._requests(requests)
        except KeystoreError:   # reported at its position by the one-at-a-time loop
            return super()._sign_start(requests)
        batch = _Batch()
        with self._lock:
            self._batch_id += 1
            bid = self._batch_id
            try:
                for i in range(0, len(reqs), SIGN_MANY_CHUNK):
                    if i == 0:
                        self._outstanding.append(batch)
                        self._start_verifier()
                    batch.chunks.append(self._send_chunk(reqs[i:i + SIGN_MANY_CHUNK], bid))
                    batch.unread += 1
            except (KeystoreUnavailable, DeviceTimeout) as exc:
                self._collect()   # the replies written before the death, up to EOF; then failures
                batch.failure = batch.failure or exc

        def wait() -> tuple[list[bytes], Optional[BaseException]]:
            if batch.result is None:
                with self._lock:
                    while batch.unread:
                        self._read_outstanding()
                batch.result = self._batch_result(batch)
            return batch.result
        return wait

    def _read_outstanding(self) -> None:
        """Read the next reply into the oldest outstanding batch (the caller holds ``_lock``); a
        dead worker fails every outstanding batch."""
        try:
            reply = self._recv("sign_many")
        except (KeystoreUnavailable, DeviceTimeout) as exc:
            self._fail_outstanding(exc)
            return
        batch = self._outstanding[0]
        if any(failure is not None for _, failure in batch.results):
            batch.results.append(([], None))   # after its failure: dropped unverified, never returned
        else:
            batch.results.append(self._resolve(batch.chunks[len(batch.results)], reply))
        batch.unread -= 1
        if not batch.unread:
            self._outstanding.popleft()

    def _fail_outstanding(self, exc: BaseException) -> None:
        while self._outstanding:
            batch = self._outstanding.popleft()
            batch.unread = 0
            batch.failure = batch.failure or exc

    def _collect(self) -> None:
        """Before any other request (the caller holds ``_lock``): read every outstanding batch's
        replies into its buffer, so the next reply on the pipe is the caller's own."""
        while self._outstanding:
            self._read_outstanding()

    @staticmethod
    def _batch_result(batch: _Batch) -> tuple[list[bytes], Optional[BaseException]]:
        """``_sign_many``'s answer from a batch's verified chunks: the signatures up to the first
        failure, then that failure (the chunks after it are dropped, unknown outcomes; after a
        token's failure the worker did not sign them)."""
        sigs: list[bytes] = []
        for part, failure in batch.results:
            sigs.extend(part)
            if failure is not None:
                return sigs, failure
        return sigs, batch.failure

    # -- verification (docs/keystore.md "Verified in a verifier process") ---------------------
    def _send_chunk(self, reqs: list, batch: int) -> _Chunk:
        """Send one sign_many request of ``batch`` (the caller holds ``_lock``); the worker copies
        it to the verifier when one runs and every item is P-256 (Ed25519 is verified here, with
        PyNaCl), and skips it, unsigned, when an earlier chunk of ``batch`` failed at the token."""
        self._seq += 1
        copy = self._verifier_takes(reqs)
        req: dict[str, Any] = {"requests": reqs, "batch": batch}
        if copy:
            req.update(copy=True, seq=self._seq)
        self._send("sign_many", req)
        return _Chunk(reqs, self._seq, batch, copy)

    def _resolve(self, chunk: _Chunk, reply: dict) -> tuple[list[bytes], Optional[BaseException]]:
        """A chunk's reply as (signatures verified, failure): the signatures before the first that
        does not verify, then a KeystoreError for it (the token's own failure comes after)."""
        if "ok" not in reply:
            return [], _worker_error(reply)
        got = reply["ok"]
        sigs = [bytes(x) for x in got["sigs"]]
        failure = _worker_error(got) if "err" in got else None
        n = self._verified(chunk, sigs, bool(got.get("copied")))
        if n < len(sigs):
            self._cancel(chunk.batch)
            return sigs[:n], _bad_signature(chunk.reqs[n][0])
        return sigs, failure

    def _cancel(self, batch: int) -> None:
        """Tell the worker that ``batch`` failed verification: it signs none of its chunks still
        queued (the verifier tells it too, sooner, for the chunks it verified). Best effort."""
        if self._cancel_w is not None:
            try:
                os.write(self._cancel_w, struct.pack(">Q", batch))
            except OSError:
                pass

    def _verified(self, chunk: _Chunk, sigs: list[bytes], copied: bool) -> int:
        """How many of ``sigs`` verify, from the first: the verifier's verdict when it gave one
        for exactly these (digest, signature) pairs, else checked here."""
        if not sigs:
            return 0
        if chunk.copy and not copied and not self._vgone:
            self._stop_verifier()   # the worker stopped copying for good (the verifier died or fell far behind)
        if copied and not self._vgone:
            answer = self._answer(chunk.seq)
            if answer is not None:
                count, ok, digest = answer
                # the verdict is over the worker's copy: taken only if it is this process's own
                # data (its digests of the data it sent, the signatures it read)
                body = encode_items([(name.encode(), hashlib.sha256(data).digest(), sig)
                                     for (name, _, data), sig in zip(chunk.reqs, sigs)])
                if count == len(sigs) and hashlib.sha256(body).digest() == digest:
                    return ok
        return self._verify_here(chunk.reqs, sigs)

    def _verify_here(self, reqs: list, sigs: list[bytes]) -> int:
        for i, ((name, alg, data), sig) in enumerate(zip(reqs, sigs)):
            pub = self._keys[name][1]
            if not (verify_ed25519(pub, data, sig) if alg == "ed25519" else verify_p256(pub, data, sig)):
                return i
        return len(sigs)

    def _start_verifier(self) -> None:
        """Start the verifier process on the first pipelined batch (a sequencer's; a CLI verb's
        one signature is checked here without starting a process it would use once). Its
        failure to start only leaves verification here."""
        if self._copies_r is None or self._vgone or self._verifier is not None:
            return
        fd, self._copies_r = self._copies_r, None
        try:
            fds = (fd,) if self._cancel_w is None else (fd, self._cancel_w)
            self._verifier = subprocess.Popen([*_python_m("firmware_bridge.verify_worker"), *map(str, fds)],
                                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self._env,
                                              bufsize=0, pass_fds=fds)
        except OSError:
            self._vgone = True
            return
        finally:
            os.close(fd)   # the verifier holds it now: when it dies, the worker's copies fail and stop
        assert self._verifier.stdin is not None and self._verifier.stdout is not None
        self._vwfd, self._vrfd = self._verifier.stdin.fileno(), self._verifier.stdout.fileno()
        os.set_blocking(self._vwfd, False)
        self._vpoller = select.poll()
        self._vpoller.register(self._vrfd, select.POLLIN)

    def _verifier_takes(self, reqs: list) -> bool:
        """True when the verifier runs and has every P-256 key of ``reqs`` (registered now if
        new); False for a chunk with an Ed25519 item."""
        if self._verifier is None or self._vgone:
            return False
        names = set()
        for name, alg, _ in reqs:
            if alg != "p256":
                return False
            names.add(name)
        for name in names - self._vkeys:
            data = encode_key(name, self._keys[name][1])
            try:   # a few bytes into an empty pipe: a verifier that cannot take them is broken
                if os.write(self._vwfd, data) != len(data):
                    raise OSError
            except OSError:
                self._stop_verifier()
                return False
            self._vkeys.add(name)
        return True

    def _answer(self, seq: int) -> Optional[tuple[int, int, bytes]]:
        """The verifier's answer for chunk ``seq`` (count, verified, sha256 of the copy's body), or
        None when it has none (it died, missed the deadline, or never got the copy): then the
        chunk is verified here. Answers to chunks dropped unread are skipped."""
        buf = self._vbuf
        deadline = time.monotonic() + self.timeout_s
        try:
            while True:
                while len(buf) >= 48:
                    aseq, count, ok = ANSWER.unpack_from(buf)
                    if aseq > seq:
                        return None
                    digest = bytes(buf[16:48])
                    del buf[:48]
                    if aseq == seq:
                        return count, ok, digest
                buf += read_before(self._vrfd, self._vpoller, deadline)
        except (OSError, EOFError):
            self._stop_verifier()
            return None

    def _stop_verifier(self) -> None:
        """The verifier is gone for good (died, stuck, or closing): every later signature is
        verified in this process. The worker's next copy fails and it stops copying."""
        self._vgone = True
        proc, self._verifier = self._verifier, None
        self._vbuf.clear()
        if proc is not None:
            proc.kill()
            proc.wait()
            for f in (proc.stdin, proc.stdout):
                assert f is not None  # pipes
                try:
                    f.close()
                except OSError:
                    pass
        if self._copies_r is not None:
            os.close(self._copies_r)
            self._copies_r = None

    def _drain(self, n: int) -> None:
        """Read and drop ``n`` replies in flight (a stopped stream; the verifier's answers to them
        are skipped later, by their numbers); a worker that does not answer is stopped, so the
        next call reports it unavailable instead of reading a stale reply."""
        try:
            for _ in range(n):
                self._recv("sign_many")
        except (KeystoreUnavailable, DeviceTimeout):
            self._broken()

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
        """Read the outstanding batches' replies first: their ``wait`` still gives them."""
        lock = getattr(self, "_lock", None)
        if lock is None:
            return
        with lock:
            self._collect()
            proc, self._proc = self._proc, None
            if proc is not None:
                try:
                    if proc.stdin:
                        proc.stdin.close()
                    proc.wait(timeout=5)
                except Exception:  # noqa: BLE001
                    proc.kill()
                    proc.wait()
            self._close_stdout()
            self._stop_verifier()
            if self._cancel_w is not None:
                os.close(self._cancel_w)
                self._cancel_w = None
