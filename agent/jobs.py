"""Jobs the long-running node runs between its sync steps, whatever the transports
(agent/runtime.py; the MQTT Runner's own `evict` calls the same one).

- `evict`: the device profile's eviction job (node.run_eviction, docs/apply.md "Eviction"),
  deferred, not failed, while the clock is untrusted ("Clocks without an RTC").
- `note_clock`: keep the clock evidence fresh while the clock is trusted (every minute).
Neither may ever stop the sync loop: failures are counted and logged."""
from __future__ import annotations

import json
import logging

from .core import reasons

# The runner's logger: operators' filters for eviction reports keep matching (docs/operations.md).
log = logging.getLogger("ssp_agent.runner")


def evict(node, stats) -> dict | None:
    """Run the eviction job once; its report, or None when deferred or failed. `stats` (a
    Counter) counts evictions, evictions_deferred and eviction_failures."""
    from .node import ClockUntrusted
    try:
        rep = node.run_eviction()
    except ClockUntrusted as e:
        # Deferred, not failed: the next interval tries again (docs/apply.md "Clocks without an RTC").
        stats["evictions_deferred"] = stats.get("evictions_deferred", 0) + 1
        if stats["evictions_deferred"] == 1:
            log.warning("eviction deferred: %s", e)
            node.surface_clock(reasons.CLOCK_UNTRUSTED, {"deferred": "eviction", "message": str(e)})
        return None
    except Exception as e:  # noqa: BLE001 - eviction must never stop the sync loop
        stats["eviction_failures"] += 1
        log.warning("eviction failed: %s", e)
        return None
    stats["evictions"] += 1
    deleted = sum(t.get("events_deleted", 0) for t in rep.get("tables", {}).values())
    log.info("eviction: %d events deleted, store %d -> %d bytes, budget %s: %s", deleted,
             rep.get("bytes_before", 0), rep.get("bytes_after", 0), (rep.get("budget") or {}).get("state", "?"),
             json.dumps(rep, sort_keys=True))
    return rep


def note_clock(node) -> dict | None:
    """docs/apply.md "Clocks without an RTC": the clock's state, its evidence kept while trusted."""
    try:
        return node.note_clock()
    except Exception as e:  # noqa: BLE001 - a clock check must never stop the sync loop
        log.warning("clock check failed: %s", e)
        return None
