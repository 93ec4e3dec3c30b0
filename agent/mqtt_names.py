"""The MQTT runner's exchange state under the names benches, tests and operators' scripts use:
read-through views of `Runner.ex` (agent/core/exchange.py) and of the link's body limits, kept
apart from the loop's own work (agent/runner.py). Nothing here decides anything."""
from __future__ import annotations

from collections import deque

from .core.exchange import InFlight
from .core.sending import PeerLimit


class ExchangeNames:
    """Mixed into `Runner`: every name reads the runner's exchange (`ex`), link and clock."""

    @property
    def pending(self) -> dict[bytes, InFlight]:
        return self.ex.pending

    @property
    def sent_upto(self) -> dict[bytes, int]:
        return self.ex.sent_upto

    @property
    def caps(self) -> dict:
        return self.ex.presence.caps

    @property
    def presence_limit(self) -> int:
        return self.ex.presence.limit

    @presence_limit.setter
    def presence_limit(self, n: int) -> None:
        self.ex.presence.limit = self.intake.presence_limit = n

    @property
    def peer_limit(self) -> dict[bytes, PeerLimit]:
        return self.ex.limits.peer_limit

    @property
    def advertised(self) -> dict[bytes, int]:
        return self.ex.limits.advertised

    @property
    def _others(self) -> deque:
        return self.intake.others

    def _reset_peer(self, peer: bytes) -> None:
        self.ex.reset(peer)

    def _wait(self, peer: bytes) -> float:
        return self.ex.wait_s(peer)

    def in_flight(self, peer: bytes) -> int:
        return self.ex.in_flight(peer)

    def backfill_in_flight(self, peer: bytes) -> bool:
        return self.ex.backfill_in_flight(peer)

    def _top(self, peer: bytes) -> int:
        return self.ex.limits.top(peer, self.link.max_payload())

    def _limit(self, peer: bytes) -> int:
        """Bytes per body for `peer` now (`BodyLimits.limit`)."""
        return self.ex.limits.limit(peer, self.clock.mono(), self.link.max_payload())

    def _too_large(self, peer: bytes) -> None:
        self.ex.limits.too_large(peer, self.clock.mono(), self.link.max_payload())

    def realtime_peers(self) -> list[bytes]:
        return self.ex.realtime_peers(self.node.keyring.__contains__)
