"""The node's clock outside the pure HLC (agent/core/clock.py): waiting for a trustworthy wall
clock before what needs one (init, eviction, a horizon change; docs/apply.md "Clocks without
an RTC")."""
from __future__ import annotations

import logging
import os
import sys
import time

from . import clockstate
from .errors import NodeError

log = logging.getLogger("ssp_agent")

CLOCK_WAIT_SAY_S = 5.0   # how often a wait for a synchronised clock says so


class ClockUntrusted(NodeError):
    """Reason code `clock_untrusted`: an operation that needs a trustworthy wall clock (eviction,
    a horizon change, `init`) found none and had no override (docs/apply.md "Clocks without an RTC")."""


def wait_trusted_clock(node, what: str, override: bool, wait_s: float, now: int | None = None,
                           strict: bool = False) -> dict:
    """Wait up to `wait_s` for a trustworthy clock. A clock the node has evidence against (behind
    or far ahead of what it read while trusted) is always refused. A clock that is merely not
    known to be synchronised (no sync source, no contrary evidence: containers, devices without a
    time service) is refused only in strict mode — `strict`, a `--wait-clock`, or
    SSP_AGENT_CLOCK_STRICT=1, which first-boot enrolment and the automatic eviction job use — and
    otherwise accepted with a warning, so the command-line contract (docs/cli.md "The manifest": `init`,
    `evict --horizon`) holds on machines that cannot say."""
    strict = strict or wait_s > 0 or os.environ.get("SSP_AGENT_CLOCK_STRICT", "").strip().lower() in ("1", "true", "yes")
    deadline = time.monotonic() + max(0.0, wait_s)
    say_at = time.monotonic()
    while True:
        st = clockstate.assess(node, now, trusted_override=override)
        if st["trusted"] or time.monotonic() >= deadline:
            break
        if time.monotonic() >= say_at:
            # A wait of up to `wait_s` (enrolment: 600 s) is never silent: the console and the
            # journal say what it waits for.
            say_at += CLOCK_WAIT_SAY_S
            print(f"ssp-agent: {what} waits for a synchronised wall clock ({st['state']}: "
                  f"{st['hint'].split(';')[0]}); {max(0.0, deadline - time.monotonic()):.0f} s left",
                  file=sys.stderr, flush=True)
        time.sleep(1.0)
    if not st["trusted"] and not strict and st["state"] == "unsynced":
        log.warning("%s: the wall clock is not known to be synchronised (%s); proceeding", what, st["hint"])
        st = dict(st, unverified=True)
        return st
    if not st["trusted"]:
        raise ClockUntrusted(f"clock_untrusted: {what} needs a trustworthy wall clock ({st['state']}: {st['hint']}); "
                             "wait for time sync (--wait-clock SECONDS), or pass --clock-trusted if the clock is right")
    return st

