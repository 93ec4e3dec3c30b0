"""One list of the reason codes a message from outside is refused with (docs/protocol.md
§11: one `ProtocolError` for everything from outside, one list of reason codes, what
`ssp-agent events` shows). One name per violation, whatever the transport: the in-memory and
serial sessions, MQTT and mailbox files refuse the same violation with the same code.

Each code is a stable string; `tests/core/test_reasons.py` fails when any `ProtocolError`,
MQTT refusal or session check in agent/ uses a code that is not here, and
`tests/sync/test_reasons_surface.py` drives every code each transport can reach through it and
finds it in `ssp-agent events` (mailbox: on stderr with exit 2, which docs/cli.md says changes
nothing in the store)."""
from __future__ import annotations

# -- bytes and CBOR (agent/core/messages.py parse_message, the SSP/1 message boundary, §30, §32.2)
NOT_BYTES = "not_bytes"
TOO_LARGE = "too_large"                     # over the message / frame / body limit (a body limit on MQTT)
MALFORMED_CBOR = "malformed_cbor"
NOT_A_MAP = "not_a_map"
BAD_MEMBERS = "bad_members"
MISSING_SSP_VERSION = "missing_ssp_version"
BAD_SSP_VERSION = "bad_ssp_version"
UNKNOWN_SSP_VERSION = "unknown_ssp_version"
BAD_SITE_ID = "bad_site_id"
BAD_HAVE_MAX_HLC = "bad_have_max_hlc"
BAD_WATERMARK = "bad_watermark"
BAD_WATERMARKS = "bad_watermarks"
BAD_EVENTS = "bad_events"
BAD_RECORDS = "bad_records"
NOT_A_BODY = "not_a_body"                   # a handshake where a sync body belongs
NOT_A_HANDSHAKE = "not_a_handshake"         # a sync body where a handshake belongs
# -- who speaks
SENDER_MISMATCH = "sender_mismatch"         # a body's from_site_id is not the peer the link is with
HANDSHAKE_SITE_MISMATCH = "handshake_site_mismatch"  # a handshake names another site than the link's
SELF_HANDSHAKE = "self_handshake"           # the peer claims this node's own site_id
# -- order and mode
NO_HANDSHAKE = "no_handshake"               # a body before the capability handshake (§31)
REALTIME_NOT_ESTABLISHED = "realtime_not_established"  # a realtime body without mutual realtime (§33)
# -- framing around the messages
BAD_FRAME = "bad_frame"                     # a session frame (agent/core/session.py) of the wrong shape
BAD_FRAME_META = "bad_frame_meta"           # stream positions that do not describe the body
UNKNOWN_KIND = "unknown_kind"               # MQTT `ssp-kind` neither batch nor realtime
BAD_TOPIC = "bad_topic"                     # an MQTT inbox topic without its sender
# -- a serial link incarnation ends (agent/transport/serial_link.py, docs/serial.md "State machine").
# Not a refused message: `ssp-agent events` lists them as kind `link_lost` (source `link:serial`).
PEER_SILENT = "peer_silent"                 # no frame for dead_s: a pulled cable, a peer powered off
PEER_RESTARTED = "peer_restarted"           # a HELLO with a new nonce: the other process restarted
MESSAGE_TOO_LARGE = "message_too_large"     # a CRC-clean length over the link's max_message: a broken peer
BAD_COMPRESSED_MESSAGE = "bad_compressed_message"  # compressed without our offer, or not one deflate stream
# -- the MQTT link's broker connection is lost (agent/transport/mqtt.py, docs/mqtt.md): kind
# `link_lost` (source `link:mqtt`) as a serial loss; paho's reason, or why a reconnect failed, in
# the detail. The link reconnects by itself and sync resumes from the durable cursors.
BROKER_LOST = "broker_lost"
# -- any other exception a boundary parser raised (agent/core/classify.py), or that handling a
# received message raised past it (the MQTT and serial loops' net, agent/faults.py)
UNCLASSIFIED = "unclassified"

# Every code above: a refused message or a lost link (the apply outcomes below are not in it).
ALL = frozenset(v for k, v in dict(globals()).items() if k.isupper() and isinstance(v, str))

# Names used before one list existed, and the one name each violation has now.
RENAMED = {"from_site_mismatch": SENDER_MISMATCH, "unsolicited_body": REALTIME_NOT_ESTABLISHED,
           "wrong_peer": HANDSHAKE_SITE_MISMATCH, "presence_site_mismatch": HANDSHAKE_SITE_MISMATCH}

# -- what applying one event came to: `Outcome.reason` (agent/outcomes.py), in the order of the §12
# steps. The event decoder's codes (agent/core/events.py) and a row key's misfit (agent/core/schema.py)
# are reasons too; these are the apply path's own.
NOT_AN_EVENT = "not_an_event"               # a COSE_Sign1 of another content type: dropped
SELF_ECHO = "self_echo"                     # this node's own event sent back (§32.1): dropped
DUPLICATE = "duplicate"                     # this event_id is in the log already (§12.4)
ALREADY_HELD = "already_held"               # this event_id is held already (§13.6)
UNKNOWN_KID = "unknown_kid"                 # the signer is not in the keyring (§12.1): rejected, re-offered
BAD_SIGNATURE = "bad_signature"             # the signature does not verify (§12.1): dropped
RETIRED_SIGNER = "retired_signer"           # later than its signer's retirement cutoff (§12.1): dropped
CLOCK_SKEW = "clock_skew"                   # its HLC is beyond the skew bound (§12.2): rejected, re-offered
OUT_OF_FLOOR = "out_of_floor"               # its table is outside the floor (§12.3): dropped and logged
TABLE_MISSING = "table_missing"             # its table is not in this node's schema (§13.6 row 1): held
HELD_LIMIT = "held_limit"                   # the held events' budget is spent: rejected, re-offered
BELOW_HORIZON = "below_horizon"             # under the table's eviction horizon (§3): applied, nothing written
APPLIED = "applied"                         # merged into its row (§13)
OUTCOME_REASONS = frozenset({NOT_BYTES, NOT_AN_EVENT, SELF_ECHO, DUPLICATE, ALREADY_HELD, UNKNOWN_KID, BAD_SIGNATURE,
                             RETIRED_SIGNER, CLOCK_SKEW, OUT_OF_FLOOR, TABLE_MISSING, HELD_LIMIT, BELOW_HORIZON,
                             APPLIED})

# -- this node's own clock (kind `clock` in `ssp-agent events`, docs/apply.md "Clocks without an RTC")
CLOCK_UNTRUSTED = "clock_untrusted"         # eviction or a horizon change waits for a trustworthy clock
CLOCK_EVIDENCE_RESET = "clock_evidence_reset"  # evidence taken under a lying source, contradicted by the mesh
CLOCK_REISSUED = "clock_reissued"           # own writes stamped ahead, received by no one, re-issued in the gap
CLOCK_STRANDED = "clock_stranded"           # own writes stamped ahead that cannot be re-issued (detail says why)
CLOCK_REASONS = frozenset({CLOCK_UNTRUSTED, CLOCK_EVIDENCE_RESET, CLOCK_REISSUED, CLOCK_STRANDED})   # not refusals
