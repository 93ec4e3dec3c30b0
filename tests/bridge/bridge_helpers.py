"""Shared test helpers: a minimal COSE_Sign1 builder (the caller owns COSE encoding) and a
journal parser written independently of firmware_bridge.journal, from docs/keystore.md."""
from __future__ import annotations

import glob
import os
import struct
import threading
import zlib

import cbor2

MESH_ID = bytes(range(16))


def event_protected(site_id: bytes) -> bytes:
    return cbor2.dumps({1: -8, 3: "sovm/ssp-event-v1", 4: site_id}, canonical=True)


def receipt_protected(kid33: bytes) -> bytes:
    return cbor2.dumps({1: -7, 3: "sovm/sequencing-receipt-v1", 4: kid33}, canonical=True)


def event_payload(physical_ms: int, logical: int, value: int) -> bytes:
    return cbor2.dumps({"table_schema": "t1", "table_name": "readings", "row_key": {"id": value % 7},
                        "operation": "upsert", "payload": {"v": value},
                        "hlc_physical_ms": physical_ms, "hlc_logical": logical}, canonical=True)


def receipt_payload(group_id: bytes, epoch: int, commit_hash: bytes, prev: bytes | None) -> bytes:
    return cbor2.dumps({"group_id": group_id, "epoch": epoch, "commit_hash": commit_hash,
                        "previous_receipt_hash": prev}, canonical=True)


def sig_structure(protected: bytes, payload: bytes, aad: bytes = MESH_ID) -> bytes:
    return cbor2.dumps(["Signature1", protected, aad, payload], canonical=True)


def assembler(protected: bytes, payload: bytes):
    def assemble(signature: bytes) -> bytes:
        return cbor2.dumps(cbor2.CBORTag(18, [protected, {}, payload, signature]), canonical=True)
    return assemble


def cose_parts(cose: bytes) -> tuple[bytes, bytes, bytes]:
    tag = cbor2.loads(cose)
    assert tag.tag == 18
    protected, _unprot, payload, sig = tag.value
    return protected, payload, sig


def parse_journal(path: str) -> list[tuple[int, bytes, bytes]]:
    """[(type, ident, key_name-or-cose-or-b"")] of every complete, CRC-valid record (docs/keystore.md):
    type 1 INTENT, 2 RELEASED, 3 FLOOR, 4 SEALED, 5 GAP (a released output sealed at rest: the agent's
    node journals, docs/keystore.md; open it with the home's data key)."""
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == b"SSPJRNL1", "bad journal magic"
    pos, out = 8, []
    while pos + 8 <= len(data):
        blen, crc = struct.unpack_from(">II", data, pos)
        body = data[pos + 8:pos + 8 + blen]
        if len(body) != blen or zlib.crc32(body) != crc or blen == 0:
            break
        rtype = body[0]
        (ilen,) = struct.unpack_from(">H", body, 1)
        ident = body[3:3 + ilen]
        rest = body[3 + ilen:]
        if rtype == 1:
            out.append((1, ident, rest[1:1 + rest[0]]))
        elif rtype == 3:   # FLOOR: ident is (site_id, HLC); rest is empty
            out.append((3, ident, b""))
        elif rtype == 5:   # GAP: ident is (site_id, low HLC); rest is the top HLC (u64, u32)
            out.append((5, ident, rest))
        else:
            (clen,) = struct.unpack_from(">I", rest, 0)
            out.append((4 if rtype == 4 else 2, ident, rest[4:4 + clen]))
        pos += 8 + blen
    return out


def softhsm_module() -> str | None:
    for cand in ["/usr/lib/softhsm/libsofthsm2.so", *glob.glob("/usr/lib/*/softhsm/libsofthsm2.so"),
                 "/usr/local/lib/softhsm/libsofthsm2.so", *glob.glob("/usr/lib64/**/libsofthsm2.so", recursive=True)]:
        if os.path.exists(cand):
            return cand
    return None


def softhsm_token(tmp, label: str, so_pin: str = "87654321", pin: str = "246810") -> dict:
    """A fresh SoftHSM2 token in `tmp/softhsm` and the keystore config that opens it (the
    node-on-keystore and sequencer tests share it). Fails the test when SoftHSM2 is missing."""
    import shutil
    import subprocess
    import pytest
    module, util = softhsm_module(), shutil.which("softhsm2-util")
    if module is None or util is None:
        pytest.fail("SoftHSM2 is not installed: run `apt-get install -y softhsm2` (docs/keystore.md, Test set-up)")
    d = tmp / "softhsm"
    (d / "tokens").mkdir(parents=True)
    conf = d / "softhsm2.conf"
    conf.write_text(f"directories.tokendir = {d / 'tokens'}\nobjectstore.backend = file\nlog.level = ERROR\n")
    subprocess.run([util, "--init-token", "--free", "--label", label, "--so-pin", so_pin, "--pin", pin],
                   check=True, env=dict(os.environ, SOFTHSM2_CONF=str(conf)), capture_output=True)
    return {"kind": "pkcs11", "module": module, "token_label": label, "pin": pin,
            "env": {"SOFTHSM2_CONF": str(conf)}}


def serial_keystore(tmp):
    """The serial keystore emulator over a pty, as a keystore config (a generator: a fixture's body)."""
    proc, port = start_emulator(tmp)
    yield {"kind": "serial", "port": port, "timeout_s": 5.0}
    proc.terminate()
    proc.wait(10)


def start_emulator(tmp, *extra: str, state: str = "device"):
    """Start the serial keystore emulator; return (process, port path)."""
    import subprocess
    import sys
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    port = os.path.join(str(tmp), f"port-{state}")
    proc = subprocess.Popen([sys.executable, "-m", "firmware_bridge.serial_device", "--port-link", port,
                             "--state", os.path.join(str(tmp), state), *extra],
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=root))
    line = proc.stdout.readline()
    assert line.startswith("READY"), line
    return proc, port


def receipt_requests(group: bytes, lo: int, n: int, size: int = 40, key: str = "seq") -> list:
    """Keystore signing requests (key, ReceiptIdentity, random data) for epochs lo..lo+n-1."""
    from firmware_bridge import ReceiptIdentity
    return [(key, ReceiptIdentity(group, e), os.urandom(size)) for e in range(lo, lo + n)]


def receipt_item(group: bytes, protected: bytes, epoch: int, key: str = "seq") -> tuple:
    """A bridge item (identity, key, to-be-signed, assemble) for a receipt of (group, epoch)."""
    from firmware_bridge import ReceiptIdentity
    pay = receipt_payload(group, epoch, bytes(32), None)
    return ReceiptIdentity(group, epoch), key, sig_structure(protected, pay), assembler(protected, pay)


def in_thread(fn, timeout):
    """fn() in a daemon thread joined with ``timeout``: (finished, result or the exception raised)."""
    got = []

    def run():
        try:
            got.append(fn())
        except BaseException as exc:  # noqa: BLE001 - the test inspects it
            got.append(exc)
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout)
    return not th.is_alive(), (got[0] if got else None)
