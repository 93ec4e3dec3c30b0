"""The MQTT binding's settings and names, pure of any connection: the broker URL and TLS files
(`MqttSettings`), the topic layout (`Topics`, docs/mqtt.md), the body limit a node advertises
and the packet bounds it announces at CONNECT (docs/mqtt.md "Size limits", "Memory bound"), and
the reconnect back-off. agent/transport/mqtt.py's link uses them; the CLI and tools read them."""
from __future__ import annotations

import random
import re
from dataclasses import dataclass
from urllib.parse import unquote, urlparse

from ..core import numbers

DEFAULT_PREFIX = "ssp"
DEFAULT_SESSION_EXPIRY_S = 7 * 24 * 3600  # a device offline for a week still finds its mailbox
DEFAULT_BODY_LIMIT_BYTES = 256 * 1024
DEFAULT_MAX_EVENTS = 1000
PACKET_OVERHEAD = 1024  # topic, packet id, properties: generous, so a body never trips the limit

# The publisher's own body limit (bytes), on its presence, its bodies and its answers: transport
# metadata that carries no authority (the §32 body keeps its six members). A sender uses min(its
# link's maximum, the peer's advertised limit), never below ADVERTISED_FLOOR, whoever wrote it
# (docs/mqtt.md "Size limits").
P_BODY_LIMIT = "ssp-body-limit"
ADVERTISED_FLOOR = 16 * 1024
# In-flight memory bound: the broker may have at most ReceiveMaximum unacknowledged
# PUBLISHes out to this node, each at most its Maximum Packet Size (own body limit + PACKET_OVERHEAD).
RECEIVE_BUDGET_BYTES = 64 * 1024 * 1024
RECEIVE_MAXIMUM_MIN, RECEIVE_MAXIMUM_MAX = 16, 1000
# Presence topics a "members" node subscribes to one by one; past it, the mesh's wildcard is fewer
# subscriptions and the same deliveries (such a node's peers are most of the mesh).
PRESENCE_TOPICS_MAX = 64
PRESENCE_SCOPES = ("mesh", "members")


@dataclass
class MqttSettings:
    host: str = "127.0.0.1"
    port: int = 1883
    tls: bool = False
    ca_file: str | None = None
    cert_file: str | None = None  # optional client certificate (mutual TLS)
    key_file: str | None = None
    username: str | None = None
    password: str | None = None
    keepalive: int = 30
    session_expiry_s: int = DEFAULT_SESSION_EXPIRY_S
    prefix: str = DEFAULT_PREFIX
    body_limit_bytes: int = DEFAULT_BODY_LIMIT_BYTES  # the profile's body limit
    max_events: int = DEFAULT_MAX_EVENTS  # events per body (the sender-enforced limit)
    backoff_min_s: float = 0.5
    backoff_max_s: float = 60.0
    client_id: str | None = None  # default: the site_id in hex (a persistent session per device)
    receive_maximum: int | None = None  # default: receive_maximum(body_limit_bytes) (the in-flight memory bound)
    # Announce a Maximum Packet Size at CONNECT (body limit + PACKET_OVERHEAD) so the broker drops
    # larger PUBLISHes: paho reads every PUBLISH whole before the link can refuse it, so without it
    # one 64 MiB message costs a node hundreds of MB (docs/mqtt.md "Memory bound"). mosquitto 2.0.11
    # keeps the in-flight slot of each PUBLISH it drops so; the link's delivery watch frees them.
    announce_max_packet: bool = True
    # Whose presence the node subscribes to (docs/scale.md "Presence"): "mesh" (the wildcard: every
    # site's, strangers' included, so a forged or poisoned presence is seen and surfaced) or
    # "members" (its keyring's, one topic each, up to PRESENCE_TOPICS_MAX, then the wildcard): a
    # device that syncs with one gateway then takes one presence per reconnect, not the mesh's.
    presence: str = "mesh"

    @classmethod
    def from_url(cls, url: str, **kw) -> "MqttSettings":
        """mqtt://[user[:password]@]HOST[:PORT] or mqtts://... (TLS, default port 8883)."""
        u = urlparse(url)
        if u.scheme not in ("mqtt", "mqtts", "tcp", "ssl"):
            raise ValueError(f"broker URL must be mqtt://HOST:PORT or mqtts://HOST:PORT, got {url!r}")
        if not u.hostname:
            raise ValueError(f"broker URL {url!r} names no host")
        tls = u.scheme in ("mqtts", "ssl")
        try:
            port = u.port or (8883 if tls else 1883)
        except ValueError:
            raise ValueError(f"broker URL {url!r} has a bad port") from None
        s = cls(host=u.hostname, port=port, tls=tls)
        if u.username:
            s.username = unquote(u.username)
        if u.password:
            s.password = unquote(u.password)
        for k, v in kw.items():
            if v is not None:
                setattr(s, k, v)
        if s.ca_file or s.cert_file:
            s.tls = True
        return s


class Topics:
    def __init__(self, mesh_id: bytes, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix, self.mesh = prefix, mesh_id.hex()
        self._node = re.compile(rf"^{re.escape(prefix)}/{self.mesh}/([0-9a-f]{{32}})"
                                rf"/(inbox/req|inbox/ans|presence)(?:/([0-9a-f]{{32}}))?$")

    def base(self, site: bytes) -> str:
        return f"{self.prefix}/{self.mesh}/{site.hex()}"

    def requests(self, site: bytes, sender: bytes) -> str:
        """Where `sender` publishes bodies for `site`."""
        return self.base(site) + "/inbox/req/" + sender.hex()

    def answers(self, site: bytes, sender: bytes) -> str:
        """Where `sender` publishes its answers to `site`'s pushes."""
        return self.base(site) + "/inbox/ans/" + sender.hex()

    def inbox_filter(self, site: bytes) -> str:
        return self.base(site) + "/inbox/#"

    def presence(self, site: bytes) -> str:
        return self.base(site) + "/presence"

    def presence_filter(self) -> str:
        return f"{self.prefix}/{self.mesh}/+/presence"

    def classify(self, topic: str) -> tuple[bytes, str, bytes | None] | None:
        """(site_id, 'inbox/req' | 'inbox/ans' | 'presence', sender or None), or None for a
        foreign topic. Inbox topics must name their sender; presence must not."""
        m = self._node.match(topic)
        if m is None or (m.group(2) == "presence") != (m.group(3) is None):
            return None
        return bytes.fromhex(m.group(1)), m.group(2), bytes.fromhex(m.group(3)) if m.group(3) else None


def parse_body_limit(text: str | None) -> int | None:
    """An advertised body limit (`ssp-body-limit`) read by the one strict reader
    (`core.numbers.uint`: ASCII digits, at most 10 of them); None for anything else (ignored, as
    every member a node does not understand)."""
    return numbers.uint(text, max_value=10**10 - 1)


def max_packet_size(body_limit: int) -> int:
    """The Maximum Packet Size this node announces at CONNECT: its body limit plus the topic and
    properties (the sender counts `ssp-meta` inside the body limit; the rest fits PACKET_OVERHEAD)."""
    return int(body_limit) + PACKET_OVERHEAD


def receive_maximum(body_limit: int) -> int:
    """Unacknowledged PUBLISHes the broker may have out to this node at once: as many of the
    largest packets as RECEIVE_BUDGET_BYTES holds, between 16 and 1 000."""
    return max(RECEIVE_MAXIMUM_MIN, min(RECEIVE_MAXIMUM_MAX, RECEIVE_BUDGET_BYTES // max_packet_size(body_limit)))


class Backoff:
    """Capped exponential backoff with jitter (half fixed, half random: never a zero wait, and
    a fleet that lost its broker at the same moment does not come back in lockstep)."""

    def __init__(self, base: float = 0.5, cap: float = 60.0, rng: random.Random | None = None) -> None:
        self.base, self.cap, self.n = base, cap, 0
        self.rng = rng or random.Random()

    def next(self) -> float:
        d = min(self.cap, self.base * (2 ** min(self.n, 30)))
        self.n += 1
        return d / 2 + self.rng.uniform(0, d / 2)

    def reset(self) -> None:
        self.n = 0
