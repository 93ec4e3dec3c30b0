"""Is this node's wall clock trustworthy? (docs/apply.md "Clocks without an RTC").

A Raspberry Pi has no real-time clock: it boots at fake-hwclock's last saved time, or anywhere,
until NTP syncs. The node trusts its wall clock when one of its sync sources says it is
synchronised (`SSP_AGENT_CLOCK_SYNC`, default `kernel,timesyncd`: adjtimex(2)'s STA_UNSYNC, or
systemd-timesyncd's flag file) and the clock is not behind the node's own evidence: the highest
wall-clock reading taken while the clock was trustworthy (`meta.clock_evidence`) and the highest
HLC it holds. `SSP_AGENT_CLOCK_TRUSTED=1` (or `--clock-trusted` for one command) declares the wall
clock trustworthy whatever the sources say (a battery-backed RTC, a GPS clock)."""
from __future__ import annotations

import os
import time
from pathlib import Path

from .core.clock import SKEW_BOUND_MS, signing_time

TIMESYNCD_FLAG = "/run/systemd/timesync/synchronized"


def now_ms() -> int:
    """The wall clock in milliseconds (HLCs, the skew bound). Here, at the bottom: the node, the
    sync driver and rehydration all read it, and none of them may import the others upward."""
    return time.time_ns() // 1_000_000
STA_UNSYNC = 0x0040
TIME_ERROR = 5
# A wall clock this far from the evidence is surfaced (`check` warns): the §12 step 2 bound, so
# what is shown as "behind" is exactly what peers with a right clock would reject.
FAR_MS = SKEW_BOUND_MS
EVIDENCE_EVERY_MS = 60_000  # how stale the recorded evidence may get before a write refreshes it

_TRUE = ("1", "yes", "true", "on")


_libc = None
_Timex = None


def _timex():
    """struct timex (linux/timex.h) and libc, loaded on the first kernel query (ctypes is not
    needed by anything else a short-lived verb does)."""
    global _libc, _Timex
    if _Timex is None:
        import ctypes

        class Timex(ctypes.Structure):
            # only `status` is read; the trailing padding covers the reserved fields of every kernel ABI
            _fields_ = [("modes", ctypes.c_uint), ("offset", ctypes.c_long), ("freq", ctypes.c_long),
                        ("maxerror", ctypes.c_long), ("esterror", ctypes.c_long), ("status", ctypes.c_int),
                        ("constant", ctypes.c_long), ("precision", ctypes.c_long), ("tolerance", ctypes.c_long),
                        ("time_sec", ctypes.c_long), ("time_usec", ctypes.c_long), ("tick", ctypes.c_long),
                        ("ppsfreq", ctypes.c_long), ("jitter", ctypes.c_long), ("shift", ctypes.c_int),
                        ("stabil", ctypes.c_long), ("jitcnt", ctypes.c_long), ("calcnt", ctypes.c_long),
                        ("errcnt", ctypes.c_long), ("stbcnt", ctypes.c_long), ("tai", ctypes.c_int),
                        ("_reserved", ctypes.c_int * 11)]
        try:
            # glibc's soname directly: ctypes.util.find_library runs `ldconfig -p` in a subprocess
            _libc = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:
            import ctypes.util
            _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        _Timex = Timex
    return _libc, _Timex


def kernel_synced() -> bool | None:
    """The kernel's NTP state: True synchronised, False not, None when it cannot be read."""
    try:
        import ctypes
        libc, timex = _timex()
        fn = getattr(libc, "adjtimex", None) or getattr(libc, "ntp_adjtime")
        tx = timex()  # modes = 0: read only
        state = fn(ctypes.byref(tx))
    except (OSError, AttributeError):
        return None
    if state < 0:
        return None
    return state != TIME_ERROR and not (tx.status & STA_UNSYNC)


def sources() -> list[tuple[str, str | None]]:
    spec = os.environ.get("SSP_AGENT_CLOCK_SYNC", "kernel,timesyncd")
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, _, arg = item.partition(":")
        out.append((name, arg or None))
    return out


def sync_state() -> dict[str, bool | None]:
    """Each configured source's answer (None: unreadable or unknown source)."""
    res: dict[str, bool | None] = {}
    for name, arg in sources():
        if name == "kernel":
            res["kernel"] = kernel_synced()
        elif name == "timesyncd":
            res["timesyncd"] = Path(arg or TIMESYNCD_FLAG).exists()
        else:
            res[name] = None
    return res


def override() -> bool:
    return os.environ.get("SSP_AGENT_CLOCK_TRUSTED", "").strip().lower() in _TRUE


def assess(node=None, now: int | None = None, *, trusted_override: bool = False) -> dict:
    """The clock's state for `status`, `check` and the gates. Reads only (works on a read-only
    node). Keys: trusted (bool), state ("ok", "unsynced", "behind", "ahead", "no_evidence"),
    source (what made it trusted, or None), sync (each source's answer), now_ms, evidence_ms
    (None when the home has none), hlc ("P.L"), behind_ms (how far the node's HLC is ahead of
    the wall clock), ahead_ms (how far the wall clock is past the evidence), signing_cap_ms
    (the highest physical a tick may use now, None when unbounded), hint."""
    now = now_ms() if now is None else now
    sync = sync_state()
    synced = any(v for v in sync.values())
    forced = trusted_override or override()
    evidence = getattr(node, "clock_evidence", None) if node is not None else None
    hlc = node.clock.current() if node is not None else (0, 0)
    behind_ms = max(0, hlc[0] - now)
    ahead_ms = max(0, now - evidence) if evidence is not None else 0
    behind_evidence = evidence is not None and evidence - now > FAR_MS
    # Evidence recorded while a source lied (synchronised, ten years ahead) would keep a right
    # clock "behind" until that time came. A synchronised reading that the newest time the peers
    # vouch for agrees with (within the §12 step 2 bound) outweighs it; a clock set back while
    # the peers' time moved on still does not (their newer time contradicts the reading).
    contradicted = False
    if synced and behind_evidence and node is not None:
        mesh = node.mesh_time()
        contradicted = mesh is not None and abs(now - mesh) <= FAR_MS and evidence - mesh > FAR_MS
        behind_evidence = not contradicted
    source = "override" if forced else next((k for k, v in sync.items() if v), None)
    trusted = forced or (synced and not behind_evidence)
    if not trusted and behind_evidence:
        state = "behind"
        hint = (f"the wall clock is {(evidence - now) // 1000} s behind what this node saw it read while it "
                "was trustworthy; the time service set it wrong, or the evidence was recorded under a wrong "
                "override. Fix the clock (timedatectl), or pass --clock-trusted if it is right")
    elif not trusted:
        state = "unsynced"
        hint = ("no sync source says the clock is synchronised (timedatectl timesync-status); eviction and "
                "horizon changes wait for it, and writes are stamped no later than the evidence plus "
                f"{SKEW_BOUND_MS // 1000} s. Bring NTP up, or set SSP_AGENT_CLOCK_TRUSTED=1 on a device with an RTC")
    elif behind_ms > FAR_MS:
        state = "behind"
        hint = (f"this node's HLC is {behind_ms // 1000} s ahead of the (trusted) wall clock: it once stamped "
                "events ahead (a bad clock before this rule, or observed from a peer); its writes stay "
                "above that value (§13.5) and peers with a right clock reject them until real time passes it")
    elif node is not None and evidence is None:
        state = "no_evidence"
        hint = "this home has no record of a trustworthy reading yet; the next eviction or write records one"
    else:
        state = "ok"
        hint = ""
    if not trusted and ahead_ms > FAR_MS and state == "unsynced":
        state = "ahead"
        hint = (f"the wall clock reads {ahead_ms // 1000} s past the last trustworthy reading and is not "
                "synchronised (a bad boot?); " + hint)
    cap = signing_time(now, evidence, trusted)
    return {"trusted": trusted, "state": state, "source": source, "sync": sync, "now_ms": now,
            "evidence_ms": evidence, "hlc": f"{hlc[0]}.{hlc[1]}", "behind_ms": behind_ms,
            "ahead_ms": ahead_ms, "signing_cap_ms": cap if cap < now else None, "hint": hint,
            "evidence_contradicted": contradicted}
