"""What the MQTT loop keeps in sync_state between its processes: the bodies it sent and nobody
answered (`sent_bodies`, restored into the exchange's window at start, given up on durably, so
the next wake or a restart does not send the window again: docs/mqtt.md "Quiet links"), and what
it learned of each peer's body limit (`peer_links`, docs/mqtt.md "Size limits")."""
from __future__ import annotations

import logging
from typing import Callable

from .store import db, sync_state as st
from .sync_tokens import token_from_json
from .timesource import Clock

log = logging.getLogger("ssp_agent.runner")


class RunnerRows:
    def __init__(self, conn, clock: Clock, path: str) -> None:
        self.conn, self.clock, self.path = conn, clock, path

    def load_in_flight(self, ex, keyring, cursor: Callable[[bytes], int], session_expiry_s: float) -> None:
        """Bodies an earlier process sent to a keyring peer and nobody answered yet (not given up,
        not older than a session lasts): the exchange decides which are in flight (`Exchange.restore`)."""
        since = self.clock.wall_ms() - int(session_expiry_s) * 1000
        for _id, corr, peer, text in st.bodies_in_flight(self.conn, self.path, since):
            if peer not in keyring:
                continue
            tok, extra = token_from_json(text)
            ex.restore(_id, corr, peer, tok.end, cursor(peer), bool(extra.get("bf")))

    def gave_up(self, peer: bytes, upto_id: int | None = None) -> None:
        """The bodies in flight to `peer` (up to sent_bodies id `upto_id`) count as in flight no more."""
        with db.transaction(self.conn):
            st.give_up_sent_bodies(self.conn, peer, self.path, upto_id=upto_id)

    def load_limits(self, limits, keyring) -> None:
        now, wall = self.clock.mono(), self.clock.wall_ms()
        for peer in keyring:
            link = st.peer_link(self.conn, peer, self.path)
            limits.restore(peer, link["advertised"], link["limit_state"], now, wall)

    def save_limits(self, limits) -> None:
        """What was learned of peers' limits since the last call (`BodyLimits.take_dirty`)."""
        if not limits.dirty:
            return
        rows = limits.take_dirty(self.clock.mono(), self.clock.wall_ms())
        try:
            with db.transaction(self.conn):
                for peer, adv, state in rows:
                    st.set_advertised_limit(self.conn, peer, self.path, adv)
                    st.set_limit_state(self.conn, peer, self.path, state)
        except Exception as e:  # noqa: BLE001 - a full disk: learned again from the next advertisement
            log.warning("could not keep the peers' body limits: %s", e)
