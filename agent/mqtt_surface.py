"""What the MQTT loop shows in `ssp-agent events` beside its counters: refused messages (kind
`refused`, a code from agent/core/reasons.py) and the broker connection's losses (kind
`link_lost`, reason `broker_lost`, source `link:mqtt`, as a serial link's), each bounded per
window by the one pure budget (`core.budget.SurfaceBudget`, docs/apply.md "Bounds"): a surfaced
row is a transaction (an fsync), and a hostile sender provokes refusals at will."""
from __future__ import annotations

import logging
from collections import Counter

from .core.budget import SurfaceBudget, not_surfaced
from .core.reasons import BROKER_LOST
from .timesource import Clock

log = logging.getLogger("ssp_agent.runner")

# Refusals surfaced (and logged) per (source, reason) in each window; the rest are counted and
# summed up in one row when the window ends.
REFUSALS_SURFACED_PER_WINDOW = 20
REFUSAL_WINDOW_S = 60.0
# Broker connections lost: bounded as a serial link's losses are (agent/transport/serial.py
# LOSSES_SURFACED_PER_WINDOW), with the same pure budget.
LOSSES_SURFACED_PER_WINDOW = 20
LOSS_WINDOW_S = 60.0


class Surfacing:
    """The MQTT loop's surfaced rows, through `node.surface_refused`, on the loop's clock."""

    def __init__(self, node, stats: Counter, clock: Clock, path: str) -> None:
        self.node, self.stats, self.clock, self.path = node, stats, clock, path
        self.refusal_budget = SurfaceBudget(REFUSALS_SURFACED_PER_WINDOW, REFUSAL_WINDOW_S)  # (source, reason)
        self.loss_budget = SurfaceBudget(LOSSES_SURFACED_PER_WINDOW, LOSS_WINDOW_S)  # the broker connection's losses

    def refusal(self, source: str, reason: str, detail: str, sender: bytes | None) -> None:
        """Log and surface a refusal, at most REFUSALS_SURFACED_PER_WINDOW per (source, reason) in
        each REFUSAL_WINDOW_S (one fsync per hostile message held honest bodies back). The rest
        are counted (`refusals_not_surfaced`) and surfaced as one row when the window ends."""
        surface, told = self.refusal_budget.admit((source, reason), self.clock.mono())
        if told:
            self.suppressed(source, reason, told)
        if not surface:
            self.stats["refusals_not_surfaced"] += 1
            return
        log.warning("refused %s (%s%s)", "a body in our inbox" if source == "mqtt_request" else source,
                    reason, f": {detail}" if detail else "")
        self.node.surface_refused(source, reason, detail, sender)

    def suppressed(self, source: str, reason: str, n: int) -> None:
        msg = not_surfaced(n, REFUSAL_WINDOW_S, "refusals")
        log.warning("refused %s (%s): %s", source, reason, msg)
        try:
            self.node.surface_refused(source, reason, msg, None)
        except Exception as e:  # noqa: BLE001 - a summary row must never stop the loop (or close)
            log.warning("could not surface the refusal summary: %s", e)

    def losses(self, losses) -> None:
        """The broker connection's losses and failed reconnects the link noted (`MqttLink.losses`,
        (wall ms, detail) each), taken from the deque."""
        while losses:
            wall, detail = losses.popleft()
            self.stats["broker_lost"] += 1
            surface, told = self.loss_budget.admit(BROKER_LOST, self.clock.mono())
            if told:
                self.loss(not_surfaced(told, LOSS_WINDOW_S), wall)
            if surface:
                self.loss(detail, wall)

    def loss(self, detail: str, wall: int | None) -> None:
        try:
            self.node.surface_refused(f"link:{self.path}", BROKER_LOST, detail, None, wall, kind="link_lost")
        except Exception as e:  # noqa: BLE001 - a row not written (a full disk) must never stop the loop
            log.warning("could not surface a broker loss: %s", e)

    def close(self) -> None:
        """What the windows did not surface yet, in one row each."""
        for (source, reason), n in self.refusal_budget.drain():
            self.suppressed(source, reason, n)
        for _key, n in self.loss_budget.drain():
            self.loss(not_surfaced(n, LOSS_WINDOW_S), None)
