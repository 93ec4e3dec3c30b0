"""Signed acknowledgements on the MQTT binding (docs/protocol.md §5): a sender that asks for one
gets its answers with a record naming the BLAKE3 of each body and what it processed, signed
through the keystore bridge like every record this node issues. Signing persists through the
bridge (two journal fsyncs and a witness write), so the answers taken in one pump are grouped,
one record per sender and MAX_ACK_ANSWERS bodies; a record released is served again to a replay
of the same body (`binding.ReleasedAcks`) instead of signing anew."""
from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from .core.binding import ReleasedAcks, ack_due, ack_wait
from .core.records import MAX_ACK_ANSWERS, AckAnswer
from .timesource import Clock

log = logging.getLogger("ssp_agent.runner")


class SignedAnswers:
    """The answers waiting for their sender's signed acknowledgement, and the records released."""

    def __init__(self, node, stats: Counter, clock: Clock, cfg) -> None:
        self.node, self.stats, self.clock = node, stats, clock
        self.cfg = cfg  # read live: `ack_interval_s` above 0, at most one signature per sender this often
        self.owed: dict[bytes, list] = {}  # sender -> [(request, answer properties, AckAnswer)] not yet answered
        self.last: dict[bytes, float] = {}  # sender -> when its last acknowledgement was signed
        self.released = ReleasedAcks()  # records released, served again to a replay of the same body

    def own_entry(self):
        """This node's keyring entry: the key its acknowledgements verify under (kept records are
        dropped when it changes, `ReleasedAcks`)."""
        return self.node.keyring.get(self.node.site_id)

    def kept(self, sender: bytes, answered: AckAnswer) -> bytes | None:
        """The record already released for the same bytes from the same sender, processed to the
        same outcome: it states exactly that, so no new signature."""
        return self.released.get(sender, answered, self.own_entry())

    def owe(self, sender: bytes, m: Any, user: dict[str, str], answered: AckAnswer) -> None:
        self.owed.setdefault(sender, []).append((m, user, answered))

    def wait(self, now: float) -> float:
        """Seconds until the next grouped acknowledgement is due (`binding.ack_wait`)."""
        return ack_wait((self.last.get(s, 0.0) for s in self.owed), now, self.cfg.ack_interval_s)

    def answer(self, link, port, force: bool = False) -> None:
        """Answer the bodies owed a signed acknowledgement on `link` (bodies from `port`, the
        runner's sync layer, which signs), then ack them to the broker. Bodies that
        arrive faster than the node signs (honest, or forged in a trusted name) queue meanwhile and
        share the next record; `ack_interval_s` > 0 also caps signatures per sender per second (its
        answers wait, already committed)."""
        now = self.clock.mono()
        for sender in list(self.owed):
            items = self.owed[sender]
            if not ack_due(len(items), self.last.get(sender, 0.0), now, self.cfg.ack_interval_s, force):
                continue  # grouped with what arrives before the interval ends
            del self.owed[sender]
            self.last[sender] = now
            if len(self.last) > 4 * len(self.node.keyring) + 16:
                self.last = {sender: now}  # senders are keyring sites: bounded, reset if it ever grows
            for i in range(0, len(items), MAX_ACK_ANSWERS):
                chunk = items[i:i + MAX_ACK_ANSWERS]
                try:
                    ack = port.sign_ack(sender, [a for _m, _u, a in chunk])
                    self.stats["acks_signed"] += 1
                    self.released.put(sender, [a for _m, _u, a in chunk], ack, self.own_entry())
                except Exception as e:  # noqa: BLE001 - the keystore: answered unsigned, the body is re-offered
                    ack = None
                    self.stats["ack_sign_failures"] += 1
                    log.warning("could not sign an acknowledgement for %s: %s", sender.hex(), e)
                extra = (ack,) if ack is not None else ()
                for m, user, _a in chunk:
                    if link.answer(m, port.answer_body(sender, extra), user):
                        self.stats["answers_sent"] += 1
                    link.ack(m)
