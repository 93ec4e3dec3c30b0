"""Serial keystore protocol, sans I/O (docs/keystore.md "Serial keystore protocol (v1)").

Frame on the wire:   COBS( payload | CRC-32(payload) as 4 bytes big-endian ) | 0x00   (framing.py)
payload:             version (u8 = 1) | kind (u8) | request id (u16) | body

COBS makes 0x00 an unambiguous frame delimiter, so a receiver resynchronises after line noise
at the next 0x00; CRC-32 (zlib/IEEE polynomial) rejects corrupted frames.  Requests carry an
op code as kind; an OK response carries ``op | 0x80``; an error response carries ``ERROR`` with
body ``code (u8) | message (utf-8)``.  Strings are u8-length-prefixed, blobs u16-length-prefixed.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Iterator, Union

from . import framing
from .errors import DeviceProtocolError
from .framing import FrameError, cobs_decode, cobs_encode  # noqa: F401 - this protocol's names for them

VERSION = 1
MAX_PAYLOAD = 4096

# request op codes
HELLO = 0x01      # body: -                          -> proto u8 | firmware str | device_id (8)
GENERATE = 0x02   # body: alg u8 | name str          -> alg u8 | public key blob
PUBKEY = 0x03     # body: name str                   -> alg u8 | public key blob
SIGN = 0x04       # body: name str | ident blob | data blob -> counter u64 | signature blob
LIST = 0x05       # body: -                          -> count u8 | (alg u8 | name str)*
# seal keys (sealing.py: the agent's data keys are sealed by the device and never leave it in clear)
SEAL_GENERATE = 0x06  # body: name str                -> -   (E_KEY_EXISTS if there is one)
SEAL = 0x07       # body: name str | ad blob | plaintext blob (<= 1024) -> sealed blob
UNSEAL = 0x08     # body: name str | ad blob | sealed blob -> plaintext blob (E_UNSEAL if it does not open)
# a key's tag (Keystore.generate_key: what tells an init cut short its own key from another's);
# firmware without these answers E_UNKNOWN_OP, and the host then keeps no tag there
GENERATE_TAGGED = 0x09  # body: alg u8 | name str | tag blob (1..32) -> alg u8 | public key blob
KEY_TAG = 0x0A    # body: name str                   -> tag blob (empty: the key has none)
MAX_TAG = 32
OK_BIT = 0x80
ERROR = 0x7F

ALG_CODES = {"ed25519": 1, "p256": 2}
ALG_NAMES = {v: k for k, v in ALG_CODES.items()}

# error codes (ERROR body)
E_BAD_REQUEST = 1
E_UNKNOWN_OP = 2
E_KEY_NOT_FOUND = 3
E_KEY_EXISTS = 4
E_BAD_ALG = 5
E_ALREADY_SIGNED = 6
E_NOT_MONOTONIC = 7
E_STORAGE = 8
E_TOO_LARGE = 9
E_WRONG_KEY_FOR_IDENTITY = 10
E_UNSEAL = 11
ERROR_NAMES = {E_BAD_REQUEST: "bad request", E_UNKNOWN_OP: "unknown op", E_KEY_NOT_FOUND: "key not found",
               E_KEY_EXISTS: "key exists", E_BAD_ALG: "bad algorithm", E_ALREADY_SIGNED: "identity already signed",
               E_NOT_MONOTONIC: "identity at or below the last signed one", E_STORAGE: "device storage failure",
               E_TOO_LARGE: "request too large", E_WRONG_KEY_FOR_IDENTITY: "key algorithm does not fit identity",
               E_UNSEAL: "sealed data does not open under this device's seal key"}


def encode_frame(kind: int, req_id: int, body: bytes = b"") -> bytes:
    payload = struct.pack(">BBH", VERSION, kind, req_id & 0xFFFF) + body
    if len(payload) > MAX_PAYLOAD:
        raise ValueError("frame payload too large")
    return framing.encode(payload, MAX_PAYLOAD)


@dataclass(frozen=True)
class Frame:
    kind: int
    req_id: int
    body: bytes


def decode_frame(raw: bytes) -> Frame:
    """``raw`` is the COBS data between delimiters (without the 0x00). Raises FrameError only
    (anything else a hostile line could provoke is classified as one: the reader never dies)."""
    try:
        return _decode_frame(raw)
    except FrameError:
        raise
    except Exception as exc:  # noqa: BLE001 - the catch-and-classify net of this boundary
        raise FrameError(f"unclassified frame ({type(exc).__name__})") from None


def _decode_frame(raw: bytes) -> Frame:
    return _frame(framing.decode(raw, MAX_PAYLOAD))  # COBS, length bound, CRC (framing.py)


def _frame(payload: bytes) -> Frame:
    if len(payload) < 4:
        raise FrameError("frame too short")
    if payload[0] != VERSION:
        raise FrameError(f"unsupported protocol version {payload[0]}")
    _, kind, req_id = struct.unpack(">BBH", payload[:4])
    return Frame(kind, req_id, bytes(payload[4:]))


class FrameReader:
    """Accumulates bytes from the line; yields decoded frames and counts rejected ones
    (framing.Decoder: bounded, linear, resynchronises at the next 0x00)."""

    def __init__(self) -> None:
        self._dec = framing.Decoder(MAX_PAYLOAD)
        self._rejected = 0
        self._last_error = ""

    @property
    def rejected(self) -> int:
        return self._dec.rejected + self._rejected

    @property
    def last_error(self) -> str:
        return self._last_error or self._dec.last_error

    def feed(self, data: bytes) -> Iterator[Frame]:
        before = self._dec.rejected
        payloads = self._dec.feed(data)
        if self._dec.rejected != before:
            self._last_error = ""
        for payload in payloads:
            try:
                frame = _frame(payload)
            except FrameError as exc:
                self._rejected += 1
                self._last_error = str(exc)
                continue
            yield frame


# -- body helpers -----------------------------------------------------------------------------
def put_str(s: str) -> bytes:
    b = s.encode()
    if len(b) > 255:
        raise ValueError("string too long")
    return bytes([len(b)]) + b


def put_blob(b: bytes) -> bytes:
    if len(b) > 0xFFFF:
        raise ValueError("blob too long")
    return struct.pack(">H", len(b)) + b


class BodyReader:
    def __init__(self, body: bytes) -> None:
        self.b = body
        self.i = 0

    def u8(self) -> int:
        if self.i >= len(self.b):
            raise FrameError("body truncated")
        self.i += 1
        return self.b[self.i - 1]

    def u64(self) -> int:
        if self.i + 8 > len(self.b):
            raise FrameError("body truncated")
        (v,) = struct.unpack_from(">Q", self.b, self.i)
        self.i += 8
        return v

    def take(self, n: int) -> bytes:
        if self.i + n > len(self.b):
            raise FrameError("body truncated")
        self.i += n
        return self.b[self.i - n:self.i]

    def str(self) -> str:
        try:
            return self.take(self.u8()).decode()
        except UnicodeDecodeError:
            raise FrameError("bad utf-8") from None

    def blob(self) -> bytes:
        n = struct.unpack(">H", self.take(2))[0]
        return self.take(n)

    def end(self) -> None:
        if self.i != len(self.b):
            raise FrameError("trailing bytes in body")


# -- replies (the host's boundary: every byte the device sends back) ---------------------------
class ReplyError(DeviceProtocolError):
    """A reply frame that is not a valid answer to the request; `reason` is a stable code."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"serial keystore reply refused ({reason}{': ' + detail if detail else ''}); "
                         "line noise, a wrong baud rate or firmware that does not speak protocol 1")
        self.reason, self.detail = reason, detail


@dataclass(frozen=True)
class Hello:
    protocol: int
    firmware: str
    device_id: bytes  # 8 bytes


@dataclass(frozen=True)
class KeyInfo:  # GENERATE, GENERATE_TAGGED and PUBKEY
    alg: str
    public_key: bytes


@dataclass(frozen=True)
class Signed:
    counter: int
    signature: bytes  # 64 bytes: Ed25519, or P-256 raw r||s


@dataclass(frozen=True)
class KeyList:
    keys: tuple[tuple[str, str], ...]  # (name, alg); an algorithm this host does not know is "?"


@dataclass(frozen=True)
class Data:  # SEAL_GENERATE (empty), SEAL, UNSEAL, KEY_TAG
    data: bytes


@dataclass(frozen=True)
class DeviceError:
    code: int
    message: str


Reply = Union[Hello, KeyInfo, Signed, KeyList, Data, DeviceError]
_PUBLIC_KEY_LEN = {"ed25519": (32,), "p256": (33, 65)}  # SEC1 compressed or uncompressed point


def parse_reply(op: int, frame: Frame) -> Reply:
    """The serial keystore reply boundary: the reply to request `op` in `frame`, parsed whole
    (no trailing bytes), or ReplyError (a DeviceProtocolError, a KeystoreError) with a stable reason.
    Nothing else escapes, whatever the device or the line sends."""
    try:
        return _parse_reply(op, frame)
    except ReplyError:
        raise
    except FrameError as exc:
        raise ReplyError("malformed_body", str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - the catch-and-classify net of this boundary
        raise ReplyError("unclassified", type(exc).__name__) from None


def _parse_reply(op: int, frame: Frame) -> Reply:
    if frame.kind == ERROR:
        code = frame.body[0] if frame.body else 0
        return DeviceError(code, frame.body[1:].decode(errors="replace"))
    if frame.kind != op | OK_BIT:
        raise ReplyError("unexpected_kind", f"op 0x{op:02x} answered with kind 0x{frame.kind:02x}")
    r = BodyReader(frame.body)
    out: Reply
    if op == HELLO:
        out = Hello(r.u8(), r.str(), r.take(8))
    elif op in (GENERATE, GENERATE_TAGGED, PUBKEY):
        alg = ALG_NAMES.get(r.u8())
        if alg is None:
            raise ReplyError("unknown_algorithm", "the device reported an algorithm this host does not know")
        out = KeyInfo(alg, r.blob())
        if len(out.public_key) not in _PUBLIC_KEY_LEN[alg]:
            raise ReplyError("bad_public_key", f"{len(out.public_key)}-byte {alg} public key")
    elif op == SIGN:
        out = Signed(r.u64(), r.blob())
        if len(out.signature) != 64:
            raise ReplyError("bad_signature_length", "a signature is 64 bytes")
    elif op == LIST:
        keys = []
        for _ in range(r.u8()):
            alg = ALG_NAMES.get(r.u8(), "?")
            keys.append((r.str(), alg))
        out = KeyList(tuple(keys))
    elif op == SEAL_GENERATE:
        out = Data(b"")
    elif op in (SEAL, UNSEAL):
        out = Data(r.blob())
    elif op == KEY_TAG:
        out = Data(r.blob())
        if len(out.data) > MAX_TAG:
            raise ReplyError("bad_tag", f"a {len(out.data)}-byte tag (at most {MAX_TAG})")
    else:
        raise ReplyError("unknown_op", f"0x{op:02x}")
    if r.i != len(r.b):
        raise ReplyError("trailing_bytes", f"{len(r.b) - r.i} bytes after the reply")
    return out
