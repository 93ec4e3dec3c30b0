"""Durable delivery state (SQLite), one module a part: the tables (sync_schema.py), per-(peer,
path) link state on the sending side (sync_links.py), delivery progress: streams, watermarks,
pins and re-offers (sync_progress.py), the mailbox's answers (sync_mailbox.py), and the policy,
control records, keyring and trust (sync_records.py). Callers use this module (`st`): it names
every public function of the parts. The bounds (SENT_BODIES_KEPT, PINS_PER_SIGNER,
REOFFER_PER_SIGNER, MAILBOX_*, RECORDS_LIMIT*) are named only in the part that reads them."""
from __future__ import annotations

from .sync_schema import (has_schema, schema_ready, ensure_schema, create_schema, TRUNCATION_DDL)
from .sync_links import (cursor, advance_cursor, put_sent_body, sent_body, forget_sent_body, PEER_LINKS_DDL,
                         peer_link, give_up_sent_bodies, bodies_in_flight, set_advertised_limit, set_limit_state,
                         schedule_backfill, backfill_jobs, advance_backfill, drop_backfill, peers_with_cursors,
                         adopt_meta_cursors)
from .sync_progress import (stream_completed, set_stream_completed, stream_gaps, add_stream_gaps, own_watermarks,
                            raise_watermarks, held_min, pin_rejected, any_pins, unpin, reoffer_due, reoffer_count,
                            reoffer_put, rescan_done, reoffer_done, peer_watermarks, acked_by_any,
                            peer_time_evidence, set_peer_watermarks, group_counts, peer_lag, own_coverage)
from .sync_mailbox import (owe_mailbox_answer, owed_mailbox_answers, mailbox_ack_saying, put_mailbox_ack,
                           relay_mailbox_ack, relayed_mailbox_acks, mailbox_owed_peers)
from .sync_records import (policy_rows, put_policy_row, delete_policy_row, record_usage, RecordBudget, record_bounds,
                           has_record, put_record, records, record_raws, records_ordered, delivered_records,
                           mark_records_delivered, clear_all_records_delivered, clear_records_delivered,
                           provisioned_keyring, put_keyring, keyring_source, drop_keyring, keyring_sources,
                           holds_signed_record, authorities, trust, overlay_keyring, current_roles, rehydrate_upto,
                           rehydrate_generation)

__all__ = ["has_schema", "schema_ready", "ensure_schema", "create_schema", "TRUNCATION_DDL", "cursor", "advance_cursor",
           "put_sent_body", "sent_body", "forget_sent_body", "PEER_LINKS_DDL", "peer_link", "give_up_sent_bodies",
           "bodies_in_flight", "set_advertised_limit", "set_limit_state", "schedule_backfill", "backfill_jobs",
           "advance_backfill", "drop_backfill", "peers_with_cursors", "adopt_meta_cursors", "stream_completed",
           "set_stream_completed", "stream_gaps", "add_stream_gaps", "own_watermarks", "raise_watermarks",
           "held_min", "pin_rejected", "any_pins", "unpin", "reoffer_due", "reoffer_count", "reoffer_put",
           "rescan_done", "reoffer_done", "peer_watermarks", "acked_by_any", "peer_time_evidence",
           "set_peer_watermarks", "group_counts", "peer_lag", "own_coverage", "owe_mailbox_answer",
           "owed_mailbox_answers", "mailbox_ack_saying", "put_mailbox_ack", "relay_mailbox_ack",
           "relayed_mailbox_acks", "mailbox_owed_peers", "policy_rows", "put_policy_row", "delete_policy_row",
           "record_usage", "RecordBudget", "record_bounds", "has_record", "put_record", "records", "record_raws",
           "records_ordered", "delivered_records", "mark_records_delivered", "clear_all_records_delivered",
           "clear_records_delivered", "provisioned_keyring", "put_keyring", "keyring_source", "drop_keyring",
           "keyring_sources", "holds_signed_record", "authorities", "trust", "overlay_keyring", "current_roles",
           "rehydrate_upto", "rehydrate_generation"]
