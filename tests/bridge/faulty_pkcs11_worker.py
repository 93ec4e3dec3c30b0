"""A PKCS#11 worker whose token returns one bad signature (a test seam, never reachable from
production: Pkcs11Keystore runs firmware_bridge.pkcs11_worker unless a test subclass names this
module). Env: FAULTY_SIG_AT=k flips a bit in the k-th signature this worker makes (1-based; 0:
none); FAULTY_FAIL_AT=k makes the k-th signing call fail as a token error would (1-based; 0:
none); FAULTY_HOLD=1: after the chunk holding the bad signature, wait (up to 30 s) before the next chunk
until a cancellation arrives (the verifier's or the keystore's: docs/keystore.md), so a test sees
deterministically whether the rest of that batch is skipped. FAULTY_LOG=path appends every signature it returns (hex, one a line) to ``path``: what the
token returned, to compare with what the keystore returns."""
from __future__ import annotations

import os
import select
import sys

from firmware_bridge import pkcs11_worker


class FaultyWorker(pkcs11_worker.Worker):
    made = 0
    calls = 0
    hold = False

    def op_sign_many(self, requests, copy=False, seq=0, batch=None):
        if FaultyWorker.hold and self.cancel is not None:
            FaultyWorker.hold = False
            poller = select.poll()
            poller.register(self.cancel, select.POLLIN)
            poller.poll(30_000)
        return super().op_sign_many(requests, copy, seq, batch)

    def op_sign(self, name, alg, data, digest=None):
        FaultyWorker.calls += 1
        if FaultyWorker.calls == int(os.environ.get("FAULTY_FAIL_AT", "0")):
            raise RuntimeError("CKR_DEVICE_ERROR (test: the token failed this signature)")
        sig = super().op_sign(name, alg, data, digest)
        FaultyWorker.made += 1
        if FaultyWorker.made == int(os.environ.get("FAULTY_SIG_AT", "0")):
            sig = sig[:-1] + bytes([sig[-1] ^ 1])
            FaultyWorker.hold = os.environ.get("FAULTY_HOLD") == "1"
        log = os.environ.get("FAULTY_LOG")
        if log:
            with open(log, "a") as f:
                f.write(sig.hex() + "\n")
        return sig


if __name__ == "__main__":
    pkcs11_worker.main(sys.argv[1:], FaultyWorker)
