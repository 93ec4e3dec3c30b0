"""Serial keystore: protocol (COBS + CRC-32), host driver and the reference-firmware emulator
over a real pty pair.  The device's own refusal is SOVM §22.5 clause 2 held against a buggy host."""
import signal
import threading
import time

import pytest

from firmware_bridge import (DeviceProtocolError, DeviceRefused, DeviceTimeout, EventIdentity, KeyNotFound,
                             KeystoreUnavailable, ReceiptIdentity, SigningBridge, Status, open_keystore, verify_ed25519,
                             verify_p256)
from firmware_bridge import serial_protocol as sp

from bridge_helpers import (assembler, cose_parts, event_payload, event_protected, parse_journal, receipt_payload,
                            receipt_protected, sig_structure, start_emulator)
from tests.waiting import HANG_S

SITE = b"\x07" * 16


@pytest.fixture
def device(tmp_path):
    procs = []

    def start(*extra, state="device"):
        proc, port = start_emulator(tmp_path, *extra, state=state)
        procs.append(proc)
        return proc, port
    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _ks(port, timeout_s=HANG_S):   # a device that answers meets it however slow the machine
    return open_keystore({"kind": "serial", "port": port, "baud": 115200, "timeout_s": timeout_s})


def ev(p, l):
    prot, pay = event_protected(SITE), event_payload(p, l, l)
    return EventIdentity(SITE, p, l), "ev", sig_structure(prot, pay), assembler(prot, pay)


def rc(kid, e):
    prot, pay = receipt_protected(kid), receipt_payload(b"grp", e, bytes(32), None)
    return ReceiptIdentity(b"grp", e), "rc", sig_structure(prot, pay), assembler(prot, pay)


# -- protocol, sans I/O ---------------------------------------------------------------------------

def test_every_single_byte_corruption_is_rejected():
    frame = sp.encode_frame(sp.SIGN, 0x1234, sp.put_str("ev") + sp.put_blob(b"\x00" * 40) + sp.put_blob(bytes(300)))
    assert frame.count(0) == 1 and frame[-1] == 0
    for i in range(len(frame) - 1):
        for mask in (0x01, 0x80, 0xFF):
            bad = bytearray(frame)
            bad[i] ^= mask
            reader = sp.FrameReader()
            got = list(reader.feed(bytes(bad)))
            assert got == [] and reader.rejected >= 1, (i, mask)
    assert list(sp.FrameReader().feed(frame))[0].req_id == 0x1234


def test_reader_resynchronises_after_noise():
    good = sp.encode_frame(sp.HELLO, 7)
    reader = sp.FrameReader()
    frames = list(reader.feed(b"\x13\x37garbage\x00" + good[:3]) )
    frames += list(reader.feed(good[3:] + good))
    assert [f.req_id for f in frames] == [7, 7] and reader.rejected == 1


# -- against the emulator over a pty ---------------------------------------------------------------

def test_round_trip_generate_sign_verify(device, tmp_path):
    _, port = device()
    ks = _ks(port)
    ed = ks.generate_key("ev", "ed25519")
    p = ks.generate_key("rc", "p256")
    assert len(ed) == 32 and len(p) == 33
    d = ks.describe()
    assert d["kind"] == "serial" and d["keys"] == {"ev": "ed25519", "rc": "p256"} and d["port"] == port
    with SigningBridge(ks, str(tmp_path / "j")) as bridge:
        out = bridge.release(*ev(10, 0))
        prot, pay, sig = cose_parts(out)
        assert verify_ed25519(ed, sig_structure(prot, pay), sig)
        r = bridge.release(*rc(p, 0))
        prot, pay, sig = cose_parts(r)
        assert verify_p256(p, sig_structure(prot, pay), sig)
        assert bridge.release(*rc(p, 0)) == r  # persisted bytes, no device round trip
        outs = bridge.release_many([ev(11, k) for k in reversed(range(20))])  # signed in identity order
        assert len(set(outs)) == 20
    with pytest.raises(KeyNotFound):
        ks.public_key("nope")
    ks.close()


def test_device_refuses_resigning_even_for_a_buggy_host(device, tmp_path):
    proc, port = device()
    ks = _ks(port)
    ks.generate_key("ev", "ed25519")
    kid = ks.generate_key("rc", "p256")
    with SigningBridge(ks, str(tmp_path / "j1")) as bridge:
        bridge.release(*ev(5, 5))
        bridge.release(*rc(kid, 3))
    # the host lost its journal (or is compromised): a fresh bridge asks again
    with SigningBridge(ks, str(tmp_path / "j2")) as bridge:
        with pytest.raises(DeviceRefused, match="already signed") as ei:
            bridge.release(*ev(5, 5))
        assert ei.value.code == sp.E_ALREADY_SIGNED
        with pytest.raises(DeviceRefused, match="at or below"):
            bridge.release(*ev(5, 4))
        with pytest.raises(DeviceRefused, match="already signed"):
            bridge.release(*rc(kid, 3))
        assert bridge.status(ev(5, 5)[0]) is Status.OUTCOME_UNKNOWN  # burnt, not released
        assert [r for r in parse_journal(str(tmp_path / "j2")) if r[0] == 2] == []
        bridge.release(*ev(5, 6))
    ks.close()
    # the device's counters survive its own restart
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _, port = device()
    ks = _ks(port)
    with pytest.raises(DeviceRefused):
        ks._sign("rc", ReceiptIdentity(b"grp", 3), b"x")
    ks._sign("rc", ReceiptIdentity(b"grp", 4), b"x")
    assert ks.last_counter == 2
    ks.close()


def test_unplugged_mid_request_gives_a_clear_error_and_no_release(device, tmp_path):
    proc, port = device("--sign-delay-s", "3")
    ks = _ks(port, timeout_s=HANG_S)
    ks.generate_key("ev", "ed25519")
    bridge = SigningBridge(ks, str(tmp_path / "j"))
    threading.Timer(0.4, proc.kill).start()
    t0 = time.monotonic()
    with pytest.raises(KeystoreUnavailable, match="disconnected mid-request"):
        bridge.release(*ev(1, 0))
    assert time.monotonic() - t0 < HANG_S  # noticed at the unplug, not at the reply deadline
    assert bridge.released(ev(1, 0)[0]) is None and bridge.status(ev(1, 0)[0]) is Status.OUTCOME_UNKNOWN
    assert [r[0] for r in parse_journal(str(tmp_path / "j"))] == [1]  # intent only
    bridge.close()
    ks.close()


def test_missing_device_is_unavailable(tmp_path):
    with pytest.raises(KeystoreUnavailable, match="plugged in"):
        _ks(str(tmp_path / "no-such-port"))


def test_line_noise_on_reply_is_rejected_by_crc(device, tmp_path):
    _, port = device("--corrupt-op", "sign")
    ks = _ks(port)
    ks.generate_key("ev", "ed25519")
    ks.timeout_s = 0.5     # the corrupted reply is reported once the deadline passed without a good one
    bridge = SigningBridge(ks, str(tmp_path / "j"))
    with pytest.raises(DeviceProtocolError, match="CRC mismatch"):
        bridge.release(*ev(1, 0))
    assert bridge.released(ev(1, 0)[0]) is None
    # the device did sign: the bridge never asks again, and the device would refuse anyway
    with pytest.raises(Exception) as ei:
        bridge.release(*ev(1, 0))
    assert type(ei.value).__name__ == "OutcomeUnknown"
    bridge.close()
    ks.close()


def test_line_noise_towards_device_is_dropped_then_resynchronised(device):
    _, port = device()
    ks = _ks(port)
    pub = ks.generate_key("ev", "ed25519")
    ident = EventIdentity(SITE, 9, 9)
    frame = bytearray(sp.encode_frame(sp.SIGN, 999, sp.put_str("ev") + sp.put_blob(ident.encode()) + sp.put_blob(b"m")))
    frame[10] ^= 0x04
    ks._ser.write(b"noise\xff\x00" + bytes(frame))
    sig = ks._sign("ev", ident, b"m")  # the corrupted SIGN was never executed
    assert verify_ed25519(pub, b"m", sig)
    ks.close()


def test_timeout_then_stale_reply_is_ignored(device):
    _, port = device("--sign-delay-s", "0.8")
    ks = _ks(port)
    ks.generate_key("ev", "ed25519")
    ks.timeout_s = 0.3     # below the device's 0.8 s delay whatever the machine's speed
    with pytest.raises(DeviceTimeout, match="did not answer"):
        ks._sign("ev", EventIdentity(SITE, 1, 0), b"m")
    ks.timeout_s = HANG_S
    time.sleep(0.7)
    assert len(ks.public_key("ev")) == 32  # the late SIGN reply (old request id) was discarded
    ks.close()
