"""Mailbox files (cli-contract.md `mailbox`): one sync body per file, store-and-forward.
Import parses the whole body strictly before anything touches the store (§32.2)."""
from __future__ import annotations

from .core.messages import parse_body
from .outcomes import counts


def import_body(node, data: bytes) -> dict:
    body = parse_body(data)  # raises ProtocolError: nothing has changed yet
    outcomes = node.apply_batch(body.events)
    result = counts(outcomes)
    result["from_site_id"] = body.from_site_id.hex()
    # Detail for what did not simply apply (reasons, event ids); counts cover the rest.
    result["events"] = [o.as_json() for o in outcomes if o.status not in ("applied",) or o.reason != "applied"]
    if hasattr(node, "apply_records") and body.records:
        result["records"] = node.apply_records(body.records)
    return result
