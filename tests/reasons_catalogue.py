"""A malformed input for every reason code in agent/core/reasons.py, and which codes each
transport can reach (tests/sync/test_reasons_surface.py, tests/mqtt/test_reasons_mqtt.py drive
them and find each one in `ssp-agent events`)."""
from __future__ import annotations

import cbor2

from agent.core import reasons as R
from agent.core.messages import Handshake, emit_handshake

_WM = {"site_id": "ab" * 16, "table_schema": "app", "table_name": "readings", "hlc_physical_ms": 1, "hlc_logical": 0}


def body(sender: bytes, drop=(), **over) -> bytes:
    b = {"ssp_version": 1, "from_site_id": sender.hex(), "have_max_hlc": {"physical_ms": 0, "logical": 0},
         "events": [], "records": [], "applied_watermarks": []}
    b.update(over)
    for k in drop:
        del b[k]
    return cbor2.dumps(b)


def handshake(site: bytes, realtime: bool = False) -> bytes:
    return emit_handshake(Handshake(site, (0, 0), realtime, False, None))


def bad_messages(sender: bytes) -> dict[str, bytes]:
    """Code -> bytes offered as a sync body from `sender` that its boundary refuses with it."""
    return {
        R.MALFORMED_CBOR: b"\xff\x00garbage",
        R.NOT_A_MAP: cbor2.dumps([1, 2, 3]),
        R.MISSING_SSP_VERSION: body(sender, drop=("ssp_version",)),
        R.BAD_SSP_VERSION: body(sender, ssp_version="1"),
        R.UNKNOWN_SSP_VERSION: body(sender, ssp_version=2),
        R.BAD_MEMBERS: body(sender, extra=1),
        R.BAD_SITE_ID: body(sender, from_site_id="AB" * 16),
        R.BAD_HAVE_MAX_HLC: body(sender, have_max_hlc=[0, 0]),
        R.BAD_WATERMARK: body(sender, applied_watermarks=[dict(_WM, extra=1)]),
        R.BAD_WATERMARKS: body(sender, applied_watermarks={}),
        R.BAD_EVENTS: body(sender, events=["text"]),
        R.BAD_RECORDS: body(sender, records={}),
        R.NOT_A_BODY: handshake(sender),
    }


MESSAGE_CODES = frozenset(bad_messages(b"\x00" * 16))
# A session (in memory or over a serial line) refuses these too: frames, who speaks, order, mode.
SESSION_CODES = MESSAGE_CODES | {R.BAD_FRAME, R.BAD_FRAME_META, R.TOO_LARGE, R.NOT_A_HANDSHAKE, R.SENDER_MISMATCH,
                                 R.HANDSHAKE_SITE_MISMATCH, R.SELF_HANDSHAKE, R.NO_HANDSHAKE,
                                 R.REALTIME_NOT_ESTABLISHED}
# Over a serial line a message longer than the link's max_message ends the link incarnation
# (`message_too_large`, docs/serial.md) before any session sees it: a link loss, not a refusal.
SERIAL_CODES = SESSION_CODES - {R.TOO_LARGE}
# MQTT: bodies in inboxes and handshakes on presence topics; no session frames (the metadata is
# MQTT v5 properties) and no handshake-before-body order (presence is retained, not a step).
MQTT_CODES = MESSAGE_CODES | {R.TOO_LARGE, R.SENDER_MISMATCH, R.REALTIME_NOT_ESTABLISHED, R.BAD_FRAME_META,
                              R.UNKNOWN_KIND, R.HANDSHAKE_SITE_MISMATCH, R.NOT_A_HANDSHAKE}
# Mailbox files: refused on stderr with exit 2 and nothing stored (docs/protocol.md §6, docs/cli.md exit status 2).
MAILBOX_CODES = MESSAGE_CODES | {R.TOO_LARGE}
# A serial link incarnation that ends (docs/serial.md "State machine"): kind `link_lost`, not a
# refused message; the session on it is dropped and the next incarnation starts a new one.
LINK_CODES = frozenset({R.PEER_SILENT, R.PEER_RESTARTED, R.MESSAGE_TOO_LARGE, R.BAD_COMPRESSED_MESSAGE})
# The MQTT link's broker connection lost (or a reconnect failing): kind `link_lost`, source `link:mqtt`
# (tests/mqtt/test_broker_lost.py).
MQTT_LINK_CODES = frozenset({R.BROKER_LOST})
# Reached through no transport: `not_bytes` (every transport delivers bytes), `bad_topic` (the
# MQTT link subscribes only to inbox topics that name a sender), `unclassified` (a parser bug).
UNREACHABLE = frozenset({R.NOT_BYTES, R.BAD_TOPIC, R.UNCLASSIFIED})
