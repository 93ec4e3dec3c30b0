"""NEGATIVE CONTROL ONLY: a bridge with the unsafe order (release before persist).

It returns signed bytes at once and persists them "write-behind", at the start of its next call
— the classic bug SOVM §22.5 clause 1 forbids.  It also records no intent, so after a crash it
re-signs.  It lives in tests/ only; the checker in test_bridge_crash.py must catch it."""
from __future__ import annotations

import threading

from firmware_bridge import SigningBridge
from firmware_bridge.journal import INTENT, RELEASED


class UnsafeBridge(SigningBridge):
    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._behind: list = []
        self._mutex = threading.Lock()

    def _release(self, items):
        with self._mutex:
            return self._release_unsafe(items)

    def _release_unsafe(self, items):
        if self._behind:  # persist the previous call's outputs, too late
            self._journal.commit(self._behind)
            self._behind = []
        outs = []
        for identity, key_name, tbs, assemble in items:
            ident = identity.encode()
            if self._journal.state(ident) == "released":
                outs.append(self._journal.read_released(ident))
                continue
            out = assemble(self._ks._sign(key_name, identity, bytes(tbs)))
            self._behind += [(INTENT, ident, key_name), (RELEASED, ident, out)]
            outs.append(out)
        return outs

    def close(self):
        self._journal.close()


class ResigningBridge(SigningBridge):
    """NEGATIVE CONTROL ONLY: persists before release, but treats an unknown outcome (intent, no
    output) as never signed and signs it again — what §22.5 clause 2 forbids."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        real = self._journal.state
        self._journal.state = lambda ident: "absent" if real(ident) == "intent" else real(ident)
        self._journal.states = lambda idents: [self._journal.state(i) for i in idents]   # the group look-up


class CompactAllBridge(SigningBridge):
    """NEGATIVE CONTROL ONLY: compaction that ignores what the caller has recorded and drops every
    released event — a crash before the caller records the last outputs loses them."""

    def compact_events(self, recorded):
        return super().compact_events(lambda identity: True)
