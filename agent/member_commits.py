"""A member's Commit client beside its sync node (SOVM §22.5-§22.6; docs/sequencer.md): the key a
receipt is checked against, from the node's binding records (agent/sequencing.py); what decides
when the queue looks at its held receipts again; and the feeder that hands every receipt the
queue gets to the node's gossip. The `commits` verbs build their client with these."""
from __future__ import annotations

from pathlib import Path


def commit_client(home: Path, q, settings):
    """The queue's client (agent/sequencer/client.py) for the member whose node is in ``home``."""
    from . import sequencing
    from .node import Node
    from .sequencer import client
    home = Path(home)
    store = home / Node.STORE_FILE
    return client.CommitClient(q, settings, signer_for=signer_for(home, q.sequencer_key),
                               binding_state=binding_state(home, q.sequencer_key),
                               node_held=lambda gid: sequencing.held_of(store, gid))


def signer_for(home: Path, fallback):
    """§22.6: the queue checks a receipt against the sequencer bound to the group at the receipt's
    generation, from the member node's binding records (agent/sequencing.py). ``--sequencer-key``
    (``fallback``) counts only for a group no binding record names at all — a member without a
    node, or a group whose binding has not been issued yet; without either, any valid signature
    is taken (the broker's ACLs decide who may answer, docs/mqtt.md)."""
    from . import sequencing
    from .node import Node
    from .sequencer.answers import Signer
    path = Path(home) / Node.STORE_FILE

    def signer(gid: bytes, epoch: int):
        try:
            has, key = sequencing.bound_signer(path, gid, epoch)
        except Exception:  # noqa: BLE001 - the node store unreadable right now: decide nothing, hold
            return Signer(None, unresolved=True)
        if not has:
            return Signer(fallback)
        return Signer(key, unresolved=key is None)
    return signer


def binding_state(home: Path, fallback):
    """What decides ``signer_for``'s answers for a group (its binding records as resolved, and the
    fallback key for a group with none): the queue looks at its held and attributed receipts again
    only when this changed (client.py's recheck). An unreadable store is a state of its own (every
    link held meanwhile, as ``signer_for`` says)."""
    from . import sequencing
    from .node import Node
    states = sequencing.BindingStates(Path(home) / Node.STORE_FILE)   # one data_version question while idle
    prefix = b"fallback:" + (fallback or b"") + b";"

    def state(gid: bytes):
        try:
            return prefix + states(gid)
        except Exception:  # noqa: BLE001 - as signer_for: decide nothing, hold
            return b"unreadable"
    return state


class GossipFeeder:
    """Hands every receipt (and signed discontinuity statement) the member's queue gets to its
    node's gossip — receipt-head and discontinuity records in `records` (agent/sequencing.py) —
    with no CLI step between (§22.5: "clients retain receipts ... and gossip current receipt
    heads"). While `ssp-agent run` holds the home, through its control socket (the verb runs on
    the agent's node, one writer); otherwise the node is opened here for the moment it takes.
    What was handed over is marked in the queue file, so a crash in between hands it over again
    (a receipt some record already carries is not wrapped twice). A home with no node (a
    sequencer-only member) has nothing to feed. A failure is retried, backing off to 30 s."""

    FIRST_S, MAX_S = 1.0, 30.0

    def __init__(self, home: Path, q) -> None:
        from .node import Node
        self.home, self.q = Path(home).resolve(), q
        self.store = self.home / Node.STORE_FILE
        self.next_at, self.wait = 0.0, self.FIRST_S

    def flush(self) -> None:
        import time
        if time.monotonic() < self.next_at or not self.store.exists():
            return
        raws = self.q.ungossiped()
        if not raws:
            return
        ok, how = self._deliver(raws)
        if ok:
            self.q.mark_gossiped(raws)
            self.q.record_event("gossiped", {"receipts": len(raws), "via": how})
            self.wait = self.FIRST_S
            return
        if self.wait == self.FIRST_S:
            self.q.record_event("gossip_deferred", {"receipts": len(raws), "why": how[-500:]})
        self.next_at = time.monotonic() + self.wait
        self.wait = min(2 * self.wait, self.MAX_S)

    def _deliver(self, raws: list[bytes]) -> tuple[bool, str]:
        from . import control, sequencing
        from .node import Node, now_ms
        res = control.forward(self.home, ["--home", str(self.home), "sequencing", "gossip", *[r.hex() for r in raws]])
        if res is not None:
            rc, _out, err = res
            return rc == 0, "agent" if rc == 0 else err.strip()
        try:
            node = Node.open(self.home)
        except Exception as e:  # noqa: BLE001 - busy (an agent starting), unusable: try again later
            return False, str(e)
        try:
            for raw in raws:
                try:
                    sequencing.gossip(node, raw, now_ms())
                except sequencing.SequencingRefused:
                    continue            # verified by the queue; nothing to spread if the node says no
        finally:
            node.close()
        return True, "node"
